//! Failures behave as on the host loopback: panicking, dropped and missing ranks, mismatched calls
//! (the same error text on both backends), and wgpu errors, which fail the world naming the rank.

use std::time::Duration;

use zero_comm::wgpu_loopback::WgpuWorld;
use zero_comm::{Communicator, Error, FailureReason};

use crate::bodies::failures as shared;
use crate::bodies::mismatch::{Case, mismatch};
use crate::bodies::stamp;
use crate::common::*;
use crate::device::{or_skip, wgpu, wgpu_world};

stamp! { wgpu, shared:
    a_panicking_rank_fails_its_peers_promptly(topo(4, 2));
    a_panic_in_one_sub_group_fails_every_group();
    a_missing_rank_times_out_and_aborts_the_world();
    a_dropped_communicator_fails_its_peers_promptly();
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

#[test]
fn mismatched_calls_fail_like_the_host_loopback() {
    if or_skip().is_none() {
        return;
    }
    for case in Case::ALL {
        let host = mismatch(host_world(topo(4, 4)), case, SAFE_TIMEOUT / 4);
        let wgpu = mismatch(wgpu_world(topo(4, 4)), case, SAFE_TIMEOUT / 4);
        assert_eq!(wgpu[0].to_string(), host[0].to_string(), "{case:?}");
    }
}
