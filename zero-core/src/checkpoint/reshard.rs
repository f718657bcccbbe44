//! The reshard map: which element ranges of which saved rank's tensors feed a rank of a new plan.
//!
//! Coordinates are plan-independent: element `e` of parameter `p`. A layout maps it to unit `u`
//! at offset `o = offset(p) + e`, which lies in chunk `⌊o / c_u⌋` (owned by that rank) at
//! `o mod c_u`; or, for a parameter in no unit (frozen at stages 0–2), to the rank that saves it
//! whole, at `e`. For destination rank `s`, each destination unit's chunk is split into
//! parameter pieces by binary search over the unit's entries, each piece is mapped through the
//! source layout and split again at the source's chunk boundaries, and runs that are contiguous
//! on both sides are merged. The cost is `O((pieces + splits) · log P)` per rank; nothing per
//! rank × per parameter is materialised. The same list serves every state (`w`, `m`, `v`), which
//! share a layout. A destination's loose parameters, which every rank holds whole, are mapped the
//! same way ([`loose_copies`]).

use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::layout::{CkptLayout, Place, Saved};
use crate::error::{CheckpointError, Result};

/// Copy `len` elements from offset `src_off` of tensor `src` of saved rank `src_rank`'s file to
/// offset `dst_off` of the destination rank's chunk of unit `dst_unit`. Offsets count the real
/// elements of a chunk (which start at the chunk's start), or a loose parameter's elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyRun {
    /// The saved rank whose file holds the elements.
    pub src_rank: usize,
    /// The saved tensor: that rank's chunk of a unit, or a loose parameter.
    pub src: Saved,
    /// Offset in that tensor.
    pub src_off: u64,
    /// The destination unit.
    pub dst_unit: usize,
    /// Offset in the destination rank's chunk of it.
    pub dst_off: u64,
    /// Elements.
    pub len: u64,
}

/// `len` elements of a parameter, from its element `elem` on, saved in tensor `src` of rank
/// `src_rank`'s file from offset `src_off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The saved rank whose file holds them.
    pub src_rank: usize,
    /// The tensor.
    pub src: Saved,
    /// Offset in the tensor.
    pub src_off: u64,
    /// Offset in the parameter.
    pub elem: u64,
    /// Elements.
    pub len: u64,
}

/// Where a saved layout keeps each parameter's elements: the table is built once (`O(P)`), each
/// query costs its pieces.
#[derive(Debug)]
pub struct Locator<'a> {
    layout: &'a CkptLayout,
    places: Vec<Option<Place>>,
}

impl<'a> Locator<'a> {
    /// The locator of `layout`.
    pub fn new(layout: &'a CkptLayout) -> Self {
        Locator {
            layout,
            places: layout.locations(),
        }
    }

    /// Calls `emit` for each saved piece of elements `elems` of parameter `param`, in element
    /// order. A parameter the layout saves nowhere is an error.
    pub fn pieces(
        &self,
        param: usize,
        elems: Range<u64>,
        mut emit: impl FnMut(Piece),
    ) -> Result<()> {
        let Some(place) = self.places.get(param).copied().flatten() else {
            return Err(CheckpointError::NotSharded {
                param,
                name: self
                    .layout
                    .params
                    .get(param)
                    .map(|p| p.name.clone())
                    .unwrap_or_default(),
            }
            .into());
        };
        match place {
            Place::Loose { rank } => emit(Piece {
                src_rank: rank,
                src: Saved::Loose(param),
                src_off: elems.start,
                elem: elems.start,
                len: elems.end.saturating_sub(elems.start),
            }),
            Place::Unit { unit, offset } => {
                let cu = self.layout.chunk_len(unit).max(1);
                // Walk the unit's chunk boundaries from the piece's first element.
                let mut o = offset + elems.start;
                let mut d = elems.start;
                while d < elems.end {
                    let k = o / cu;
                    let n = (elems.end - d).min((k + 1) * cu - o);
                    emit(Piece {
                        src_rank: k as usize,
                        src: Saved::Unit(unit),
                        src_off: o - k * cu,
                        elem: d,
                        len: n,
                    });
                    o += n;
                    d += n;
                }
            }
        }
        Ok(())
    }
}

/// The copies that fill every real element of `dst_rank`'s chunks under layout `dst` from the
/// tensors saved under layout `src`, in destination order (unit, then offset). Both layouts must
/// describe the same parameters (names and sizes are the caller's check); a parameter that `dst`
/// puts in a unit but `src` saves nowhere is an error.
pub fn copies(src: &CkptLayout, dst: &CkptLayout, dst_rank: usize) -> Result<Vec<CopyRun>> {
    let at = Locator::new(src);
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
            at.pieces(e.param, s - e.offset..t - e.offset, |p| {
                push(
                    &mut out,
                    CopyRun {
                        src_rank: p.src_rank,
                        src: p.src,
                        src_off: p.src_off,
                        dst_unit: v,
                        dst_off: e.offset + p.elem - lo,
                        len: p.len,
                    },
                );
            })?;
        }
    }
    Ok(out)
}

/// For every loose parameter of `dst` (in no unit; every rank holds it whole), in index order:
/// the pieces of `src`'s tensors that make it up, in element order.
pub fn loose_copies(src: &CkptLayout, dst: &CkptLayout) -> Result<Vec<(usize, Vec<Piece>)>> {
    let at = Locator::new(src);
    dst.loose
        .iter()
        .map(|l| {
            let mut pieces = Vec::new();
            at.pieces(l.param, 0..l.numel, |p| pieces.push(p))?;
            Ok((l.param, pieces))
        })
        .collect()
}

/// Appends `c`, merging it into the last copy when both sides continue it.
fn push(out: &mut Vec<CopyRun>, c: CopyRun) {
    if let Some(last) = out.last_mut()
        && last.src_rank == c.src_rank
        && last.src == c.src
        && last.dst_unit == c.dst_unit
        && last.src_off + last.len == c.src_off
        && last.dst_off + last.len == c.dst_off
    {
        last.len += c.len;
        return;
    }
    out.push(c);
}
