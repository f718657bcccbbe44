//! zero-quant's CUDA kernels as NCCL's [`DeviceCodec`] (feature `nccl`), so that
//! [`qwz_all_gather_device`](crate::quantized::qwz_all_gather_device) and
//! [`qgz_reduce_scatter_device`](crate::quantized::qgz_reduce_scatter_device) keep a GPU trainer's
//! weights and gradients in device memory.
//!
//! The CUDA codecs are bit-identical to the host ones, and qgZ's final division is a hand-written
//! PTX kernel (`backend/finish.rs`) with IEEE `div.rn.f32` and the host's rounding to bf16/f16. The quantizer must run
//! on the communicator's stream (`CudaQuantizer::new(comm.stream().clone())`), which orders its
//! kernels with the collectives; a quantizer on another stream is refused.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use zero_quant::cuda::CudaElement;
use zero_quant::{BlockCodec, Codec, CudaQuantizer};

use super::backend::finish::{Finish, backend};
use super::{CudaComm, NcclBuffer, NcclComm};
use crate::error::Result;
use crate::quantized::{DeviceCodec, QuantElement};
use crate::{Communicator, Element};

/// A communicator whose buffers are [`NcclBuffer`]s ordered on one CUDA stream: NCCL's, and the
/// CUDA loopback's. One [`DeviceCodec`] serves both, and so does a trainer's bridge to burn-cuda.
pub trait OnCuda: Communicator {
    /// The name in the codec's error messages.
    const CODEC_NAME: &'static str;
    /// The context the buffers live in.
    fn cuda_context(&self) -> &Arc<CudaContext>;
    /// The stream the collectives run on.
    fn cuda_stream(&self) -> &Arc<CudaStream>;
    /// The buffer as device memory.
    fn nccl<E: Element>(buf: &Self::Buffer<E>) -> &NcclBuffer<E>;
    /// The buffer as device memory, mutably.
    fn nccl_mut<E: Element>(buf: &mut Self::Buffer<E>) -> &mut NcclBuffer<E>;
    /// Device memory as the communicator's buffer.
    fn from_nccl<E: Element>(buf: NcclBuffer<E>) -> Self::Buffer<E>;
}

/// [`OnCuda`]'s conversions for a communicator whose `Buffer<E>` is [`NcclBuffer<E>`]: the
/// identity.
macro_rules! nccl_buffers {
    () => {
        fn nccl<E: Element>(buf: &NcclBuffer<E>) -> &NcclBuffer<E> {
            buf
        }

        fn nccl_mut<E: Element>(buf: &mut NcclBuffer<E>) -> &mut NcclBuffer<E> {
            buf
        }

        fn from_nccl<E: Element>(buf: NcclBuffer<E>) -> NcclBuffer<E> {
            buf
        }
    };
}

impl OnCuda for NcclComm {
    const CODEC_NAME: &'static str = "nccl";

    fn cuda_context(&self) -> &Arc<CudaContext> {
        self.context()
    }

    fn cuda_stream(&self) -> &Arc<CudaStream> {
        self.stream()
    }

    nccl_buffers!();
}

impl OnCuda for CudaComm {
    const CODEC_NAME: &'static str = "cuda loopback";

    fn cuda_context(&self) -> &Arc<CudaContext> {
        self.device().context()
    }

    fn cuda_stream(&self) -> &Arc<CudaStream> {
        self.device().stream()
    }

    nccl_buffers!();
}

fn wire_len(codec: Codec, len: usize) -> usize {
    codec.layout(len).total_len
}

impl<C: OnCuda, E: QuantElement + CudaElement> DeviceCodec<C, E> for CudaQuantizer {
    fn name(&self) -> &'static str {
        C::CODEC_NAME
    }

    fn supports(&self, codec: &Codec) -> bool {
        !matches!(codec, Codec::Identity(_))
    }

    fn check(&self, comm: &C) -> std::result::Result<(), String> {
        if self.stream().cu_stream() == comm.cuda_stream().cu_stream() {
            Ok(())
        } else {
            Err(
                "the quantizer runs on another stream than the communicator (make it with \
                 CudaQuantizer::new(comm.stream().clone()), or device().stream() on the CUDA \
                 loopback)"
                    .into(),
            )
        }
    }

    fn buffer_len(&self, buf: &C::Buffer<E>) -> usize {
        C::nccl(buf).len()
    }

    fn encode_piece(
        &self,
        codec: Codec,
        (src, at): (&C::Buffer<E>, usize),
        len: usize,
        (wire, slot): (&mut C::Buffer<u8>, usize),
    ) -> zero_quant::Result<()> {
        let x = C::nccl(src).view();
        let mut w = C::nccl_mut(wire).view_mut();
        let mut dst = w.slice_mut(slot..slot + wire_len(codec, len));
        self.encode(codec, &x.slice(at..at + len), &mut dst)
    }

    fn encode_sum(
        &self,
        codec: Codec,
        sums: &C::Buffer<f32>,
        (wire, slot): (&mut C::Buffer<u8>, usize),
    ) -> zero_quant::Result<()> {
        let sums = C::nccl(sums);
        let mut w = C::nccl_mut(wire).view_mut();
        let mut dst = w.slice_mut(slot..slot + wire_len(codec, sums.len()));
        self.encode(codec, &sums.view(), &mut dst)
    }

    fn decode_piece(
        &self,
        codec: Codec,
        (wire, slot): (&C::Buffer<u8>, usize),
        len: usize,
        (out, at): (&mut C::Buffer<E>, usize),
    ) -> zero_quant::Result<()> {
        let w = C::nccl(wire).view();
        let piece = w.slice(slot..slot + wire_len(codec, len));
        let mut o = C::nccl_mut(out).view_mut();
        self.decode(codec, &piece, &mut o.slice_mut(at..at + len))
    }

    fn decode_sum(
        &self,
        codec: Codec,
        (wire, slot): (&C::Buffer<u8>, usize),
        sums: &mut C::Buffer<f32>,
        accumulate: bool,
    ) -> zero_quant::Result<()> {
        let sums = C::nccl_mut(sums);
        let w = C::nccl(wire).view();
        let piece = w.slice(slot..slot + wire_len(codec, sums.len()));
        let mut acc = sums.view_mut();
        if accumulate {
            self.decode_accumulate(codec, &piece, &mut acc)
        } else {
            self.decode(codec, &piece, &mut acc)
        }
    }

    fn finish_mean(
        &self,
        comm: &mut C,
        codec: Codec,
        sums: &C::Buffer<f32>,
        n: usize,
        out: &mut C::Buffer<E>,
    ) -> Result<zero_quant::Result<()>> {
        // The host fails on the first element whose rounded mean is not finite: the encoder finds
        // it in `out`; only then is its sum read back.
        let (sums, out) = (C::nccl(sums), C::nccl_mut(out));
        let stream = self.stream();
        let s = sums.view();
        Finish::get(comm.cuda_context())?.run(stream, &s, &mut out.view_mut(), n as f32)?;
        let mut wire = stream
            .alloc_zeros::<u8>(wire_len(codec, sums.len()))
            .map_err(|err| backend("allocating a wire", err))?;
        Ok(match self.encode(codec, &out.view(), &mut wire) {
            Ok(()) => Ok(()),
            Err(zero_quant::Error::NonFinite { index, .. }) => {
                let sum = stream
                    .clone_dtoh(&s.slice(index..index + 1))
                    .map_err(|err| backend("reading a sum", err))?;
                Err(zero_quant::Error::Overflow {
                    index,
                    value: sum[0] / n as f32,
                    dtype: <E as zero_quant::Element>::DTYPE,
                })
            }
            Err(err) => Err(err),
        })
    }

    fn copy_finite(
        &self,
        codec: Codec,
        src: &C::Buffer<E>,
        out: &mut C::Buffer<E>,
    ) -> Result<zero_quant::Result<()>> {
        // The encoder reports the first non-finite element and its value, as the host does.
        let (src, out) = (C::nccl(src), C::nccl_mut(out));
        if src.is_empty() {
            return Ok(Ok(()));
        }
        let stream = self.stream();
        let mut wire = stream
            .alloc_zeros::<u8>(wire_len(codec, src.len()))
            .map_err(|err| backend("allocating a wire", err))?;
        if let Err(err) = self.encode(codec, &src.view(), &mut wire) {
            return Ok(Err(err));
        }
        stream
            .memcpy_dtod(&src.view(), &mut out.view_mut())
            .map_err(|err| backend("copying the input", err))?;
        Ok(Ok(()))
    }
}
