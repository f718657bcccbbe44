//! The explicit parameter → unit → offset table of a plan, as the manifest records it, and the
//! plan fingerprint.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use serde::{Deserialize, Serialize};

use crate::config::Precision;
use crate::model::ParamDesc;
use crate::plan::{Plan, UnitKind};

/// One parameter's place in its unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutEntry {
    /// Index of the parameter in the model.
    pub param: usize,
    /// Offset of its first element in the unit.
    pub offset: u64,
    /// Its element count.
    pub numel: u64,
}

/// One unit: its real and padded length and its entries in offset order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutUnit {
    /// What the unit is for.
    pub kind: UnitKind,
    /// Whether its parameters are trainable.
    pub trainable: bool,
    /// Real (unpadded) elements.
    pub numel: u64,
    /// Padded length (a multiple of `2·N`).
    pub len: u64,
    /// The parameters, in increasing offset.
    pub entries: Vec<LayoutEntry>,
}

/// A parameter in no unit (frozen and replicated at stages 0–2): every rank holds it whole, and
/// one rank saves it whole, as the tensor [`Saved::Loose`] of its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LooseParam {
    /// Index of the parameter.
    pub param: usize,
    /// Its element count.
    pub numel: u64,
    /// The rank whose file holds it.
    pub rank: usize,
}

/// A tensor of a rank file: a unit's chunk, or a loose parameter held whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Saved {
    /// The rank's chunk of unit `u` (its real elements).
    Unit(usize),
    /// Parameter `p`, in no unit, whole.
    Loose(usize),
}

/// Where a parameter's saved elements are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// In unit `unit` from `offset`: element `e` lies in the chunk of rank
    /// `⌊(offset + e) / chunk_len⌋`.
    Unit {
        /// The unit.
        unit: usize,
        /// Offset of the parameter's first element in the unit.
        offset: u64,
    },
    /// Whole, in the file of `rank`.
    Loose {
        /// The rank.
        rank: usize,
    },
}

/// Everything a loader needs to know about the layout a checkpoint was saved with, without
/// re-running the planner that made it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CkptLayout {
    /// Number of ranks.
    pub world_size: usize,
    /// Ranks per node.
    pub ranks_per_node: usize,
    /// ZeRO stage.
    pub stage: u8,
    /// Working precision.
    pub precision: Precision,
    /// hpZ group size (1 = off).
    pub hpz_partition_size: usize,
    /// The model's parameters in forward order.
    pub params: Vec<ParamDesc>,
    /// The units in flat order.
    pub units: Vec<LayoutUnit>,
    /// The parameters in no unit, by index, each with the rank that saves it (spread over the
    /// ranks greedily by size). Empty, and then absent from the JSON, when every parameter is in
    /// a unit, so the fingerprints of such plans are unchanged by this field.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub loose: Vec<LooseParam>,
}

impl CkptLayout {
    /// The layout of `plan`.
    pub fn of(plan: &Plan) -> CkptLayout {
        let units: Vec<LayoutUnit> = plan
            .units()
            .iter()
            .enumerate()
            .map(|(u, unit)| LayoutUnit {
                kind: unit.kind,
                trainable: unit.trainable,
                numel: unit.numel,
                len: unit.len,
                entries: plan
                    .unit_entries(u)
                    .iter()
                    .map(|e| LayoutEntry {
                        param: e.param,
                        offset: e.offset,
                        numel: e.numel,
                    })
                    .collect(),
            })
            .collect();
        let loose = spread_loose(plan, &units);
        CkptLayout {
            world_size: plan.world_size(),
            ranks_per_node: plan.topology().ranks_per_node(),
            stage: plan.stage(),
            precision: plan.config().precision,
            hpz_partition_size: plan.config().hpz_partition_size,
            params: plan.model().params.clone(),
            units,
            loose,
        }
    }

    /// The chunk length of unit `u` (elements each rank owns, padding included).
    pub fn chunk_len(&self, u: usize) -> u64 {
        self.units[u].len / self.world_size as u64
    }

    /// Real elements of `rank`'s chunk of unit `u`.
    pub fn real_in_chunk(&self, u: usize, rank: usize) -> u64 {
        let c = self.chunk_len(u);
        self.units[u].numel.saturating_sub(rank as u64 * c).min(c)
    }

    /// For every parameter, where its saved elements are, or `None` when the layout saves it
    /// nowhere (a layout that lists neither a unit entry nor a loose record for it). `O(P)`.
    pub fn locations(&self) -> Vec<Option<Place>> {
        let mut out = vec![None; self.params.len()];
        for (u, unit) in self.units.iter().enumerate() {
            for e in &unit.entries {
                if let Some(slot) = out.get_mut(e.param) {
                    *slot = Some(Place::Unit {
                        unit: u,
                        offset: e.offset,
                    });
                }
            }
        }
        for l in &self.loose {
            if let Some(slot) = out.get_mut(l.param) {
                *slot = Some(Place::Loose { rank: l.rank });
            }
        }
        out
    }

    /// Checks that the layout describes a checkpoint its readers can index without panicking:
    /// a world of at least one rank, units padded to whole chunks with their entries in offset
    /// order inside them, each of the right size, and every parameter saved exactly once (a unit
    /// entry or a loose record of a rank of the world, the loose records in parameter order). The first problem, in words.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.world_size == 0 || self.ranks_per_node == 0 {
            return Err(format!(
                "world size {} with {} ranks per node",
                self.world_size, self.ranks_per_node
            ));
        }
        let n = self.world_size as u64;
        let mut placed = vec![0u32; self.params.len()];
        let mut place = |p: usize, numel: u64, what: &dyn Fn() -> String| match (
            self.params.get(p),
            placed.get_mut(p),
        ) {
            (Some(d), Some(k)) if d.numel() == numel => {
                *k += 1;
                Ok(())
            }
            (Some(d), _) => Err(format!(
                "{}: {numel} elements of {} ({} elements)",
                what(),
                d.name,
                d.numel()
            )),
            _ => Err(format!(
                "{}: parameter {p} of {}",
                what(),
                self.params.len()
            )),
        };
        for (u, unit) in self.units.iter().enumerate() {
            if unit.len % n != 0 || unit.numel > unit.len {
                return Err(format!(
                    "unit {u}: {} real elements in {} for {n} ranks",
                    unit.numel, unit.len
                ));
            }
            let mut end = 0;
            for e in &unit.entries {
                if e.offset < end || e.offset + e.numel > unit.numel {
                    return Err(format!(
                        "unit {u}: an entry at {}..{} out of order or outside its {} elements",
                        e.offset,
                        e.offset + e.numel,
                        unit.numel
                    ));
                }
                end = e.offset + e.numel;
                place(e.param, e.numel, &|| format!("unit {u}"))?;
            }
        }
        if self.loose.windows(2).any(|w| w[0].param >= w[1].param) {
            return Err("loose records out of parameter order".into());
        }
        for l in &self.loose {
            if l.rank >= self.world_size {
                return Err(format!(
                    "loose parameter {} saved by rank {} of {}",
                    l.param, l.rank, self.world_size
                ));
            }
            place(l.param, l.numel, &|| "a loose record".to_string())?;
        }
        match placed.iter().position(|&k| k != 1) {
            Some(p) => Err(format!(
                "parameter {} ({}) is saved {} times, expected once",
                p, self.params[p].name, placed[p]
            )),
            None => Ok(()),
        }
    }

    /// The elements of tensor `t` in `rank`'s file: the real elements of its chunk of a unit, or
    /// a loose parameter's whole length in its holder's file (0 in every other file).
    pub fn saved_len(&self, t: Saved, rank: usize) -> u64 {
        match t {
            Saved::Unit(u) => self.real_in_chunk(u, rank),
            // `loose` is listed by parameter index.
            Saved::Loose(p) => self
                .loose
                .binary_search_by_key(&p, |l| l.param)
                .ok()
                .map(|i| self.loose[i])
                .filter(|l| l.rank == rank)
                .map_or(0, |l| l.numel),
        }
    }

    /// The weight elements rank `rank` saves: its real chunk elements of every unit and the
    /// loose parameters it holds.
    pub fn real_elements(&self, rank: usize) -> u64 {
        let units: u64 = (0..self.units.len())
            .map(|u| self.real_in_chunk(u, rank))
            .sum();
        let loose: u64 = self
            .loose
            .iter()
            .filter(|l| l.rank == rank)
            .map(|l| l.numel)
            .sum();
        units + loose
    }
}

/// The parameters of `plan` in no unit, each given to the rank holding the fewest loose elements
/// so far, largest first (ties: the lower parameter index, then the lower rank), listed by index.
/// Deterministic, so every rank computes the same table.
fn spread_loose(plan: &Plan, units: &[LayoutUnit]) -> Vec<LooseParam> {
    let params = &plan.model().params;
    let mut in_unit = vec![false; params.len()];
    for e in units.iter().flat_map(|u| &u.entries) {
        if let Some(slot) = in_unit.get_mut(e.param) {
            *slot = true;
        }
    }
    let mut todo: Vec<(usize, u64)> = (0..params.len())
        .filter(|&p| !in_unit[p])
        .map(|p| (p, params[p].numel()))
        .collect();
    todo.sort_by_key(|&(p, n)| (Reverse(n), p));
    // The ranks by (elements held, rank), least first: O(log N) per parameter.
    let mut ranks: BinaryHeap<Reverse<(u64, usize)>> = (0..plan.world_size().max(1))
        .map(|r| Reverse((0, r)))
        .collect();
    let mut out: Vec<LooseParam> = todo
        .into_iter()
        .map(|(param, numel)| {
            let Reverse((held, rank)) = ranks.pop().unwrap_or(Reverse((0, 0)));
            ranks.push(Reverse((held + numel, rank)));
            LooseParam { param, numel, rank }
        })
        .collect();
    out.sort_by_key(|l| l.param);
    out
}

/// A 64-bit FNV-1a fingerprint (hex) of everything that fixes where bytes live: the model, the
/// topology, the whole configuration but the placements (device, host memory or NVMe, with the
/// store's folder and ring, which change no byte of a checkpoint) and the resulting units. Two plans with the same fingerprint
/// lay out every element identically; it guards against mixing checkpoints, not adversaries.
pub fn fingerprint(plan: &Plan) -> String {
    #[derive(Serialize)]
    struct Canon {
        layout: CkptLayout,
        config: crate::config::ZeroConfig,
    }
    let canon = Canon {
        layout: CkptLayout::of(plan),
        config: crate::config::ZeroConfig {
            optimizer_placement: crate::config::Placement::Device,
            param_placement: crate::config::Placement::Device,
            nvme_path: None,
            offload_buffer_count: crate::config::ZeroConfig::default().offload_buffer_count,
            ..plan.config().clone()
        },
    };
    // Serialising plain data types to a `Vec` cannot fail.
    let bytes = serde_json::to_vec(&canon).unwrap_or_default();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Placement, ZeroConfig};
    use crate::{ModelDesc, ParamDesc, Topology};

    /// Where the state lives changes no byte of a checkpoint, so not the fingerprint; the stage
    /// does.
    #[test]
    fn the_fingerprint_ignores_placements_but_not_the_stage() {
        let model = ModelDesc::new(vec![ParamDesc::new("w", &[40, 5], "m")]);
        let print = |c: &ZeroConfig| {
            fingerprint(&Plan::new(&model, Topology::new(2, 2).unwrap(), c).unwrap())
        };
        let device = ZeroConfig {
            stage: 3,
            ..ZeroConfig::default()
        };
        let offloaded = ZeroConfig {
            optimizer_placement: Placement::Nvme,
            param_placement: Placement::Host,
            nvme_path: Some("/scratch".into()),
            offload_buffer_count: 7,
            ..device.clone()
        };
        assert_eq!(print(&device), print(&offloaded));
        let stage2 = ZeroConfig {
            stage: 2,
            ..device.clone()
        };
        assert_ne!(print(&device), print(&stage2));
    }
}
