//! Failures: a panicking rank, a missing rank, a dropped communicator, mismatched calls. Every
//! case must end promptly, well within its timeout, with the right error on every rank.

use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use half::f16;
use zero_comm::host::{HostComm, HostLoopback, HostWorld};
use zero_comm::{Communicator, Error, FailureReason, Op, ReduceOp};
use zero_core::Collective;

use crate::common::*;

/// The timeout of tests where a failure must end every wait "promptly": under a quarter of it, so
/// a prompt failure and a timed-out one stay apart by a wide margin even on a loaded machine.
const PROMPT_TIMEOUT: Duration = Duration::from_secs(60);

fn launch<R: Send>(
    w: usize,
    l: usize,
    timeout: Duration,
    f: impl Fn(HostComm) -> R + Sync,
) -> Vec<thread::Result<R>> {
    HostLoopback::launch(topo(w, l), timeout, f)
}

#[test]
fn a_panicking_rank_fails_its_peers_promptly() {
    let timeout = PROMPT_TIMEOUT;
    let results = launch(4, 4, timeout, |mut comm| {
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
                assert_eq!(op, Collective::AllReduce);
                assert_eq!(me, rank);
            }
            e => panic!("rank {rank}: unexpected {e}"),
        }
        assert!(matches!(
            again,
            Error::PeerFailed {
                failed_rank: 2,
                op: Op::Collective(Collective::Barrier),
                ..
            }
        ));
    }
}

/// A panic in one node's group poisons the other node's group too (one world).
#[test]
fn a_panic_in_one_sub_group_fails_every_group() {
    let timeout = PROMPT_TIMEOUT;
    let results = launch(4, 2, timeout, |mut comm| {
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
#[test]
fn a_missing_rank_times_out_and_aborts_the_world() {
    let timeout = Duration::from_millis(400);
    let together = Barrier::new(2);
    let failed = [Signal::new(), Signal::new(), Signal::new()];
    let results = launch(3, 3, timeout, |mut comm| {
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
                assert_eq!(*op, Collective::AllGather);
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
            "{later}"
        );
    }
    assert!(full_waits >= 1, "no rank waited out the full {timeout:?}");
}

/// A rank that never arrives in a sub-group: its group peer times out naming it, and the world is
/// aborted for everyone else. The others act only once the timeout has fired (a signal); the
/// missing rank keeps its communicators alive until then, so its peer sees a timeout, not a
/// dropped communicator.
#[test]
fn a_timeout_in_a_sub_group_aborts_the_world() {
    let timeout = Duration::from_millis(300);
    let timed_out = Signal::new();
    let results = launch(4, 2, timeout, |mut comm| {
        let t = *comm.topology();
        let g = comm.global_rank();
        let mut intra = comm.split(t.node_of(g), t.local_rank(g)).unwrap();
        match g {
            3 => {
                timed_out.wait("rank 2's timeout");
                None
            }
            2 => {
                let e = intra.barrier().unwrap_err();
                timed_out.set();
                Some(e)
            }
            _ => {
                timed_out.wait("rank 2's timeout");
                Some(comm.barrier().unwrap_err())
            }
        }
    });
    let errs: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    assert!(
        matches!(&errs[2], Some(Error::Timeout { rank: 2, missing, waited, .. })
            if missing == &vec![3] && *waited >= timeout),
        "{:?}",
        errs[2]
    );
    for e in &errs[..2] {
        assert!(matches!(e, Some(Error::Aborted { .. })), "{e:?}");
        let text = e.as_ref().unwrap().to_string();
        assert!(text.contains("waiting for ranks [3]"), "{text}");
    }
}

#[test]
fn a_dropped_communicator_fails_its_peers_promptly() {
    let timeout = PROMPT_TIMEOUT;
    let results = launch(3, 1, timeout, |mut comm| {
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
            "{e}"
        );
    }
}

/// Dropping a sub-communicator fails only that group; the world goes on.
#[test]
fn dropping_a_sub_communicator_fails_only_its_group() {
    run_ranks(host_world(topo(4, 2)), |mut comm| {
        let t = *comm.topology();
        let g = comm.global_rank();
        let mut intra = comm.split(t.node_of(g), t.local_rank(g)).unwrap();
        if g == 0 {
            drop(intra);
        } else {
            let r = intra.barrier();
            if g == 1 {
                assert!(
                    matches!(r, Err(Error::PeerFailed { failed_rank: 0, .. })),
                    "{r:?}"
                );
            } else {
                r.unwrap();
            }
        }
        comm.barrier().unwrap();
        assert_eq!(comm.all_gather_host(&[g as u8]).unwrap(), vec![0, 1, 2, 3]);
    });
}

/// Runs `f` on 4 ranks of one node and returns every rank's error; asserts they are all equal.
fn mismatch(f: impl Fn(&mut HostComm) -> zero_comm::Result<()> + Sync) -> String {
    let errs = run_ranks(
        HostWorld::new(topo(4, 4), PROMPT_TIMEOUT).into_comms(),
        |mut c| {
            let start = Instant::now();
            let e = f(&mut c).unwrap_err().to_string();
            // Validation, not the timeout, ended the call.
            assert!(start.elapsed() < PROMPT_TIMEOUT / 4);
            // Validation errors are not fatal: the group goes on.
            c.barrier().unwrap();
            e
        },
    );
    assert!(
        errs.iter().all(|e| e == &errs[0]),
        "ranks disagree: {errs:#?}"
    );
    errs[0].clone()
}

#[test]
fn mismatched_calls_fail_on_every_rank_and_move_nothing() {
    // Wrong receive length on rank 2: nobody's output is touched.
    let errs = run_ranks(host_world(topo(4, 4)), |mut c| {
        let send = c.upload(&[c.rank() as f32; 3]).unwrap();
        let recv_len = if c.rank() == 2 { 11 } else { 12 };
        let mut recv = c.upload(&vec![-1.0f32; recv_len]).unwrap();
        let e = c.all_gather(&send, &mut recv).unwrap_err();
        assert!(recv.as_slice().iter().all(|&x| x == -1.0), "output written");
        e
    });
    for e in errs {
        assert!(
            matches!(
                e,
                Error::LengthMismatch {
                    rank: 2,
                    expected: 12,
                    got: 11,
                    op: Op::Collective(Collective::AllGather)
                }
            ),
            "{e}"
        );
    }

    let e = mismatch(|c| {
        let n = if c.rank() == 3 { 5 } else { 4 };
        c.all_gather_host(&vec![0u8; n]).map(drop)
    });
    assert_eq!(
        e,
        "all_gather: rank 3 disagrees with rank 0: a chunk of 5 elements on rank 3, 4 on rank 0"
    );

    let e = mismatch(|c| {
        let mut b = c.alloc::<f32>(if c.rank() == 1 { 7 } else { 8 })?;
        c.all_reduce(&mut b, ReduceOp::Sum)
    });
    assert!(e.contains("rank 1 disagrees with rank 0"), "{e}");

    let e = mismatch(|c| {
        let s = c.alloc::<f32>(8)?;
        let mut r = c.alloc::<f32>(if c.rank() == 0 { 2 } else { 3 })?;
        c.reduce_scatter(&s, &mut r, ReduceOp::Sum)
    });
    assert_eq!(
        e,
        "reduce_scatter: rank 1 passed a buffer of 8 elements, expected 12"
    );

    let e = mismatch(|c| {
        if c.rank() == 2 {
            let mut b = c.alloc::<f16>(4)?;
            c.all_reduce(&mut b, ReduceOp::Sum)
        } else {
            let mut b = c.alloc::<f32>(4)?;
            c.all_reduce(&mut b, ReduceOp::Sum)
        }
    });
    assert_eq!(
        e,
        "all_reduce: rank 2 disagrees with rank 0: dtype f16 on rank 2, f32 on rank 0"
    );

    let e = mismatch(|c| {
        let op = if c.rank() == 3 {
            ReduceOp::Mean
        } else {
            ReduceOp::Sum
        };
        c.all_reduce_host(&mut [0.0f32; 4], op)
    });
    assert!(e.contains("reduction mean on rank 3, sum on rank 0"), "{e}");

    let e = mismatch(|c| {
        if c.rank() == 1 {
            c.broadcast_host(&mut [0.0f32; 4], 0)
        } else {
            c.all_reduce_host(&mut [0.0f32; 4], ReduceOp::Sum)
        }
    });
    assert!(
        e.contains("rank 1 called broadcast, rank 0 called all_reduce"),
        "{e}"
    );

    let e = mismatch(|c| c.broadcast_host(&mut [0u8; 4], c.rank() % 2));
    assert!(e.contains("root 1 on rank 1, 0 on rank 0"), "{e}");

    let e = mismatch(|c| c.broadcast_host(&mut [0u8; 4], 4));
    assert_eq!(e, "broadcast: root 4 is not a rank of this group of 4");

    let e = mismatch(|c| c.all_reduce_host(&mut [0u8; 4], ReduceOp::Sum));
    assert_eq!(e, "all_reduce: reductions are not defined for u8");

    let e = mismatch(|c| c.all_to_all_host(&[0u8; 6]).map(drop));
    assert_eq!(
        e,
        "all_to_all: rank 0 passed a buffer of 6 elements, expected 8"
    );

    let e = mismatch(|c| {
        let mut b = c.alloc::<u8>(if c.rank() == 3 { 10 } else { 8 })?;
        c.all_gather_in_place(&mut b)
    });
    assert_eq!(
        e,
        "all_gather: rank 3 passed a buffer of 10 elements, expected 12"
    );

    let e = mismatch(|c| {
        if c.rank() == 0 {
            c.split(0, 0).map(drop)
        } else {
            c.barrier()
        }
    });
    assert!(
        e.contains("rank 1 called barrier, rank 0 called split"),
        "{e}"
    );
}

#[test]
fn no_error_message_ends_with_a_full_stop() {
    let errs = [
        Error::Backend("x".into()),
        Error::NotCompiled { backend: "nccl" },
        Error::BufferLength {
            what: "download",
            buffer: 1,
            host: 2,
        },
        Error::Timeout {
            op: Op::Split,
            rank: 0,
            waited: Duration::from_millis(5),
            missing: vec![1],
        },
    ];
    for e in errs {
        assert!(!e.to_string().ends_with('.'), "{e}");
    }
    assert_eq!(
        Error::NotCompiled { backend: "wgpu" }.to_string(),
        "the wgpu backend is not compiled in: enable the `wgpu` feature of zero-comm"
    );
}
