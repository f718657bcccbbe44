//! [`Core`]: the device and queue every rank of a wgpu loopback world shares, with its limits
//! ([`Caps`]) and kernels, and the uploads, downloads and waits around them.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::buffer::REQUIRED_USAGES;
use super::kernels::{Kernels, MAX_WINDOW_BYTES, PARAMS_BYTES};

/// Limits the encoder respects, from the device's.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Caps {
    /// `min_storage_buffer_offset_alignment`.
    pub(super) storage_align: u64,
    /// The params block's size rounded up to `min_uniform_buffer_offset_alignment`.
    pub(super) uniform_stride: u64,
    /// `max_compute_workgroups_per_dimension`.
    pub(super) max_groups: u64,
    /// Bytes per window (see [`MAX_WINDOW_BYTES`]), a multiple of 4.
    pub(super) window: u64,
}

/// A device with its queue, limits and kernels: what every rank of a world shares.
#[derive(Debug)]
pub(crate) struct Core {
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    pub(super) caps: Caps,
    pub(super) kernels: Kernels,
}

pub(crate) use zero_quant::wgpu_kernels::error_scope as scoped;

impl Core {
    pub(crate) fn new(device: wgpu::Device, queue: wgpu::Queue) -> Result<Core, String> {
        let limits = device.limits();
        let storage_align = u64::from(limits.min_storage_buffer_offset_alignment.max(4));
        let max_binding = limits.max_storage_buffer_binding_size;
        let window = MAX_WINDOW_BYTES.min(max_binding.saturating_sub(storage_align + 8)) / 4 * 4;
        if window < 1024 {
            return Err(format!(
                "wgpu loopback: max_storage_buffer_binding_size {max_binding} is too small"
            ));
        }
        let caps = Caps {
            storage_align,
            uniform_stride: PARAMS_BYTES
                .next_multiple_of(u64::from(limits.min_uniform_buffer_offset_alignment).max(1)),
            max_groups: u64::from(limits.max_compute_workgroups_per_dimension).max(1),
            window,
        };
        let kernels = scoped(&device, || Kernels::new(&device))?;
        Ok(Core {
            device,
            queue,
            caps,
            kernels,
        })
    }

    /// Creates a buffer holding `bytes` (zero-padded to a multiple of 4, at least 4 bytes).
    pub(crate) fn upload(&self, bytes: &[u8]) -> Result<wgpu::Buffer, String> {
        let size = (bytes.len() as u64).next_multiple_of(4).max(4);
        scoped(&self.device, || {
            let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("zero-comm"),
                size,
                usage: REQUIRED_USAGES,
                mapped_at_creation: true,
            });
            if !bytes.is_empty() {
                let mut view = buffer
                    .get_mapped_range_mut(..)
                    .map_err(|e| format!("wgpu loopback: upload: {e}"))?;
                view.slice(..bytes.len()).copy_from_slice(bytes);
            }
            buffer.unmap();
            Ok(buffer)
        })?
    }

    /// Creates a zero-filled buffer of `bytes` (rounded up to a multiple of 4, at least 4).
    pub(crate) fn alloc(&self, bytes: u64) -> Result<wgpu::Buffer, String> {
        scoped(&self.device, || {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("zero-comm"),
                size: bytes.next_multiple_of(4).max(4),
                usage: REQUIRED_USAGES,
                mapped_at_creation: false,
            })
        })
    }

    /// Reads `out.len()` bytes from byte `offset` of `buffer`, after all work submitted so far.
    pub(crate) fn download(
        &self,
        buffer: &wgpu::Buffer,
        offset: u64,
        out: &mut [u8],
        timeout: Duration,
    ) -> Result<(), String> {
        if out.is_empty() {
            return Ok(());
        }
        let start = offset / 4 * 4;
        let end = (offset + out.len() as u64).next_multiple_of(4);
        let (tx, rx) = mpsc::channel();
        let staging = scoped(&self.device, || {
            let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("zero-comm download"),
                size: end - start,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let mut enc = self.device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(buffer, start, &staging, 0, end - start);
            let index = self.queue.submit([enc.finish()]);
            staging.map_async(wgpu::MapMode::Read, .., move |r| {
                // The receiver only goes away once we have given up waiting.
                let _ = tx.send(r);
            });
            (staging, index)
        })?;
        let (staging, index) = staging;
        let deadline = Instant::now() + timeout;
        loop {
            self.device
                .poll(wgpu::PollType::Wait {
                    submission_index: Some(index.clone()),
                    timeout: Some(timeout),
                })
                .map_err(|e| format!("wgpu loopback: download: {e}"))?;
            // Another thread's poll may be running our callback right now: wait for it briefly.
            match rx.recv_timeout(Duration::from_millis(1)) {
                Ok(Ok(())) => break,
                Ok(Err(e)) => return Err(format!("wgpu loopback: download: {e}")),
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                Err(_) => {
                    return Err(format!(
                        "wgpu loopback: download: the buffer was not mapped within {timeout:?}"
                    ));
                }
            }
        }
        {
            let view = staging
                .get_mapped_range(..)
                .map_err(|e| format!("wgpu loopback: download: {e}"))?;
            let lo = (offset - start) as usize;
            out.copy_from_slice(&view[lo..lo + out.len()]);
        }
        staging.unmap();
        Ok(())
    }

    /// Waits until all work submitted to the queue so far has finished.
    pub(crate) fn synchronize(&self, timeout: Duration) -> Result<(), String> {
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: None,
                timeout: Some(timeout),
            })
            .map(drop)
            .map_err(|e| format!("wgpu loopback: synchronize: {e}"))
    }
}
