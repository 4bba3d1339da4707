//! The model's tokenizer: where to find `tokenizer.json`, and incremental detokenization for
//! streamed output.

use std::path::{Path, PathBuf};

use anyhow::bail;
use deltafin_inference::run::ModelPath;
use deltafin_storage::manifest::Manifest;

use crate::generate::args::SourceArgs;

/// `--tokenizer`, else `tokenizer.json` next to the model (a layout: in its source checkpoint
/// folder, then next to the manifest).
pub(crate) fn find_tokenizer(
    args: &SourceArgs,
    path: &ModelPath,
) -> anyhow::Result<Option<PathBuf>> {
    if let Some(t) = &args.tokenizer {
        if !t.is_file() {
            bail!("--tokenizer {}: no such file", t.display());
        }
        return Ok(Some(t.clone()));
    }
    let candidates: Vec<PathBuf> = match path {
        ModelPath::Directory(d) => vec![d.join("tokenizer.json")],
        ModelPath::Layout(m) => {
            let mut v = Vec::new();
            // The source checkpoint the layout was written from, if still there.
            if let Ok(manifest) = Manifest::load(m) {
                if let Some(src) = manifest.meta.get("source") {
                    v.push(Path::new(src).join("tokenizer.json"));
                }
            }
            if let Some(dir) = m.parent() {
                v.push(dir.join("tokenizer.json"));
            }
            v
        }
    };
    Ok(candidates.into_iter().find(|p| p.is_file()))
}

/// Load the tokenizer `find_tokenizer` finds, if any.
pub(crate) fn load_tokenizer(
    args: &SourceArgs,
    path: &ModelPath,
) -> anyhow::Result<Option<(PathBuf, tokenizers::Tokenizer)>> {
    match find_tokenizer(args, path)? {
        Some(p) => {
            let t = without_panics(|| tokenizers::Tokenizer::from_file(&p))
                .map_err(|what| anyhow::anyhow!("{}: malformed tokenizer ({what})", p.display()))?
                .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
            Ok(Some((p, t)))
        }
        None => Ok(None),
    }
}

/// Run `f`, turning a panic into an error. The tokenizers crate panics on some malformed
/// `tokenizer.json` files (our fuzz target found one in its decoder deserializer); a file
/// shipped with a checkpoint is untrusted, so that must be an error naming the file, not a
/// crash. The panic message is kept for the error instead of being printed.
fn without_panics<T>(f: impl FnOnce() -> T) -> Result<T, String> {
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

/// Incremental detokenization: emits only text that later tokens cannot change (the approach
/// of Hugging Face's text-generation-inference).
pub(crate) struct Detok<'t> {
    tok: &'t tokenizers::Tokenizer,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl<'t> Detok<'t> {
    pub(crate) fn new(tok: &'t tokenizers::Tokenizer) -> Self {
        Detok {
            tok,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }
}

impl Detok<'_> {
    pub(crate) fn push(&mut self, id: u32) -> anyhow::Result<String> {
        self.ids.push(id);
        let decode = |ids: &[u32]| {
            self.tok
                .decode(ids, true)
                .map_err(|e| anyhow::anyhow!("decoding tokens: {e}"))
        };
        let prefix = decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = decode(&self.ids[self.prefix_offset..])?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            if let Some(new) = full.get(prefix.len()..) {
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                return Ok(new.to_string());
            }
        }
        Ok(String::new())
    }
}
