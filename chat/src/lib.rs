//! deltafin-chat: what turns a conversation into token ids and generated ids back into a reply,
//! the way the model's own files say.
//!
//! - [`template`]: the model's Jinja `chat_template`, rendered as Hugging Face's
//!   `apply_chat_template` does ([`template::ChatTemplate`]), with [`pyjson`] for its `tojson`.
//! - [`tiktoken`]: the tiktoken BPE files Kimi K2 / K3 ship (`tiktoken.model` + the special
//!   tokens of `tokenizer_config.json`).
//! - [`tokenizer`]: [`tokenizer::ChatTokenizer`], either a `tokenizer.json` or a tiktoken file,
//!   found next to a model; [`detok`]: streamed decoding that never emits a broken character.
//! - [`reasoning`]: splitting a thinking model's output into reasoning and answer.

pub mod detok;
pub mod error;
pub mod pyjson;
pub mod reasoning;
pub mod template;
pub mod tiktoken;
pub mod tokenizer;

pub use error::{ChatError, Result};
pub use template::ChatTemplate;
pub use tokenizer::ChatTokenizer;
