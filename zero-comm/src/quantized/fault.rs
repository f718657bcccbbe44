//! How a data failure travels with the wire, so a collective never hangs on it: a rank whose
//! encode fails sends poisoned pieces naming it, every receiver notes the lowest rank named, and
//! each rank ends the call with the same [`Error::Quant`].

use zero_quant::WireLayout;

use crate::error::{Error, Op, Result};

/// Marker of a poisoned wire: a negative quiet NaN (sign, all-ones exponent, top mantissa bit),
/// which is never a valid scale (those are finite and non-negative) nor an identity value (encode
/// rejects non-finite input). The low 22 bits carry the failing rank.
const POISON: u32 = 0xffc0_0000;
const ORIGIN_MASK: u32 = 0x003f_ffff;

/// Where the poison marker of a wire of this layout goes: the first scale, or for the identity
/// codec (no scales) the first value. `None` for an empty tensor (whose encode cannot fail).
fn marker_at(layout: &WireLayout) -> Option<usize> {
    if layout.num_blocks > 0 {
        Some(layout.scales_offset)
    } else if layout.codes_len >= 4 {
        Some(0)
    } else {
        None
    }
}

pub(crate) fn poison(piece: &mut [u8], layout: &WireLayout, origin: usize) {
    piece.fill(0);
    if let Some(at) = marker_at(layout) {
        let bits = POISON | (origin as u32 & ORIGIN_MASK);
        piece[at..at + 4].copy_from_slice(&bits.to_le_bytes());
    }
}

fn poisoned(piece: &[u8], layout: &WireLayout) -> Option<usize> {
    let at = marker_at(layout)?;
    let bytes: [u8; 4] = piece.get(at..at + 4)?.try_into().ok()?;
    let bits = u32::from_le_bytes(bytes);
    (bits & !ORIGIN_MASK == POISON).then_some((bits & ORIGIN_MASK) as usize)
}

/// The data failure seen so far by one rank in one call.
pub(crate) struct Fault {
    op: Op,
    me: usize,
    local: Option<zero_quant::Error>,
    peer: Option<usize>,
}

impl Fault {
    pub(crate) fn new(op: Op, me: usize) -> Self {
        Fault {
            op,
            me,
            local: None,
            peer: None,
        }
    }

    pub(crate) fn local(&mut self, e: zero_quant::Error) {
        self.local.get_or_insert(e);
    }

    fn peer(&mut self, origin: usize) {
        self.peer = Some(self.peer.map_or(origin, |p| p.min(origin)));
    }

    /// The rank to name in poison this rank sends on.
    pub(crate) fn origin(&self) -> Option<usize> {
        if self.local.is_some() {
            Some(self.me)
        } else {
            self.peer
        }
    }

    pub(crate) fn check(&mut self, piece: &[u8], layout: &WireLayout) {
        if let Some(o) = poisoned(piece, layout) {
            self.peer(o);
        }
    }

    pub(crate) fn finish(self) -> Result<()> {
        match (self.local, self.peer) {
            (None, None) => Ok(()),
            (Some(e), _) => Err(Error::Quant {
                op: self.op,
                rank: self.me,
                failed_rank: self.me,
                source: Some(e),
            }),
            (None, Some(o)) => Err(Error::Quant {
                op: self.op,
                rank: self.me,
                failed_rank: o,
                source: None,
            }),
        }
    }
}

pub(crate) fn length(op: Op, rank: usize, expected: usize, got: usize) -> Error {
    Error::LengthMismatch {
        op,
        rank,
        expected,
        got,
    }
}
