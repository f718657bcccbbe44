//! The `Group` guard: batched ops, results after the group ends, early returns, errors on drop.

use zero_comm::host::HostComm;
use zero_comm::{Communicator, ReduceOp};

use crate::bodies::groups as shared;
use crate::bodies::{host, stamp};
use crate::common::*;

stamp! { host, shared:
    a_group_runs_its_ops_when_it_finishes();
    an_error_in_a_dropped_group_aborts_the_communicator();
}

fn queue_then_bail(
    comm: &mut HostComm,
    buf: &mut zero_comm::host::HostBuffer<f32>,
) -> Result<(), String> {
    let mut g = comm.group();
    g.all_reduce(buf, ReduceOp::Sum);
    Err("bailed out".to_string())?;
    g.finish().map_err(|e| e.to_string())
}

#[test]
fn an_early_return_still_ends_the_group() {
    run_ranks(host_world(topo(3, 3)), |mut comm| {
        let mut buf = comm.upload(&[1.0f32, 2.0]).unwrap();
        assert_eq!(
            queue_then_bail(&mut comm, &mut buf).unwrap_err(),
            "bailed out"
        );
        // The queued all-reduce ran on drop, on every rank, so the ranks are still in step.
        assert_eq!(buf.as_slice(), &[3.0, 6.0]);
        comm.barrier().unwrap();
    });
}
