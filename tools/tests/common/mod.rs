//! What the chat and serve tests share: a tiny synthetic model with the test tokenizer and
//! Kimi K2's chat template.
#![allow(clippy::unwrap_used, dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A tiny synthetic model in `dir/chatmodel` with the test tokenizer and Kimi K2's template.
pub fn chat_model(dir: &Path) -> PathBuf {
    let model = dir.join("chatmodel");
    let out = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args([
            "synth",
            "--out",
            model.to_str().unwrap(),
            "--preset",
            "tiny",
        ])
        .args(["--set", "vocab_size=606", "--force", "-q"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::copy(
        repo().join("testdata/tokenizers/hf/tokenizer.json"),
        model.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::copy(
        repo().join("testdata/chat_templates/kimi_k2_instruct.jinja"),
        model.join("chat_template.jinja"),
    )
    .unwrap();
    model
}
