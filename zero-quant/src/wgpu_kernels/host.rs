//! Host-memory conveniences: upload, run a kernel, read back (for tests and one-off use).

#[allow(clippy::wildcard_imports)]
use super::*;

impl WgpuQuantizer {
    /// Uploads `x`, encodes it on the device and reads the wire back (for
    /// tests and one-off use; allocates two buffers per call).
    pub fn encode_host_via_gpu(&self, codec: impl Into<Codec>, x: &[f32]) -> Result<Vec<u8>> {
        let codec = codec.into();
        self.pick(codec)?;
        let len = codec.encoded_len(x.len());
        if x.is_empty() {
            return Ok(Vec::new());
        }
        let input = self.upload(bytemuck::cast_slice(x));
        let output = self.scratch(len as u64);
        self.encode(codec, &input, x.len(), &output)?;
        self.download(&output, len)
    }

    /// Uploads `wire`, decodes `n` elements on the device and reads them back.
    pub fn decode_host_via_gpu(
        &self,
        codec: impl Into<Codec>,
        wire: &[u8],
        n: usize,
    ) -> Result<Vec<f32>> {
        let codec = codec.into();
        self.pick(codec)?;
        if n == 0 {
            return Ok(Vec::new());
        }
        let src = self.upload_wire(codec, wire, n, "gpu decode src bytes")?;
        let out = self.scratch(4 * n as u64);
        self.decode(codec, &src, n, &out)?;
        let bytes = self.download(&out, 4 * n)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// Uploads `wire` and `acc`, runs
    /// [`decode_accumulate`](Self::decode_accumulate) and reads `acc` back.
    pub fn decode_accumulate_host_via_gpu(
        &self,
        codec: impl Into<Codec>,
        wire: &[u8],
        acc: &mut [f32],
    ) -> Result<()> {
        let codec = codec.into();
        self.pick(codec)?;
        let n = acc.len();
        if n == 0 {
            return Ok(());
        }
        let src = self.upload_wire(codec, wire, n, "gpu decode_accumulate src bytes")?;
        let a = self.upload(bytemuck::cast_slice(acc));
        self.decode_accumulate(codec, &src, n, &a)?;
        let bytes = self.download(&a, 4 * n)?;
        acc.copy_from_slice(&bytemuck::pod_collect_to_vec::<u8, f32>(&bytes));
        Ok(())
    }

    pub(super) fn upload_wire(
        &self,
        codec: Codec,
        wire: &[u8],
        n: usize,
        what: &'static str,
    ) -> Result<wgpu::Buffer> {
        let expected = codec.encoded_len(n);
        if wire.len() != expected {
            return Err(Error::BufferLen {
                codec: codec.name(),
                what,
                expected,
                got: wire.len(),
            });
        }
        Ok(self.upload(wire))
    }

    pub(super) fn upload(&self, bytes: &[u8]) -> wgpu::Buffer {
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("zero-quant upload"),
                contents: bytes,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            })
    }

    pub(super) fn scratch(&self, size: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("zero-quant output"),
            size,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    }

    /// Copies the first `len` bytes (a multiple of 4) of `buf` to the host.
    pub(super) fn download(&self, buf: &wgpu::Buffer, len: usize) -> Result<Vec<u8>> {
        let what = "zero-quant download";
        let staging = scoped(&self.device, what, || {
            let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(what),
                size: len as u64,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let mut enc = self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(what) });
            enc.copy_buffer_to_buffer(buf, 0, &staging, 0, len as u64);
            self.queue.submit([enc.finish()]);
            staging
        })?;
        self.read_back(&staging, what)
    }
}
