//! Typed errors. Every variant names the config field, tensor, layer or token at fault.

use deltafin_storage::StorageError;

/// Problems with `config.json`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("config.json is not a JSON object")]
    NotAnObject,
    #[error("config.json has no string field `model_type`")]
    MissingModelType,
    #[error("model_type `{0}` is not supported (supported: deepseek_v3, kimi_k2, qwen3_moe, kimi_linear, kimi_k3)")]
    UnsupportedModelType(String),
    #[error("config.json ({model_type}): required field `{field}` is missing or null")]
    MissingField { model_type: String, field: String },
    #[error("config.json: field `{field}`: {reason}")]
    InvalidField { field: String, reason: String },
    #[error("config.json: field `{field}`: {reason} (not supported by this engine)")]
    Unsupported { field: String, reason: String },
}

impl ConfigError {
    pub(crate) fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError::InvalidField {
            field: field.into(),
            reason: reason.into(),
        }
    }
    pub(crate) fn unsupported(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError::Unsupported {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// Every error the inference crate returns.
#[derive(Debug, thiserror::Error)]
pub enum InferenceError {
    #[error(transparent)]
    Config(#[from] ConfigError),

    #[error(transparent)]
    Storage(#[from] StorageError),

    /// Reading a routed expert's record from a layout failed (I/O error, short read, hash
    /// mismatch, engine closed).
    #[error("layer {layer} expert {expert}: reading its record failed: {source}")]
    ExpertRead {
        layer: usize,
        expert: usize,
        #[source]
        source: Box<StorageError>,
    },

    /// Reading a resident record from a layout failed.
    #[error("resident record `{record}`: read failed: {source}")]
    ResidentRead {
        record: String,
        #[source]
        source: Box<StorageError>,
    },

    #[error("tensor `{name}` is missing from the checkpoint")]
    MissingTensor { name: String },

    #[error("tensor `{name}` has shape {got:?}; expected {expected:?}")]
    TensorShape {
        name: String,
        expected: Vec<u64>,
        got: Vec<u64>,
    },

    #[error("tensor `{name}` has dtype {got}; expected {expected}")]
    TensorDtype {
        name: String,
        expected: String,
        got: String,
    },

    #[error("tensor `{name}`: {reason}")]
    BadTensor { name: String, reason: String },

    #[error("layer {layer}: routed expert {expert} is not available: {reason}")]
    MissingExpert {
        layer: usize,
        expert: usize,
        reason: String,
    },

    #[error("token id {token} at input position {index} is outside the vocabulary (vocab_size {vocab_size})")]
    TokenOutOfRange {
        token: u32,
        index: usize,
        vocab_size: usize,
    },

    #[error("empty input: at least one token is required")]
    EmptyInput,

    #[error("cannot truncate a sequence of {len} positions to {requested}")]
    Truncate { len: usize, requested: usize },

    #[error("the session's state does not belong to this model: {0}")]
    StateMismatch(String),

    #[error("position {position} exceeds the supported context of {max} positions")]
    ContextOverflow { position: usize, max: usize },

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The expert memory budget cannot hold even this one expert record.
    #[error("layer {layer} expert {expert}: its record needs {need} bytes but the expert memory budget is {cap} bytes")]
    ExpertBudget {
        layer: usize,
        expert: usize,
        need: u64,
        cap: u64,
    },

    #[error("{0}")]
    Unsupported(String),
}

pub type Result<T, E = InferenceError> = std::result::Result<T, E>;
