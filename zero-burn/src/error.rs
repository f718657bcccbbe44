//! The crate's error type.

/// Errors from building or running a trainer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The plan or its inputs are invalid.
    #[error(transparent)]
    Plan(zero_core::Error),
    /// A collective failed (a peer died, timed out, or disagreed).
    #[error(transparent)]
    Comm(#[from] zero_comm::Error),
    /// A codec rejected its configuration.
    #[error(transparent)]
    Quant(#[from] zero_quant::Error),
    /// The plan does not fit the communicator or the model it is run with.
    #[error("the plan does not fit: {what}")]
    PlanMismatch {
        /// What differs.
        what: String,
    },
    /// The run diverged: a non-finite loss or gradient norm, or fp16 gradients that overflow at
    /// the minimum loss scale. Every rank that sees it fails; the others learn of it from its
    /// dropped communicator.
    #[error("the run diverged at step {step} on rank {rank}: {what}")]
    Diverged {
        /// The optimizer step (1-based) that diverged.
        step: u64,
        /// The rank that found it.
        rank: usize,
        /// What was not finite.
        what: String,
    },
    /// A segment's backward produced no gradient for its input activation (the activation was
    /// detached, or the segment does not use its input).
    #[error("segment {segment} produced no gradient for its input activation")]
    NoInputGradient {
        /// The segment.
        segment: usize,
    },
    /// A safetensors file to initialise a model from is unusable.
    #[error("{file}: {detail}")]
    Init {
        /// The file.
        file: String,
        /// What is wrong with it.
        detail: String,
    },
    /// The caller's own error, returned from a rank's closure (see [`crate::Launch::run`]); build it
    /// with [`Error::other`].
    #[error(transparent)]
    Other(Box<dyn std::error::Error + Send + Sync + 'static>),
    /// The ranks' run summaries (the demo trainer's) do not come together: one is unreadable
    /// (ranks of different builds), or it disagrees with rank 0's on what every rank shares.
    #[error("the run summary of rank {rank}: {detail}")]
    RunSummary {
        /// The rank whose summary it is.
        rank: usize,
        /// What is wrong with it.
        detail: String,
    },
    /// A broken internal invariant: a bug in zero-burn, please report it.
    #[error("internal error (a bug in zero-burn): {0}")]
    Internal(String),
    /// The model's segments do not cover its parameters exactly once.
    #[error("segments: parameter `{path}` {detail}")]
    Segmentation {
        /// The parameter's dotted path.
        path: String,
        /// What is wrong (visited by no segment, or by two).
        detail: String,
    },
    /// A segment returned the wrong kind of output.
    #[error("segment {segment} of {segments} returned {got}, expected {expected}")]
    SegmentOutput {
        /// The segment.
        segment: usize,
        /// Segments in the model.
        segments: usize,
        /// What it returned.
        got: &'static str,
        /// What the engine expected.
        expected: &'static str,
    },
    /// A tensor could not be read (wrong dtype or shape).
    #[error("tensor: {0}")]
    Tensor(String),
    /// A training option is out of range.
    #[error("invalid {field}: got {got}, expected {expected}")]
    Invalid {
        /// The option.
        field: &'static str,
        /// What was given.
        got: String,
        /// What would be valid.
        expected: String,
    },
    /// The data source is unusable.
    #[error("data: {0}")]
    Data(String),
    /// A compute backend could not be set up (e.g. no wgpu adapter).
    #[error("backend: {0}")]
    Backend(String),
    /// A checkpoint is unusable (names the file and what is wrong; boxed: it is large).
    #[error(transparent)]
    Checkpoint(Box<zero_core::CheckpointError>),
    /// The NVMe store of `optimizer_placement = nvme` failed: an IO error, a full disk, a short
    /// read, or a block whose checksum does not match. The unit's last whole state stays in its
    /// file; the step or load that met it did not complete, so the run should resume from its
    /// last checkpoint.
    #[error("NVMe store of rank {rank}{}, {path}: {what}", unit_of(*unit))]
    Offload {
        /// The rank.
        rank: usize,
        /// The unit whose state it was, if any.
        unit: Option<usize>,
        /// The file or folder.
        path: String,
        /// What went wrong.
        what: String,
    },
    /// A checkpoint storage operation failed (the IO error is its [`source`], so `{:#}` with
    /// anyhow, or [`Error::full_message`], prints it once).
    ///
    /// [`source`]: std::error::Error::source
    #[error("checkpoint storage: {op} {path}")]
    Storage {
        /// The operation (`write`, `fsync`, `rename`, ...).
        op: &'static str,
        /// The path it was applied to.
        path: String,
        /// The IO error.
        #[source]
        source: std::io::Error,
    },
    /// Another rank failed its part of a collective save or load, so every rank fails it.
    #[error("checkpoint {action} failed on rank {rank}: {cause}")]
    CheckpointFailed {
        /// `save` or `load`.
        action: &'static str,
        /// The rank that failed.
        rank: usize,
        /// Its error, as it reported it.
        cause: String,
    },
    /// A load failed after it began restoring (a rank file changed after the load verified it,
    /// or another rank failed its restore): the engine's state is partly the checkpoint's, and
    /// the ranks no longer agree on it. Steps and saves are refused until a load succeeds.
    #[error(
        "rank {rank}: the engine's state was partly restored by a failed checkpoint load ({cause}); load a checkpoint again or build a fresh engine"
    )]
    PartlyRestored {
        /// This rank.
        rank: usize,
        /// Why the load failed.
        cause: String,
    },
    /// The ranks disagree on what they are saving (a caller bug: not every rank is at the same
    /// step, or runs the same plan).
    #[error("checkpoint save: ranks {ranks:?} disagree with rank 0 on {what}")]
    CheckpointDisagree {
        /// What differs.
        what: &'static str,
        /// The ranks that differ from rank 0.
        ranks: Vec<usize>,
    },
    /// A save between the micro-steps of an optimizer step (the gradient accumulators are not
    /// saved). [`crate::ZeroEngine::step`] runs all micro-steps, so the public API cannot reach
    /// it; it guards future micro-step APIs.
    #[error(
        "checkpoint save refused: {micro} micro-steps of the current optimizer step have run; save at a step boundary"
    )]
    SaveBetweenMicroSteps {
        /// Micro-steps run since the last optimizer step.
        micro: u32,
    },
    /// The tag's directory exists: a committed checkpoint is never rewritten.
    #[error(
        "checkpoint save refused: {tag} already exists (committed checkpoints are never rewritten)"
    )]
    TagExists {
        /// The tag.
        tag: String,
    },
    /// Ranks were started with different plans, options or models: found before any data moved,
    /// by every rank alike.
    #[error(
        "rank {rank} was started with a different {what} than rank 0 (fingerprint {theirs:016x}, \
         rank 0's {ours:016x}); every rank must build the same model, plan and options"
    )]
    RanksDisagree {
        /// The first rank that differs from rank 0.
        rank: usize,
        /// `"plan or options"` or `"model (parameter values)"`.
        what: &'static str,
        /// Rank 0's fingerprint.
        ours: u64,
        /// That rank's.
        theirs: u64,
    },
    /// A rank's thread panicked.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The rank.
        rank: usize,
        /// The panic message.
        message: String,
    },
    /// A rank of a [`crate::Launch`] failed: the root cause, the first error in rank order that
    /// is not a consequence of another rank's failure, and what the other ranks then reported.
    #[error("rank {rank} failed: {source}{}", then_line(consequences))]
    RankFailed {
        /// The failing rank.
        rank: usize,
        /// Its error.
        source: Box<Error>,
        /// The other failing ranks' errors, `(rank, message)`, in rank order.
        consequences: Vec<(usize, String)>,
    },
    /// A segment read a parameter of another segment without visiting it (a tied weight not
    /// declared): its gradient would be lost, or at stage 3 it was released.
    #[error(
        "segment {reader} reads parameter `{path}` of segment {owner} without visiting it \
         ({found}); make `visit_segment({reader})` visit it too: a parameter may be visited by \
         several segments, and the engine then gathers it for each and sums their gradients"
    )]
    UndeclaredRead {
        /// The parameter's dotted path.
        path: String,
        /// The segment that owns it (the first that visits it).
        owner: usize,
        /// The segment that read it.
        reader: usize,
        /// How it showed: a gradient from the reader's backward, or a read of the released
        /// parameter (stage 3).
        found: &'static str,
    },
    /// The model is on a device without autodiff, so nothing in it can be trained.
    #[error(
        "the model is on a device without autodiff ({device}); build it on an autodiff device, \
         e.g. `Device::flex().autodiff()`"
    )]
    NotAutodiff {
        /// The device, as burn prints it.
        device: String,
    },
    /// A segment's recompute (activation checkpointing) did not reproduce its forward: the
    /// gradients would belong to neither.
    #[error(
        "step {step}, micro-step {micro} on rank {rank}: the recompute of segment {segment} did not \
         reproduce its forward ({what}); the model draws randomness the engine cannot replay or \
         computes nondeterministically (see `zero_burn::rng`)"
    )]
    RecomputeMismatch {
        /// The optimizer step (1-based).
        step: u64,
        /// The micro-step (0-based).
        micro: u32,
        /// The rank.
        rank: usize,
        /// The segment.
        segment: usize,
        /// What differs: the loss, or a checksum of the output activation.
        what: String,
    },
}

fn unit_of(unit: Option<usize>) -> String {
    unit.map(|u| format!(", unit {u}")).unwrap_or_default()
}

fn then_line(consequences: &[(usize, String)]) -> String {
    if consequences.is_empty() {
        return String::new();
    }
    let list: Vec<String> = consequences
        .iter()
        .map(|(r, m)| format!("rank {r}: {m}"))
        .collect();
    format!(" (then {})", list.join("; "))
}

impl From<zero_core::Error> for Error {
    /// A checkpoint error from zero-core becomes [`Error::Checkpoint`], so callers match one
    /// variant whichever crate found the fault.
    fn from(e: zero_core::Error) -> Self {
        match e {
            zero_core::Error::Checkpoint(c) => Error::Checkpoint(c),
            e => Error::Plan(e),
        }
    }
}

impl From<zero_core::CheckpointError> for Error {
    fn from(e: zero_core::CheckpointError) -> Self {
        Error::Checkpoint(Box::new(e))
    }
}

impl Error {
    /// Wraps the caller's own error (like [`std::io::Error::other`]), e.g. to return it from a
    /// rank's closure in [`crate::Launch::run`].
    pub fn other(e: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> Self {
        Error::Other(e.into())
    }

    /// Whether this error, raised on rank `rank`, is only the consequence of another rank's
    /// failure (a peer that dropped its communicator, an aborted world, a timeout waiting for
    /// peers, a codec or a collective checkpoint step that failed on another rank) rather than a
    /// root cause.
    pub fn is_consequence_on(&self, rank: usize) -> bool {
        use zero_comm::Error as C;
        match self {
            Error::Comm(C::PeerFailed { .. } | C::Aborted { .. } | C::Timeout { .. }) => true,
            Error::Comm(C::Quant { failed_rank, .. }) => *failed_rank != rank,
            Error::CheckpointFailed { rank: failed, .. } => *failed != rank,
            Error::RankFailed { rank, source, .. } => source.is_consequence_on(*rank),
            _ => false,
        }
    }

    /// The root cause: the error inside [`Error::RankFailed`], or this one.
    pub fn root_cause(&self) -> &Error {
        match self {
            Error::RankFailed { source, .. } => source.root_cause(),
            e => e,
        }
    }

    /// The message with every underlying cause after it (`a: b: c`), as anyhow's `{:#}` prints
    /// it: what one rank sends the others when it fails a collective checkpoint step.
    pub fn full_message(&self) -> String {
        let mut out = self.to_string();
        let mut cause = std::error::Error::source(self);
        while let Some(c) = cause {
            out.push_str(": ");
            out.push_str(&c.to_string());
            cause = c.source();
        }
        out
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    /// A storage error prints its IO error once: as its source (anyhow's `{:#}`), and in
    /// `full_message`, which is what the other ranks of a failed save or load are told.
    #[test]
    fn a_storage_error_names_its_io_error_once() {
        let e = Error::Storage {
            op: "create_dir",
            path: "/ck".into(),
            source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
        };
        assert_eq!(e.to_string(), "checkpoint storage: create_dir /ck");
        let full = e.full_message();
        assert!(
            full.starts_with("checkpoint storage: create_dir /ck: "),
            "{full}"
        );
        let io = std::io::Error::from(std::io::ErrorKind::AlreadyExists).to_string();
        assert_eq!(full.matches(&io).count(), 1, "{full}");
        // A transparent variant is not repeated either.
        let e = Error::from(zero_core::Error::Model("no parameters".into()));
        assert_eq!(e.full_message(), e.to_string());
    }
}
