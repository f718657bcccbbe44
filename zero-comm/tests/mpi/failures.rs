//! Failures on MPI: mismatched calls fail on every rank before data moves; a rank that is killed
//! or panics ends the whole job in well under half a long collective timeout (so the death, not a
//! timeout, ended it), and a rank that never arrives ends it within the collective timeout plus
//! 10 s, with a message naming the rank (and the op, for a timeout). Nothing hangs.

use std::time::Duration;

use zero_comm::{Communicator, Error, ReduceOp};

use crate::harness::{self, Job, is_rank, launch, rank_ok};

const LIMIT: Duration = Duration::from_secs(60);
/// The collective timeout of the failure jobs that must time out.
const TIMEOUT: Duration = Duration::from_secs(4);
/// The collective timeout of the jobs whose failure must end them sooner than any timeout.
const LONG: Duration = Duration::from_secs(50);
/// Their bound: under half of [`LONG`].
const FAST: Duration = Duration::from_secs(20);

#[track_caller]
fn assert_failed_within(job: &Job, bound: Duration, needles: &[&str]) {
    assert!(!job.success, "the job succeeded:\n{}", job.output);
    assert!(
        job.elapsed < bound,
        "the job took {:?} to fail:\n{}",
        job.elapsed,
        job.output
    );
    for n in needles {
        assert!(
            job.output.contains(n),
            "no {n:?} in the output:\n{}",
            job.output
        );
    }
}

#[test]
fn mismatched_calls_fail_on_every_rank_before_data_moves() {
    if is_rank() {
        let mut comm = harness::world();
        let (n, me) = (comm.world_size(), comm.rank());
        let len = if me == 2 { 9 } else { 10 };
        let mut x = vec![1.0f32; len];
        match comm.all_reduce_host(&mut x, ReduceOp::Sum).unwrap_err() {
            Error::PeerMismatch {
                peer: 2, rank: 0, ..
            } => {}
            e => panic!("rank {me}: {e}"),
        }
        assert_eq!(x, vec![1.0; len], "data moved");
        let mut recv = comm.alloc::<f32>(3 * n).unwrap();
        let send = comm.upload(&[1.0f32; 2]).unwrap();
        match comm.all_gather(&send, &mut recv).unwrap_err() {
            Error::LengthMismatch {
                rank,
                expected,
                got,
                ..
            } => {
                assert_eq!((rank, expected, got), (0, 2 * n, 3 * n))
            }
            e => panic!("rank {me}: {e}"),
        }
        // Validation errors leave the communicator usable.
        let mut y = vec![1.0f32; 4];
        comm.all_reduce_host(&mut y, ReduceOp::Sum).unwrap();
        assert_eq!(y, vec![n as f32; 4]);
        return rank_ok(me, n);
    }
    let name = "failures::mismatched_calls_fail_on_every_rank_before_data_moves";
    if let Some(job) = launch(name, 3, 3, TIMEOUT, &[], LIMIT) {
        job.assert_ranks_ok(3);
    }
}

#[test]
fn a_killed_rank_ends_the_job() {
    if is_rank() {
        let mut comm = harness::world();
        let mut x = vec![1.0f32; 1000];
        comm.all_reduce_host(&mut x, ReduceOp::Sum).unwrap();
        if comm.rank() == 1 {
            let pid = std::process::id().to_string();
            let _ = std::process::Command::new("kill")
                .args(["-9", &pid])
                .status();
            std::thread::sleep(Duration::from_secs(30));
        }
        comm.all_reduce_host(&mut x, ReduceOp::Sum).unwrap();
        unreachable!(
            "rank {} finished a collective with a dead peer",
            comm.rank()
        );
    }
    // A long collective timeout: the job must end because the rank died, not by a timeout.
    if let Some(job) = launch(
        "failures::a_killed_rank_ends_the_job",
        3,
        3,
        LONG,
        &[],
        LIMIT,
    ) {
        assert_failed_within(&job, FAST, &["rank 1"]);
    }
}

#[test]
fn a_rank_that_never_arrives_times_out_naming_the_op() {
    if is_rank() {
        let mut comm = harness::world();
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_secs(30));
        }
        let mut x = vec![1.0f32; 10];
        comm.all_reduce_host(&mut x, ReduceOp::Sum).unwrap();
        unreachable!(
            "rank {} finished a collective without its peer",
            comm.rank()
        );
    }
    let name = "failures::a_rank_that_never_arrives_times_out_naming_the_op";
    if let Some(job) = launch(name, 2, 2, TIMEOUT, &[], LIMIT) {
        // The wait for the descriptors of the all-reduce is what times out.
        let bound = TIMEOUT + Duration::from_secs(10);
        assert_failed_within(&job, bound, &["all_reduce on rank 0: timed out", "[1]"]);
    }
}

#[test]
fn a_panicking_rank_aborts_its_peers() {
    if is_rank() {
        let mut comm = harness::world();
        if comm.rank() == 1 {
            panic!("rank 1 fails on purpose");
        }
        let mut x = vec![1.0f32; 10];
        comm.all_reduce_host(&mut x, ReduceOp::Sum).unwrap();
        unreachable!("rank 0 finished a collective without its peer");
    }
    let name = "failures::a_panicking_rank_aborts_its_peers";
    // A long collective timeout: the job must end because of the panic, not a timeout.
    if let Some(job) = launch(name, 2, 2, LONG, &[], LIMIT) {
        assert_failed_within(&job, FAST, &["rank 1 fails on purpose", "rank 1 panicked"]);
    }
}
