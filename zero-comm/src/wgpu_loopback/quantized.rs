//! qwZ on wgpu buffers (feature `wgpu`): the quantized all-gather with zero-quant's WGSL kernels,
//! so weights stay in device memory.
//!
//! The same collective, bytes and results as [`qwz_all_gather`](crate::quantized::qwz_all_gather)
//! bit for bit (the WGSL codecs are bit-identical to the host ones), with the same error contract
//! (a rank whose chunk cannot be encoded poisons its piece; every rank fails naming it). The WGSL
//! kernels read and write whole buffers from offset 0, so each received piece is copied into a
//! scratch buffer on the device before it is decoded, and each decoded chunk copied into place;
//! only the failure path reads the wire back to the host.

use zero_core::Collective;
use zero_quant::{BlockCodec, Codec, WgpuQuantizer};

use super::buffer::REQUIRED_USAGES;
use super::{WgpuBuffer, WgpuComm};
use crate::Communicator;
use crate::error::{Error, Op, Result};
use crate::quantized::{Fault, length, poison};

fn scratch(device: &wgpu::Device, bytes: u64) -> wgpu::Buffer {
    device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("zero-comm qwz scratch"),
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
