//! The one device of this test process, and the skip rule.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use zero_comm::wgpu_loopback::{WgpuComm, WgpuDevice, WgpuWorld};
use zero_core::Topology;
use zero_testkit::gate::Device;

use crate::bodies::World;
use crate::common::SAFE_TIMEOUT;

static DEVICE: OnceLock<Result<Arc<WgpuDevice>, String>> = OnceLock::new();

/// The process's device, opened once. `Err` (why) if there is no adapter; panics if there is one
/// but the device or its kernels fail, or if there is none and `ZERO_REQUIRE_WGPU` is `1`.
pub(crate) fn shared() -> Result<Arc<WgpuDevice>, String> {
    DEVICE
        .get_or_init(|| {
            if let Some(why) = Device::Wgpu.simulated() {
                return Err(why);
            }
            match WgpuDevice::default_adapter() {
                Ok(adapter) => Ok(WgpuDevice::from_adapter(&adapter)
                    .unwrap_or_else(|e| panic!("the adapter exists but the device failed: {e}"))),
                Err(e) => Err(e.to_string()),
            }
        })
        .clone()
        .inspect_err(|why| {
            if Device::Wgpu.required() {
                Device::Wgpu.missing(zero_testkit::binary!(), "", why);
            }
        })
}

/// The device, or `None` after recording that the calling test did not run and why
/// (stderr and `$ZERO_SKIP_LOG`, which `cargo xtask test` counts).
#[track_caller]
pub(crate) fn or_skip() -> Option<Arc<WgpuDevice>> {
    match shared() {
        Ok(d) => Some(d),
        Err(why) => {
            Device::Wgpu.missing(zero_testkit::binary!(), "", &why);
            None
        }
    }
}

/// The factory for the shared bodies: a world on the process's device.
pub(crate) fn wgpu_world(topology: Topology) -> Vec<WgpuComm> {
    wgpu_world_within(topology, SAFE_TIMEOUT)
}

/// A world on the process's device whose ranks wait at most `timeout`.
fn wgpu_world_within(topology: Topology, timeout: Duration) -> Vec<WgpuComm> {
    let device = shared().expect("wgpu_world called without a device: check or_skip() first");
    WgpuWorld::with_device(device, topology, timeout).into_comms()
}

/// The wgpu loopback as a backend of the stamped tests (`bodies::stamp!`): its worlds, or `None`
/// after [`or_skip`] recorded that the calling test did not run.
#[track_caller]
pub(crate) fn wgpu() -> Option<World<WgpuComm>> {
    or_skip()?;
    Some(wgpu_world_within)
}
