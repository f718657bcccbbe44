//! Stage 3's weights between uses, in the working precision, owned by one type: the rank's shard
//! of every unit and the hpZ secondary slices, on the model's device. A 16-bit shard beside fp32
//! secondaries, or the reverse, is not a state it can be in. Empty below stage 3.

use burn::tensor::{Device, Tensor};

use super::slab::{Shard, Slab};
use super::words::{Words, words_device};
use crate::error::{Error, Result};
use crate::precision::Half;

/// The rank's stage-3 shards.
#[derive(Debug)]
pub(super) enum Stage3Weights {
    /// fp32: the shard is the fp32 master (the optimizer steps it in place), one slab per unit on
    /// the model's device; the secondary slices live beside it.
    F32 {
        shard: Shard,
        /// hpZ: unit `u`'s secondary slice, valid between its forward and the optimizer step.
        secondary: Vec<Option<Slab>>,
    },
    /// bf16/fp16: the 16-bit working copies, one buffer per unit, on the model's device where it
    /// supports the type (see [`super::words`]); the optimizer keeps the fp32 master.
    Half {
        half: Half,
        shard: Vec<Words>,
        secondary: Vec<Option<Words>>,
        /// Where they live (`None`: host memory).
        device: Option<Device>,
    },
}

/// What a gather of one unit sends: an fp32 slab or 16-bit words (wherever they live).
pub(super) enum Source<'a> {
    F32(&'a Slab),
    Half(Half, &'a Words),
}

impl Stage3Weights {
    /// Empty shards of `units` units in the working precision (`half`, if any).
    pub(super) fn empty(half: Option<Half>, units: usize) -> Stage3Weights {
        match half {
            None => Stage3Weights::F32 {
                shard: Shard::default(),
                secondary: (0..units).map(|_| None).collect(),
            },
            Some(half) => Stage3Weights::Half {
                half,
                shard: Vec::new(),
                secondary: (0..units).map(|_| None).collect(),
                device: None,
            },
        }
    }

    /// The shards of `chunks` (the rank's fp32 chunk of every unit, in order) on `device`
    /// (`None`: host memory), rounded to the working precision in bf16/fp16 (in host memory where
    /// the device lacks the 16-bit type).
    pub(super) fn fill(&mut self, chunks: Vec<Vec<f32>>, device: Option<Device>) {
        match self {
            Stage3Weights::F32 { shard, .. } => *shard = Shard::new(chunks, device),
            Stage3Weights::Half {
                half,
                shard,
                device: at,
                ..
            } => {
                *at = words_device(*half, device);
                *shard = chunks
                    .iter()
                    .map(|c| Words::round(*half, c, at.as_ref()))
                    .collect();
            }
        }
    }

    /// Unit `u`'s piece for a gather: its shard chunk, or with `hpz` its secondary slice (an
    /// error when the forward left none).
    pub(super) fn source(&self, u: usize, hpz: bool) -> Result<Source<'_>> {
        let none = || {
            Error::Internal(format!(
                "unit {u}: the plan gathers it from hpZ, but it has no secondary shard"
            ))
        };
        Ok(match self {
            Stage3Weights::F32 { secondary, .. } if hpz => {
                Source::F32(secondary[u].as_ref().ok_or_else(none)?)
            }
            Stage3Weights::F32 { shard, .. } => Source::F32(shard.unit(u)),
            Stage3Weights::Half {
                half, secondary, ..
            } if hpz => Source::Half(*half, secondary[u].as_ref().ok_or_else(none)?),
            Stage3Weights::Half { half, shard, .. } => Source::Half(*half, &shard[u]),
        })
    }

    /// Unit `u`'s fp32 shard, to step in place.
    pub(super) fn f32_mut(&mut self, u: usize) -> Result<&mut Slab> {
        match self {
            Stage3Weights::F32 { shard, .. } => Ok(shard.unit_mut(u)),
            Stage3Weights::Half { .. } => Err(mismatch("an fp32 shard", "16-bit")),
        }
    }

    /// Replaces unit `u`'s 16-bit chunk with the fp32 master `master` rounded (the step's new
    /// working weights): on the device where both live there.
    pub(super) fn round_master(&mut self, u: usize, master: &Slab) -> Result<()> {
        match self {
            Stage3Weights::Half {
                half,
                shard,
                device,
                ..
            } => {
                shard[u] = Words::round_slab(*half, master, device.as_ref());
                Ok(())
            }
            Stage3Weights::F32 { .. } => Err(mismatch("a 16-bit shard", "fp32")),
        }
    }

    /// Writes fp32 `values` into unit `u`'s chunk from element `at` (rounded in bf16/fp16).
    pub(super) fn write(&mut self, u: usize, at: usize, values: &[f32]) {
        match self {
            Stage3Weights::F32 { shard, .. } => shard.unit_mut(u).write(at, values),
            Stage3Weights::Half { half, shard, .. } => shard[u].write(*half, at, values),
        }
    }

    /// Zeros unit `u`'s chunk.
    pub(super) fn zero(&mut self, u: usize) {
        match self {
            Stage3Weights::F32 { shard, .. } => shard.unit_mut(u).zero(),
            Stage3Weights::Half { half, shard, .. } => shard[u].zero(*half),
        }
    }

    /// Keeps `values` (gathered fp32, in host memory) as unit `u`'s hpZ secondary slice, where
    /// the shard lives.
    pub(super) fn keep_f32(&mut self, u: usize, values: Vec<f32>) -> Result<()> {
        match self {
            Stage3Weights::F32 { shard, secondary } => {
                secondary[u] = Some(shard.slab(values));
                Ok(())
            }
            Stage3Weights::Half { .. } => Err(mismatch("fp32 weights", "16-bit")),
        }
    }

    /// Keeps `t` (a tensor on the model's device) as unit `u`'s hpZ secondary slice.
    pub(super) fn keep_tensor(&mut self, u: usize, t: Tensor<1>) -> Result<()> {
        match self {
            Stage3Weights::F32 { secondary, .. } => {
                secondary[u] = Some(Slab::Device(Box::new(t)));
                Ok(())
            }
            Stage3Weights::Half { .. } => Err(mismatch("fp32 weights", "16-bit")),
        }
    }

    /// Keeps `values` (gathered 16-bit words) as unit `u`'s hpZ secondary slice, where the
    /// shard lives.
    pub(super) fn keep_half(&mut self, u: usize, values: Vec<u16>) -> Result<()> {
        match self {
            Stage3Weights::Half {
                half,
                secondary,
                device,
                ..
            } => {
                secondary[u] = Some(Words::from_bits(*half, values, device.as_ref()));
                Ok(())
            }
            Stage3Weights::F32 { .. } => Err(mismatch("16-bit weights", "fp32")),
        }
    }

    /// Keeps `words` (a slice of a unit gathered on the shard's device) as unit `u`'s hpZ
    /// secondary slice.
    pub(super) fn keep_words(&mut self, u: usize, words: Words) -> Result<()> {
        match self {
            Stage3Weights::Half { secondary, .. } => {
                secondary[u] = Some(words);
                Ok(())
            }
            Stage3Weights::F32 { .. } => Err(mismatch("16-bit weights", "fp32")),
        }
    }

    /// Drops every hpZ secondary slice (they never outlive a weight update).
    pub(super) fn clear_secondaries(&mut self) {
        match self {
            Stage3Weights::F32 { secondary, .. } => secondary.iter_mut().for_each(|s| *s = None),
            Stage3Weights::Half { secondary, .. } => secondary.iter_mut().for_each(|s| *s = None),
        }
    }

    /// Bytes held: (the shard, the secondary slices), host buffers as allocated, tensors by
    /// their elements.
    pub(super) fn bytes(&self) -> (u64, u64) {
        match self {
            Stage3Weights::F32 { shard, secondary } => (
                shard.bytes(),
                secondary.iter().flatten().map(Slab::bytes).sum(),
            ),
            Stage3Weights::Half {
                shard, secondary, ..
            } => (
                shard.iter().map(Words::bytes).sum(),
                secondary.iter().flatten().map(Words::bytes).sum(),
            ),
        }
    }
}

fn mismatch(wanted: &str, got: &str) -> Error {
    Error::Internal(format!(
        "{wanted} was asked of stage 3's shards, which are {got}"
    ))
}
