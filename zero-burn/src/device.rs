//! The device hooks: burn tensors and ZeRO++'s codecs in the communicator's own memory.

use burn::tensor::{DType, Tensor, bf16, f16};
use zero_comm::Communicator;
use zero_comm::quantized::DeviceCodec;

use crate::error::{Error, Result};

/// Moves burn tensors to and from the communicator's own memory without a host round trip (the
/// wgpu path's hook is `bridge::BridgeTensors`, over the zero-copy bridge; burn-cuda's is
/// `cuda::CudaTensors`, over NCCL's or the CUDA loopback's buffers). Gradients: packed
/// into their unit's buffer, for fp32 units reduced every micro-step (through qgZ only with
/// [`DeviceQuant`] codecs; the other paths round or quantize on the host). Weights: units
/// all-gathered into the communicator's memory (stage 3's gathers, through qwZ only with
/// [`DeviceQuant`] codecs, and the post-step gathers) become the model's tensors there, in fp32.
///
/// 16-bit words (bf16/fp16 shards on the device) travel in a [`WordBuffer`]: [`Self::words_of`]
/// copies a tensor's storage into one that a gather sends, and [`Self::tensor_of`] makes a tensor
/// of the 16-bit type from a gathered one. A hook that cannot move them leaves
/// both at their defaults (an error) and [`Self::moves_words`] false: the trainer then stages
/// 16-bit collectives through host memory. With it, bf16/fp16 gradients are rounded on the
/// model's device and reduced in a [`WordBuffer`] too.
pub trait DeviceTensors<C: Communicator>: Send + std::fmt::Debug {
    /// A zeroed buffer of `len` f32 elements.
    fn zeros(&self, len: usize) -> Result<C::Buffer<f32>>;
    /// Copies the flat gradient `grad` into `dst` at element `offset`, in the device's order
    /// after the work that computed it.
    fn copy_in(&self, dst: &mut C::Buffer<f32>, offset: usize, grad: &Tensor<1>) -> Result<()>;
    /// A new flat tensor on the model's device holding `len` elements of `src` from `offset`.
    fn tensor_at(&self, src: &C::Buffer<f32>, offset: usize, len: usize) -> Result<Tensor<1>>;

    /// Whether [`Self::words_of`] and [`Self::tensor_of`] move 16-bit words.
    fn moves_words(&self) -> bool {
        false
    }

    /// A new buffer in the communicator's memory holding a copy of `t`, a contiguous flat tensor
    /// of a 16-bit type on the model's device.
    fn words_of(&self, t: &Tensor<1>) -> Result<WordBuffer<C>> {
        Err(no_words(t.dtype()))
    }

    /// A new flat tensor of `src`'s 16-bit type on the model's device holding its `len`
    /// elements from `offset` (an even offset).
    fn tensor_of(&self, src: &WordBuffer<C>, offset: usize, len: usize) -> Result<Tensor<1>> {
        let _ = (offset, len);
        Err(no_words(src.dtype()))
    }
}

/// `len` elements from `offset` lie within a device buffer of `buf_len`, else the bridge named
/// `bridge` says they overrun it.
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
pub(crate) fn within(bridge: &str, offset: usize, len: usize, buf_len: usize) -> Result<()> {
    if offset + len > buf_len {
        return Err(Error::Backend(format!(
            "{bridge}: {len} elements at {offset} overrun a buffer of {buf_len}"
        )));
    }
    Ok(())
}

fn no_words(dtype: DType) -> Error {
    Error::Backend(format!(
        "this device hook moves f32 tensors only, not {dtype:?} words"
    ))
}

/// Flat 16-bit words in the communicator's memory, of either type: a bf16/fp16 shard's piece on
/// its way to a gather, or a gathered unit.
pub enum WordBuffer<C: Communicator> {
    Bf16(C::Buffer<bf16>),
    F16(C::Buffer<f16>),
}

impl<C: Communicator> WordBuffer<C> {
    /// The words' burn type.
    pub fn dtype(&self) -> DType {
        match self {
            WordBuffer::Bf16(_) => DType::BF16,
            WordBuffer::F16(_) => DType::F16,
        }
    }

    /// A buffer of `t`'s 16-bit type, made by `bf16` or `f16`; an error for any other type.
    pub fn of_type(
        t: &Tensor<1>,
        bf16: impl FnOnce() -> Result<C::Buffer<bf16>>,
        f16: impl FnOnce() -> Result<C::Buffer<f16>>,
    ) -> Result<Self> {
        match t.dtype() {
            DType::BF16 => Ok(WordBuffer::Bf16(bf16()?)),
            DType::F16 => Ok(WordBuffer::F16(f16()?)),
            d => Err(Error::Backend(format!(
                "only bf16 and fp16 tensors move as words, not {d:?}"
            ))),
        }
    }

    /// `bf16` or `f16` applied to the typed buffer, with the words' burn type.
    pub fn visit<R>(
        &self,
        bf16: impl FnOnce(&C::Buffer<bf16>, DType) -> R,
        f16: impl FnOnce(&C::Buffer<f16>, DType) -> R,
    ) -> R {
        match self {
            WordBuffer::Bf16(b) => bf16(b, DType::BF16),
            WordBuffer::F16(b) => f16(b, DType::F16),
        }
    }
}

impl<C: Communicator> std::fmt::Debug for WordBuffer<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WordBuffer<{:?}>", self.dtype())
    }
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
