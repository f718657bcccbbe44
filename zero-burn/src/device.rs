//! The device hooks: burn tensors and ZeRO++'s codecs in the communicator's own memory.

use burn::tensor::Tensor;
use zero_comm::Communicator;
use zero_comm::quantized::DeviceCodec;

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

/// ZeRO++'s codecs on the communicator's memory: any fp32 [`DeviceCodec`] (the wgpu path's is
/// zero-quant's `WgpuQuantizer` on the shared device, one for every rank). With them, qwZ gathers
/// and qgZ reductions of fp32 units stay on the device too, through zero-comm's
/// `qwz_all_gather_device` and `qgz_reduce_scatter_device`. They must give the host codecs' bits,
/// as zero-comm's do.
pub trait DeviceQuant<C: Communicator>:
    DeviceCodec<C, f32> + Send + Sync + std::fmt::Debug
{
}

impl<C, T> DeviceQuant<C> for T
where
    C: Communicator,
    T: DeviceCodec<C, f32> + Send + Sync + std::fmt::Debug,
{
}
