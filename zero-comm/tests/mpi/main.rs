//! Integration tests of the MPI backend (feature `mpi`), in one binary.
//!
//! Each test runs twice: once as the test the harness started, which launches this same binary
//! under `mpirun` ([`harness::launch`]) with only that test selected, and once per MPI rank inside
//! that job, where [`harness::rank`] says so and the test body runs on a real [`MpiComm`]. The
//! bodies are the shared ones of `tests/comm/common.rs`; results are checked bit for bit against
//! the canonical reduction and against the host loopback run in-process on the same inputs.
//!
//! Without `mpirun` on `PATH` each test records that it did not run (`$ZERO_SKIP_LOG`, counted by
//! `cargo xtask test`) and returns; with `ZERO_REQUIRE_MPI=1` (what `cargo xtask test` and CI
//! set) it fails instead.
//!
//! [`MpiComm`]: zero_comm::mpi::MpiComm
#![cfg(feature = "mpi")]

// The shared bodies; not every helper is used by this binary.
#[allow(dead_code)]
#[path = "../comm/common.rs"]
mod common;

mod collectives;
mod failures;
mod harness;
