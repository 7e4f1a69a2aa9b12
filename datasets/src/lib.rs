//! Readers for the public measurements iadeep is built and evaluated on.
//!
//! The files live in the repository's `data/` folder with their licences and are
//! compiled into the crate, so tests, benchmarks and the demo need no download
//! and no path. Readers return errors for malformed input, never panic.

pub mod csv_text;
pub mod gavel;
pub mod philly;
pub mod pollux;

/// Errors reading a dataset.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("cannot read {path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("malformed data: {0}")]
    Format(String),
    #[error("worker type {requested:?} is not in the file (it has: {available})")]
    UnknownWorkerType {
        requested: String,
        available: String,
    },
    #[error("model {requested:?} is not bundled (available: {available})")]
    UnknownModel {
        requested: String,
        available: String,
    },
}

impl From<csv_text::CsvError> for DatasetError {
    fn from(error: csv_text::CsvError) -> Self {
        DatasetError::Format(error.to_string())
    }
}

impl DatasetError {
    /// Prefixes a format error with where it happened.
    fn context(self, place: &str) -> DatasetError {
        match self {
            DatasetError::Format(reason) => DatasetError::Format(format!("{place}: {reason}")),
            other => other,
        }
    }
}
