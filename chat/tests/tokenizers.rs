//! Tokenizer parity with the reference libraries (Python `tokenizers` and `tiktoken` with Kimi's
//! pattern) on a corpus with Unicode, whitespace runs, digits, code and special tokens
//! (testdata/tokenizers, made by make_tokenizers.py there); decoding round-trips, and streamed
//! decoding never emits a broken character.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use deltafin_chat::detok::Detok;
use deltafin_chat::ChatTokenizer;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/tokenizers")
}

fn cases() -> Vec<serde_json::Value> {
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir().join("references.json")).unwrap()).unwrap();
    v["cases"].as_array().unwrap().clone()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn tokenizer_json_matches_python_tokenizers() {
    let t = ChatTokenizer::from_dir(&dir().join("hf")).unwrap();
    for c in cases() {
        let text = c["text"].as_str().unwrap();
        assert_eq!(t.encode(text, true).unwrap(), ids(&c["hf_ids"]), "{text:?}");
        assert_eq!(
            t.decode(&ids(&c["hf_ids"]), false).unwrap(),
            text,
            "{text:?}"
        );
    }
}

#[test]
fn tiktoken_matches_python_tiktoken() {
    let t = ChatTokenizer::from_dir(&dir().join("tiktoken")).unwrap();
    assert!(matches!(t, ChatTokenizer::Tiktoken(_)));
    for c in cases() {
        let text = c["text"].as_str().unwrap();
        assert_eq!(
            t.encode(text, true).unwrap(),
            ids(&c["tiktoken_ids"]),
            "{text:?}"
        );
        assert_eq!(
            t.encode(text, false).unwrap(),
            ids(&c["tiktoken_ordinary_ids"]),
            "{text:?}"
        );
        assert_eq!(
            t.decode(&ids(&c["tiktoken_ids"]), false).unwrap(),
            text,
            "{text:?}"
        );
    }
    assert_eq!(t.token_id("<|im_end|>"), Some(600));
}

#[test]
fn streamed_decoding_never_breaks_a_character() {
    for sub in ["hf", "tiktoken"] {
        let t = ChatTokenizer::from_dir(&dir().join(sub)).unwrap();
        for c in cases() {
            let text = c["text"].as_str().unwrap();
            let mut d = Detok::new(&t, false);
            let mut out = String::new();
            for id in t.encode(text, true).unwrap() {
                let piece = d.push(id).unwrap();
                assert!(!piece.contains('\u{FFFD}'), "{sub} {text:?}: {piece:?}");
                out.push_str(&piece);
            }
            out.push_str(&d.finish().unwrap());
            assert_eq!(out, text, "{sub}");
        }
    }
}
