//! Flat 16-bit buffers (bf16/fp16 working weights and gradients) that live on a device or in
//! host memory: `half`'s bit patterns in host memory, or a tensor of the 16-bit type on the
//! device. Stage 3's 16-bit shard and hpZ secondary slices ([`super::sharded`]) and the 16-bit
//! gradient accumulator ([`super::grad_acc`]) are made of them.
//!
//! A device holds them only when it supports the type (burn's `Device::supports_dtype`): fp16 on
//! Vulkan devices with 16-bit floats (lavapipe has them), bf16 and fp16 on CUDA. Elsewhere they
//! stay in host memory (bf16 on wgpu: WGSL has no bf16).
//!
//! On a device the rounding is the device's cast from f32 (round to nearest, ties to even, as
//! `half` rounds on the host), a 16-bit addition widens both sides, adds in f32 and rounds once
//! (as [`Half::add_into`]), and the words travel to and from host memory as bits.

use std::borrow::Cow;
use std::ops::Range;

use burn::tensor::{DType, Device, Tensor, TensorData, bf16, f16};

use super::slab::{Buf, Place, Slab, upload};
use crate::precision::Half;

/// A flat buffer of a 16-bit type's words: their bit patterns in host memory, or a tensor of the
/// type on a device.
pub(super) type Words = Buf<u16>;

/// Where `half`'s words live beside state at `place`: there if its device supports the type,
/// else host memory.
pub(super) fn words_place(half: Half, place: Place) -> Place {
    match place {
        Place::Device(d) if d.supports_dtype(dtype(half)) => Place::Device(d),
        _ => Place::Host,
    }
}

/// The burn type of `half`'s words.
pub(super) fn dtype(half: Half) -> DType {
    match half {
        Half::Bf16 => DType::BF16,
        Half::F16 => DType::F16,
    }
}

impl Words {
    /// `values` rounded to `half`, at `place`.
    pub(super) fn round(half: Half, values: &[f32], place: &Place) -> Words {
        match place {
            Place::Host => Words::Host(half.round_all(values)),
            Place::Device(d) => Words::Device(Box::new(upload(values, d).cast(dtype(half)))),
        }
    }

    /// The fp32 master `master` (wherever it lives) rounded to `half`, at `place`: on the device
    /// itself when both live there.
    pub(super) fn round_slab(half: Half, master: &Slab, place: &Place) -> Words {
        match (master.device_slice(0..master.len()), place) {
            (Some(t), Place::Device(_)) => Words::Device(Box::new(t.cast(dtype(half)))),
            _ => Words::round(half, &master.host(), place),
        }
    }

    /// The bit patterns `words` of `half`, at `place`.
    pub(super) fn from_bits(half: Half, words: Vec<u16>, place: &Place) -> Words {
        match place {
            Place::Host => Words::Host(words),
            Place::Device(d) => Words::Device(Box::new(bits_tensor(half, &words, d))),
        }
    }

    /// `len` zeros of `half` at `place`.
    pub(super) fn zeros(half: Half, len: usize, place: &Place) -> Words {
        match place {
            Place::Host => Words::Host(vec![0; len]),
            Place::Device(d) => Words::Device(Box::new(Tensor::zeros([len], (d, dtype(half))))),
        }
    }

    /// The bit patterns, in host memory (read from a device).
    pub(super) fn bits(&self, half: Half) -> Cow<'_, [u16]> {
        match self {
            Words::Host(v) => Cow::Borrowed(v),
            Words::Device(t) => Cow::Owned(tensor_bits(half, t)),
        }
    }

    /// Elements `range` widened to f32, as a tensor on the device; `None` in host memory.
    pub(super) fn widened(&self, range: Range<usize>) -> Option<Tensor<1>> {
        match self {
            Words::Device(t) => Some((**t).clone().slice(range).cast(DType::F32)),
            Words::Host(_) => None,
        }
    }

    /// Elements `range`'s bit patterns, in host memory.
    pub(super) fn bits_of(&self, half: Half, range: Range<usize>) -> Cow<'_, [u16]> {
        match self {
            Words::Host(v) => Cow::Borrowed(&v[range]),
            Words::Device(t) => Cow::Owned(tensor_bits(half, &t.clone().slice(range))),
        }
    }

    /// Writes the bit patterns `words` from element `at`.
    pub(super) fn write_bits(&mut self, half: Half, at: usize, words: &[u16]) {
        match self {
            Words::Host(v) => v[at..at + words.len()].copy_from_slice(words),
            Words::Device(t) => {
                let new = bits_tensor(half, words, &t.device());
                self.assign(at, new);
            }
        }
    }

    /// `self[at + i] = round(widen(self[at + i]) + add[i])`, where the words live.
    pub(super) fn add_f32(&mut self, half: Half, at: usize, add: &[f32]) {
        match self {
            Words::Host(v) => half.add_f32_into(&mut v[at..at + add.len()], add),
            Words::Device(t) => {
                let add = upload(add, &t.device());
                self.add_widened(half, at, add);
            }
        }
    }

    /// `self[at + i] = round(widen(self[at + i]) + widen(words[i]))`, where the words live.
    pub(super) fn add_bits(&mut self, half: Half, at: usize, words: &[u16]) {
        match self {
            Words::Host(v) => half.add_into(&mut v[at..at + words.len()], words),
            Words::Device(t) => {
                let add = bits_tensor(half, words, &t.device()).cast(DType::F32);
                self.add_widened(half, at, add);
            }
        }
    }

    /// Writes fp32 `values`, rounded to `half`, from element `at`.
    pub(super) fn write(&mut self, half: Half, at: usize, values: &[f32]) {
        match self {
            Words::Host(v) => {
                for (d, &x) in v[at..at + values.len()].iter_mut().zip(values) {
                    *d = half.round(x);
                }
            }
            Words::Device(t) => {
                let new = upload(values, &t.device()).cast(dtype(half));
                self.assign(at, new);
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

    /// A device buffer's elements from `at` replaced by the tensor `new` (of the 16-bit type).
    /// Owned, the tensor is the only handle to its memory: burn may write in place.
    fn assign(&mut self, at: usize, new: Tensor<1>) {
        let Words::Device(t) = std::mem::replace(self, Words::Host(Vec::new())) else {
            unreachable!("only a device buffer takes a tensor");
        };
        let range = at..at + new.dims()[0];
        *self = Words::Device(Box::new(if range.start == 0 && range.end == t.dims()[0] {
            new
        } else {
            t.slice_assign(range, new)
        }));
    }

    /// A device buffer's elements from `at` widened, plus the f32 tensor `add`, rounded back.
    fn add_widened(&mut self, half: Half, at: usize, add: Tensor<1>) {
        let Words::Device(t) = self else {
            unreachable!("only a device buffer adds a tensor");
        };
        let range = at..at + add.dims()[0];
        let sum = ((**t).clone().slice(range).cast(DType::F32) + add).cast(dtype(half));
        self.assign(at, sum);
    }
}

/// A tensor of `half` on `device` holding the bit patterns `words`.
fn bits_tensor(half: Half, words: &[u16], device: &Device) -> Tensor<1> {
    let n = words.len();
    let data = match half {
        Half::Bf16 => TensorData::new(words.iter().map(|&w| bf16::from_bits(w)).collect(), [n]),
        Half::F16 => TensorData::new(words.iter().map(|&w| f16::from_bits(w)).collect(), [n]),
    };
    Tensor::from_data(data, (device, dtype(half)))
}

/// The bit patterns of a tensor of `half`, in host memory.
fn tensor_bits(half: Half, t: &Tensor<1>) -> Vec<u16> {
    let data = t.clone().into_data();
    let words = match half {
        Half::Bf16 => data
            .as_slice::<bf16>()
            .map(|s| s.iter().map(|h| h.to_bits()).collect()),
        Half::F16 => data
            .as_slice::<f16>()
            .map(|s| s.iter().map(|h| h.to_bits()).collect()),
    };
    words.expect("a 16-bit tensor holds 16-bit elements")
}
