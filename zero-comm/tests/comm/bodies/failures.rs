//! Failures every backend reports alike: a panicking rank, a panic in a sub-group, a missing rank,
//! a dropped communicator. Every case must end promptly, well within its timeout, with the right
//! error on every rank.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use zero_comm::{Communicator, Error, FailureReason, Op, ReduceOp};
use zero_core::{Collective, Topology};

use super::{World, launch};
use crate::common::*;

/// The timeout of tests where a failure must end every wait "promptly": under a quarter of it, so
/// a prompt failure and a timed-out one stay apart by a wide margin even on a loaded machine.
pub(crate) const PROMPT_TIMEOUT: Duration = Duration::from_secs(60);

/// Rank 2 of a world shaped `t` (four ranks) panics between two all-reduces: its peers' next
/// all-reduce fails promptly naming it, and so does every later call.
pub(crate) fn a_panicking_rank_fails_its_peers_promptly<C: Communicator>(
    world: World<C>,
    t: Topology,
) {
    let timeout = PROMPT_TIMEOUT;
    let results = launch(world(t, timeout), |mut comm| {
        let mut x = vec![1.0f32; 8];
        comm.all_reduce_host(&mut x, ReduceOp::Sum).unwrap();
        if comm.rank() == 2 {
            panic!("rank 2 fails on purpose");
        }
        let start = Instant::now();
        let err = comm.all_reduce_host(&mut x, ReduceOp::Sum).unwrap_err();
        let elapsed = start.elapsed();
        // Later calls fail fast too.
        let again = comm.barrier().unwrap_err();
        (err, again, elapsed)
    });
    for (rank, r) in results.into_iter().enumerate() {
        if rank == 2 {
            let p = r.unwrap_err();
            assert!(panic_message(&p).contains("on purpose"));
            continue;
        }
        let (err, again, elapsed) = r.unwrap();
        assert!(elapsed < timeout / 4, "rank {rank} waited {elapsed:?}");
        match err {
            Error::PeerFailed {
                op,
                rank: me,
                failed_rank: 2,
                reason: FailureReason::Panicked,
            } => {
                assert_eq!(op, Op::Collective(Collective::AllReduce));
                assert_eq!(me, rank);
            }
            e => panic!("rank {rank}: unexpected {e}"),
        }
        assert!(
            matches!(
                again,
                Error::PeerFailed {
                    failed_rank: 2,
                    op: Op::Collective(Collective::Barrier),
                    ..
                }
            ),
            "rank {rank}: {again}"
        );
    }
}

/// A panic in one node's group poisons the other node's group too (one world).
pub(crate) fn a_panic_in_one_sub_group_fails_every_group<C: Communicator>(world: World<C>) {
    let timeout = PROMPT_TIMEOUT;
    let results = launch(world(topo(4, 2), timeout), |mut comm| {
        let t = *comm.topology();
        let g = comm.global_rank();
        let mut intra = comm.split(t.node_of(g), t.local_rank(g)).unwrap();
        if g == 1 {
            panic!("rank 1 fails inside node 0");
        }
        if g == 0 {
            // Its node peer is gone; the next intra-node op fails.
            return intra.all_gather_host(&[0u8]).unwrap_err();
        }
        // Node 1 keeps working inside its own group until it sees the failure.
        let start = Instant::now();
        loop {
            match intra.barrier() {
                Ok(()) => assert!(start.elapsed() < timeout / 4, "never saw the failure"),
                Err(e) => return e,
            }
        }
    });
    for (rank, r) in results.into_iter().enumerate() {
        if rank == 1 {
            assert!(r.is_err());
            continue;
        }
        let e = r.unwrap();
        assert!(
            matches!(e, Error::PeerFailed { failed_rank: 1, .. }),
            "rank {rank}: {e}"
        );
    }
}

/// A rank that never arrives: the ranks waiting for it time out naming it, and the world is
/// aborted for everyone, the late rank included. Ordered by signals, not sleeps: the late rank
/// calls only once both peers have their errors. At least one peer waits out the full timeout;
/// the other is told by that timeout, as a `Timeout` of its own if it was already waiting at the
/// barrier (the two enter it together), or as `Aborted` if a loaded machine held it back.
pub(crate) fn a_missing_rank_times_out_and_aborts_the_world<C: Communicator>(world: World<C>) {
    let timeout = Duration::from_millis(400);
    let together = Barrier::new(2);
    let failed = [Signal::new(), Signal::new(), Signal::new()];
    let results = launch(world(topo(3, 3), timeout), |mut comm| {
        let me = comm.rank();
        if me == 1 {
            failed[0].wait("rank 0's error");
            failed[2].wait("rank 2's error");
            let late = comm.all_gather_host(&[1.0f32]).unwrap_err();
            return (late, Duration::ZERO, None);
        }
        together.wait();
        let start = Instant::now();
        let err = comm.all_gather_host(&[1.0f32]).unwrap_err();
        let elapsed = start.elapsed();
        let later = comm.barrier().unwrap_err();
        failed[me].set();
        (err, elapsed, Some(later))
    });
    let mut full_waits = 0;
    for (rank, r) in results.into_iter().enumerate() {
        let (err, elapsed, later) = r.unwrap();
        if rank == 1 {
            assert!(
                matches!(err, Error::Aborted { rank: 1, .. }),
                "late rank: {err}"
            );
            assert!(err.to_string().contains("waiting for ranks [1]"), "{err}");
            continue;
        }
        // Bounded only to catch a wait that never ends; a loaded machine may stretch it.
        assert!(
            elapsed < timeout + SAFE_TIMEOUT,
            "rank {rank} waited {elapsed:?}"
        );
        match &err {
            Error::Timeout {
                op,
                rank: me,
                waited,
                missing,
            } => {
                assert_eq!(*op, Op::Collective(Collective::AllGather));
                assert_eq!(*me, rank);
                assert_eq!(missing, &vec![1]);
                assert!(*waited <= elapsed, "{waited:?} > {elapsed:?}");
                if *waited >= timeout {
                    full_waits += 1;
                }
            }
            Error::Aborted { rank: me, .. } => {
                assert_eq!(*me, rank);
                assert!(err.to_string().contains("waiting for ranks [1]"), "{err}");
            }
            e => panic!("rank {rank}: unexpected {e}"),
        }
        let later = later.unwrap();
        assert!(
            matches!(later, Error::Aborted { .. }),
            "rank {rank}: {later}"
        );
        assert!(
            later.to_string().contains("waiting for ranks [1]"),
            "rank {rank}: {later}"
        );
    }
    assert!(full_waits >= 1, "no rank waited out the full {timeout:?}");
}

/// Rank 1 drops its communicator without panicking: its peers' all-reduce fails promptly, saying
/// so.
pub(crate) fn a_dropped_communicator_fails_its_peers_promptly<C: Communicator>(world: World<C>) {
    let timeout = PROMPT_TIMEOUT;
    let results = launch(world(topo(3, 1), timeout), |mut comm| {
        if comm.rank() == 1 {
            return None; // drops its communicator without panicking
        }
        let start = Instant::now();
        let mut x = vec![1.0f32; 4];
        let e = comm.all_reduce_host(&mut x, ReduceOp::Mean).unwrap_err();
        Some((e, start.elapsed()))
    });
    for (rank, r) in results.into_iter().enumerate() {
        let Some((e, elapsed)) = r.unwrap() else {
            continue;
        };
        assert!(elapsed < timeout / 4, "rank {rank} waited {elapsed:?}");
        assert!(
            matches!(
                e,
                Error::PeerFailed {
                    failed_rank: 1,
                    reason: FailureReason::Dropped,
                    op: Op::Collective(Collective::AllReduce),
                    ..
                }
            ),
            "rank {rank}: {e}"
        );
        assert!(
            e.to_string().contains("rank 1 dropped its communicator"),
            "rank {rank}: {e}"
        );
    }
}
