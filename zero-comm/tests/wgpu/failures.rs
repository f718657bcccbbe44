//! Failures behave as on the host loopback: panicking, dropped and missing ranks, mismatched calls
//! (the same error text on both backends), and wgpu errors, which fail the world naming the rank.

use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use half::f16;
use zero_comm::host::HostComm;
use zero_comm::wgpu_loopback::{WgpuComm, WgpuWorld};
use zero_comm::{Communicator, Error, FailureReason, Op, ReduceOp};
use zero_core::Collective;

use crate::common::*;
use crate::device::{or_skip, wgpu_world};

/// The timeout of tests where a failure must end every wait "promptly": under a quarter of it, so
/// a prompt failure and a timed-out one stay apart by a wide margin even on a loaded machine.
const PROMPT_TIMEOUT: Duration = Duration::from_secs(60);

#[track_caller]
fn launch<R: Send>(
    w: usize,
    l: usize,
    timeout: Duration,
    f: impl Fn(WgpuComm) -> R + Sync,
) -> Option<Vec<thread::Result<R>>> {
    let device = or_skip()?;
    Some(WgpuWorld::with_device(device, topo(w, l), timeout).launch(f))
}

#[test]
fn a_panicking_rank_fails_its_peers_promptly() {
    let timeout = PROMPT_TIMEOUT;
    let Some(results) = launch(4, 2, timeout, |mut comm| {
        let mut x = vec![1.0f32; 8];
        comm.all_reduce_host(&mut x, ReduceOp::Sum).unwrap();
        if comm.rank() == 2 {
            panic!("rank 2 fails on purpose");
        }
        let start = Instant::now();
        let err = comm.all_reduce_host(&mut x, ReduceOp::Sum).unwrap_err();
        let elapsed = start.elapsed();
        let again = comm.barrier().unwrap_err();
        (err, again, elapsed)
    }) else {
        return;
    };
    for (rank, r) in results.into_iter().enumerate() {
        if rank == 2 {
            assert!(panic_message(&r.unwrap_err()).contains("on purpose"));
            continue;
        }
        let (err, again, elapsed) = r.unwrap();
        assert!(elapsed < timeout / 4, "rank {rank} waited {elapsed:?}");
        assert!(
            matches!(
                err,
                Error::PeerFailed {
                    op: Op::Collective(Collective::AllReduce),
                    failed_rank: 2,
                    reason: FailureReason::Panicked,
                    ..
                }
            ),
            "rank {rank}: {err}"
        );
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

/// A panic inside one node's group poisons the other node's group too (one world).
#[test]
fn a_panic_in_one_sub_group_fails_every_group() {
    let timeout = PROMPT_TIMEOUT;
    let Some(results) = launch(4, 2, timeout, |mut comm| {
        let t = *comm.topology();
        let g = comm.global_rank();
        let mut intra = comm.split(t.node_of(g), t.local_rank(g)).unwrap();
        if g == 1 {
            panic!("rank 1 fails inside node 0");
        }
        if g == 0 {
            return intra.all_gather_host(&[0u8]).unwrap_err();
        }
        let start = Instant::now();
        loop {
            match intra.barrier() {
                Ok(()) => assert!(start.elapsed() < timeout / 4, "never saw the failure"),
                Err(e) => return e,
            }
        }
    }) else {
        return;
    };
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

/// As on the host loopback (`tests/comm/failures.rs`): ordered by signals, not sleeps; one peer
/// waits out the full timeout, the other is told by it (`Timeout` if already waiting, else
/// `Aborted`).
#[test]
fn a_missing_rank_times_out_and_aborts_the_world() {
    let timeout = Duration::from_millis(400);
    let together = Barrier::new(2);
    let failed = [Signal::new(), Signal::new(), Signal::new()];
    let Some(results) = launch(3, 3, timeout, |mut comm| {
        let me = comm.rank();
        if me == 1 {
            failed[0].wait("rank 0's error");
            failed[2].wait("rank 2's error");
            return (
                comm.all_gather_host(&[1.0f32]).unwrap_err(),
                Duration::ZERO,
                None,
            );
        }
        together.wait();
        let start = Instant::now();
        let err = comm.all_gather_host(&[1.0f32]).unwrap_err();
        let elapsed = start.elapsed();
        let later = comm.barrier().unwrap_err();
        failed[me].set();
        (err, elapsed, Some(later))
    }) else {
        return;
    };
    let mut full_waits = 0;
    for (rank, r) in results.into_iter().enumerate() {
        let (err, elapsed, later) = r.unwrap();
        if rank == 1 {
            assert!(
                matches!(err, Error::Aborted { rank: 1, .. }),
                "late rank: {err}"
            );
            continue;
        }
        assert!(
            elapsed < timeout + SAFE_TIMEOUT,
            "rank {rank} waited {elapsed:?}"
        );
        match &err {
            Error::Timeout {
                op: Op::Collective(Collective::AllGather),
                missing,
                waited,
                ..
            } if missing == &vec![1] => {
                assert!(*waited <= elapsed, "{waited:?} > {elapsed:?}");
                if *waited >= timeout {
                    full_waits += 1;
                }
            }
            Error::Aborted { .. } if err.to_string().contains("waiting for ranks [1]") => {}
            e => panic!("rank {rank}: unexpected {e}"),
        }
        let later = later.unwrap();
        assert!(
            later.to_string().contains("waiting for ranks [1]"),
            "rank {rank}: {later}"
        );
    }
    assert!(full_waits >= 1, "no rank waited out the full {timeout:?}");
}

#[test]
fn a_dropped_communicator_fails_its_peers_promptly() {
    let timeout = PROMPT_TIMEOUT;
    let Some(results) = launch(3, 1, timeout, |mut comm| {
        if comm.rank() == 1 {
            return None;
        }
        let start = Instant::now();
        let mut x = vec![1.0f32; 4];
        let e = comm.all_reduce_host(&mut x, ReduceOp::Mean).unwrap_err();
        Some((e, start.elapsed()))
    }) else {
        return;
    };
    for (rank, r) in results.into_iter().enumerate() {
        let Some((e, elapsed)) = r.unwrap() else {
            continue;
        };
        assert!(elapsed < timeout / 4, "rank {rank} waited {elapsed:?}");
        assert!(
            e.to_string().contains("rank 1 dropped its communicator"),
            "rank {rank}: {e}"
        );
    }
}

/// A wgpu error while recording or submitting an op (here: a buffer that was destroyed, as a
/// memory pool might) fails that rank with `Error::Backend` and the world with
/// `FailureReason::Backend` naming it.
#[test]
fn a_backend_error_fails_the_world_naming_the_rank() {
    let Some(device) = or_skip() else {
        return;
    };
    let dead = device
        .device()
        .create_buffer(&zero_comm::wgpu_loopback::wgpu::BufferDescriptor {
            label: Some("destroyed"),
            size: 64,
            usage: zero_comm::wgpu_loopback::REQUIRED_USAGES,
            mapped_at_creation: false,
        });
    dead.destroy();
    let results =
        WgpuWorld::with_device(device, topo(3, 3), Duration::from_secs(10)).launch(|mut comm| {
            let send = comm.upload(&[comm.rank() as f32; 4]).unwrap();
            let mut recv = if comm.rank() == 1 {
                comm.wrap::<f32>(dead.clone(), 0, 12).unwrap()
            } else {
                comm.alloc::<f32>(12).unwrap()
            };
            let first = comm.all_gather(&send, &mut recv);
            let second = comm.barrier();
            (first, second)
        });
    for (rank, r) in results.into_iter().enumerate() {
        let (first, second) = r.unwrap();
        if rank == 1 {
            let e = first.unwrap_err();
            assert!(matches!(e, Error::Backend(_)), "{e}");
            assert!(
                e.to_string()
                    .starts_with("backend error: all_gather on rank 1: "),
                "{e}"
            );
            let e = second.unwrap_err();
            assert!(matches!(e, Error::Aborted { .. }), "{e}");
            continue;
        }
        first.unwrap();
        let e = second.unwrap_err();
        assert!(
            matches!(
                &e,
                Error::PeerFailed {
                    failed_rank: 1,
                    reason: FailureReason::Backend(_),
                    ..
                }
            ),
            "rank {rank}: {e}"
        );
        assert!(
            e.to_string().contains("rank 1 failed in the backend"),
            "{e}"
        );
    }
}

/// The mismatched calls of the host tests, as one generic function per case.
#[derive(Clone, Copy, Debug)]
enum Case {
    RecvLength,
    Chunk,
    AllReduceLength,
    ReduceScatterLength,
    Dtype,
    Reduction,
    Op,
    Root,
    RootRange,
    U8Reduce,
    AllToAllLength,
    InPlaceLength,
    SplitVsBarrier,
}

impl Case {
    const ALL: [Case; 13] = [
        Case::RecvLength,
        Case::Chunk,
        Case::AllReduceLength,
        Case::ReduceScatterLength,
        Case::Dtype,
        Case::Reduction,
        Case::Op,
        Case::Root,
        Case::RootRange,
        Case::U8Reduce,
        Case::AllToAllLength,
        Case::InPlaceLength,
        Case::SplitVsBarrier,
    ];

    /// Makes the bad call on `c`; returns its error and whether `recv` kept its contents.
    fn call<C: Communicator>(self, c: &mut C) -> (Error, bool) {
        let r = c.rank();
        let mut untouched = true;
        let e = match self {
            Case::RecvLength => {
                let send = c.upload(&[r as f32; 3]).unwrap();
                let len = if r == 2 { 11 } else { 12 };
                let mut recv = c.upload(&vec![-1.0f32; len]).unwrap();
                let e = c.all_gather(&send, &mut recv).map(drop);
                untouched = c.download_vec(&recv).unwrap().iter().all(|&x| x == -1.0);
                e
            }
            Case::Chunk => c
                .all_gather_host(&vec![0u8; if r == 3 { 5 } else { 4 }])
                .map(drop),
            Case::AllReduceLength => {
                let mut b = c
                    .upload(&vec![-2.0f32; if r == 1 { 7 } else { 8 }])
                    .unwrap();
                let e = c.all_reduce(&mut b, ReduceOp::Sum);
                untouched = c.download_vec(&b).unwrap().iter().all(|&x| x == -2.0);
                e
            }
            Case::ReduceScatterLength => {
                let s = c.alloc::<f32>(8).unwrap();
                let mut recv = c.alloc::<f32>(if r == 0 { 2 } else { 3 }).unwrap();
                c.reduce_scatter(&s, &mut recv, ReduceOp::Sum)
            }
            Case::Dtype => {
                if r == 2 {
                    let mut b = c.alloc::<f16>(4).unwrap();
                    c.all_reduce(&mut b, ReduceOp::Sum)
                } else {
                    let mut b = c.alloc::<f32>(4).unwrap();
                    c.all_reduce(&mut b, ReduceOp::Sum)
                }
            }
            Case::Reduction => {
                let op = if r == 3 {
                    ReduceOp::Mean
                } else {
                    ReduceOp::Sum
                };
                c.all_reduce_host(&mut [0.0f32; 4], op)
            }
            Case::Op => {
                if r == 1 {
                    c.broadcast_host(&mut [0.0f32; 4], 0)
                } else {
                    c.all_reduce_host(&mut [0.0f32; 4], ReduceOp::Sum)
                }
            }
            Case::Root => c.broadcast_host(&mut [0u8; 4], r % 2),
            Case::RootRange => c.broadcast_host(&mut [0u8; 4], 4),
            Case::U8Reduce => c.all_reduce_host(&mut [0u8; 4], ReduceOp::Sum),
            Case::AllToAllLength => c.all_to_all_host(&[0u8; 6]).map(drop),
            Case::InPlaceLength => {
                let mut b = c.alloc::<u8>(if r == 3 { 10 } else { 8 }).unwrap();
                c.all_gather_in_place(&mut b)
            }
            Case::SplitVsBarrier => {
                if r == 0 {
                    c.split(0, 0).map(drop)
                } else {
                    c.barrier()
                }
            }
        };
        (e.unwrap_err(), untouched)
    }
}

/// Runs `case` on 4 ranks; every rank must fail promptly with the same error, keep its output, and
/// go on (validation errors are not fatal). Returns the error text.
fn mismatch<C: Communicator>(comms: Vec<C>, case: Case) -> String {
    let errs = run_ranks(comms, |mut c| {
        let start = Instant::now();
        let (e, untouched) = case.call(&mut c);
        // Validation, not the timeout, ended the call.
        assert!(start.elapsed() < SAFE_TIMEOUT / 4);
        assert!(untouched, "{case:?}: output written");
        assert_eq!(c.traffic().calls(), 0, "{case:?}: traffic recorded");
        c.barrier().unwrap();
        e.to_string()
    });
    assert!(
        errs.iter().all(|e| e == &errs[0]),
        "{case:?}: ranks disagree: {errs:#?}"
    );
    errs[0].clone()
}

#[test]
fn mismatched_calls_fail_like_the_host_loopback() {
    if or_skip().is_none() {
        return;
    }
    for case in Case::ALL {
        let host = mismatch::<HostComm>(host_world(topo(4, 4)), case);
        let wgpu = mismatch::<WgpuComm>(wgpu_world(topo(4, 4)), case);
        assert_eq!(wgpu, host, "{case:?}");
    }
}
