//! The checked plan: flat layout, shards, fragments, buckets, gather groups and hpZ groups.
//!
//! # Layout
//!
//! Parameters are packed into **units**: contiguous runs of parameters in one flat buffer, each
//! unit padded with zeros to a multiple of `2·N` elements (N = world size; the factor 2 keeps every
//! rank's chunk start 4-byte aligned for 16-bit types, as DeepSpeed's `nccl_start_alignment_factor`
//! does). Every unit is split into N equal contiguous **chunks**; rank `r` owns chunk `r` of every
//! unit. A rank's **shard buffer** is the concatenation of its chunks in unit order. A parameter
//! whose elements cross a chunk boundary is split exactly there (a *straddling* parameter); each
//! piece is a [`Fragment`].
//!
//! What a unit is depends on the stage:
//! - **Stages 0–2**: a unit is a gradient *bucket*: trainable parameters in **backward** order
//!   (reverse forward order), filled up to `reduce_bucket_size` elements (a larger parameter gets a
//!   bucket of its own). One reduction per bucket: an all-reduce at stage 0, a reduce-scatter at
//!   stages 1–2 (each rank receives exactly its chunk), then one all-gather per bucket after the
//!   optimizer step at stages 1–2. Frozen parameters are replicated and belong to no unit.
//!   **Buffers** ([`crate::ParamDesc::buffer`], e.g. BatchNorm's running statistics) belong to no
//!   unit at any stage: every rank holds them whole, and the engine keeps them equal.
//!   (DeepSpeed cuts one flat buffer into N contiguous partitions and then all-reduces buckets,
//!   moving twice the bytes; sharding each bucket, as Megatron's distributed optimizer does, makes
//!   the reduction a true reduce-scatter.)
//! - **Stage 3**: a unit is a *gather group*: consecutive parameters (forward order) of one module
//!   with the same trainable flag. Parameters of at most `param_persistence_threshold` elements
//!   (while the running total stays within `model_persistence_threshold`) are *persistent*: packed
//!   into persistent units of at most `allgather_bucket_size` elements that stay gathered, are
//!   reduce-scattered after backward and all-gathered once after each optimizer step.
//!
//! Nothing here is per rank × per parameter: per-rank views ([`Plan::fragments`]) are computed on
//! demand by binary search, so planning is `O(P log P)` in the number of parameters `P` and
//! independent of the world size.

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::config::{Precision, ZeroConfig};
use crate::error::{Error, Result};
use crate::model::ModelDesc;
use crate::topology::Topology;

/// What a unit is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnitKind {
    /// Stages 0–2: a gradient bucket (backward order).
    Bucket,
    /// Stage 3: a per-module gather group, gathered for forward and for backward, then released.
    Gather,
    /// Stage 3: small parameters that stay gathered.
    Persistent,
}

/// A contiguous run of parameters in the flat buffer, padded to a multiple of `2·N`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Unit {
    /// What the unit is for.
    pub kind: UnitKind,
    /// Whether its parameters are trainable (a unit never mixes trainable and frozen ones).
    pub trainable: bool,
    /// The module of a gather group; the first parameter's module otherwise.
    pub module: String,
    /// Stage 3: the other modules that read a gather group's parameters (tied weights, see
    /// [`crate::ParamDesc::readers`]); its parameters all have these readers. Empty otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub readers: Vec<String>,
    /// Range of this unit's entries in [`Plan::entries`].
    pub entries: Range<usize>,
    /// Offset of the unit in the global flat buffer (elements).
    pub flat_offset: u64,
    /// Real (unpadded) elements.
    pub numel: u64,
    /// Padded length: a multiple of `2·N`.
    pub len: u64,
    /// Offset of this unit's chunk in every rank's shard buffer (elements).
    pub shard_offset: u64,
}

impl Unit {
    /// Padding elements at the end of the unit.
    pub fn padding(&self) -> u64 {
        self.len - self.numel
    }
}

/// A parameter's place in its unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Entry {
    /// Index of the parameter in the model.
    pub param: usize,
    /// Offset of its first element in the unit.
    pub offset: u64,
    /// Its element count.
    pub numel: u64,
}

/// The piece of one parameter that one rank owns.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Fragment {
    /// The unit.
    pub unit: usize,
    /// Index of the parameter in the model.
    pub param: usize,
    /// The owned elements, as a range of the parameter's flattened (row-major) elements.
    pub param_range: Range<u64>,
    /// Where they sit in the rank's shard buffer.
    pub shard_offset: u64,
}

/// A checked plan. Build it with [`Plan::new`]; downstream code takes it by reference.
#[derive(Clone, Debug)]
pub struct Plan {
    model: ModelDesc,
    topology: Topology,
    config: ZeroConfig,
    units: Vec<Unit>,
    entries: Vec<Entry>,
    /// For each parameter: `(unit, index into entries)`, or `None` if replicated.
    param_entry: Vec<Option<(u32, u32)>>,
    shard_len: u64,
}

impl Plan {
    /// Validates the inputs once and lays out the model.
    pub fn new(model: &ModelDesc, topology: Topology, config: &ZeroConfig) -> Result<Plan> {
        model.validate()?;
        crate::config::validate(config, &topology)?;
        let n = topology.world_size() as u64;
        let align = 2 * n;
        let mut b = Builder {
            units: Vec::new(),
            entries: Vec::new(),
            flat: 0,
            shard: 0,
            n,
            align,
        };
        if config.stage <= 2 {
            let mut cur: Vec<usize> = Vec::new();
            let mut cur_numel = 0u64;
            for (i, p) in model.params.iter().enumerate().rev() {
                if !p.trainable {
                    continue;
                }
                let k = p.numel();
                if !cur.is_empty() && cur_numel + k > config.reduce_bucket_size {
                    b.push(model, UnitKind::Bucket, true, std::mem::take(&mut cur));
                    cur_numel = 0;
                }
                cur.push(i);
                cur_numel += k;
            }
            if !cur.is_empty() {
                b.push(model, UnitKind::Bucket, true, cur);
            }
            if b.units.is_empty() {
                return Err(Error::Model(
                    "no trainable parameters: every parameter is frozen, so there is nothing to train \
                     (a burn model built on a device without `.autodiff()` has none)"
                        .into(),
                ));
            }
        } else {
            // Persistent parameters first decided in forward order, capped by the model threshold.
            let mut persistent = vec![false; model.params.len()];
            let mut total = 0u64;
            for (i, p) in model.params.iter().enumerate() {
                let k = p.numel();
                if p.buffer {
                    continue;
                }
                if k <= config.param_persistence_threshold
                    && total + k <= config.model_persistence_threshold
                {
                    persistent[i] = true;
                    total += k;
                }
            }
            let mut cur: Vec<usize> = Vec::new();
            let mut key: Option<(&str, bool, &[String])> = None;
            for (i, p) in model.params.iter().enumerate() {
                // Buffers, like persistent parameters, are in no gather unit; they are in no
                // unit at all (replicated on every rank, at every stage).
                if persistent[i] || p.buffer {
                    continue;
                }
                // A gather group: consecutive parameters of one module, one trainable flag and
                // one set of other readers (a tied weight gets a unit of its own).
                let k = (p.module.as_str(), p.trainable, p.readers.as_slice());
                if key != Some(k) && !cur.is_empty() {
                    b.push(
                        model,
                        UnitKind::Gather,
                        key.unwrap().1,
                        std::mem::take(&mut cur),
                    );
                }
                key = Some(k);
                cur.push(i);
            }
            if let Some((_, t, _)) = key.filter(|_| !cur.is_empty()) {
                b.push(model, UnitKind::Gather, t, cur);
            }
            for trainable in [true, false] {
                let mut cur: Vec<usize> = Vec::new();
                let mut cur_numel = 0;
                for (i, p) in model.params.iter().enumerate() {
                    if !persistent[i] || p.buffer || p.trainable != trainable {
                        continue;
                    }
                    if !cur.is_empty() && cur_numel + p.numel() > config.allgather_bucket_size {
                        b.push(
                            model,
                            UnitKind::Persistent,
                            trainable,
                            std::mem::take(&mut cur),
                        );
                        cur_numel = 0;
                    }
                    cur_numel += p.numel();
                    cur.push(i);
                }
                if !cur.is_empty() {
                    b.push(model, UnitKind::Persistent, trainable, cur);
                }
            }
            if !model.params.iter().any(|p| p.trainable) {
                return Err(Error::Model(
                    "no trainable parameters: every parameter is frozen, so there is nothing to train \
                     (a burn model built on a device without `.autodiff()` has none)"
                        .into(),
                ));
            }
        }
        let mut param_entry = vec![None; model.params.len()];
        for (u, unit) in b.units.iter().enumerate() {
            for e in unit.entries.clone() {
                param_entry[b.entries[e].param] = Some((u as u32, e as u32));
            }
        }
        Ok(Plan {
            model: model.clone(),
            topology,
            config: config.clone(),
            shard_len: b.shard,
            units: b.units,
            entries: b.entries,
            param_entry,
        })
    }

    /// The model.
    pub fn model(&self) -> &ModelDesc {
        &self.model
    }

    /// The topology.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The configuration.
    pub fn config(&self) -> &ZeroConfig {
        &self.config
    }

    /// The ZeRO stage.
    pub fn stage(&self) -> u8 {
        self.config.stage
    }

    /// World size `N`.
    pub fn world_size(&self) -> usize {
        self.topology.world_size()
    }

    /// The units in flat order.
    pub fn units(&self) -> &[Unit] {
        &self.units
    }

    /// Every parameter's place, grouped by unit (see [`Unit::entries`]).
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The entries of one unit.
    pub fn unit_entries(&self, unit: usize) -> &[Entry] {
        &self.entries[self.units[unit].entries.clone()]
    }

    /// The unit and offset of parameter `param`, or `None` for a replicated one (a buffer, or a
    /// frozen parameter at stages 0–2).
    pub fn locate(&self, param: usize) -> Option<(usize, u64)> {
        self.param_entry[param].map(|(u, e)| (u as usize, self.entries[e as usize].offset))
    }

    /// The chunk length of `unit` (elements each rank owns).
    pub fn chunk_len(&self, unit: usize) -> u64 {
        self.units[unit].len / self.world_size() as u64
    }

    /// Length of every rank's shard buffer: the sum of its chunks (padding included).
    pub fn shard_len(&self) -> u64 {
        self.shard_len
    }

    /// Total length of the flat buffer (padding included).
    pub fn flat_len(&self) -> u64 {
        self.units.iter().map(|u| u.len).sum()
    }

    /// Total padding elements.
    pub fn padding(&self) -> u64 {
        self.units.iter().map(Unit::padding).sum()
    }

    /// Elements of `rank`'s chunk of `unit` that are real data (not padding).
    pub fn real_in_chunk(&self, unit: usize, rank: usize) -> u64 {
        let u = &self.units[unit];
        let c = self.chunk_len(unit);
        let start = rank as u64 * c;
        u.numel.saturating_sub(start).min(c)
    }

    /// The fragments of `unit` that `rank` owns, in flat order.
    pub fn unit_fragments(&self, unit: usize, rank: usize) -> Vec<Fragment> {
        let u = &self.units[unit];
        let c = self.chunk_len(unit);
        let (lo, hi) = (rank as u64 * c, (rank as u64 + 1) * c);
        let entries = &self.entries[u.entries.clone()];
        // First entry whose end is past lo.
        let first = entries.partition_point(|e| e.offset + e.numel <= lo);
        let mut out = Vec::new();
        for e in &entries[first..] {
            if e.offset >= hi {
                break;
            }
            let s = e.offset.max(lo);
            let t = (e.offset + e.numel).min(hi);
            out.push(Fragment {
                unit,
                param: e.param,
                param_range: s - e.offset..t - e.offset,
                shard_offset: u.shard_offset + (s - lo),
            });
        }
        out
    }

    /// Every fragment `rank` owns, in shard order.
    pub fn fragments(&self, rank: usize) -> Vec<Fragment> {
        (0..self.units.len())
            .flat_map(|u| self.unit_fragments(u, rank))
            .collect()
    }

    /// The hpZ layout, if hpZ is on.
    pub fn hpz(&self) -> Option<HpzLayout> {
        self.config.hpz().then_some(HpzLayout {
            size: self.config.hpz_partition_size,
        })
    }

    /// Global ranks of the hpZ group (consecutive ranks) that holds `rank`.
    pub fn hpz_group(&self, rank: usize) -> Range<usize> {
        let h = self.config.hpz_partition_size.max(1);
        let g = rank / h;
        g * h..(g + 1) * h
    }

    /// Working dtype bytes (weights and gradients).
    pub fn working_bytes(&self) -> u64 {
        self.config.precision.working_dtype().size()
    }

    /// Bytes per element of the gradient accumulator: the working dtype's, or 4 with
    /// `grad_accum_dtype = fp32`.
    pub fn grad_accum_bytes(&self) -> u64 {
        match self.config.grad_accum_dtype {
            Some(Precision::Fp32) => 4,
            _ => self.working_bytes(),
        }
    }

    /// Whether the plan uses fp32 master weights.
    pub fn mixed_precision(&self) -> bool {
        self.config.precision != Precision::Fp32
    }
}

/// The hpZ secondary layout: group `g` holds ranks `[g·size, (g+1)·size)`; inside a group, member
/// `i` keeps slice `i` of `size` equal slices of every gather unit (`unit.len / size` elements).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct HpzLayout {
    /// The group size (`zero_hpz_partition_size`).
    pub size: usize,
}

struct Builder {
    units: Vec<Unit>,
    entries: Vec<Entry>,
    flat: u64,
    shard: u64,
    n: u64,
    align: u64,
}

impl Builder {
    fn push(&mut self, model: &ModelDesc, kind: UnitKind, trainable: bool, params: Vec<usize>) {
        let start = self.entries.len();
        let mut off = 0;
        for &i in &params {
            let k = model.params[i].numel();
            self.entries.push(Entry {
                param: i,
                offset: off,
                numel: k,
            });
            off += k;
        }
        let len = off.div_ceil(self.align) * self.align;
        let first = &model.params[params[0]];
        self.units.push(Unit {
            kind,
            trainable,
            module: first.module.clone(),
            readers: match kind {
                UnitKind::Gather => first.readers.clone(),
                UnitKind::Bucket | UnitKind::Persistent => Vec::new(),
            },
            entries: start..self.entries.len(),
            flat_offset: self.flat,
            numel: off,
            len,
            shard_offset: self.shard,
        });
        self.flat += len;
        self.shard += len / self.n;
    }
}

impl fmt::Display for Plan {
    /// A readable table: the plan's header, every unit, and rank 0's and the last rank's
    /// fragments (the others follow the same pattern).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(
            f,
            "plan: stage {} {:?} world {} ({} node(s) x {}) params {} trainable {} flat {} padding {} shard {}",
            c.stage,
            c.precision,
            self.world_size(),
            self.topology.num_nodes(),
            self.topology.ranks_per_node(),
            self.model.numel(),
            self.model.trainable_numel(),
            self.flat_len(),
            self.padding(),
            self.shard_len,
        )?;
        writeln!(
            f,
            "{:>4}  {:<10} {:<5} {:>10} {:>10} {:>8} {:>8}  params",
            "unit", "kind", "train", "flat_off", "numel", "len", "chunk"
        )?;
        for (u, unit) in self.units.iter().enumerate() {
            let names: Vec<&str> = self
                .unit_entries(u)
                .iter()
                .map(|e| self.model.params[e.param].name.as_str())
                .collect();
            let shown = if names.len() > 4 {
                format!(
                    "{}, {} … {} ({} params)",
                    names[0],
                    names[1],
                    names[names.len() - 1],
                    names.len()
                )
            } else {
                names.join(", ")
            };
            writeln!(
                f,
                "{u:>4}  {:<10} {:<5} {:>10} {:>10} {:>8} {:>8}  {shown}",
                format!("{:?}", unit.kind).to_lowercase(),
                unit.trainable,
                unit.flat_offset,
                unit.numel,
                unit.len,
                self.chunk_len(u),
            )?;
        }
        let n = self.world_size();
        let ranks: Vec<usize> = if n == 1 { vec![0] } else { vec![0, n - 1] };
        for r in ranks {
            writeln!(f, "rank {r} fragments:")?;
            for fr in self.fragments(r) {
                let p = &self.model.params[fr.param];
                let straddle = if fr.param_range.end - fr.param_range.start < p.numel() {
                    " (split)"
                } else {
                    ""
                };
                writeln!(
                    f,
                    "  unit {:>3} shard[{}..{}) <- {}[{}..{}){straddle}",
                    fr.unit,
                    fr.shard_offset,
                    fr.shard_offset + (fr.param_range.end - fr.param_range.start),
                    p.name,
                    fr.param_range.start,
                    fr.param_range.end,
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ParamDesc;

    fn tiny() -> ModelDesc {
        ModelDesc::new(vec![
            ParamDesc::new("a.w", &[3, 3], "a"),
            ParamDesc::new("a.b", &[3], "a"),
            ParamDesc::new("b.w", &[5], "b"),
        ])
    }

    #[test]
    fn stage1_buckets_go_backward_and_split_straddlers() {
        let cfg = ZeroConfig {
            stage: 1,
            reduce_bucket_size: 8,
            ..Default::default()
        };
        let p = Plan::new(&tiny(), Topology::single_node(2).unwrap(), &cfg).unwrap();
        // backward order: b.w (5) | a.b (3) -> 8 fits; a.w (9) alone.
        assert_eq!(p.units().len(), 2);
        assert_eq!(
            p.unit_entries(0)
                .iter()
                .map(|e| e.param)
                .collect::<Vec<_>>(),
            vec![2, 1]
        );
        assert_eq!(p.units()[0].len, 8);
        assert_eq!(p.units()[1].len, 12);
        let f0 = p.fragments(0);
        let f1 = p.fragments(1);
        // unit 1 (a.w, 9 elements, len 12, chunk 6): rank 0 gets [0..6), rank 1 [6..9).
        assert!(f0.iter().any(|f| f.param == 0 && f.param_range == (0..6)));
        assert!(f1.iter().any(|f| f.param == 0 && f.param_range == (6..9)));
        assert_eq!(p.shard_len(), 4 + 6);
    }

    #[test]
    fn stage3_groups_by_module_and_keeps_small_params_persistent() {
        let cfg = ZeroConfig {
            stage: 3,
            param_persistence_threshold: 3,
            ..Default::default()
        };
        let p = Plan::new(&tiny(), Topology::single_node(2).unwrap(), &cfg).unwrap();
        let kinds: Vec<UnitKind> = p.units().iter().map(|u| u.kind).collect();
        assert_eq!(
            kinds,
            vec![UnitKind::Gather, UnitKind::Gather, UnitKind::Persistent]
        );
        assert_eq!(p.locate(1), Some((2, 0)));
    }
}
