//! The one device of this test process, and the skip rule.

use std::sync::{Arc, OnceLock};

use zero_comm::wgpu_loopback::{WgpuComm, WgpuDevice, WgpuWorld};
use zero_core::Topology;

use crate::common::SAFE_TIMEOUT;

/// The environment variable that turns a missing adapter into a test failure.
pub(crate) const REQUIRE: &str = "ZERO_REQUIRE_WGPU";

static DEVICE: OnceLock<Result<Arc<WgpuDevice>, String>> = OnceLock::new();

/// The process's device, opened once. `Err` (why) if there is no adapter; panics if there is one
/// but the device or its kernels fail, or if there is none and [`REQUIRE`] is `1`.
pub(crate) fn shared() -> Result<Arc<WgpuDevice>, String> {
    DEVICE
        .get_or_init(|| match WgpuDevice::default_adapter() {
            Ok(adapter) => Ok(WgpuDevice::from_adapter(&adapter)
                .unwrap_or_else(|e| panic!("the adapter exists but the device failed: {e}"))),
            Err(e) => Err(e.to_string()),
        })
        .clone()
        .map_err(|why| {
            if std::env::var(REQUIRE).is_ok_and(|v| v == "1") {
                panic!("{REQUIRE}=1 but there is no wgpu adapter: {why}");
            }
            why
        })
}

/// The device, or `None` after printing why the calling test is skipped.
#[track_caller]
pub(crate) fn or_skip() -> Option<Arc<WgpuDevice>> {
    match shared() {
        Ok(d) => Some(d),
        Err(why) => {
            eprintln!(
                "skipped at {}: no wgpu adapter ({why}); install mesa-vulkan-drivers, or set \
                 {REQUIRE}=1 to fail instead",
                std::panic::Location::caller()
            );
            None
        }
    }
}

/// The factory for the shared bodies: a world on the process's device.
pub(crate) fn wgpu_world(topology: Topology) -> Vec<WgpuComm> {
    let device = shared().expect("wgpu_world called without a device: check or_skip() first");
    WgpuWorld::with_device(device, topology, SAFE_TIMEOUT).into_comms()
}
