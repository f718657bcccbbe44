//! The WGSL kernels (feature `wgpu`) against the host codecs, bit for bit:
//! wire bytes, decoded values, accumulated values and errors.
//!
//! Runs on any wgpu adapter (Mesa lavapipe on CPU-only machines). Without
//! one each test records that it did not run (`$ZERO_SKIP_LOG`, which
//! `cargo xtask test` counts) and returns, unless `ZERO_REQUIRE_WGPU=1`
//! (the default of `cargo xtask test`, and CI), which makes a missing adapter
//! a failure. A device or kernel error is always a failure.
#![cfg(feature = "wgpu")]

mod common;

use std::sync::OnceLock;

use common::device::{self, DeviceCodec};
use zero_quant::wgpu_kernels::wgpu;
use zero_quant::{Codec, Error, Identity, Int8Block, WgpuQuantizer};
use zero_testkit::gate::Device;

/// One quantizer (one device) shared by every test of this binary, or `None` when there is no
/// adapter (recorded as a test that did not run; a failure with `ZERO_REQUIRE_WGPU=1`). Only a
/// missing adapter skips: a device that fails to open or kernels that fail to compile panic.
fn gpu(test: &str) -> Option<&'static WgpuQuantizer> {
    static Q: OnceLock<Result<WgpuQuantizer, String>> = OnceLock::new();
    let q = Q.get_or_init(|| {
        let adapter = adapter()?;
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("zero-quant tests"),
            required_limits: adapter.limits(),
            ..Default::default()
        }))
        .unwrap_or_else(|e| panic!("the adapter exists but its device failed to open: {e}"));
        Ok(WgpuQuantizer::new(device, queue)
            .unwrap_or_else(|e| panic!("the device opened but the WGSL kernels failed: {e}")))
    });
    match q {
        Ok(q) => Some(q),
        Err(why) => {
            Device::Wgpu.missing(zero_testkit::binary!(), test, why);
            None
        }
    }
}

/// The default adapter (as [`WgpuQuantizer::new_default`] requests it), or why there is none.
fn adapter() -> Result<wgpu::Adapter, String> {
    if let Some(why) = Device::Wgpu.simulated() {
        return Err(why);
    }
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
        power_preference: wgpu::PowerPreference::HighPerformance,
        ..Default::default()
    }))
    .map_err(|e| e.to_string())
}

impl DeviceCodec for WgpuQuantizer {
    fn encode(&self, c: Codec, x: &[f32]) -> zero_quant::Result<Vec<u8>> {
        self.encode_host_via_gpu(c, x)
    }
    fn decode(&self, c: Codec, wire: &[u8], n: usize) -> zero_quant::Result<Vec<f32>> {
        self.decode_host_via_gpu(c, wire, n)
    }
    fn accumulate(&self, c: Codec, wire: &[u8], acc: &mut [f32]) -> zero_quant::Result<()> {
        self.decode_accumulate_host_via_gpu(c, wire, acc)
    }
}

/// The shared cases record nothing when they pass: only a GPU run's cookie needs proof.
fn ran(_test: &str) {}

device::stamp!("", gpu, ran;
    encode_decode_accumulate_match_host_bit_for_bit,
    every_length_up_to_70_with_small_blocks,
    hand_computed_int4_wire,
    non_finite_input_reports_the_first_index,
    corrupt_wires_give_the_host_errors,
);

#[test]
fn device_buffers_are_checked() {
    let Some(q) = gpu("device_buffers_are_checked") else {
        return;
    };
    let c = Int8Block::default();
    let small = q.device().create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 16,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    let big = q.device().create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 4096,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    assert!(matches!(
        q.encode(c, &small, 100, &big),
        Err(Error::BufferLen {
            expected: 400,
            got: 16,
            ..
        })
    ));
    assert!(matches!(
        q.decode(c, &small, 100, &big),
        Err(Error::BufferLen { .. })
    ));
    let map = q.device().create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 4096,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    assert!(matches!(
        q.encode(c, &big, 100, &map),
        Err(Error::Device(_))
    ));
    assert!(matches!(
        q.encode_host_via_gpu(Identity, &[1.0]),
        Err(Error::Device(_))
    ));
    assert_eq!(q.encode_host_via_gpu(c, &[]).unwrap(), Vec::<u8>::new());
}
