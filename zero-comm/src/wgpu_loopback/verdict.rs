//! Checks every rank runs identically over every rank's call descriptor, before anything moves.
//!
//! The same checks, in the same order and with the same messages, as the host loopback's, so both
//! backends reject a bad call with the same error (the tests compare them).

use crate::element::{DType, ReduceOp};
use crate::error::{Error, Op, Result};

use super::rendezvous::Call;

pub(super) struct Verdict<'a> {
    pub(super) calls: &'a [Call],
    pub(super) members: &'a [usize],
}

impl Verdict<'_> {
    fn n(&self) -> usize {
        self.calls.len()
    }

    fn op(&self) -> Op {
        self.calls[0].op
    }

    fn mismatch(&self, peer: usize, detail: String) -> Error {
        Error::PeerMismatch {
            op: self.op(),
            rank: self.members[0],
            peer: self.members[peer],
            detail,
        }
    }

    /// A length error for group rank `rank`.
    pub(super) fn length(&self, rank: usize, expected: usize, got: usize) -> Error {
        Error::LengthMismatch {
            op: self.op(),
            rank: self.members[rank],
            expected,
            got,
        }
    }

    /// Op, dtype, reduction and root agree with rank 0's; the dtype reduces if it must; the root is
    /// in range.
    pub(super) fn common(&self) -> Result<()> {
        let c0 = &self.calls[0];
        let g0 = self.members[0];
        for (j, c) in self.calls.iter().enumerate().skip(1) {
            let gj = self.members[j];
            if c.op != c0.op {
                return Err(self.mismatch(
                    j,
                    format!("rank {gj} called {}, rank {g0} called {}", c.op, c0.op),
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
            && root >= self.n()
        {
            return Err(Error::InvalidRoot {
                op: c0.op,
                root,
                world_size: self.n(),
            });
        }
        Ok(())
    }

    /// The length selected by `f` is equal on every rank.
    pub(super) fn equal(&self, what: &str, f: impl Fn(&Call) -> usize) -> Result<()> {
        let v0 = f(&self.calls[0]);
        match self.calls.iter().position(|c| f(c) != v0) {
            None => Ok(()),
            Some(j) => Err(self.mismatch(
                j,
                format!(
                    "{what} of {} elements on rank {}, {v0} on rank {}",
                    f(&self.calls[j]),
                    self.members[j],
                    self.members[0]
                ),
            )),
        }
    }
}
