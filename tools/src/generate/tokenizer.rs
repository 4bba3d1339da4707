//! The model's tokenizer: where to find it (`tokenizer.json` or `tiktoken.model`); loading and
//! streamed decoding are the chat crate's.

use std::path::PathBuf;

use anyhow::bail;
use deltafin_inference::run::ModelPath;
use deltafin_storage::manifest::Manifest;

use deltafin_chat::ChatTokenizer;

use crate::generate::args::SourceArgs;

/// `--tokenizer`, else the tokenizer next to the model (`tokenizer.json` or `tiktoken.model`; a
/// layout: in its source checkpoint folder, then next to the manifest).
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
    let dirs: Vec<PathBuf> = match path {
        ModelPath::Directory(d) => vec![d.clone()],
        ModelPath::Layout(m) => {
            let mut v = Vec::new();
            // The source checkpoint the layout was written from, if still there.
            if let Ok(manifest) = Manifest::load(m) {
                if let Some(src) = manifest.meta.get("source") {
                    v.push(PathBuf::from(src));
                }
            }
            if let Some(dir) = m.parent() {
                v.push(dir.to_path_buf());
            }
            v
        }
    };
    Ok(dirs
        .iter()
        .find_map(|d| deltafin_chat::tokenizer::find_in(d)))
}

/// Load the tokenizer `find_tokenizer` finds, if any.
pub(crate) fn load_tokenizer(
    args: &SourceArgs,
    path: &ModelPath,
) -> anyhow::Result<Option<(PathBuf, ChatTokenizer)>> {
    match find_tokenizer(args, path)? {
        Some(p) => Ok(Some((p.clone(), ChatTokenizer::from_file(&p)?))),
        None => Ok(None),
    }
}

/// Where the model's chat files are (`tokenizer_config.json`, `chat_template.jinja`): the
/// model directory, or a layout's source checkpoint folder when it is still there, else the
/// folder of the manifest.
pub(crate) fn model_files_dir(args: &SourceArgs) -> anyhow::Result<PathBuf> {
    match ModelPath::detect(&args.model)? {
        ModelPath::Directory(d) => Ok(d),
        ModelPath::Layout(m) => {
            if let Ok(manifest) = Manifest::load(&m) {
                if let Some(src) = manifest.meta.get("source") {
                    let p = PathBuf::from(src);
                    if p.is_dir() {
                        return Ok(p);
                    }
                }
            }
            Ok(m.parent().map(PathBuf::from).unwrap_or_default())
        }
    }
}
