//! The crate's error type. Every message names the operation and the values involved.

use std::fmt;
use std::time::Duration;

use zero_core::Collective;

use crate::element::DType;

/// An operation of a communicator: one of the [`Collective`]s, or a communicator split.
///
/// Errors carry an `Op` rather than a [`Collective`] because `split` is collective too (every rank
/// must call it) but moves no payload and so has no entry in a traffic table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// A collective that moves data (or a barrier).
    Collective(Collective),
    /// [`crate::Communicator::split`].
    Split,
}

impl Op {
    /// The traffic-table key of this op, if it has one.
    pub fn collective(self) -> Option<Collective> {
        match self {
            Op::Collective(c) => Some(c),
            Op::Split => None,
        }
    }

    /// Lower-case name used in messages.
    pub fn name(self) -> &'static str {
        match self {
            Op::Collective(c) => c.name(),
            Op::Split => "split",
        }
    }
}

impl From<Collective> for Op {
    fn from(c: Collective) -> Self {
        Op::Collective(c)
    }
}

impl PartialEq<Collective> for Op {
    fn eq(&self, other: &Collective) -> bool {
        *self == Op::Collective(*other)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a rank stopped taking part.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureReason {
    /// The rank's thread panicked (its communicator was dropped while unwinding).
    Panicked,
    /// The rank dropped its communicator without panicking.
    Dropped,
    /// The backend reported an asynchronous error for that rank.
    Backend(String),
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FailureReason::Panicked => f.write_str("panicked"),
            FailureReason::Dropped => f.write_str("dropped its communicator"),
            FailureReason::Backend(m) => write!(f, "failed in the backend: {m}"),
        }
    }
}

/// Errors of the communicators.
///
/// Ranks in errors are **global** ranks (ranks of the world every communicator was split from,
/// the numbering of [`zero_core::Topology`]), so an error from a sub-communicator names the same
/// rank ids as one from the world. For a world communicator, group rank and global rank coincide.
///
/// After any error other than [`Error::LengthMismatch`], [`Error::PeerMismatch`],
/// [`Error::InvalidRoot`], [`Error::UnsupportedReduce`] and [`Error::BufferLength`] (which every
/// rank of the group detects together, before anything moves), the communicator must be treated as
/// aborted, as with NCCL: later calls fail.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A rank's buffers have the wrong length for the op (e.g. `recv.len() != n * send.len()` for an
    /// all-gather). Reported identically on every rank of the group; nothing moved.
    #[error("{op}: rank {rank} passed a buffer of {got} elements, expected {expected}")]
    LengthMismatch {
        /// The op.
        op: Op,
        /// The rank whose buffer is wrong.
        rank: usize,
        /// The length the op needs on that rank.
        expected: usize,
        /// The length it got.
        got: usize,
    },
    /// Ranks of one group disagree on the op, the dtype, the reduction, the root or a length that
    /// must be equal everywhere. Reported identically on every rank of the group; nothing moved.
    #[error("{op}: rank {peer} disagrees with rank {rank}: {detail}")]
    PeerMismatch {
        /// The op (as called by the group's first rank).
        op: Op,
        /// The reference rank (the group's first rank).
        rank: usize,
        /// The first rank whose call differs from the reference.
        peer: usize,
        /// What differs, with both values.
        detail: String,
    },
    /// A peer failed (panicked, dropped its communicator, or hit a backend error), so the op cannot
    /// complete.
    #[error("{op} on rank {rank}: rank {failed_rank} {reason}")]
    PeerFailed {
        /// The op that was pending or called.
        op: Op,
        /// The rank reporting the error.
        rank: usize,
        /// The rank that failed.
        failed_rank: usize,
        /// Why it failed.
        reason: FailureReason,
    },
    /// Some ranks never arrived at the op within the communicator's timeout. The world is aborted.
    #[error("{op} on rank {rank}: timed out after {waited:?} waiting for ranks {missing:?}")]
    Timeout {
        /// The op.
        op: Op,
        /// The rank reporting the error.
        rank: usize,
        /// How long it waited.
        waited: Duration,
        /// The ranks that never arrived.
        missing: Vec<usize>,
    },
    /// The communicator (or its world) was aborted by an earlier error, e.g. a timeout elsewhere.
    #[error("{op} on rank {rank}: communicator aborted after an earlier error: {cause}")]
    Aborted {
        /// The op that was called.
        op: Op,
        /// The rank reporting the error.
        rank: usize,
        /// The earlier error.
        cause: String,
    },
    /// The root of a broadcast is not a rank of the group. Reported on every rank.
    #[error("{op}: root {root} is not a rank of this group of {world_size}")]
    InvalidRoot {
        /// The op.
        op: Op,
        /// The root that was passed (a group rank).
        root: usize,
        /// The group size.
        world_size: usize,
    },
    /// A reduction was requested on a dtype that has none (`u8`). Reported on every rank.
    #[error("{op}: reductions are not defined for {dtype}")]
    UnsupportedReduce {
        /// The op.
        op: Op,
        /// The dtype.
        dtype: DType,
    },
    /// A host slice does not match the length of the device buffer it is copied to or from.
    #[error("{what}: buffer has {buffer} elements, host slice has {host}")]
    BufferLength {
        /// `"download"` or the helper that copied.
        what: &'static str,
        /// Elements in the buffer.
        buffer: usize,
        /// Elements in the host slice.
        host: usize,
    },
    /// A backend failure (allocation, device loss, driver error), with the backend's own message
    /// and code.
    #[error("backend error: {0}")]
    Backend(String),
    /// The backend was not compiled in.
    #[error(
        "the {backend} backend is not compiled in: enable the `{backend}` feature of zero-comm"
    )]
    NotCompiled {
        /// The backend's feature name.
        backend: &'static str,
    },
    /// An invalid topology or group description from zero-core.
    #[error(transparent)]
    Topology(zero_core::Error),
    /// A quantized collective ([`crate::quantized`]) failed because the codec on `failed_rank`
    /// rejected data: a non-finite input element, an `f32` partial sum that overflowed, or a wire
    /// that fails validation. On `failed_rank` itself `source` holds the codec's error; its peers
    /// learn of it from a poisoned wire and report `source: None`. Unlike the other errors that are
    /// not validation errors, every rank still made the same collective calls, so nobody hangs and
    /// the communicators stay usable; the output buffer is unspecified.
    // The codec's error is the `source`, not part of this message: reporters that walk the
    // chain (anyhow's `{:#}`) would print it twice.
    #[error("quantized {op} on rank {rank}: the codec failed on rank {failed_rank}")]
    Quant {
        /// The logical op (all-gather for qwZ, reduce-scatter for qgZ).
        op: Op,
        /// The rank reporting the error.
        rank: usize,
        /// The rank whose codec failed first.
        failed_rank: usize,
        /// The codec's error, on `failed_rank` only.
        source: Option<zero_quant::Error>,
    },
}

impl From<zero_core::Error> for Error {
    fn from(e: zero_core::Error) -> Self {
        Error::Topology(e)
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
