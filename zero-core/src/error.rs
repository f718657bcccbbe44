//! The crate's error type. Every message says what was wrong and what would be valid.

/// Errors from building a topology, a configuration or a plan.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A value is out of its valid range.
    #[error("invalid {field}: got {got}, expected {expected}")]
    Invalid {
        /// Dotted path of the offending field, e.g. `zero_optimization.stage`.
        field: String,
        /// What was given.
        got: String,
        /// What would be valid.
        expected: String,
    },
    /// The model description is unusable.
    #[error("invalid model: {0}")]
    Model(String),
    /// Configuration keys that are unknown or unsupported. Reported together, never ignored.
    #[error("unsupported configuration keys: {}", .0.join("; "))]
    UnsupportedKeys(Vec<String>),
    /// A configuration or model file could not be parsed.
    #[error("cannot parse {what}: {message}")]
    Parse {
        /// What was being parsed (a file name or a format).
        what: String,
        /// The parser's message.
        message: String,
    },
    /// A checkpoint is unusable: what is wrong and in which file (boxed: it is large).
    #[error(transparent)]
    Checkpoint(Box<CheckpointError>),
}

/// What is wrong with a checkpoint. Every variant names the file (or the parameter) at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A file does not parse.
    #[error("checkpoint file {file} is malformed: {message}")]
    Parse {
        /// The file.
        file: String,
        /// What the parser found.
        message: String,
    },
    /// An unsupported format or version.
    #[error("checkpoint file {file} has format {found}, expected {expected}")]
    Version {
        /// The file.
        file: String,
        /// What it declares.
        found: String,
        /// What this build reads.
        expected: String,
    },
    /// A listed file is absent.
    #[error("checkpoint file {file} is missing")]
    Missing {
        /// The file.
        file: String,
    },
    /// A file's size differs from the recorded one (truncated or extended).
    #[error(
        "checkpoint file {file} has {found} bytes, expected {expected} (truncated or extended)"
    )]
    Size {
        /// The file.
        file: String,
        /// Recorded size.
        expected: u64,
        /// Size found.
        found: u64,
    },
    /// A block's checksum differs: the bytes changed after they were written.
    #[error(
        "checkpoint file {file} is corrupt: block {block} (bytes {offset}..{end}) has crc32c {found:08x}, expected {expected:08x}"
    )]
    Checksum {
        /// The file.
        file: String,
        /// Block index.
        block: u64,
        /// First byte of the block.
        offset: u64,
        /// One past its last byte.
        end: u64,
        /// Recorded crc32c.
        expected: u32,
        /// Computed crc32c.
        found: u32,
    },
    /// A file belongs to another save, rank, world or plan.
    #[error("checkpoint file {file} is foreign: its {field} is {found}, expected {expected}")]
    Foreign {
        /// The file.
        file: String,
        /// The header field that differs (`save_id`, `rank`, ...).
        field: String,
        /// Expected value.
        expected: String,
        /// Value found.
        found: String,
    },
    /// The model being loaded into differs from the saved one (the message lists the first
    /// differences and counts the rest; `differences` holds them all).
    #[error("the checkpoint in {file} was saved from a different model: {}", first_few(.differences))]
    ModelMismatch {
        /// The manifest.
        file: String,
        /// Every difference found (names, shapes, dtypes, trainable flags, frozen values).
        differences: Vec<String>,
    },
    /// The checkpoint was saved with another plan and the load did not ask to reshard.
    #[error(
        "the checkpoint in {file} was saved with {saved} (plan {saved_fingerprint}); this run has {current} (plan {current_fingerprint}): resharding is needed"
    )]
    PlanMismatch {
        /// The manifest.
        file: String,
        /// The saved plan in words.
        saved: String,
        /// Its fingerprint.
        saved_fingerprint: String,
        /// The current plan in words.
        current: String,
        /// Its fingerprint.
        current_fingerprint: String,
    },
    /// A file's content disagrees with its header or the manifest (a missing tensor, a tensor of
    /// the wrong length or out of bounds).
    #[error("checkpoint file {file}: {what}")]
    Layout {
        /// The file.
        file: String,
        /// What disagrees.
        what: String,
    },
    /// A parameter the saved layout keeps nowhere: in no unit and not among its loose
    /// parameters (a manifest that does not describe its own files).
    #[error(
        "parameter {param} ({name}) is in no unit of the saved layout and not saved whole either"
    )]
    NotSharded {
        /// Index of the parameter.
        param: usize,
        /// Its name.
        name: String,
    },
}

impl From<CheckpointError> for Error {
    fn from(e: CheckpointError) -> Self {
        Error::Checkpoint(Box::new(e))
    }
}

impl Error {
    pub(crate) fn invalid(
        field: impl Into<String>,
        got: impl Into<String>,
        expected: impl Into<String>,
    ) -> Self {
        Error::Invalid {
            field: field.into(),
            got: got.into(),
            expected: expected.into(),
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The first few of a list of differences, `; `-separated, and how many more there are.
fn first_few(all: &[String]) -> String {
    const SHOWN: usize = 6;
    let mut out = all[..all.len().min(SHOWN)].join("; ");
    if all.len() > SHOWN {
        out.push_str(&format!("; and {} more", all.len() - SHOWN));
    }
    out
}
