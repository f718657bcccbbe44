//! Integration tests of the wgpu loopback (feature `wgpu`), in one binary.
//!
//! The bodies are the shared ones of `tests/comm/common.rs` (written once against the
//! [`zero_comm::Communicator`] trait), run here with a wgpu factory; results are checked bit for bit
//! against the canonical reduction and, in `equality`, against the host loopback itself.
//!
//! All tests share one device per process (`device::shared`). A missing wgpu adapter fails every
//! test with `ZERO_REQUIRE_WGPU=1` (what `cargo xtask test` and CI set); without it each test
//! records that it did not run (`$ZERO_SKIP_LOG`, counted and listed by `cargo xtask test
//! --allow-device-skips`) and returns. An adapter whose device or kernels fail always fails.
#![cfg(feature = "wgpu")]

// The shared bodies; not every helper is used by this binary.
#[allow(dead_code)]
#[path = "../comm/common.rs"]
mod common;

// Whole tests shared with the host binary, stamped here with `device::wgpu`; the host's own
// backend is not used here.
#[allow(dead_code)]
#[path = "../comm/bodies/mod.rs"]
mod bodies;

#[path = "../comm/bits.rs"]
mod bits;
mod collectives;
mod device;
mod equality;
mod failures;
mod groups;
mod qgz;
#[path = "../comm/quant_common.rs"]
mod quant_common;
mod qwz;
mod wrap;
