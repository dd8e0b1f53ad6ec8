//! The one error type of spattn-bench: a message meant for one line of stderr.

use std::fmt;

/// Everything that can stop a benchmark run or a report: bad arguments, unreadable files,
/// format or GPU errors. Displayed as one line, without a backtrace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    message: String,
    /// Entries of a graph past what a 32-bit CSR holds ([`spattn_formats::Error::TooManyEntries`]),
    /// kept through [`context`](Self::context) so that a search for the largest graph can
    /// record it as not fitting instead of stopping.
    too_many_entries: Option<u64>,
}

impl Error {
    /// An error with this message (one line; newlines are replaced by `; `).
    pub fn new(message: impl Into<String>) -> Self {
        let message: String = message.into();
        let message = message
            .lines()
            .map(str::trim_end)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join("; ");
        Error {
            message,
            too_many_entries: None,
        }
    }

    /// The message, prefixed with what was being done.
    pub fn context(self, what: impl fmt::Display) -> Self {
        Error {
            too_many_entries: self.too_many_entries,
            ..Error::new(format!("{what}: {}", self.message))
        }
    }

    /// The entries of a graph too large for a 32-bit CSR, where that is what this error is.
    pub fn too_many_entries(&self) -> Option<u64> {
        self.too_many_entries
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

impl From<spattn_formats::Error> for Error {
    fn from(e: spattn_formats::Error) -> Self {
        let too_many_entries = match e {
            spattn_formats::Error::TooManyEntries { nnz, .. } => Some(nnz),
            _ => None,
        };
        Error {
            too_many_entries,
            ..Error::new(e.to_string())
        }
    }
}

impl From<spattn_ops::Error> for Error {
    fn from(e: spattn_ops::Error) -> Self {
        Error::new(e.to_string())
    }
}

impl From<spattn::Error> for Error {
    fn from(e: spattn::Error) -> Self {
        Error::new(e.to_string())
    }
}

impl From<serde_json::Error> for Error {
    fn from(e: serde_json::Error) -> Self {
        Error::new(e.to_string())
    }
}

/// Result with the bench [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Adds context to the error of a `Result` whose error converts into [`Error`].
pub trait Context<T> {
    /// Prefixes the error with `what`.
    fn context(self, what: impl fmt::Display) -> Result<T>;
    /// Prefixes the error with the message `what()` builds (only on error).
    fn with_context<D: fmt::Display>(self, what: impl FnOnce() -> D) -> Result<T>;
}

impl<T, E: Into<Error>> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl fmt::Display) -> Result<T> {
        self.map_err(|e| e.into().context(what))
    }
    fn with_context<D: fmt::Display>(self, what: impl FnOnce() -> D) -> Result<T> {
        self.map_err(|e| e.into().context(what()))
    }
}

/// An I/O error on `path`, as one line.
pub fn io_error(action: &str, path: &std::path::Path, e: std::io::Error) -> Error {
    Error::new(format!("cannot {action} {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line() {
        let e = Error::new("first\n\nsecond  \n");
        assert_eq!(e.to_string(), "first; second");
        assert_eq!(
            e.context("reading x").to_string(),
            "reading x: first; second"
        );
    }

    #[test]
    fn a_graph_past_the_csr_limit_stays_recognisable_through_context() {
        let e: Error = spattn_formats::Error::TooManyEntries {
            nnz: 4_300_000_000,
            limit: u32::MAX as u64,
        }
        .into();
        let e = e.context("R-MAT scale 27");
        assert_eq!(e.too_many_entries(), Some(4_300_000_000));
        assert!(e
            .to_string()
            .starts_with("R-MAT scale 27: 4300000000 entries exceed"));
        let other: Error = spattn_formats::Error::InvalidParameter {
            what: "x",
            why: "y".into(),
        }
        .into();
        assert_eq!(other.too_many_entries(), None);
        assert_eq!(Error::new("z").too_many_entries(), None);
    }
}
