//! The executor's modes: overlapped submits return before their collective completes, inline ones
//! run it at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use zero_comm::host::HostWorld;
use zero_core::Topology;

use super::*;

/// Two ranks: rank 1 submits its half of an all-reduce only once rank 0's `submit` has
/// returned (with whatever result). Overlapped, rank 0's submit returns at once and both get
/// the sum; inline it blocks in the collective until the timeout. No clock decides the
/// outcome: rank 1 waits for rank 0's return, bounded only as a guard against a hang.
fn rank1_waits_for_rank0s_submit(overlap: bool, timeout: Duration) -> Vec<Result<Vec<f32>>> {
    let submitted = AtomicBool::new(false);
    let world = HostWorld::new(Topology::new(2, 2).expect("topology"), timeout);
    world
        .launch(|comm| {
            let rank = comm.rank();
            let mut comms = Comms {
                world: comm,
                hpz: None,
                qgroups: None,
                qwz: None,
                qgz: None,
                quant: None,
                qwz_scratch: QuantScratch::new(),
                qgz_scratch: QuantScratch::new(),
            };
            with_exec(&mut comms, overlap, rank, |exec| {
                if rank == 1 {
                    let guard = Instant::now() + Duration::from_secs(60);
                    while !submitted.load(Ordering::SeqCst) {
                        assert!(Instant::now() < guard, "rank 0's submit never returned");
                        thread::sleep(Duration::from_millis(1));
                    }
                }
                let r = exec.submit(
                    Job::AllReduce {
                        data: Elems::F32(vec![rank as f32 + 1.0; 5]),
                        op: ReduceOp::Sum,
                    },
                    "the all-reduce",
                );
                submitted.store(true, Ordering::SeqCst);
                r?;
                assert_eq!(exec.in_flight().count(), 1);
                match exec.next()? {
                    Some(("the all-reduce", Elems::F32(v))) => Ok(v),
                    _ => Err(mixed()),
                }
            })
        })
        .into_iter()
        .map(|r| r.expect("no rank panics"))
        .collect()
}

#[test]
fn an_overlapped_submit_returns_before_its_collective_completes() {
    for r in rank1_waits_for_rank0s_submit(true, Duration::from_secs(20)) {
        assert_eq!(r.expect("the all-reduce completes"), vec![3.0; 5]);
    }
}

#[test]
fn an_inline_submit_runs_its_collective_at_once() {
    let r = rank1_waits_for_rank0s_submit(false, Duration::from_millis(300));
    let err = r[0].as_ref().expect_err("rank 0 blocks until its timeout");
    assert!(err.to_string().contains("all_reduce"), "{err}");
}
