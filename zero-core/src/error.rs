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
