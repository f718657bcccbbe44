//! Stage 3's weights between uses, in the working precision, owned by one type: the rank's shard
//! of every unit and the hpZ secondary slices, where `param_placement` puts them (the model's
//! device, host memory, or NVMe through [`OnDisk`] with one unit in host memory at a time). A
//! 16-bit shard beside fp32 secondaries, or the reverse, is not a state it can be in. Empty below
//! stage 3.
//!
//! On NVMe a unit is paged in by [`Stage3Weights::source`] before it reads it, and by the calls
//! that change it; [`Stage3Weights::settle`] writes it back.

use std::path::Path;

use burn::tensor::Tensor;

use super::shard_disk::OnDisk;
use super::slab::{Place, Shard, Slab};
use super::words::{Words, words_place};
use crate::error::{Error, Result};
use crate::offload::IoReport;
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
        /// On NVMe: the store, and `shard` holds only the unit paged in.
        disk: Option<OnDisk<f32>>,
    },
    /// bf16/fp16: the 16-bit working copies, one buffer per unit, on the model's device where it
    /// supports the type (see [`super::words`]); the optimizer keeps the fp32 master.
    Half {
        half: Half,
        shard: Vec<Words>,
        secondary: Vec<Option<Words>>,
        /// Where they live.
        place: Place,
        /// On NVMe: the store, and `shard` holds only the unit paged in.
        disk: Option<OnDisk<u16>>,
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
                disk: None,
            },
            Some(half) => Stage3Weights::Half {
                half,
                shard: Vec::new(),
                secondary: (0..units).map(|_| None).collect(),
                place: Place::Host,
                disk: None,
            },
        }
    }

    /// The shards of `chunks` (the rank's fp32 chunk of every unit, in order) at `place`,
    /// rounded to the working precision in bf16/fp16 (in host memory where the device lacks the
    /// 16-bit type).
    pub(super) fn fill(&mut self, chunks: Vec<Vec<f32>>, place: Place) {
        match self {
            Stage3Weights::F32 { shard, .. } => *shard = Shard::new(chunks, place),
            Stage3Weights::Half {
                half,
                shard,
                place: at,
                ..
            } => {
                *at = words_place(*half, place);
                *shard = chunks.iter().map(|c| Words::round(*half, c, at)).collect();
            }
        }
    }

    /// Moves the shard (filled in host memory) into a store in `root/rank{rank}` with a ring of
    /// `buffers`, leaving no unit in host memory.
    pub(super) fn move_to_disk(&mut self, store: (&Path, usize, usize)) -> Result<()> {
        match self {
            Stage3Weights::F32 { shard, disk, .. } => {
                *disk = Some(OnDisk::create(
                    store,
                    shard.units_mut(),
                    Slab::len,
                    take_f32,
                )?);
            }
            Stage3Weights::Half {
                half, shard, disk, ..
            } => *disk = Some(OnDisk::create(store, shard, Words::len, take_words(*half))?),
        }
        Ok(())
    }

    /// On NVMe, makes unit `u` the one in host memory (reading `next` ahead); `changes`: the
    /// caller changes it, so it is written back. Nothing otherwise.
    fn page(&mut self, u: usize, next: Option<usize>, changes: bool) -> Result<()> {
        match self {
            Stage3Weights::F32 {
                shard,
                disk: Some(d),
                ..
            } => d.page_in(shard.units_mut(), (u, next), changes, take_f32, Slab::Host),
            Stage3Weights::Half {
                half,
                shard,
                disk: Some(d),
                ..
            } => d.page_in(shard, (u, next), changes, take_words(*half), Words::Host),
            _ => Ok(()),
        }
    }

    /// On NVMe, makes unit `u` the one in host memory without reading it (the caller replaces
    /// all of it). Nothing otherwise.
    fn claim(&mut self, u: usize) -> Result<()> {
        match self {
            Stage3Weights::F32 {
                shard,
                disk: Some(d),
                ..
            } => d.claim(shard.units_mut(), u, take_f32),
            Stage3Weights::Half {
                half,
                shard,
                disk: Some(d),
                ..
            } => d.claim(shard, u, take_words(*half)),
            _ => Ok(()),
        }
    }

    /// On NVMe, writes the unit in host memory back if it changed and waits for every write:
    /// the store then holds the whole shard. Nothing otherwise.
    pub(super) fn settle(&mut self) -> Result<()> {
        match self {
            Stage3Weights::F32 {
                shard,
                disk: Some(d),
                ..
            } => d.settle(shard.units_mut(), take_f32),
            Stage3Weights::Half {
                half,
                shard,
                disk: Some(d),
                ..
            } => d.settle(shard, take_words(*half)),
            _ => Ok(()),
        }
    }

    /// On NVMe, what the store moved so far.
    pub(super) fn io_report(&self) -> Option<IoReport> {
        match self {
            Stage3Weights::F32 { disk, .. } => disk.as_ref().map(OnDisk::report),
            Stage3Weights::Half { disk, .. } => disk.as_ref().map(OnDisk::report),
        }
    }

    /// Unit `u`'s piece for a gather: its shard chunk (on NVMe paged in first, `next` read
    /// ahead), or with `hpz` its secondary slice (an error when the forward left none).
    pub(super) fn source(
        &mut self,
        u: usize,
        hpz: bool,
        next: Option<usize>,
    ) -> Result<Source<'_>> {
        if !hpz {
            self.page(u, next, false)?;
            return Ok(self.chunk(u));
        }
        let none = || {
            Error::Internal(format!(
                "unit {u}: the plan gathers it from hpZ, but it has no secondary shard"
            ))
        };
        Ok(match self {
            Stage3Weights::F32 { secondary, .. } => {
                Source::F32(secondary[u].as_ref().ok_or_else(none)?)
            }
            Stage3Weights::Half {
                half, secondary, ..
            } => Source::Half(*half, secondary[u].as_ref().ok_or_else(none)?),
        })
    }

    /// Unit `u`'s shard chunk as it is in memory: on NVMe, the caller has paged it in.
    fn chunk(&self, u: usize) -> Source<'_> {
        match self {
            Stage3Weights::F32 { shard, .. } => Source::F32(shard.unit(u)),
            Stage3Weights::Half { half, shard, .. } => Source::Half(*half, &shard[u]),
        }
    }

    /// The first `len` elements of unit `u`'s shard widened to f32: on NVMe read from the store
    /// unless the unit is paged in (between steps the store holds every unit as it is).
    pub(super) fn read_f32(&self, u: usize, len: usize) -> Result<Vec<f32>> {
        match self {
            Stage3Weights::F32 { disk: Some(d), .. } if !d.holds(u) => {
                let mut v = d.read(u)?;
                v.truncate(len);
                Ok(v)
            }
            Stage3Weights::Half {
                half,
                disk: Some(d),
                ..
            } if !d.holds(u) => Ok(half.widen_all(&d.read(u)?[..len])),
            _ => Ok(match self.chunk(u) {
                Source::F32(slab) => slab.read(0..len),
                Source::Half(h, chunk) => h.widen_all(&chunk.bits_of(h, 0..len)),
            }),
        }
    }

    /// Unit `u`'s fp32 shard, to step in place (paged in on NVMe, reading `next` ahead).
    pub(super) fn f32_mut(&mut self, u: usize, next: Option<usize>) -> Result<&mut Slab> {
        self.page(u, next, true)?;
        match self {
            Stage3Weights::F32 { shard, .. } => Ok(shard.unit_mut(u)),
            Stage3Weights::Half { .. } => Err(mismatch("an fp32 shard", "16-bit")),
        }
    }

    /// Replaces unit `u`'s 16-bit chunk with the fp32 master `master` rounded (the step's new
    /// working weights): on the device where both live there.
    pub(super) fn round_master(&mut self, u: usize, master: &Slab) -> Result<()> {
        self.claim(u)?;
        match self {
            Stage3Weights::Half {
                half, shard, place, ..
            } => {
                shard[u] = Words::round_slab(*half, master, place);
                Ok(())
            }
            Stage3Weights::F32 { .. } => Err(mismatch("a 16-bit shard", "fp32")),
        }
    }

    /// Writes fp32 `values` into unit `u`'s chunk from element `at` (rounded in bf16/fp16).
    pub(super) fn write(&mut self, u: usize, at: usize, values: &[f32]) -> Result<()> {
        self.page(u, None, true)?;
        match self {
            Stage3Weights::F32 { shard, .. } => shard.unit_mut(u).write(at, values),
            Stage3Weights::Half { half, shard, .. } => shard[u].write(*half, at, values),
        }
        Ok(())
    }

    /// Zeros unit `u`'s chunk.
    pub(super) fn zero(&mut self, u: usize) -> Result<()> {
        self.page(u, None, true)?;
        match self {
            Stage3Weights::F32 { shard, .. } => shard.unit_mut(u).zero(),
            Stage3Weights::Half { half, shard, .. } => shard[u].zero(*half),
        }
        Ok(())
    }

    /// Keeps `values` (gathered fp32, in host memory) as unit `u`'s hpZ secondary slice, where
    /// the shard lives.
    pub(super) fn keep_f32(&mut self, u: usize, values: Vec<f32>) -> Result<()> {
        match self {
            Stage3Weights::F32 {
                shard, secondary, ..
            } => {
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
                place,
                ..
            } => {
                secondary[u] = Some(Words::from_bits(*half, values, place));
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
    /// their elements, and on NVMe the shard the store holds (as the optimizer's state counts).
    pub(super) fn bytes(&self) -> (u64, u64) {
        match self {
            Stage3Weights::F32 {
                shard,
                secondary,
                disk,
            } => (
                disk.as_ref().map_or_else(|| shard.bytes(), OnDisk::bytes),
                secondary.iter().flatten().map(Slab::bytes).sum(),
            ),
            Stage3Weights::Half {
                shard,
                secondary,
                disk,
                ..
            } => (
                disk.as_ref()
                    .map_or_else(|| shard.iter().map(Words::bytes).sum(), OnDisk::bytes),
                secondary.iter().flatten().map(Words::bytes).sum(),
            ),
        }
    }
}

/// A host slab's values, leaving it empty (a device slab's read; never one on NVMe).
fn take_f32(slab: &mut Slab) -> Vec<f32> {
    match std::mem::replace(slab, Slab::Host(Vec::new())) {
        Slab::Host(v) => v,
        Slab::Device(t) => Slab::Device(t).host().into_owned(),
    }
}

/// Takes a host buffer's `half` bits, leaving it empty (a device buffer's read; never one on
/// NVMe).
fn take_words(half: Half) -> impl Fn(&mut Words) -> Vec<u16> {
    move |w| match std::mem::replace(w, Words::Host(Vec::new())) {
        Words::Host(v) => v,
        device => device.bits(half).into_owned(),
    }
}

fn mismatch(wanted: &str, got: &str) -> Error {
    Error::Internal(format!(
        "{wanted} was asked of stage 3's shards, which are {got}"
    ))
}
