//! The crate's error type.

/// Errors from building or running a trainer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The plan or its inputs are invalid.
    #[error(transparent)]
    Plan(#[from] zero_core::Error),
    /// A collective failed (a peer died, timed out, or disagreed).
    #[error(transparent)]
    Comm(#[from] zero_comm::Error),
    /// A codec rejected its configuration.
    #[error(transparent)]
    Quant(#[from] zero_quant::Error),
    /// The model does not fit the trainer's expectations.
    #[error("model: {0}")]
    Model(String),
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
    /// A rank's thread panicked.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The rank.
        rank: usize,
        /// The panic message.
        message: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
