//! The one device of this test process, and the skip rule.

use std::sync::{Arc, OnceLock};

use zero_comm::wgpu_loopback::{WgpuComm, WgpuDevice, WgpuWorld};
use zero_core::Topology;

use crate::common::{SAFE_TIMEOUT, record_skip};

/// The environment variable that turns a missing adapter into a test failure (`cargo xtask test`
/// sets it unless `--allow-device-skips`; so does CI).
pub(crate) const REQUIRE: &str = "ZERO_REQUIRE_WGPU";
/// Behaves as a machine without an adapter (tests the not-run accounting of `cargo xtask test`).
pub(crate) const SIMULATE_NO_ADAPTER: &str = "ZERO_SIMULATE_NO_ADAPTER";

static DEVICE: OnceLock<Result<Arc<WgpuDevice>, String>> = OnceLock::new();

/// The process's device, opened once. `Err` (why) if there is no adapter; panics if there is one
/// but the device or its kernels fail, or if there is none and [`REQUIRE`] is `1`.
pub(crate) fn shared() -> Result<Arc<WgpuDevice>, String> {
    DEVICE
        .get_or_init(|| {
            if std::env::var(SIMULATE_NO_ADAPTER).is_ok_and(|v| v == "1") {
                return Err(format!("simulated by {SIMULATE_NO_ADAPTER}=1"));
            }
            match WgpuDevice::default_adapter() {
                Ok(adapter) => Ok(WgpuDevice::from_adapter(&adapter)
                    .unwrap_or_else(|e| panic!("the adapter exists but the device failed: {e}"))),
                Err(e) => Err(e.to_string()),
            }
        })
        .clone()
        .map_err(|why| {
            if std::env::var(REQUIRE).is_ok_and(|v| v == "1") {
                panic!(
                    "{REQUIRE}=1 but there is no wgpu adapter: {why}; install \
                     mesa-vulkan-drivers, or run `cargo xtask test --allow-device-skips`"
                );
            }
            why
        })
}

/// The device, or `None` after recording that the calling test did not run and why
/// ([`record_skip`]: stderr and `$ZERO_SKIP_LOG`, which `cargo xtask test` counts).
#[track_caller]
pub(crate) fn or_skip() -> Option<Arc<WgpuDevice>> {
    match shared() {
        Ok(d) => Some(d),
        Err(why) => {
            record_skip(
                "",
                &format!(
                    "no wgpu adapter ({why}); install mesa-vulkan-drivers, or set {REQUIRE}=1 to \
                     fail instead"
                ),
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
