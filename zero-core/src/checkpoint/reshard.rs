//! The reshard map: which element ranges of which saved rank's chunks feed a rank of a new plan.
//!
//! Coordinates are plan-independent: element `e` of parameter `p`. A layout maps it to unit `u`
//! at offset `o = offset(p) + e`, which lies in chunk `⌊o / c_u⌋` (owned by that rank) at
//! `o mod c_u`. For destination rank `s`, each destination unit's chunk is split into parameter
//! pieces by binary search over the unit's entries, each piece is mapped through the source
//! layout and split again at the source's chunk boundaries, and runs that are contiguous on both
//! sides are merged. The cost is `O((pieces + splits) · log P)` per rank; nothing per rank ×
//! per parameter is materialised. The same list serves every state (`w`, `m`, `v`), which share
//! a layout.

use serde::{Deserialize, Serialize};

use super::layout::CkptLayout;
use crate::error::{CheckpointError, Result};

/// Copy `len` elements from offset `src_off` of saved rank `src_rank`'s chunk of unit
/// `src_unit` to offset `dst_off` of the destination rank's chunk of unit `dst_unit`. Offsets
/// count the real elements of a chunk (which start at the chunk's start).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyRun {
    /// The saved rank whose file holds the elements.
    pub src_rank: usize,
    /// The saved unit.
    pub src_unit: usize,
    /// Offset in that rank's chunk of the saved unit.
    pub src_off: u64,
    /// The destination unit.
    pub dst_unit: usize,
    /// Offset in the destination rank's chunk of it.
    pub dst_off: u64,
    /// Elements.
    pub len: u64,
}

/// The copies that fill every real element of `dst_rank`'s chunks under layout `dst` from the
/// shards saved under layout `src`, in destination order (unit, then offset). Both layouts must
/// describe the same parameters (names and sizes are the caller's check); a parameter that `dst`
/// shards but `src` holds in no unit is an error.
pub fn copies(src: &CkptLayout, dst: &CkptLayout, dst_rank: usize) -> Result<Vec<CopyRun>> {
    let loc = src.locations();
    let mut out: Vec<CopyRun> = Vec::new();
    for (v, unit) in dst.units.iter().enumerate() {
        let c = dst.chunk_len(v);
        let lo = dst_rank as u64 * c;
        let hi = (lo + c).min(unit.numel);
        if lo >= hi {
            continue;
        }
        let entries = &unit.entries;
        let first = entries.partition_point(|e| e.offset + e.numel <= lo);
        for e in &entries[first..] {
            if e.offset >= hi {
                break;
            }
            let (s, t) = (e.offset.max(lo), (e.offset + e.numel).min(hi));
            let Some((u, base)) = loc.get(e.param).copied().flatten() else {
                return Err(CheckpointError::NotSharded {
                    param: e.param,
                    name: dst
                        .params
                        .get(e.param)
                        .map(|p| p.name.clone())
                        .unwrap_or_default(),
                }
                .into());
            };
            let cu = src.chunk_len(u);
            // Source offset of the piece's first element, then walk its chunk boundaries.
            let mut o = base + (s - e.offset);
            let mut d = s;
            while d < t {
                let k = o / cu;
                let n = (t - d).min((k + 1) * cu - o);
                push(
                    &mut out,
                    CopyRun {
                        src_rank: k as usize,
                        src_unit: u,
                        src_off: o - k * cu,
                        dst_unit: v,
                        dst_off: d - lo,
                        len: n,
                    },
                );
                o += n;
                d += n;
            }
        }
    }
    Ok(out)
}

/// Appends `c`, merging it into the last copy when both sides continue it.
fn push(out: &mut Vec<CopyRun>, c: CopyRun) {
    if let Some(last) = out.last_mut()
        && last.src_rank == c.src_rank
        && last.src_unit == c.src_unit
        && last.dst_unit == c.dst_unit
        && last.src_off + last.len == c.src_off
        && last.dst_off + last.len == c.dst_off
    {
        last.len += c.len;
        return;
    }
    out.push(c);
}
