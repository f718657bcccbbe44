//! qwZ and qgZ on wgpu buffers (feature `wgpu`): the quantized all-gather and the hierarchical
//! quantized reduce-scatter with zero-quant's WGSL kernels, so weights and gradients stay in
//! device memory.
//!
//! The same collectives, bytes and results as [`qwz_all_gather`](crate::quantized::qwz_all_gather)
//! and [`qgz_reduce_scatter`](crate::quantized::qgz_reduce_scatter) bit for bit (the WGSL codecs
//! are bit-identical to the host ones), with the same error contract (a rank whose data cannot be
//! encoded poisons its pieces; every rank fails naming it). The WGSL kernels read and write whole
//! buffers from offset 0, so each piece is staged through a scratch buffer on the device before
//! it is encoded or decoded, and copied into place afterwards; only the failure path reads a wire
//! back to the host.

use zero_core::Collective;
use zero_quant::{BlockCodec, Codec, WgpuQuantizer, WireLayout};

use super::buffer::REQUIRED_USAGES;
use super::kernels::{Batch, Loc};
use super::{WgpuBuffer, WgpuComm};
use crate::error::{Error, Op, Result};
use crate::quantized::{Fault, QuantGroups, length, poison};
use crate::{Communicator, DType, ReduceOp};

fn scratch(device: &wgpu::Device, bytes: u64) -> wgpu::Buffer {
    device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("zero-comm quantized scratch"),
        size: bytes.next_multiple_of(4).max(4),
        usage: REQUIRED_USAGES,
        mapped_at_creation: false,
    })
}

/// qwZ all-gather on device: `chunk` (f32) is encoded with `codec` by `quantizer`, the wires are
/// all-gathered by the loopback, and rank `k`'s decoded chunk lands at `[k·c, (k+1)·c)` of `out`
/// (`n · c` elements). `quantizer` must be on the communicator's device
/// (`WgpuQuantizer::new(dev.device().clone(), dev.queue().clone())` with `dev = comm.device()`).
/// A quantizer whose `wgpu::Device` compares unequal is refused; wgpu cannot tell devices of two
/// different `wgpu::Instance`s apart (their ids can coincide), and wgpu-core then panics on the
/// foreign buffers, as with any wgpu call that mixes instances.
pub fn qwz_all_gather_device(
    comm: &mut WgpuComm,
    quantizer: &WgpuQuantizer,
    codec: impl Into<Codec>,
    chunk: &WgpuBuffer<f32>,
    out: &mut WgpuBuffer<f32>,
) -> Result<()> {
    let codec: Codec = codec.into();
    let op = Op::Collective(Collective::AllGather);
    let (n, c, me) = (comm.world_size(), chunk.len(), comm.global_rank());
    if out.len() != n * c {
        return Err(length(op, me, n * c, out.len()));
    }
    let dev = comm.device().clone();
    if quantizer.device() != dev.device() {
        return Err(Error::Backend(
            "wgpu loopback: qwz_all_gather_device: the quantizer is on another device than the \
             communicator"
                .into(),
        ));
    }
    let (device, queue) = (dev.device(), dev.queue());
    let layout = codec.layout(c);
    let w = layout.total_len;
    let (cb, wb) = (4 * c as u64, w as u64);
    let mut fault = Fault::new(op, me);
    let copy = |src: &wgpu::Buffer, so: u64, dst: &wgpu::Buffer, d_o: u64, bytes: u64| {
        if bytes > 0 {
            let mut enc = device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(src, so, dst, d_o, bytes);
            queue.submit([enc.finish()]);
        }
    };

    // Encode this rank's chunk (from offset 0 of a buffer: copy a view that starts elsewhere).
    let mut send = comm.alloc::<u8>(w)?;
    if c > 0 {
        let moved;
        let input = if chunk.view.offset == 0 {
            &chunk.view.buffer
        } else {
            moved = scratch(device, cb);
            copy(&chunk.view.buffer, chunk.view.offset, &moved, 0, cb);
            &moved
        };
        if let Err(e) = quantizer.encode(codec, input, c, &send.view.buffer) {
            fault.local(e);
            let mut host = vec![0u8; w];
            poison(&mut host, &layout, me);
            comm.upload_into(&host, &mut send)?;
        }
    }
    let mut recv = comm.alloc::<u8>(n * w)?;
    comm.all_gather(&send, &mut recv)?;
    drop(send);

    // Decode every piece through scratch buffers, then copy it into place.
    let mut decode_error = None;
    if c > 0 {
        let piece = scratch(device, wb);
        let part = scratch(device, cb);
        for j in 0..n as u64 {
            copy(&recv.view.buffer, recv.view.offset + j * wb, &piece, 0, wb);
            match quantizer.decode(codec, &piece, c, &part) {
                Ok(()) => copy(&part, 0, &out.view.buffer, out.view.offset + j * cb, cb),
                Err(e) => {
                    decode_error.get_or_insert(e);
                }
            }
        }
    }
    fault.finish_device(decode_error, &layout, n, || comm.download_vec(&recv))
}

/// Records and submits one `copy_buffer_to_buffer` (distinct buffers, 4-byte aligned offsets and
/// size); nothing for an empty range.
fn copy(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    (src, so): (&wgpu::Buffer, u64),
    (dst, d_o): (&wgpu::Buffer, u64),
    bytes: u64,
) {
    if bytes > 0 {
        let mut enc = device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(src, so, dst, d_o, bytes);
        queue.submit([enc.finish()]);
    }
}

/// The device side of one qgZ call: the queue, the staging buffers of one piece (`c` f32 values
/// and one wire of `e` bytes), and the codec.
struct Stage<'a> {
    device: &'a wgpu::Device,
    queue: &'a wgpu::Queue,
    quantizer: &'a WgpuQuantizer,
    codec: Codec,
    c: usize,
    e: usize,
    /// `c` f32: an input chunk, moved to offset 0 for the encoder.
    values: wgpu::Buffer,
    /// One wire of `e` bytes: an encoder's output, or a received piece moved to offset 0.
    wire: wgpu::Buffer,
}

impl Stage<'_> {
    fn copy(&self, src: (&wgpu::Buffer, u64), dst: (&wgpu::Buffer, u64), bytes: u64) {
        copy(self.device, self.queue, src, dst, bytes);
    }

    /// Encodes the `c` values at byte `at` of `src` into the piece at byte `slot` of `dst`, or
    /// only into the staging wire (a finiteness check) without `dst`.
    fn encode(
        &self,
        (src, at): (&wgpu::Buffer, u64),
        dst: Option<(&wgpu::Buffer, u64)>,
    ) -> zero_quant::Result<()> {
        if self.c == 0 {
            return Ok(());
        }
        let input = if at == 0 {
            src
        } else {
            self.copy((src, at), (&self.values, 0), 4 * self.c as u64);
            &self.values
        };
        self.quantizer
            .encode(self.codec, input, self.c, &self.wire)?;
        if let Some(dst) = dst {
            self.copy((&self.wire, 0), dst, self.e as u64);
        }
        Ok(())
    }

    /// Decodes the piece at byte `slot` of `wire` into `acc` (offset 0), or adds it to `acc`.
    fn decode(
        &self,
        (wire, slot): (&wgpu::Buffer, u64),
        acc: &wgpu::Buffer,
        accumulate: bool,
    ) -> zero_quant::Result<()> {
        if self.c == 0 {
            return Ok(());
        }
        let piece = if slot == 0 {
            wire
        } else {
            self.copy((wire, slot), (&self.wire, 0), self.e as u64);
            &self.wire
        };
        if accumulate {
            self.quantizer
                .decode_accumulate(self.codec, piece, self.c, acc)
        } else {
            self.quantizer.decode(self.codec, piece, self.c, acc)
        }
    }
}

/// Sends `send` (every piece poisoned first if this rank has a fault) through one equal-split
/// all-to-all of `comm`, as the host path's `exchange` does, and returns the received wire.
fn exchange(
    comm: &mut WgpuComm,
    fault: &Fault,
    layout: &WireLayout,
    mut send: WgpuBuffer<u8>,
) -> Result<WgpuBuffer<u8>> {
    if let Some(o) = fault.origin() {
        let mut host = vec![0u8; send.len()];
        for piece in host.chunks_exact_mut(layout.total_len.max(1)) {
            poison(piece, layout, o);
        }
        comm.upload_into(&host, &mut send)?;
    }
    let mut recv = comm.alloc::<u8>(send.len())?;
    comm.all_to_all(&send, &mut recv)?;
    Ok(recv)
}

/// qgZ reduce-scatter on device: the mean over all `N` ranks of chunk `rank` of every rank's
/// `input` (f32, `N·c` elements), through `codec` (int8 or int4; the identity codec has no device
/// kernel and is refused), into `out` (`c` elements), by the hierarchical all-to-all of
/// [`qgz_reduce_scatter`](crate::quantized::qgz_reduce_scatter): the same collectives and bytes,
/// the same result bit for bit, the same errors.
///
/// The wires are encoded, exchanged and decoded on the device; the partial sums are `f32` device
/// buffers (`M·c` elements), and the final division by `N` is the loopback's own exact `Mean`
/// kernel. `quantizer` must be on the groups' device (as for
/// [`qwz_all_gather_device`]); a quantizer on another device is refused. With `N = 1` nothing
/// moves: `out` is a copy of `input` after the same finiteness check as the host path. Error
/// feedback ([`qgz_reduce_scatter_ef`](crate::quantized::qgz_reduce_scatter_ef)) has no device
/// form yet. On an error the contents of `out` are unspecified.
pub fn qgz_reduce_scatter_device(
    groups: &mut QuantGroups<WgpuComm>,
    quantizer: &WgpuQuantizer,
    codec: impl Into<Codec>,
    input: &WgpuBuffer<f32>,
    out: &mut WgpuBuffer<f32>,
) -> Result<()> {
    let codec: Codec = codec.into();
    let op = Op::Collective(Collective::ReduceScatter);
    let (n, l, m, me) = (
        groups.world_size(),
        groups.ranks_per_node(),
        groups.num_nodes(),
        groups.global_rank(),
    );
    let len = input.len();
    if !len.is_multiple_of(n) {
        return Err(length(op, me, len.next_multiple_of(n), len));
    }
    let c = len / n;
    if out.len() != c {
        return Err(length(op, me, c, out.len()));
    }
    if matches!(codec, Codec::Identity(_)) {
        return Err(Error::Backend(
            "wgpu loopback: qgz_reduce_scatter_device: the identity codec has no device kernel \
             (use the host qgz_reduce_scatter)"
                .into(),
        ));
    }
    let (mut intra, mut cross) = groups.groups_mut();
    let dev = intra
        .as_deref()
        .or(cross.as_deref())
        .map(|comm| comm.device().clone());
    if let Some(dev) = &dev
        && quantizer.device() != dev.device()
    {
        return Err(Error::Backend(
            "wgpu loopback: qgz_reduce_scatter_device: the quantizer is on another device than \
             the communicators"
                .into(),
        ));
    }
    let (device, queue) = (quantizer.device(), quantizer.queue());
    let layout = codec.layout(c);
    let e = layout.total_len;
    let (cb, eb) = (4 * c as u64, e as u64);
    let mut fault = Fault::new(op, me);
    let stage = Stage {
        device,
        queue,
        quantizer,
        codec,
        c,
        e,
        values: scratch(device, cb),
        wire: scratch(device, eb),
    };
    let (input_buf, input_at) = (&input.view.buffer, input.view.offset);

    let Some(dev) = dev else {
        // N = 1: nothing moves; the output is the input, after the host's finiteness check (the
        // encoder reports the first non-finite element and its value, as the host does).
        if let Err(err) = stage.encode((input_buf, input_at), None) {
            fault.local(err);
            return fault.finish();
        }
        let src = if input_buf == &out.view.buffer {
            stage.copy((input_buf, input_at), (&stage.values, 0), cb);
            (&stage.values, 0)
        } else {
            (input_buf, input_at)
        };
        stage.copy(src, (&out.view.buffer, out.view.offset), cb);
        return Ok(());
    };

    // The f32 accumulators of the M destinations (the stage-2 partials; `acc[0]` also holds the
    // stage-4 sum).
    let acc: Vec<wgpu::Buffer> = (0..if l > 1 { m } else { 1 })
        .map(|_| scratch(device, cb))
        .collect();

    // Stages 1-2: intra-node exchange, node partial sums for the M destinations in `acc`.
    if let Some(intra) = intra.as_deref_mut() {
        let send = intra.alloc::<u8>(l * m * e)?;
        'encode: for lp in 0..l {
            for mp in 0..m {
                let p = mp * l + lp;
                let slot = ((lp * m + mp) * e) as u64;
                let x = (input_buf, input_at + (p as u64) * cb);
                if let Err(err) =
                    stage.encode(x, Some((&send.view.buffer, send.view.offset + slot)))
                {
                    fault.local(err);
                    break 'encode;
                }
            }
        }
        let recv = exchange(intra, &fault, &layout, send)?;
        let mut decode_error = None;
        if fault.origin().is_none() {
            'reduce: for (mp, a) in acc.iter().enumerate() {
                for j in 0..l {
                    let slot = recv.view.offset + ((j * m + mp) * e) as u64;
                    if let Err(err) = stage.decode((&recv.view.buffer, slot), a, j > 0) {
                        decode_error = Some(err);
                        break 'reduce;
                    }
                }
            }
        }
        fault.after_exchange_device(decode_error, &layout, || intra.download_vec(&recv))?;
    }

    // Stage 3: cross-node exchange of the partials (or, with L = 1, of the input chunks).
    if let Some(cross) = cross.as_deref_mut() {
        let send = cross.alloc::<u8>(m * e)?;
        if fault.origin().is_none() {
            for mp in 0..m {
                // The partial for node mp's rank, or with L = 1 the input chunk of destination
                // p = mp·1 + 0 (then this is the first quantization).
                let x = match acc.get(mp).filter(|_| l > 1) {
                    Some(partial) => (partial, 0),
                    None => (input_buf, input_at + (mp as u64) * cb),
                };
                let dst = (&send.view.buffer, send.view.offset + (mp * e) as u64);
                if let Err(err) = stage.encode(x, Some(dst)) {
                    fault.local(err);
                    break;
                }
            }
        }
        let recv = exchange(cross, &fault, &layout, send)?;
        let mut decode_error = None;
        if fault.origin().is_none() {
            for k in 0..m {
                let slot = recv.view.offset + (k * e) as u64;
                if let Err(err) = stage.decode((&recv.view.buffer, slot), &acc[0], k > 0) {
                    decode_error = Some(err);
                    break;
                }
            }
        }
        fault.after_exchange_device(decode_error, &layout, || cross.download_vec(&recv))?;
    }

    if fault.origin().is_some() || c == 0 {
        return fault.finish();
    }
    // Stage 4: the mean. The host fails on the first element whose mean is not finite, i.e.
    // (dividing by N >= 1) whose sum is not: the encoder finds it, with the sum's bits.
    match quantizer.encode(codec, &acc[0], c, &stage.wire) {
        Ok(()) => {}
        Err(zero_quant::Error::NonFinite { index, value }) => {
            fault.local(zero_quant::Error::Overflow {
                index,
                value: value / n as f32,
                dtype: <f32 as zero_quant::Element>::DTYPE,
            });
            return fault.finish();
        }
        Err(err) => {
            fault.local(err);
            return fault.finish();
        }
    }
    // `acc / N` rounded once: the loopback's `Mean` over `[acc, −0, …, −0]` (N terms), whose
    // exact integer division is the host's `/`; adding `−0` leaves every f32 unchanged, bit for
    // bit (zeros included).
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
        buffer: &acc[0],
        byte: 0,
    };
    let comm = intra
        .or(cross)
        .ok_or_else(|| Error::Backend("qgz_reduce_scatter_device: no sub-group".into()))?;
    let mut batch = Batch::new(&dev.core);
    let dst = Loc {
        buffer: &out.view.buffer,
        byte: out.view.offset,
    };
    batch.reduce(&terms, dst, c as u64, DType::F32, ReduceOp::Mean);
    batch.submit(&mut comm.scratch).map_err(|e| {
        Error::Backend(format!(
            "wgpu loopback: qgz_reduce_scatter_device on rank {me}: {e}"
        ))
    })
}
