//! The wgpu bridge's copies of 16-bit words (bf16/fp16 tensors) into and out of loopback
//! buffers, on the shared queue. They move whole 4-byte words (WebGPU's copy alignment): a tensor
//! of an odd number of elements also moves the 2 bytes after it, within cubecl's range (checked).

use burn::tensor::{DType, Tensor};
use zero_comm::Element;
use zero_comm::wgpu_loopback::WgpuBuffer;

use super::{BridgeTensors, copy_raw, err, fill, primitive, resource};
use crate::error::Result;

impl BridgeTensors {
    /// A new loopback buffer holding a copy of `t`'s storage, elements of type `E`.
    pub(super) fn copy_out<E: Element>(&self, t: &Tensor<1>) -> Result<WgpuBuffer<E>> {
        let len = t.dims()[0];
        let bytes = (len * size_of::<E>()) as u64;
        let buffer = self.raw(bytes, "zero-burn bridge: 16-bit piece");
        if bytes > 0 {
            let ct = primitive(t.clone())?;
            if !ct.is_contiguous() || ct.meta.is_tiled() || ct.qparams.is_some() {
                return Err(err(format!("not a contiguous 16-bit vector: {ct:?}")));
            }
            let (res, pin) = resource(&ct)?;
            let padded = bytes.next_multiple_of(4);
            if res.size < padded {
                return Err(err(format!(
                    "cubecl's range holds {} bytes, the copy {padded}",
                    res.size
                )));
            }
            copy_raw(
                &self.comm,
                (&res.buffer, res.offset),
                (&buffer, 0),
                padded,
                "zero-burn bridge: 16-bit words into a piece",
            )?;
            drop(pin);
        }
        Ok(WgpuBuffer::from_wgpu(buffer, 0, len)?)
    }

    /// A new tensor of `dtype` (whose elements are `E`s) on the model's device holding `len`
    /// elements of `src` from `offset`.
    pub(super) fn copy_back<E: Element>(
        &self,
        src: &WgpuBuffer<E>,
        dtype: DType,
        offset: usize,
        len: usize,
    ) -> Result<Tensor<1>> {
        fill(&self.comm, &self.model, src, dtype, offset, len)
    }
}
