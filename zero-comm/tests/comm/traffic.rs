//! Measured traffic equals zero-core's `GroupView` formulas, per collective, per link class.

use zero_comm::{Communicator, ReduceOp};

use crate::bodies::groups as shared;
use crate::bodies::{host, stamp};
use crate::common::*;

stamp! { host, shared:
    measured_traffic_equals_formula_in_every_topology(&layouts(8, 8));
    measured_traffic_equals_formula_in_sub_groups(&[(8, 4), (8, 2), (6, 3), (4, 2)]);
    all_gather_bytes_by_link_class();
}

/// Failed calls are not counted.
#[test]
fn errors_record_no_traffic() {
    run_ranks(host_world(topo(2, 1)), |mut comm| {
        let len = if comm.rank() == 0 { 4 } else { 6 };
        let mut b = comm.alloc::<f32>(len).unwrap();
        assert!(comm.all_reduce(&mut b, ReduceOp::Sum).is_err());
        assert_eq!(comm.traffic().calls(), 0);
    });
}
