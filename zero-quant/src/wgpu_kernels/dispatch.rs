//! How a kernel runs: buffer checks, the parameter block, the dispatch grid, the status words
//! and the read-back.

#[allow(clippy::wildcard_imports)]
use super::*;

impl WgpuQuantizer {
    /// Checks a buffer's size and usage for a binding of `need` bytes.
    pub(super) fn check_buffer(
        &self,
        codec: &'static str,
        what: &'static str,
        buf: &wgpu::Buffer,
        need: u64,
    ) -> Result<()> {
        if buf.size() < need {
            return Err(Error::BufferLen {
                codec,
                what,
                expected: need as usize,
                got: buf.size() as usize,
            });
        }
        if !buf.usage().contains(wgpu::BufferUsages::STORAGE) {
            return Err(Error::Device(format!("{what}: needs STORAGE usage")));
        }
        if need > self.max_binding {
            return Err(Error::Device(format!(
                "{what}: {need} bytes exceed the device's max_storage_buffer_binding_size {}",
                self.max_binding
            )));
        }
        Ok(())
    }

    /// `(x, y)` workgroup counts covering `groups`, and the x extent.
    pub(super) fn grid(&self, groups: u32) -> (u32, u32) {
        let x = groups.clamp(1, self.max_groups);
        (x, groups.div_ceil(x))
    }

    pub(super) fn params(&self, f: &Format, codec: Codec, n: usize) -> Result<Params> {
        if n >= 1 << 31 {
            return Err(Error::Device(format!(
                "{n} elements: the kernels take n < 2^31"
            )));
        }
        let l = codec.layout(n);
        let words = (l.scales_offset / 4) as u32;
        let (grid_a, _) = self.grid(l.num_blocks as u32);
        let (grid_b, _) = self.grid(words.div_ceil(WG));
        Ok(Params {
            n: n as u32,
            bs: codec.block_size().min(n) as u32,
            nb: l.num_blocks as u32,
            scale_word: words,
            grid_a,
            grid_b,
            smax: f.smax,
            zero: 0,
            p100: 2f32.powi(-100).to_bits(),
            p49: 2f32.powi(-49).to_bits(),
            pad: [0; 2],
        })
    }

    pub(super) fn binding(buf: &wgpu::Buffer, size: u64) -> wgpu::BindingResource<'_> {
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: buf,
            offset: 0,
            size: NonZeroU64::new(size),
        })
    }

    pub(super) fn status_buffer(&self) -> wgpu::Buffer {
        let init: [u32; STATUS_WORDS as usize] = [u32::MAX, 0, 0, 0];
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("zero-quant status"),
                contents: bytemuck::cast_slice(&init),
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            })
    }

    /// Records `passes` (pipeline, grid) with one bind group, copies the
    /// status words out, submits and waits; returns the status words.
    pub(super) fn run(
        &self,
        what: &str,
        layout: &wgpu::BindGroupLayout,
        resources: Vec<wgpu::BindingResource<'_>>,
        status: &wgpu::Buffer,
        passes: &[(&wgpu::ComputePipeline, (u32, u32))],
    ) -> Result<[u32; STATUS_WORDS as usize]> {
        // Binding `i` of the layout is resource `i`.
        let entries: Vec<wgpu::BindGroupEntry<'_>> = resources
            .into_iter()
            .zip(0..)
            .map(|(resource, binding)| wgpu::BindGroupEntry { binding, resource })
            .collect();
        let entries = &entries[..];
        let staging = scoped(&self.device, what, || {
            let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(what),
                layout,
                entries,
            });
            let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("zero-quant status read-back"),
                size: 4 * STATUS_WORDS,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let mut enc = self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(what) });
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some(what),
                    timestamp_writes: None,
                });
                pass.set_bind_group(0, &bind, &[]);
                for (pipe, (x, y)) in passes {
                    pass.set_pipeline(pipe);
                    pass.dispatch_workgroups(*x, *y, 1);
                }
            }
            enc.copy_buffer_to_buffer(status, 0, &staging, 0, 4 * STATUS_WORDS);
            self.queue.submit([enc.finish()]);
            staging
        })?;
        let bytes = self.read_back(&staging, what)?;
        let mut out = [0u32; STATUS_WORDS as usize];
        for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *o = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        Ok(out)
    }

    /// Maps a `MAP_READ` buffer (after its copy was submitted) and copies it out.
    pub(super) fn read_back(&self, staging: &wgpu::Buffer, what: &str) -> Result<Vec<u8>> {
        let (tx, rx) = mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| dev_err(what, e))?;
        // Another thread's poll may have run the callback: it has been sent.
        rx.recv()
            .map_err(|e| dev_err(what, e))?
            .map_err(|e| dev_err(what, e))?;
        let out = staging
            .get_mapped_range(..)
            .map_err(|e| dev_err(what, e))?
            .to_vec();
        staging.unmap();
        Ok(out)
    }
}
