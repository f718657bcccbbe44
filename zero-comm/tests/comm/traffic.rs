//! Measured traffic equals zero-core's `GroupView` formulas, per collective, per link class.

use zero_comm::{Communicator, ReduceOp};

use crate::bodies::groups as shared;
use crate::bodies::{host, stamp};
use crate::common::*;

/// `(world_size, ranks_per_node)`: single node, one rank per node, and mixed layouts.
const TOPOLOGIES: &[(usize, usize)] = &[
    (1, 1),
    (2, 1),
    (2, 2),
    (3, 1),
    (3, 3),
    (4, 1),
    (4, 2),
    (4, 4),
    (5, 5),
    (6, 2),
    (6, 3),
    (7, 7),
    (8, 1),
    (8, 2),
    (8, 4),
    (8, 8),
];

stamp! { host, shared:
    measured_traffic_equals_formula_in_every_topology(TOPOLOGIES);
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
