//! The device hooks: burn tensors and ZeRO++'s codecs in the communicator's own memory.

use burn::tensor::Tensor;
use zero_comm::Communicator;
use zero_comm::quantized::QuantGroups;
use zero_quant::{Int4Block, Int8Block};

use crate::error::Result;

/// Moves burn tensors to and from the communicator's own memory without a host round trip (the
/// wgpu path's hook is `bridge::BridgeTensors`, over the zero-copy bridge). Gradients: packed
/// into their unit's buffer, for fp32 units reduced every micro-step (through qgZ only with
/// [`DeviceQuant`] codecs; the other paths round or quantize on the host). Weights: units
/// all-gathered into the communicator's memory (stage 3's gathers, through qwZ only with
/// [`DeviceQuant`] codecs, and the post-step gathers) become the model's tensors there, in fp32.
pub trait DeviceTensors<C: Communicator>: Send + std::fmt::Debug {
    /// A zeroed buffer of `len` f32 elements.
    fn zeros(&self, len: usize) -> Result<C::Buffer<f32>>;
    /// Copies the flat gradient `grad` into `dst` at element `offset`, in the device's order
    /// after the work that computed it.
    fn copy_in(&self, dst: &mut C::Buffer<f32>, offset: usize, grad: &Tensor<1>) -> Result<()>;
    /// A new flat tensor on the model's device holding `len` elements of `src` from `offset`.
    fn tensor_at(&self, src: &C::Buffer<f32>, offset: usize, len: usize) -> Result<Tensor<1>>;
}

/// ZeRO++'s codecs on the communicator's memory (the wgpu path's is `bridge::BridgeQuant`, over
/// zero-comm's device qwZ and qgZ): with them, qwZ gathers and qgZ reductions of fp32 units stay
/// on the device too. They must give the host codecs' bits, as zero-comm's device versions do.
pub trait DeviceQuant<C: Communicator>: Send + std::fmt::Debug {
    /// qwZ: all-gathers every rank's `chunk` through `codec` into `out` (`n · chunk` elements).
    fn qwz_all_gather(
        &self,
        comm: &mut C,
        codec: Int8Block,
        chunk: &C::Buffer<f32>,
        out: &mut C::Buffer<f32>,
    ) -> Result<()>;
    /// qgZ: the hierarchical int4 reduce-scatter (mean) of `input` into the rank's `out`.
    fn qgz_reduce_scatter(
        &self,
        groups: &mut QuantGroups<C>,
        codec: Int4Block,
        input: &C::Buffer<f32>,
        out: &mut C::Buffer<f32>,
    ) -> Result<()>;
}
