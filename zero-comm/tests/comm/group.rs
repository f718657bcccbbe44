//! The `Group` guard: batched ops, results after the group ends, early returns, errors on drop.

use zero_comm::host::HostComm;
use zero_comm::{Communicator, Error, ReduceOp};

use crate::common::*;

#[test]
fn a_group_runs_its_ops_when_it_finishes() {
    run_ranks(host_world(topo(4, 2)), |mut comm| {
        let (n, me) = (comm.world_size(), comm.rank());
        let send = comm.upload(&[me as f32; 2]).unwrap();
        let mut gathered = comm.alloc::<f32>(2 * n).unwrap();
        let big = comm.upload(&vec![1.0f32; 3 * n]).unwrap();
        let mut shard = comm.alloc::<f32>(3).unwrap();
        let mut b = comm.upload(&[me as u8; 5]).unwrap();
        let mut g = comm.group();
        g.all_gather(&send, &mut gathered)
            .reduce_scatter(&big, &mut shard, ReduceOp::Sum)
            .broadcast(&mut b, 3);
        assert_eq!(g.len(), 3);
        g.finish().unwrap();
        let want: Vec<f32> = (0..n).flat_map(|k| [k as f32; 2]).collect();
        assert_eq!(gathered.as_slice(), want.as_slice());
        assert_eq!(shard.as_slice(), &[n as f32; 3]);
        assert_eq!(b.as_slice(), &[3u8; 5]);
        assert_eq!(comm.traffic().calls(), 3);
    });
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

#[test]
fn an_error_in_a_dropped_group_aborts_the_communicator() {
    run_ranks(host_world(topo(2, 2)), |mut comm| {
        let len = if comm.rank() == 0 { 3 } else { 4 };
        let mut buf = comm.alloc::<f32>(len).unwrap();
        {
            let mut g = comm.group();
            g.all_reduce(&mut buf, ReduceOp::Mean);
        }
        let e = comm.barrier().unwrap_err();
        assert!(matches!(e, Error::Aborted { .. }), "{e}");
        assert!(
            e.to_string()
                .contains("a group dropped without finish() failed"),
            "{e}"
        );
    });
}
