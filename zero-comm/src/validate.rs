//! The backend-neutral part of every collective: the call descriptor each rank passes, the checks
//! every rank runs over every rank's descriptor before anything moves, the all-reduce chunking and
//! the traffic accounting.
//!
//! Every backend (host loopback, wgpu loopback, NCCL) validates through [`validate`], so a call
//! rejected by one is rejected by the others with the same [`Error`] and message.

use zero_core::{Collective, CollectiveTraffic, Topology};

use crate::element::{DType, ReduceOp};
use crate::error::{Error, Op, Result};

/// What one rank passes to one op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Desc {
    pub(crate) op: Op,
    pub(crate) dtype: Option<DType>,
    pub(crate) reduce: Option<ReduceOp>,
    pub(crate) root: Option<usize>,
    /// All-gather: the chunk; reduce-scatter, all-reduce, broadcast, all-to-all: the input length.
    pub(crate) send_len: usize,
    /// Elements of the output buffer.
    pub(crate) recv_len: usize,
    /// In-place all-gather: the input sits inside the output buffer at `rank · c`.
    pub(crate) in_place: bool,
    pub(crate) color: usize,
    pub(crate) key: usize,
}

impl Desc {
    pub(crate) fn new(op: impl Into<Op>) -> Desc {
        Desc {
            op: op.into(),
            dtype: None,
            reduce: None,
            root: None,
            send_len: 0,
            recv_len: 0,
            in_place: false,
            color: 0,
            key: 0,
        }
    }

    /// A collective on `dtype` elements, `send_len` and `recv_len` as the fields say.
    pub(crate) fn of(op: impl Into<Op>, dtype: DType, send_len: usize, recv_len: usize) -> Desc {
        Desc {
            dtype: Some(dtype),
            send_len,
            recv_len,
            ..Desc::new(op)
        }
    }

    /// This descriptor, reducing with `op`.
    pub(crate) fn reduce(self, op: ReduceOp) -> Desc {
        Desc {
            reduce: Some(op),
            ..self
        }
    }

    /// This descriptor, from root `root`.
    pub(crate) fn root(self, root: usize) -> Desc {
        Desc {
            root: Some(root),
            ..self
        }
    }
}

/// Rounds `len` up to a multiple of `n`.
fn round_up(len: usize, n: usize) -> usize {
    len.div_ceil(n) * n
}

/// Chunk `k` of an all-reduce of `len` over `n`: `(offset, length)`.
pub(crate) fn ar_chunk(len: usize, n: usize, k: usize) -> (usize, usize) {
    let (q, r) = (len / n, len % n);
    (k * q + k.min(r), q + usize::from(k < r))
}

/// The checks of one op over the descriptors `calls` of group ranks whose global ranks are
/// `ranks`, in a group of `n` ranks.
///
/// With every rank's descriptor (`calls.len() == n`) every rank reaches the same verdict. With only
/// this rank's (`calls.len() == 1`), it checks what one rank can know alone: its own lengths, the
/// root, the dtype.
pub(crate) fn validate(calls: &[Desc], ranks: &[usize], n: usize) -> Result<()> {
    debug_assert_eq!(calls.len(), ranks.len());
    let v = Verdict { calls, ranks, n };
    v.common()?;
    let c0 = &calls[0];
    match c0.op {
        Op::Collective(Collective::AllGather) => {
            for (j, c) in calls.iter().enumerate() {
                if c.in_place && !c.recv_len.is_multiple_of(n) {
                    return Err(v.length(j, round_up(c.recv_len, n), c.recv_len));
                }
                if !c.in_place && c.recv_len != n * c.send_len {
                    return Err(v.length(j, n * c.send_len, c.recv_len));
                }
            }
            v.equal("a chunk", |c| c.send_len)
        }
        Op::Collective(Collective::ReduceScatter) => {
            for (j, c) in calls.iter().enumerate() {
                if c.send_len != n * c.recv_len {
                    return Err(v.length(j, n * c.recv_len, c.send_len));
                }
            }
            v.equal("an output", |c| c.recv_len)
        }
        Op::Collective(Collective::AllReduce) | Op::Collective(Collective::Broadcast) => {
            v.equal("a buffer", |c| c.send_len)
        }
        Op::Collective(Collective::AllToAll) => {
            for (j, c) in calls.iter().enumerate() {
                if !c.send_len.is_multiple_of(n) {
                    return Err(v.length(j, round_up(c.send_len, n), c.send_len));
                }
                if c.recv_len != c.send_len {
                    return Err(v.length(j, c.send_len, c.recv_len));
                }
            }
            v.equal("a buffer", |c| c.send_len)
        }
        Op::Collective(Collective::Barrier) | Op::Split => Ok(()),
    }
}

struct Verdict<'a> {
    calls: &'a [Desc],
    ranks: &'a [usize],
    n: usize,
}

impl Verdict<'_> {
    fn op(&self) -> Op {
        self.calls[0].op
    }

    fn mismatch(&self, peer: usize, detail: String) -> Error {
        Error::PeerMismatch {
            op: self.op(),
            rank: self.ranks[0],
            peer: self.ranks[peer],
            detail,
        }
    }

    fn length(&self, j: usize, expected: usize, got: usize) -> Error {
        Error::LengthMismatch {
            op: self.op(),
            rank: self.ranks[j],
            expected,
            got,
        }
    }

    /// Op, dtype, reduction and root agree with rank 0's; the dtype reduces if it must; the root is
    /// in range.
    fn common(&self) -> Result<()> {
        let c0 = &self.calls[0];
        let g0 = self.ranks[0];
        for (j, c) in self.calls.iter().enumerate().skip(1) {
            let gj = self.ranks[j];
            if c.op != c0.op {
                return Err(self.mismatch(
                    j,
                    format!(
                        "rank {gj} called {}, rank {g0} called {}",
                        c.op.name(),
                        c0.op.name()
                    ),
                ));
            }
            if c.dtype != c0.dtype {
                let d = |d: Option<DType>| d.map_or("none", DType::name);
                return Err(self.mismatch(
                    j,
                    format!(
                        "dtype {} on rank {gj}, {} on rank {g0}",
                        d(c.dtype),
                        d(c0.dtype)
                    ),
                ));
            }
            if c.reduce != c0.reduce {
                let r = |r: Option<ReduceOp>| r.map_or("none", ReduceOp::name);
                return Err(self.mismatch(
                    j,
                    format!(
                        "reduction {} on rank {gj}, {} on rank {g0}",
                        r(c.reduce),
                        r(c0.reduce)
                    ),
                ));
            }
            if c.root != c0.root {
                let r = |r: Option<usize>| r.map_or("none".to_string(), |r| r.to_string());
                return Err(self.mismatch(
                    j,
                    format!(
                        "root {} on rank {gj}, {} on rank {g0}",
                        r(c.root),
                        r(c0.root)
                    ),
                ));
            }
        }
        if c0.reduce.is_some()
            && let Some(dtype) = c0.dtype
            && !dtype.is_reducible()
        {
            return Err(Error::UnsupportedReduce { op: c0.op, dtype });
        }
        if let Some(root) = c0.root
            && root >= self.n
        {
            return Err(Error::InvalidRoot {
                op: c0.op,
                root,
                world_size: self.n,
            });
        }
        Ok(())
    }

    /// The length selected by `f` is equal on every rank.
    fn equal(&self, what: &str, f: impl Fn(&Desc) -> usize) -> Result<()> {
        let v0 = f(&self.calls[0]);
        match self.calls.iter().position(|c| f(c) != v0) {
            None => Ok(()),
            Some(j) => Err(self.mismatch(
                j,
                format!(
                    "{what} of {} elements on rank {}, {v0} on rank {}",
                    f(&self.calls[j]),
                    self.ranks[j],
                    self.ranks[0]
                ),
            )),
        }
    }
}

/// The traffic of one call as the loopbacks measure it, from the elements actually read: this rank
/// (group rank `me` of `members`) read `read_from[j]` elements from group rank `j`, and group rank
/// `j` read `read_by(j)` elements from this rank. Classified by the link between the two global
/// ranks; see [`zero_core::traffic`] for the convention.
pub(crate) fn tally(
    topology: &Topology,
    members: &[usize],
    me: usize,
    elem_bytes: usize,
    read_from: &[u64],
    read_by: impl Fn(usize) -> u64,
) -> CollectiveTraffic {
    let eb = elem_bytes as u64;
    let mut t = CollectiveTraffic {
        calls: 1,
        ..Default::default()
    };
    for (j, &peer) in members.iter().enumerate() {
        if j == me {
            continue;
        }
        let class = topology.link_class(members[me], peer);
        t.received.add_class(class, read_from[j] * eb);
        t.sent.add_class(class, read_by(j) * eb);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_reduce_chunks_tile_the_buffer() {
        for len in 0..40 {
            for n in 1..9 {
                let mut next = 0;
                for k in 0..n {
                    let (off, l) = ar_chunk(len, n, k);
                    assert_eq!(off, next);
                    next += l;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn local_checks_catch_bad_lengths_roots_and_dtypes() {
        let n = 4;
        let ag = Desc::of(Collective::AllGather, DType::F32, 3, 11);
        match validate(&[ag], &[5], n).unwrap_err() {
            Error::LengthMismatch {
                rank: 5,
                expected: 12,
                got: 11,
                ..
            } => {}
            e => panic!("{e}"),
        }
        let rs = Desc::of(Collective::ReduceScatter, DType::U8, 8, 2).reduce(ReduceOp::Sum);
        assert!(matches!(
            validate(&[rs], &[0], n),
            Err(Error::UnsupportedReduce {
                dtype: DType::U8,
                ..
            })
        ));
        let bc = Desc::of(Collective::Broadcast, DType::F32, 1, 1).root(4);
        assert!(matches!(
            validate(&[bc], &[0], n),
            Err(Error::InvalidRoot {
                root: 4,
                world_size: 4,
                ..
            })
        ));
        let a2a = Desc::of(Collective::AllToAll, DType::F16, 6, 6);
        assert!(matches!(
            validate(&[a2a], &[0], n),
            Err(Error::LengthMismatch { expected: 8, .. })
        ));
        let ip = Desc {
            in_place: true,
            ..Desc::of(Collective::AllGather, DType::F32, 2, 8)
        };
        validate(&[ip], &[0], n).unwrap();
    }

    #[test]
    fn peer_checks_report_the_first_disagreement_by_global_rank() {
        let ranks = [4, 5, 6];
        let a = Desc::of(Collective::AllReduce, DType::F32, 10, 10).reduce(ReduceOp::Sum);
        let b = Desc { send_len: 9, ..a };
        match validate(&[a, a, b], &ranks, 3).unwrap_err() {
            Error::PeerMismatch {
                rank: 4,
                peer: 6,
                detail,
                ..
            } => assert_eq!(detail, "a buffer of 9 elements on rank 6, 10 on rank 4"),
            e => panic!("{e}"),
        }
        let c = Desc {
            reduce: Some(ReduceOp::Mean),
            ..a
        };
        match validate(&[a, c, a], &ranks, 3).unwrap_err() {
            Error::PeerMismatch {
                peer: 5, detail, ..
            } => {
                assert_eq!(detail, "reduction mean on rank 5, sum on rank 4")
            }
            e => panic!("{e}"),
        }
        let other = Desc::of(Collective::AllGather, DType::F32, 10, 30);
        match validate(&[a, a, other], &ranks, 3).unwrap_err() {
            Error::PeerMismatch { detail, .. } => {
                assert_eq!(detail, "rank 6 called all_gather, rank 4 called all_reduce")
            }
            e => panic!("{e}"),
        }
    }
}
