//! qwZ on device memory (feature `nccl`): the quantized all-gather with zero-quant's CUDA kernels,
//! so a GPU trainer's weights never pass through the host.
//!
//! The same collective, bytes and results as [`qwz_all_gather`](crate::quantized::qwz_all_gather)
//! bit for bit (the CUDA codecs are bit-identical to the host ones), with the same error
//! contract: a rank whose chunk cannot be encoded sends a poisoned piece, and every rank fails
//! with [`Error::Quant`](crate::Error::Quant) naming it. Only the failure path reads the wire
//! back to the host (to find the poison marker).

use zero_core::Collective;
use zero_quant::cuda::CudaElement;
use zero_quant::{BlockCodec, Codec, CudaQuantizer};

use super::{NcclBuffer, NcclComm};
use crate::Communicator;
use crate::element::Element;
use crate::error::{Error, Op, Result};
use crate::quantized::{Fault, length, poison};

/// qwZ all-gather on device: every rank's `chunk` is encoded with `codec` by `quantizer` on the
/// GPU, the wires are all-gathered by NCCL, and rank `k`'s decoded chunk lands at
/// `[k·c, (k+1)·c)` of `out` (`n · c` elements). `quantizer` must run on the communicator's
/// stream (`CudaQuantizer::new(comm.stream().clone())`), which orders its kernels with the
/// collective; a quantizer on another stream is refused.
pub fn qwz_all_gather_device<E>(
    comm: &mut NcclComm,
    quantizer: &CudaQuantizer,
    codec: impl Into<Codec>,
    chunk: &NcclBuffer<E>,
    out: &mut NcclBuffer<E>,
) -> Result<()>
where
    E: Element + CudaElement,
{
    let codec: Codec = codec.into();
    let op = Op::Collective(Collective::AllGather);
    let (n, c, me) = (comm.world_size(), chunk.len(), comm.global_rank());
    if out.len() != n * c {
        return Err(length(op, me, n * c, out.len()));
    }
    if quantizer.stream().cu_stream() != comm.stream().cu_stream() {
        return Err(Error::Backend(
            "nccl: qwz_all_gather_device: the quantizer runs on another stream than the \
             communicator (make it with CudaQuantizer::new(comm.stream().clone()))"
                .into(),
        ));
    }
    let layout = codec.layout(c);
    let w = layout.total_len;
    let mut fault = Fault::new(op, me);

    let mut send = comm.alloc::<u8>(w)?;
    if let Err(e) = quantizer.encode(codec, &chunk.view(), &mut send.view_mut()) {
        fault.local(e);
        let mut host = vec![0u8; w];
        poison(&mut host, &layout, me);
        comm.upload_into(&host, &mut send)?;
    }
    let mut recv = comm.alloc::<u8>(n * w)?;
    comm.all_gather(&send, &mut recv)?;
    drop(send);

    let mut decode_error = None;
    {
        let wire = recv.view();
        let mut dst = out.view_mut();
        for j in 0..n {
            let piece = wire.slice(j * w..(j + 1) * w);
            let mut part = dst.slice_mut(j * c..(j + 1) * c);
            if let Err(e) = quantizer.decode(codec, &piece, &mut part) {
                decode_error.get_or_insert(e);
            }
        }
    }
    fault.finish_device(decode_error, &layout, n, || comm.download_vec(&recv))
}
