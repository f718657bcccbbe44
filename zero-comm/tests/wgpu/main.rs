//! Integration tests of the wgpu loopback (feature `wgpu`), in one binary.
//!
//! The bodies are the shared ones of `tests/comm/common.rs` (written once against the
//! [`zero_comm::Communicator`] trait), run here with a wgpu factory; results are checked bit for bit
//! against the canonical reduction and, in `equality`, against the host loopback itself.
//!
//! All tests share one device per process (`device::shared`). Without a wgpu adapter every test
//! prints why to stderr and passes, unless `ZERO_REQUIRE_WGPU=1`, which turns a missing adapter
//! into a failure (CI sets it after installing `mesa-vulkan-drivers`).
#![cfg(feature = "wgpu")]

// The shared bodies; not every helper is used by this binary.
#[allow(dead_code)]
#[path = "../comm/common.rs"]
mod common;

mod collectives;
mod device;
mod equality;
mod failures;
mod groups;
mod qgz;
mod qwz;
mod wrap;
