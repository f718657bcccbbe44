//! The CUDA bridge (feature `cuda`): burn-cuda tensors and the device buffers of NCCL or of the
//! CUDA loopback ([`NcclBuffer`]s), copied into each other on the device, as the trainer's
//! [`DeviceTensors`] hook over either communicator ([`OnCuda`]). The twin of the wgpu bridge
//! (`bridge`, feature `wgpu`).
//!
//! cubecl-cuda and cudarc both run in the device's primary context, so a tensor's device pointer
//! (cubecl's `get_resource`) is valid on the communicator's stream. The two streams are ordered by
//! waiting: cubecl's work is finished (`client.sync()`) before the communicator's stream copies
//! from or into a tensor, and that stream is synchronised before cubecl may reuse or read the
//! range (the resource guard pins it until then). Correct, but each copy waits for both streams;
//! CUDA events would let them overlap.
//!
//! Never run on a GPU yet: `gpu_nccl_on_cuda_bridged_equals_host_staged` and
//! `gpu_cuda_loopback_trains_like_host_staged` (`tests/cuda_path.rs`, in `cargo xtask gpu-check`)
//! compare it with the host-staged path bit for bit.

use std::fmt;
use std::sync::Arc;

use burn::backend::Cube;
use burn::tensor::{DType, Device, Tensor};
use cubecl_runtime::runtime::Runtime;
use zero_comm::Element;
use zero_comm::nccl::cudarc::driver::{
    CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits, result,
};
use zero_comm::nccl::{NcclBuffer, OnCuda};

use crate::device::{DeviceTensors, WordBuffer};
use crate::error::{Error, Result};

/// cubecl-cuda's server, whose storage names a tensor's device pointer.
type Server = <cubecl_cuda::CudaRuntime as Runtime>::Server;

fn err(why: impl fmt::Display) -> Error {
    Error::Backend(format!("cuda bridge: {why}"))
}

/// The [`DeviceTensors`] hook of a trainer over NCCL or the CUDA loopback whose model computes on
/// burn-cuda, on the same GPU: gradients are copied on the device into their unit's NCCL buffer, gathered units
/// become the model's tensors with one device copy each. The copies run on the communicator's
/// stream after cubecl's work on the tensor has finished, and cubecl may reuse the memory only
/// once the stream has finished them.
pub struct CudaTensors {
    /// The communicator's stream, which the copies run on.
    stream: Arc<CudaStream>,
    /// The model's device (with autodiff), where gathered weights become tensors.
    model: Device,
}

impl fmt::Debug for CudaTensors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaTensors")
            .field("device", &self.stream.context().ordinal())
            .field("model", &self.model)
            .finish()
    }
}

impl CudaTensors {
    /// The hook for `comm`'s buffers and a model on `model` (burn-cuda, on `comm`'s GPU).
    pub fn new(comm: &impl OnCuda, model: Device) -> Self {
        CudaTensors {
            stream: comm.cuda_stream().clone(),
            model,
        }
    }

    /// Runs `copy(ptr)` with the device pointer of `t`'s storage (a contiguous f32, bf16 or fp16
    /// vector on burn-cuda) once cubecl's work on it is done, then waits for the communicator's
    /// stream before the storage may be reused.
    fn with_storage(&self, t: &Tensor<1>, copy: impl FnOnce(u64) -> Result<()>) -> Result<()> {
        let es = elem_bytes(t.dtype())?;
        let device = t.device();
        let ct = t
            .clone()
            .inner()
            .try_into_primitive::<Cube>()
            .map_err(|e| {
                err(format!(
                    "the tensor lives on {device:?}, not on burn's CUDA backend: {e:?}"
                ))
            })?;
        if !ct.is_contiguous() || ct.meta.is_tiled() || ct.qparams.is_some() {
            return Err(err(format!("not a contiguous vector: {ct:?}")));
        }
        pollster::block_on(ct.client.sync())
            .map_err(|e| err(format!("waiting for cubecl's stream: {e}")))?;
        let managed = ct
            .client
            .get_resource::<Server>(ct.handle.clone())
            .map_err(|e| err(format!("cubecl has no device pointer for the tensor: {e}")))?;
        let bytes = (t.dims()[0] * es) as u64;
        let res = managed.resource();
        if res.size < bytes {
            return Err(err(format!(
                "cubecl's range holds {} bytes, the tensor {bytes}",
                res.size
            )));
        }
        copy(res.ptr)?;
        self.stream
            .synchronize()
            .map_err(|e| err(format!("waiting for the communicator's stream: {e}")))?;
        drop(managed);
        Ok(())
    }

    /// A new flat tensor of `dtype` (whose elements are `E`s) on the model's device holding `len`
    /// elements of `src` from `offset`.
    fn copy_back<E: Element + DeviceRepr>(
        &self,
        src: &NcclBuffer<E>,
        dtype: DType,
        offset: usize,
        len: usize,
    ) -> Result<Tensor<1>> {
        crate::device::within("cuda bridge", offset, len, src.len())?;
        let out = Tensor::<1>::empty([len], (&self.model, dtype));
        if len > 0 {
            let view = src.view();
            let (base, _guard) = view.device_ptr(&self.stream);
            let from = base + (offset * size_of::<E>()) as u64;
            self.with_storage(&out, |dst| self.copy(dst, from, len * size_of::<E>()))?;
        }
        Ok(out)
    }

    /// A new NCCL buffer holding a copy of `t`'s storage, elements of type `E`.
    fn copy_out<E: Element + DeviceRepr + ValidAsZeroBits>(
        &self,
        t: &Tensor<1>,
    ) -> Result<NcclBuffer<E>> {
        let len = t.dims()[0];
        let slice = self
            .stream
            .alloc_zeros::<E>(len)
            .map_err(|e| err(format!("allocating {len} {}: {e}", E::DTYPE)))?;
        let mut buf = NcclBuffer::from_cuda_slice(slice);
        {
            let mut view = buf.view_mut();
            let (dst, _guard) = view.device_ptr_mut(&self.stream);
            self.with_storage(t, |src| self.copy(dst, src, len * size_of::<E>()))?;
        }
        Ok(buf)
    }

    /// `bytes` bytes from `src` to `dst` on the communicator's stream.
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges are device memory of this context, `bytes` long (the callers check
        // the lengths), kept alive and in place until the stream is synchronised.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(|e| err(format!("device copy: {e}")))
    }
}

impl<C: OnCuda> DeviceTensors<C> for CudaTensors {
    fn zeros(&self, len: usize) -> Result<C::Buffer<f32>> {
        let slice = self
            .stream
            .alloc_zeros::<f32>(len)
            .map_err(|e| err(format!("allocating {len} f32: {e}")))?;
        Ok(C::from_nccl(NcclBuffer::from_cuda_slice(slice)))
    }

    fn copy_in(&self, dst: &mut C::Buffer<f32>, offset: usize, grad: &Tensor<1>) -> Result<()> {
        let dst = C::nccl_mut(dst);
        if grad.dtype() != DType::F32 {
            return Err(err(format!("a {:?} gradient in an f32 unit", grad.dtype())));
        }
        let len = grad.dims()[0];
        if offset + len > dst.len() {
            return Err(err(format!(
                "a gradient of {len} elements at {offset} overruns its unit of {}",
                dst.len()
            )));
        }
        let mut view = dst.view_mut();
        let (base, _guard) = view.device_ptr_mut(&self.stream);
        let at = base + (offset * size_of::<f32>()) as u64;
        self.with_storage(grad, |src| self.copy(at, src, len * size_of::<f32>()))
    }

    fn tensor_at(&self, src: &C::Buffer<f32>, offset: usize, len: usize) -> Result<Tensor<1>> {
        self.copy_back(C::nccl(src), DType::F32, offset, len)
    }

    fn moves_words(&self) -> bool {
        true
    }

    fn words_of(&self, t: &Tensor<1>) -> Result<WordBuffer<C>> {
        WordBuffer::of_type(
            t,
            || self.copy_out(t).map(C::from_nccl),
            || self.copy_out(t).map(C::from_nccl),
        )
    }

    fn tensor_of(&self, src: &WordBuffer<C>, offset: usize, len: usize) -> Result<Tensor<1>> {
        src.visit(
            |b, dtype| self.copy_back(C::nccl(b), dtype, offset, len),
            |b, dtype| self.copy_back(C::nccl(b), dtype, offset, len),
        )
    }
}

/// The bytes of one element of `dtype` (f32, bf16 or fp16).
fn elem_bytes(dtype: DType) -> Result<usize> {
    match dtype {
        DType::F32 => Ok(4),
        DType::F16 | DType::BF16 => Ok(2),
        d => Err(err(format!(
            "only f32, bf16 and fp16 tensors are bridged, not {d:?}"
        ))),
    }
}
