//! The crate's error type.

use crate::element::DType;

/// Errors returned by the codecs.
///
/// Every variant names the values that were wrong, so a failure in a
/// collective can be traced back to the element, block or buffer involved.
/// On any error the destination buffer's contents are unspecified (a prefix
/// may already have been written).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // --- Input values -------------------------------------------------------
    /// An input element (encode) or a raw `f32` wire element (identity decode)
    /// is NaN or infinite. `index` is the first such element of the tensor.
    #[error("non-finite element {value} at index {index}")]
    NonFinite {
        /// Element index in the tensor (the first non-finite one).
        index: usize,
        /// The offending value, widened to `f32`.
        value: f32,
    },

    // --- Buffer lengths -----------------------------------------------------
    /// A caller-provided buffer has the wrong length.
    #[error("{codec} {what}: expected length {expected}, got {got}")]
    BufferLen {
        /// The codec called (`"int8"`, `"int4"`, `"identity"`).
        codec: &'static str,
        /// Which buffer, e.g. `"encode dst bytes"`.
        what: &'static str,
        /// The length the codec needs.
        expected: usize,
        /// The length it was given.
        got: usize,
    },

    // --- Configuration ------------------------------------------------------
    /// A codec was constructed with an unusable block size.
    #[error("{codec}: block size must be a non-zero multiple of {multiple_of}, got {got}")]
    BlockSize {
        /// The codec being constructed (`"int8"`, `"int4"`).
        codec: &'static str,
        /// The granularity the codec needs (1 for int8, 2 for int4).
        multiple_of: usize,
        /// The rejected block size.
        got: usize,
    },

    // --- Wire validation (decode) -------------------------------------------
    /// A block scale read from the wire is negative, NaN, infinite, or so
    /// large that `qmax * scale` overflows. The encoder never writes one.
    #[error("{codec}: invalid scale {value} for block {block}")]
    InvalidScale {
        /// The codec decoding.
        codec: &'static str,
        /// Block index in the tensor.
        block: usize,
        /// The scale as read (little-endian `f32`).
        value: f32,
    },
    /// A code read from the wire is outside `[-qmax, qmax]` (`0x80` for int8,
    /// nibble `0x8` for int4). The encoder never writes one.
    #[error("{codec}: invalid code {code:#04x} for element {index}")]
    InvalidCode {
        /// The codec decoding.
        codec: &'static str,
        /// Element index in the tensor.
        index: usize,
        /// The raw code (a byte for int8, a nibble for int4).
        code: u8,
    },
    /// A decoded value does not fit the destination element type (it would
    /// round to infinity in bf16 or f16). Happens only when a wire is
    /// decoded into a narrower type than it was encoded from.
    #[error("decoded value {value} at index {index} overflows {dtype:?}")]
    Overflow {
        /// Element index in the tensor (the first that overflows).
        index: usize,
        /// The decoded value in `f32`.
        value: f32,
        /// The destination element type.
        dtype: DType,
    },
    /// A padding byte (or the unused high nibble after an odd int4 tensor)
    /// is not zero. The encoder always writes zeros there.
    #[error("{codec}: non-zero padding {byte:#04x} at wire offset {offset}")]
    Padding {
        /// The codec decoding.
        codec: &'static str,
        /// Byte offset in the wire buffer.
        offset: usize,
        /// The byte found there.
        byte: u8,
    },

    // --- Device (feature `wgpu`) ----------------------------------------------
    /// The wgpu device kernels could not run: no adapter, a device or
    /// validation error, a buffer without the needed usage or above the
    /// device's binding limit, or a codec without a device kernel
    /// ([`Identity`](crate::Identity)).
    #[cfg(feature = "wgpu")]
    #[error("wgpu: {0}")]
    Device(String),

    // --- Device (feature `cuda`) ----------------------------------------------
    /// The CUDA kernels could not run: no libcuda or device, a driver error
    /// (module load, launch, copy), a misaligned wire, a tensor above the
    /// kernels' limits, or a codec without a device kernel
    /// ([`Identity`](crate::Identity)).
    #[cfg(feature = "cuda")]
    #[error("cuda: {0}")]
    Cuda(String),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Shifts the element/block position carried by the error, used when a
    /// kernel worked on a sub-range of the tensor.
    pub(crate) fn offset(self, elems: usize, blocks: usize) -> Self {
        match self {
            Error::NonFinite { index, value } => Error::NonFinite {
                index: index + elems,
                value,
            },
            Error::InvalidScale {
                codec,
                block,
                value,
            } => Error::InvalidScale {
                codec,
                block: block + blocks,
                value,
            },
            Error::InvalidCode { codec, index, code } => Error::InvalidCode {
                codec,
                index: index + elems,
                code,
            },
            Error::Overflow {
                index,
                value,
                dtype,
            } => Error::Overflow {
                index: index + elems,
                value,
                dtype,
            },
            other => other,
        }
    }
}
