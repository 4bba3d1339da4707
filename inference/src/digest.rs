//! A model's identity for snapshots, taken when it is loaded.

use crate::family::text_prefix;
use crate::weights::WeightSource;

/// The weights part of [`crate::snapshot::model_hash`], computed when a model is loaded (while its source still
/// holds the resident tensors).
pub fn weights_digest(source: &dyn WeightSource) -> [u8; 32] {
    const SAMPLE: usize = 64 << 10;
    let mut h = blake3::Hasher::new();
    h.update(b"deltafin-model-hash-v1\0");
    let cfg = serde_json::to_string(source.config()).unwrap_or_default();
    h.update(&(cfg.len() as u64).to_le_bytes());
    h.update(cfg.as_bytes());
    let prefix = text_prefix(source.config());
    for name in [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
    ] {
        h.update(name.as_bytes());
        let name = format!("{prefix}{name}");
        match source.tensor(&name) {
            Ok(t) => {
                h.update(format!("{:?}{:?}", t.dtype, t.shape).as_bytes());
                h.update(&(t.bytes.len() as u64).to_le_bytes());
                let b = t.bytes;
                h.update(&b[..b.len().min(SAMPLE)]);
                h.update(&b[b.len().saturating_sub(SAMPLE)..]);
            }
            Err(_) => {
                h.update(b"\0absent");
            }
        }
    }
    *h.finalize().as_bytes()
}
