//! Failures: a panicking rank, a missing rank, a dropped communicator, mismatched calls. Every
//! case must end promptly, well within its timeout, with the right error on every rank. The cases
//! every backend shares are stamped from `bodies::failures`; the rest are the host loopback's.

use std::time::Duration;

use zero_comm::host::{HostLoopback, HostWorld};
use zero_comm::{Communicator, Error, Op};
use zero_core::Collective;

use crate::bodies::failures::{self as shared, PROMPT_TIMEOUT};
use crate::bodies::mismatch::{Case, mismatch};
use crate::bodies::{host, stamp};
use crate::common::*;

stamp! { host, shared:
    a_panicking_rank_fails_its_peers_promptly(topo(4, 4));
    a_panic_in_one_sub_group_fails_every_group();
    a_missing_rank_times_out_and_aborts_the_world();
    a_dropped_communicator_fails_its_peers_promptly();
}

/// A rank that never arrives in a sub-group: its group peer times out naming it, and the world is
/// aborted for everyone else. The others act only once the timeout has fired (a signal); the
/// missing rank keeps its communicators alive until then, so its peer sees a timeout, not a
/// dropped communicator.
#[test]
fn a_timeout_in_a_sub_group_aborts_the_world() {
    let timeout = Duration::from_millis(300);
    let timed_out = Signal::new();
    let results = HostLoopback::launch(topo(4, 2), timeout, |mut comm| {
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

/// What `case` must fail with, in full (`Is`) or in part (`Has`); `RecvLength` is checked by
/// its variant on every rank.
enum Want {
    Is(&'static str),
    Has(&'static str),
}

/// The error each mismatched call must fail with on the host loopback.
fn wanted(case: Case) -> Option<Want> {
    use Want::{Has, Is};
    Some(match case {
        Case::RecvLength => return None,
        Case::Chunk => Is(
            "all_gather: rank 3 disagrees with rank 0: a chunk of 5 elements on rank 3, 4 on rank 0",
        ),
        Case::AllReduceLength => Has("rank 1 disagrees with rank 0"),
        Case::ReduceScatterLength => {
            Is("reduce_scatter: rank 1 passed a buffer of 8 elements, expected 12")
        }
        Case::Dtype => {
            Is("all_reduce: rank 2 disagrees with rank 0: dtype f16 on rank 2, f32 on rank 0")
        }
        Case::Reduction => Has("reduction mean on rank 3, sum on rank 0"),
        Case::Op => Has("rank 1 called broadcast, rank 0 called all_reduce"),
        Case::Root => Has("root 1 on rank 1, 0 on rank 0"),
        Case::RootRange => Is("broadcast: root 4 is not a rank of this group of 4"),
        Case::U8Reduce => Is("all_reduce: reductions are not defined for u8"),
        Case::AllToAllLength => Is("all_to_all: rank 0 passed a buffer of 6 elements, expected 8"),
        Case::InPlaceLength => Is("all_gather: rank 3 passed a buffer of 10 elements, expected 12"),
        Case::SplitVsBarrier => Has("rank 1 called barrier, rank 0 called split"),
    })
}

#[test]
fn mismatched_calls_fail_on_every_rank_and_move_nothing() {
    for case in Case::ALL {
        let errs = mismatch(
            HostWorld::new(topo(4, 4), PROMPT_TIMEOUT).into_comms(),
            case,
            PROMPT_TIMEOUT / 4,
        );
        let e = errs[0].to_string();
        match wanted(case) {
            Some(Want::Is(want)) => assert_eq!(e, want, "{case:?}"),
            Some(Want::Has(part)) => assert!(e.contains(part), "{case:?}: {e}"),
            None => {
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
            }
        }
    }
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
