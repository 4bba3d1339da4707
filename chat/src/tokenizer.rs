//! [`ChatTokenizer`]: the tokenizer a model ships, `tokenizer.json` (Hugging Face tokenizers)
//! or `tiktoken.model` (Kimi), behind one face. Loading a file is guarded: the tokenizers crate
//! panics on some malformed files, which must be an error naming the file.

use std::path::{Path, PathBuf};

use crate::error::{ChatError, Result};
use crate::tiktoken::Tiktoken;

/// A loaded tokenizer.
#[derive(Debug)]
pub enum ChatTokenizer {
    Hf(Box<tokenizers::Tokenizer>),
    Tiktoken(Box<Tiktoken>),
}

impl ChatTokenizer {
    /// The tokenizer in `dir`: `tokenizer.json`, else `tiktoken.model` (with the special tokens
    /// of `tokenizer_config.json`).
    pub fn from_dir(dir: &Path) -> Result<ChatTokenizer> {
        match find_in(dir) {
            Some(p) => ChatTokenizer::from_file(&p),
            None => Err(ChatError::NotFound {
                what: "tokenizer",
                path: dir.to_path_buf(),
                looked: "tokenizer.json, tiktoken.model".into(),
            }),
        }
    }

    /// A `tokenizer.json` or a `*.model` / `*.tiktoken` file.
    pub fn from_file(path: &Path) -> Result<ChatTokenizer> {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        if name.ends_with(".json") {
            let t = without_panics(|| tokenizers::Tokenizer::from_file(path))
                .map_err(|what| ChatError::BadFile {
                    path: path.to_path_buf(),
                    reason: format!("malformed tokenizer ({what})"),
                })?
                .map_err(|e| ChatError::BadFile {
                    path: path.to_path_buf(),
                    reason: e.to_string(),
                })?;
            return Ok(ChatTokenizer::Hf(Box::new(t)));
        }
        let cfg = path
            .parent()
            .map(|d| d.join("tokenizer_config.json"))
            .filter(|p| p.is_file());
        Ok(ChatTokenizer::Tiktoken(Box::new(Tiktoken::from_files(
            path,
            cfg.as_deref(),
        )?)))
    }

    /// Token ids of `text`; special tokens written in it count as such when `special`.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>> {
        match self {
            ChatTokenizer::Hf(t) => {
                let enc = without_panics(|| t.encode_fast(text, false))
                    .map_err(|what| tok_err("encoding", what))?
                    .map_err(|e| tok_err("encoding", e.to_string()))?;
                // tokenizers matches added (special) tokens always; `special` only matters for
                // tiktoken, whose specials are text otherwise.
                let _ = special;
                Ok(enc.get_ids().to_vec())
            }
            ChatTokenizer::Tiktoken(t) => Ok(t.encode(text, special)),
        }
    }

    /// Text of `ids`; a character cut by the end of `ids` decodes to U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        match self {
            ChatTokenizer::Hf(t) => without_panics(|| t.decode(ids, skip_special))
                .map_err(|what| tok_err("decoding", what))?
                .map_err(|e| tok_err("decoding", e.to_string())),
            ChatTokenizer::Tiktoken(t) => {
                Ok(String::from_utf8_lossy(&t.decode_bytes(ids, skip_special)).into_owned())
            }
        }
    }

    /// The text of `id` when it is a special token (one that decoding with `skip_special`
    /// drops), else None.
    pub fn special_text(&self, id: u32) -> Option<String> {
        let kept = self.decode(&[id], false).ok()?;
        let skipped = self.decode(&[id], true).ok()?;
        (!kept.is_empty() && skipped.is_empty()).then_some(kept)
    }

    /// The id of a token written as `text` (a special token such as `<|im_end|>`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        match self {
            ChatTokenizer::Hf(t) => t.token_to_id(text),
            ChatTokenizer::Tiktoken(t) => t.special_id(text),
        }
    }
}

/// `tokenizer.json` or `tiktoken.model` in `dir`.
pub fn find_in(dir: &Path) -> Option<PathBuf> {
    ["tokenizer.json", "tiktoken.model"]
        .iter()
        .map(|n| dir.join(n))
        .find(|p| p.is_file())
}

fn tok_err(what: &str, reason: String) -> ChatError {
    ChatError::Tokenizer {
        what: what.into(),
        reason,
    }
}

/// Run `f`, turning a panic into an error (with the panic's message, not printed).
pub fn without_panics<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    let message = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let keep = message.clone();
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if let Ok(mut m) = keep.lock() {
            *m = info.to_string();
        }
    }));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(previous);
    r.map_err(|_| {
        let m = message.lock().map(|m| m.clone()).unwrap_or_default();
        format!(
            "the tokenizers library failed on it: {}",
            m.lines().last().unwrap_or("")
        )
    })
}
