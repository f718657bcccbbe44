//! zero-quant's WGSL codecs as the wgpu loopback's [`DeviceCodec`], so that
//! [`qwz_all_gather_device`](crate::quantized::qwz_all_gather_device) and
//! [`qgz_reduce_scatter_device`](crate::quantized::qgz_reduce_scatter_device) keep weights and
//! gradients in device memory (feature `wgpu`).
//!
//! The WGSL kernels read and write whole buffers from offset 0, so a piece that starts elsewhere
//! is staged through a scratch buffer on the device before it is encoded or decoded, and copied
//! into place afterwards. qgZ's division by `N` is the loopback's own exact `Mean` kernel.
//!
//! The quantizer must be on the communicator's device
//! (`WgpuQuantizer::new(dev.device().clone(), dev.queue().clone())` with `dev = comm.device()`);
//! one whose `wgpu::Device` compares unequal is refused. wgpu cannot tell devices of two
//! different `wgpu::Instance`s apart (their ids can coincide), and wgpu-core then panics on the
//! foreign buffers, as with any wgpu call that mixes instances.

use zero_quant::{BlockCodec, Codec, WgpuQuantizer};

use super::batch::{Batch, Loc};
use super::buffer::REQUIRED_USAGES;
use super::{WgpuBuffer, WgpuComm};
use crate::error::{Error, Result};
use crate::quantized::DeviceCodec;
use crate::{Communicator, DType, ReduceOp};

fn scratch(device: &wgpu::Device, bytes: u64) -> wgpu::Buffer {
    device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("zero-comm quantized scratch"),
        size: bytes.next_multiple_of(4).max(4),
        usage: REQUIRED_USAGES,
        mapped_at_creation: false,
    })
}

/// Records and submits one `copy_buffer_to_buffer` (distinct buffers, 4-byte aligned offsets and
/// size); nothing for an empty range.
fn copy(
    q: &WgpuQuantizer,
    (src, so): (&wgpu::Buffer, u64),
    (dst, d_o): (&wgpu::Buffer, u64),
    bytes: u64,
) {
    if bytes > 0 {
        let mut enc = q.device().create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(src, so, dst, d_o, bytes);
        q.queue().submit([enc.finish()]);
    }
}

/// `bytes` bytes from byte `at` of `buf`, as a buffer a kernel can read from offset 0: `buf`
/// itself when `at` is 0, else a scratch copy.
fn read_at(q: &WgpuQuantizer, buf: &wgpu::Buffer, at: u64, bytes: u64) -> wgpu::Buffer {
    if at == 0 {
        return buf.clone();
    }
    let s = scratch(q.device(), bytes);
    copy(q, (buf, at), (&s, 0), bytes);
    s
}

/// Runs `kernel`, which writes `bytes` bytes from offset 0 of the buffer it is given, so that they
/// land at byte `at` of `buf`: directly when `at` is 0, else through a scratch buffer that is
/// copied into place on success (filled from `buf` first when `keep`, for an accumulation).
fn write_at(
    q: &WgpuQuantizer,
    (buf, at): (&wgpu::Buffer, u64),
    bytes: u64,
    keep: bool,
    kernel: impl FnOnce(&wgpu::Buffer) -> zero_quant::Result<()>,
) -> zero_quant::Result<()> {
    if at == 0 {
        return kernel(buf);
    }
    let s = if keep {
        read_at(q, buf, at, bytes)
    } else {
        scratch(q.device(), bytes)
    };
    kernel(&s)?;
    copy(q, (&s, 0), (buf, at), bytes);
    Ok(())
}

fn wire_bytes(codec: Codec, len: usize) -> u64 {
    codec.layout(len).total_len as u64
}

impl DeviceCodec<WgpuComm, f32> for WgpuQuantizer {
    fn name(&self) -> &'static str {
        "wgpu loopback"
    }

    fn supports(&self, codec: &Codec) -> bool {
        !matches!(codec, Codec::Identity(_))
    }

    fn check(&self, comm: &WgpuComm) -> std::result::Result<(), String> {
        if self.device() == comm.device().device() {
            Ok(())
        } else {
            Err("the quantizer is on another device than the communicator".into())
        }
    }

    fn buffer_len(&self, buf: &WgpuBuffer<f32>) -> usize {
        buf.len()
    }

    fn encode_piece(
        &self,
        codec: Codec,
        (src, at): (&WgpuBuffer<f32>, usize),
        len: usize,
        (wire, slot): (&mut WgpuBuffer<u8>, usize),
    ) -> zero_quant::Result<()> {
        if len == 0 {
            return Ok(());
        }
        let input = read_at(
            self,
            &src.view.buffer,
            src.view.offset + 4 * at as u64,
            4 * len as u64,
        );
        let dst = (&wire.view.buffer, wire.view.offset + slot as u64);
        write_at(self, dst, wire_bytes(codec, len), false, |w| {
            self.encode(codec, &input, len, w)
        })
    }

    fn encode_sum(
        &self,
        codec: Codec,
        sums: &WgpuBuffer<f32>,
        wire: (&mut WgpuBuffer<u8>, usize),
    ) -> zero_quant::Result<()> {
        self.encode_piece(codec, (sums, 0), sums.len(), wire)
    }

    fn decode_piece(
        &self,
        codec: Codec,
        (wire, slot): (&WgpuBuffer<u8>, usize),
        len: usize,
        (out, at): (&mut WgpuBuffer<f32>, usize),
    ) -> zero_quant::Result<()> {
        if len == 0 {
            return Ok(());
        }
        let at_wire = wire.view.offset + slot as u64;
        let piece = read_at(self, &wire.view.buffer, at_wire, wire_bytes(codec, len));
        let dst = (&out.view.buffer, out.view.offset + 4 * at as u64);
        write_at(self, dst, 4 * len as u64, false, |o| {
            self.decode(codec, &piece, len, o)
        })
    }

    fn decode_sum(
        &self,
        codec: Codec,
        (wire, slot): (&WgpuBuffer<u8>, usize),
        sums: &mut WgpuBuffer<f32>,
        accumulate: bool,
    ) -> zero_quant::Result<()> {
        let len = sums.len();
        if len == 0 {
            return Ok(());
        }
        let at_wire = wire.view.offset + slot as u64;
        let piece = read_at(self, &wire.view.buffer, at_wire, wire_bytes(codec, len));
        let dst = (&sums.view.buffer, sums.view.offset);
        write_at(self, dst, 4 * len as u64, accumulate, |a| {
            if accumulate {
                self.decode_accumulate(codec, &piece, len, a)
            } else {
                self.decode(codec, &piece, len, a)
            }
        })
    }

    fn finish_mean(
        &self,
        comm: &mut WgpuComm,
        codec: Codec,
        sums: &WgpuBuffer<f32>,
        n: usize,
        out: &mut WgpuBuffer<f32>,
    ) -> Result<zero_quant::Result<()>> {
        let c = sums.len();
        if c == 0 {
            return Ok(Ok(()));
        }
        // The host fails on the first element whose mean is not finite, i.e. (dividing by
        // N >= 1) whose sum is not: the encoder finds it, with the sum's bits.
        let input = read_at(self, &sums.view.buffer, sums.view.offset, 4 * c as u64);
        let wire = scratch(self.device(), wire_bytes(codec, c));
        match self.encode(codec, &input, c, &wire) {
            Ok(()) => {}
            Err(zero_quant::Error::NonFinite { index, value }) => {
                return Ok(Err(zero_quant::Error::Overflow {
                    index,
                    value: value / n as f32,
                    dtype: <f32 as zero_quant::Element>::DTYPE,
                }));
            }
            Err(err) => return Ok(Err(err)),
        }
        // `sums / N` rounded once: the loopback's `Mean` over `[sums, −0, …, −0]` (N terms),
        // whose exact integer division is the host's `/`; adding `−0` leaves every f32
        // unchanged, bit for bit (zeros included).
        let dev = comm.device().clone();
        let neg_zero = dev
            .core
            .upload(bytemuck::cast_slice(&vec![-0.0f32; c]))
            .map_err(Error::Backend)?;
        let mut terms = vec![
            Loc {
                buffer: &neg_zero,
                byte: 0,
            };
            n
        ];
        terms[0] = Loc {
            buffer: &input,
            byte: 0,
        };
        let mut batch = Batch::new(&dev.core);
        let dst = Loc {
            buffer: &out.view.buffer,
            byte: out.view.offset,
        };
        batch.reduce(&terms, dst, c as u64, DType::F32, ReduceOp::Mean);
        let rank = comm.global_rank();
        batch.submit(&mut comm.scratch).map_err(|e| {
            Error::Backend(format!(
                "wgpu loopback: qgz_reduce_scatter_device on rank {rank}: {e}"
            ))
        })?;
        Ok(Ok(()))
    }

    fn copy_finite(
        &self,
        codec: Codec,
        src: &WgpuBuffer<f32>,
        out: &mut WgpuBuffer<f32>,
    ) -> Result<zero_quant::Result<()>> {
        let c = src.len();
        if c == 0 {
            return Ok(Ok(()));
        }
        // The encoder reports the first non-finite element and its value, as the host does.
        let bytes = 4 * c as u64;
        let input = read_at(self, &src.view.buffer, src.view.offset, bytes);
        let wire = scratch(self.device(), wire_bytes(codec, c));
        if let Err(err) = self.encode(codec, &input, c, &wire) {
            return Ok(Err(err));
        }
        let from = if input == out.view.buffer {
            let s = scratch(self.device(), bytes);
            copy(self, (&input, 0), (&s, 0), bytes);
            s
        } else {
            input
        };
        copy(self, (&from, 0), (&out.view.buffer, out.view.offset), bytes);
        Ok(Ok(()))
    }
}
