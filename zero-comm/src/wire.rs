//! The wire encoding of call descriptors, for the backends whose ranks live in other processes
//! (NCCL, MPI): each op first all-gathers every rank's encoded descriptor, then runs the checks of
//! [`crate::validate`] on all of them. The descriptors themselves, their checks and the logical
//! traffic of a call live there, shared with the loopbacks.
//!
//! Pure Rust, built with or without those backends' features so that plain `cargo test` checks it.

#![cfg_attr(not(any(feature = "nccl", feature = "mpi")), allow(dead_code))]

use zero_core::Collective;

use crate::element::{DType, ReduceOp};
use crate::error::{Error, Op, Result};

use crate::validate::Desc;

/// Size of an encoded [`Desc`].
pub(crate) const DESC_BYTES: usize = 64;
const DESC_MAGIC: u64 = 0x5a45_524f_4445_5343; // "ZERODESC"

fn op_code(op: Op) -> u8 {
    match op {
        Op::Collective(Collective::AllGather) => 1,
        Op::Collective(Collective::ReduceScatter) => 2,
        Op::Collective(Collective::AllReduce) => 3,
        Op::Collective(Collective::Broadcast) => 4,
        Op::Collective(Collective::AllToAll) => 5,
        Op::Collective(Collective::Barrier) => 6,
        Op::Split => 7,
    }
}

fn op_from(code: u8) -> Option<Op> {
    Some(match code {
        1 => Collective::AllGather.into(),
        2 => Collective::ReduceScatter.into(),
        3 => Collective::AllReduce.into(),
        4 => Collective::Broadcast.into(),
        5 => Collective::AllToAll.into(),
        6 => Collective::Barrier.into(),
        7 => Op::Split,
        _ => return None,
    })
}

fn dtype_code(d: Option<DType>) -> u8 {
    match d {
        None => 0,
        Some(DType::F32) => 1,
        Some(DType::BF16) => 2,
        Some(DType::F16) => 3,
        Some(DType::U8) => 4,
    }
}

fn dtype_from(code: u8) -> Option<Option<DType>> {
    Some(match code {
        0 => None,
        1 => Some(DType::F32),
        2 => Some(DType::BF16),
        3 => Some(DType::F16),
        4 => Some(DType::U8),
        _ => return None,
    })
}

fn reduce_code(r: Option<ReduceOp>) -> u8 {
    match r {
        None => 0,
        Some(ReduceOp::Sum) => 1,
        Some(ReduceOp::Mean) => 2,
    }
}

fn reduce_from(code: u8) -> Option<Option<ReduceOp>> {
    Some(match code {
        0 => None,
        1 => Some(ReduceOp::Sum),
        2 => Some(ReduceOp::Mean),
        _ => return None,
    })
}

impl Desc {
    /// Fixed little-endian layout: magic, packed codes, root + 1 (0: none), send, recv, color, key.
    pub(crate) fn to_bytes(self) -> [u8; DESC_BYTES] {
        let codes = u64::from(op_code(self.op))
            | u64::from(dtype_code(self.dtype)) << 8
            | u64::from(reduce_code(self.reduce)) << 16
            | u64::from(self.in_place) << 24;
        let words = [
            DESC_MAGIC,
            codes,
            self.root.map_or(0, |r| r as u64 + 1),
            self.send_len as u64,
            self.recv_len as u64,
            self.color as u64,
            self.key as u64,
            0,
        ];
        let mut out = [0u8; DESC_BYTES];
        for (chunk, w) in out.chunks_exact_mut(8).zip(words) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        out
    }

    /// Decodes what [`to_bytes`](Self::to_bytes) wrote; `from` names the sender in errors.
    pub(crate) fn from_bytes(bytes: &[u8], from: usize) -> Result<Desc> {
        let corrupt = |what: &str| {
            Error::Backend(format!(
                "the call descriptor received from rank {from} is corrupt ({what}); \
                 did it call another op?"
            ))
        };
        if bytes.len() != DESC_BYTES {
            return Err(corrupt("length"));
        }
        let mut w = [0u64; DESC_BYTES / 8];
        for (x, chunk) in w.iter_mut().zip(bytes.chunks_exact(8)) {
            let mut b = [0u8; 8];
            b.copy_from_slice(chunk);
            *x = u64::from_le_bytes(b);
        }
        if w[0] != DESC_MAGIC {
            return Err(corrupt("magic"));
        }
        let byte = |i: u32| (w[1] >> (8 * i)) as u8;
        let to_usize = |v: u64| usize::try_from(v).map_err(|_| corrupt("length overflow"));
        Ok(Desc {
            op: op_from(byte(0)).ok_or_else(|| corrupt("op"))?,
            dtype: dtype_from(byte(1)).ok_or_else(|| corrupt("dtype"))?,
            reduce: reduce_from(byte(2)).ok_or_else(|| corrupt("reduction"))?,
            in_place: match byte(3) {
                0 => false,
                1 => true,
                _ => return Err(corrupt("in-place flag")),
            },
            root: match w[2] {
                0 => None,
                r => Some(to_usize(r - 1)?),
            },
            send_len: to_usize(w[3])?,
            recv_len: to_usize(w[4])?,
            color: to_usize(w[5])?,
            key: to_usize(w[6])?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip() {
        let all = [
            Desc::new(Collective::Barrier),
            Desc::of(Collective::ReduceScatter, DType::BF16, 12, 3).reduce(ReduceOp::Mean),
            Desc {
                in_place: true,
                ..Desc::of(Collective::AllGather, DType::U8, 2, 8)
            },
            Desc::of(Collective::Broadcast, DType::F16, 5, 5).root(0),
            Desc {
                color: 3,
                key: usize::MAX >> 1,
                ..Desc::new(Op::Split)
            },
        ];
        for d in all {
            assert_eq!(Desc::from_bytes(&d.to_bytes(), 0).unwrap(), d);
        }
        let mut bad = all[1].to_bytes();
        bad[0] ^= 1;
        let e = Desc::from_bytes(&bad, 3).unwrap_err().to_string();
        assert!(e.contains("rank 3") && e.contains("magic"), "{e}");
    }
}
