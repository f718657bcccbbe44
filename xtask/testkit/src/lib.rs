//! What the tests of every zero-rs crate share, written once:
//! - [`gate`]: a test that needs a device this machine may lack (a wgpu adapter, `mpirun`)
//!   records that it did not run, or fails when the device is required (`ZERO_REQUIRE_*=1`, what
//!   `cargo xtask test` sets);
//! - [`cookie`]: a GPU test that passed says so in the file `cargo xtask gpu-check` reads;
//! - [`alloc`]: a counting global allocator for the tests that measure memory.
//!
//! The environment variables are named here once; xtask reads the same constants.

pub mod alloc;
pub mod cookie;
pub mod gate;

/// `<package>/<crate>` of the calling test binary (`zero-burn/families`): how the not-run record
/// names a test's binary.
#[macro_export]
macro_rules! binary {
    () => {
        concat!(env!("CARGO_PKG_NAME"), "/", env!("CARGO_CRATE_NAME"))
    };
}

/// Records that `test` of the calling binary did not run, and why ([`gate::record_skip_as`]).
/// An empty `test` names the test thread's.
#[macro_export]
macro_rules! record_skip {
    ($test:expr, $reason:expr $(,)?) => {
        $crate::gate::record_skip_as($crate::binary!(), $test, $reason)
    };
}
