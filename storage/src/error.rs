//! Typed errors. Every variant names the file, offset, tensor or drive at fault.

use std::path::{Path, PathBuf};

/// Problems in the bytes of a safetensors header (no path: see [`StorageError::Safetensors`]).
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum SafetensorsError {
    #[error("file is {len} bytes, shorter than the 8-byte header length prefix")]
    TooShort { len: u64 },
    #[error("header claims {len} bytes, over the {cap}-byte cap")]
    HeaderTooLarge { len: u64, cap: u64 },
    #[error("header claims {header_len} bytes but the file is only {file_len} bytes")]
    HeaderPastEnd { header_len: u64, file_len: u64 },
    #[error("header is not valid JSON: {0}")]
    Json(String),
    #[error("tensor `{tensor}`: {reason}")]
    BadEntry { tensor: String, reason: String },
    #[error(
        "tensor `{tensor}`: {dtype} {shape:?} needs {expected} bytes but data_offsets span {got}"
    )]
    LengthMismatch {
        tensor: String,
        dtype: String,
        shape: Vec<u64>,
        expected: u64,
        got: u64,
    },
    #[error("tensor `{tensor}` at offset {offset} overlaps the previous tensor")]
    Overlap { tensor: String, offset: u64 },
    #[error("tensor `{tensor}` spans bytes {offset}..{end} but the file ends at {file_len} (truncated?)")]
    Truncated {
        tensor: String,
        offset: u64,
        end: u64,
        file_len: u64,
    },
}

/// Every error the storage crate returns.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },

    #[error("{path}: {source}")]
    Safetensors {
        path: PathBuf,
        source: SafetensorsError,
    },

    #[error("{path}: {reason}")]
    Config { path: PathBuf, reason: String },

    #[error("{path}: tensor `{tensor}`: {reason}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        reason: String,
    },

    #[error("manifest {path}: {reason}")]
    Manifest { path: PathBuf, reason: String },

    #[error(
        "manifest {path} has format version {found}; this build reads versions up to {supported} \
         (upgrade deltafin or lay the model out again)"
    )]
    ManifestVersion {
        path: PathBuf,
        found: u32,
        supported: u32,
    },

    #[error(
        "manifest {path} was edited or corrupted: {reason}{}",
        field.as_ref().map(|f| format!("; {f}")).unwrap_or_default()
    )]
    ManifestTampered {
        path: PathBuf,
        reason: String,
        /// What differs from another drive's copy, when one could be compared.
        field: Option<String>,
    },

    #[error(
        "the drives' manifests disagree: drive {drive} ({path}) says `{field}` is {there}, \
         drive {here_drive}'s copy says {here}; refusing to guess which is right"
    )]
    ManifestDisagrees {
        drive: usize,
        path: PathBuf,
        here_drive: usize,
        field: String,
        here: String,
        there: String,
    },

    #[error("a layout already exists at {path}; pass --force to replace it")]
    LayoutExists { path: PathBuf },

    #[error(
        "{path} is {}; try again when it has finished",
        if *writing { "in use by another process (another layout run, a repair, or a reader)" }
        else { "being written or repaired by another process" }
    )]
    LayoutBusy {
        path: PathBuf,
        /// Whether this process wanted to write (else read).
        writing: bool,
    },

    #[error("drive {drive} ({path}): needs {needed} bytes free, has {available}")]
    InsufficientSpace {
        drive: usize,
        path: PathBuf,
        needed: u64,
        available: u64,
    },

    #[error("drive {drive} ({path}) is missing or unreadable: {reason}")]
    MissingDrive {
        drive: usize,
        path: PathBuf,
        reason: String,
    },

    #[error("drive {drive} ({path}) holds layout drive id {found}, expected {expected}")]
    DriveMismatch {
        drive: usize,
        path: PathBuf,
        expected: String,
        found: String,
    },

    #[error(
        "offset {offset}: read of {len} bytes failed on every replica: {}",
        failures.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")
    )]
    ReplicasFailed {
        offset: u64,
        len: u64,
        /// One error per drive tried, first the drive the read was sent to.
        failures: Vec<StorageError>,
    },

    #[error("drive {drive} {path} offset {offset}: read of {len} bytes failed: {source}")]
    Read {
        drive: usize,
        path: PathBuf,
        offset: u64,
        len: u64,
        source: std::io::Error,
    },

    #[error(
        "drive {drive} {path} offset {offset}: file ends after {got} of {len} bytes (truncated?)"
    )]
    ShortRead {
        drive: usize,
        path: PathBuf,
        offset: u64,
        len: u64,
        got: u64,
    },

    #[error("{algorithm} mismatch: {what} (drive {drive}, {path}, offset {offset}, {len} bytes)")]
    HashMismatch {
        what: String,
        /// The hash the bytes failed (`xxh3-128`, or `blake3` on older layouts).
        algorithm: &'static str,
        drive: usize,
        path: PathBuf,
        offset: u64,
        len: u64,
    },

    #[error("a buffer of {requested} bytes can never fit the pool's {cap}-byte cap")]
    BufferTooLarge { requested: u64, cap: u64 },

    #[error("unknown record: {0}")]
    UnknownRecord(String),

    /// The layout holds no record for a routed expert.
    #[error("layer {layer}: routed expert {expert} is not available: {reason}")]
    MissingExpert {
        layer: u32,
        expert: u32,
        reason: String,
    },

    /// The expert memory budget cannot hold even this one expert record.
    #[error("layer {layer} expert {expert}: its record needs {need} bytes but the expert memory budget is {cap} bytes")]
    ExpertBudget {
        layer: u32,
        expert: u32,
        need: u64,
        cap: u64,
    },

    /// Reading a routed expert's record failed.
    #[error("layer {layer} expert {expert}: reading its record failed: {source}")]
    ExpertRead {
        layer: u32,
        expert: u32,
        #[source]
        source: Box<StorageError>,
    },

    /// Reading a resident record failed.
    #[error("resident record `{record}`: read failed: {source}")]
    ResidentRead {
        record: String,
        #[source]
        source: Box<StorageError>,
    },

    #[error("the fetch was cancelled")]
    Cancelled,

    #[error("the I/O engine has shut down")]
    EngineClosed,

    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl StorageError {
    pub fn io(path: &Path, op: &'static str, source: std::io::Error) -> Self {
        StorageError::Io {
            path: path.to_path_buf(),
            op,
            source,
        }
    }
}

pub type Result<T, E = StorageError> = std::result::Result<T, E>;
