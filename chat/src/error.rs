//! Typed errors of the chat crate; each names the file, template or token at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    BadFile { path: PathBuf, reason: String },
    #[error("chat template{}: {reason}", name.as_ref().map(|n| format!(" `{n}`")).unwrap_or_default())]
    Template {
        name: Option<String>,
        reason: String,
    },
    #[error("the template raised an exception: {0}")]
    Raised(String),
    #[error("{what}: {reason}")]
    Tokenizer { what: String, reason: String },
    #[error("no {what} found for {path} (looked for {looked})")]
    NotFound {
        what: &'static str,
        path: PathBuf,
        looked: String,
    },
}

pub type Result<T, E = ChatError> = std::result::Result<T, E>;
