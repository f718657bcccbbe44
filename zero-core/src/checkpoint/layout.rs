//! The explicit parameter → unit → offset table of a plan, as the manifest records it, and the
//! plan fingerprint.

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
}

impl CkptLayout {
    /// The layout of `plan`.
    pub fn of(plan: &Plan) -> CkptLayout {
        let units = plan
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
        CkptLayout {
            world_size: plan.world_size(),
            ranks_per_node: plan.topology().ranks_per_node(),
            stage: plan.stage(),
            precision: plan.config().precision,
            hpz_partition_size: plan.config().hpz_partition_size,
            params: plan.model().params.clone(),
            units,
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

    /// For every parameter, its `(unit, offset)`, or `None` when it is in no unit (frozen and
    /// replicated at stages 0–2). `O(P)`.
    pub fn locations(&self) -> Vec<Option<(usize, u64)>> {
        let mut out = vec![None; self.params.len()];
        for (u, unit) in self.units.iter().enumerate() {
            for e in &unit.entries {
                if let Some(slot) = out.get_mut(e.param) {
                    *slot = Some((u, e.offset));
                }
            }
        }
        out
    }

    /// The real elements rank `rank` stores: the sum over units of its real chunk elements.
    pub fn real_elements(&self, rank: usize) -> u64 {
        (0..self.units.len())
            .map(|u| self.real_in_chunk(u, rank))
            .sum()
    }
}

/// A 64-bit FNV-1a fingerprint (hex) of everything that fixes where bytes live: the model, the
/// topology, the whole configuration and the resulting units. Two plans with the same fingerprint
/// lay out every element identically; it guards against mixing checkpoints, not adversaries.
pub fn fingerprint(plan: &Plan) -> String {
    #[derive(Serialize)]
    struct Canon<'a> {
        layout: CkptLayout,
        config: &'a crate::config::ZeroConfig,
    }
    let canon = Canon {
        layout: CkptLayout::of(plan),
        config: plan.config(),
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
