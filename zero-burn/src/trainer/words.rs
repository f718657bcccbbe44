//! Flat 16-bit buffers (bf16/fp16 working weights) that live where the model lives: host memory
//! as `half`'s bit patterns, or a tensor of the 16-bit type on the model's device. Stage 3's
//! 16-bit shard and hpZ secondary slices are made of them ([`super::sharded`]).
//!
//! A device holds them only when it supports the type (burn's `Device::supports_dtype`): fp16 on
//! Vulkan devices with 16-bit floats (lavapipe has them), bf16 and fp16 on CUDA. Elsewhere they
//! stay in host memory (bf16 on wgpu: WGSL has no bf16).
//!
//! On a device the rounding is the device's cast of the f32 master (round to nearest, ties to
//! even, as `half` rounds on the host), and the words travel to and from host memory as bits.

use std::borrow::Cow;
use std::ops::Range;

use burn::tensor::{DType, Device, Tensor, TensorData, bf16, f16};

use super::slab::{Slab, upload};
use crate::precision::Half;

/// A flat buffer of 16-bit words of type `half`.
#[derive(Debug)]
pub(super) enum Words {
    Host(Vec<u16>),
    /// A tensor of the 16-bit type. Boxed: a burn tensor handle is 640 bytes.
    Device(Box<Tensor<1>>),
}

/// The device where `half`'s words live beside a model whose state sits on `device` (`None`:
/// host memory): `device` if it supports the type, else host memory.
pub(super) fn words_device(half: Half, device: Option<Device>) -> Option<Device> {
    device.filter(|d| d.supports_dtype(dtype(half)))
}

fn dtype(half: Half) -> DType {
    match half {
        Half::Bf16 => DType::BF16,
        Half::F16 => DType::F16,
    }
}

impl Words {
    /// `values` rounded to `half`, on `device` (`None`: host memory).
    pub(super) fn round(half: Half, values: &[f32], device: Option<&Device>) -> Words {
        match device {
            None => Words::Host(half.round_all(values)),
            Some(d) => Words::Device(Box::new(upload(values, d).cast(dtype(half)))),
        }
    }

    /// The fp32 master `master` (wherever it lives) rounded to `half`, on `device` (`None`: host
    /// memory): on the device itself when both live there.
    pub(super) fn round_slab(half: Half, master: &Slab, device: Option<&Device>) -> Words {
        match (master.device_slice(0..master.len()), device) {
            (Some(t), Some(_)) => Words::Device(Box::new(t.cast(dtype(half)))),
            _ => Words::round(half, &master.read(0..master.len()), device),
        }
    }

    /// The bit patterns `words` of `half`, on `device` (`None`: host memory).
    pub(super) fn from_bits(half: Half, words: Vec<u16>, device: Option<&Device>) -> Words {
        let Some(d) = device else {
            return Words::Host(words);
        };
        let n = words.len();
        let data = match half {
            Half::Bf16 => TensorData::new(words.into_iter().map(bf16::from_bits).collect(), [n]),
            Half::F16 => TensorData::new(words.into_iter().map(f16::from_bits).collect(), [n]),
        };
        Words::Device(Box::new(Tensor::from_data(data, (d, dtype(half)))))
    }

    /// Bytes held: a host buffer as allocated, a tensor by its elements.
    pub(super) fn bytes(&self) -> u64 {
        match self {
            Words::Host(v) => v.capacity() as u64 * 2,
            Words::Device(t) => t.dims()[0] as u64 * 2,
        }
    }

    /// The bit patterns, in host memory (read from a device).
    pub(super) fn bits(&self, half: Half) -> Cow<'_, [u16]> {
        match self {
            Words::Host(v) => Cow::Borrowed(v),
            Words::Device(t) => {
                let data = t.clone().into_data();
                let words = match half {
                    Half::Bf16 => data
                        .as_slice::<bf16>()
                        .map(|s| s.iter().map(|h| h.to_bits()).collect()),
                    Half::F16 => data
                        .as_slice::<f16>()
                        .map(|s| s.iter().map(|h| h.to_bits()).collect()),
                };
                Cow::Owned(words.expect("a 16-bit tensor holds 16-bit elements"))
            }
        }
    }

    /// Writes fp32 `values`, rounded to `half`, from element `at`.
    pub(super) fn write(&mut self, half: Half, at: usize, values: &[f32]) {
        let range = at..at + values.len();
        match self {
            Words::Host(v) => {
                for (d, &x) in v[range].iter_mut().zip(values) {
                    *d = half.round(x);
                }
            }
            Words::Device(t) => {
                let device = t.device();
                let new = upload(values, &device).cast(dtype(half));
                **t = whole_or_assign(t, range, new);
            }
        }
    }

    /// Sets every element to zero.
    pub(super) fn zero(&mut self, half: Half) {
        match self {
            Words::Host(v) => v.fill(0),
            Words::Device(t) => **t = Tensor::zeros([t.dims()[0]], (&t.device(), dtype(half))),
        }
    }
}

/// `t` with elements `range` replaced by `new` (`new` itself when it covers `t`).
fn whole_or_assign(t: &Tensor<1>, range: Range<usize>, new: Tensor<1>) -> Tensor<1> {
    if range.start == 0 && range.end == t.dims()[0] {
        new
    } else {
        t.clone().slice_assign(range, new)
    }
}
