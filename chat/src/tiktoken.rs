//! The tiktoken BPE format Kimi K2 and K3 ship: `tiktoken.model` (one `base64(token) rank` per
//! line), special tokens from `tokenizer_config.json`'s `added_tokens_decoder`, and Kimi's
//! pre-tokenizer pattern. Encoding follows tiktoken exactly: the text is cut at special tokens
//! (all allowed), each ordinary run is split with the pattern (fancy-regex, as tiktoken's own
//! core), and each piece is merged byte pair by byte pair, lowest rank first.

use std::collections::HashMap;
use std::path::Path;

use base64::Engine;
use fancy_regex::Regex;

use crate::error::{ChatError, Result};

/// Kimi's pre-tokenizer (`tokenization_kimi.py`'s `pat_str`).
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// Ranks and token files larger than this are refused (Kimi's is ~2.8 MB).
const MAX_FILE_BYTES: u64 = 256 << 20;

/// A tiktoken encoding.
#[derive(Debug)]
pub struct Tiktoken {
    ranks: HashMap<Vec<u8>, u32>,
    decoder: Vec<Option<Vec<u8>>>,
    specials: HashMap<String, u32>,
    special_decoder: HashMap<u32, String>,
    pattern: Regex,
    /// Matches any special token (longest first).
    special_pattern: Option<Regex>,
}

impl Tiktoken {
    /// From the contents of a `tiktoken.model` file, special tokens (text, id), and a pattern.
    pub fn new(model: &str, specials: &[(String, u32)], pattern: &str) -> Result<Tiktoken> {
        let bad = |reason: String| ChatError::Tokenizer {
            what: "tiktoken ranks".into(),
            reason,
        };
        let mut ranks = HashMap::new();
        for (i, line) in model.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let (tok, rank) = line
                .split_once(' ')
                .ok_or_else(|| bad(format!("line {}: expected `base64 rank`", i + 1)))?;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(tok)
                .map_err(|e| bad(format!("line {}: {e}", i + 1)))?;
            let rank: u32 = rank
                .trim()
                .parse()
                .map_err(|_| bad(format!("line {}: rank `{rank}` is not a number", i + 1)))?;
            if ranks.insert(bytes, rank).is_some() {
                return Err(bad(format!("line {}: a token appears twice", i + 1)));
            }
        }
        let top = ranks
            .values()
            .chain(specials.iter().map(|(_, id)| id))
            .copied()
            .max()
            .unwrap_or(0);
        if top as usize > 1 << 24 {
            return Err(bad(format!("id {top} is too large")));
        }
        let mut decoder = vec![None; top as usize + 1];
        for (b, &r) in &ranks {
            decoder[r as usize] = Some(b.clone());
        }
        let mut sorted: Vec<&(String, u32)> = specials.iter().collect();
        sorted.sort_by_key(|(s, _)| std::cmp::Reverse(s.len()));
        let special_pattern = if sorted.is_empty() {
            None
        } else {
            let alt: Vec<String> = sorted
                .iter()
                .map(|(s, _)| fancy_regex::escape(s).into_owned())
                .collect();
            Some(Regex::new(&alt.join("|")).map_err(|e| bad(format!("special tokens: {e}")))?)
        };
        Ok(Tiktoken {
            ranks,
            decoder,
            specials: specials.iter().cloned().collect(),
            special_decoder: specials.iter().map(|(s, i)| (*i, s.clone())).collect(),
            pattern: Regex::new(pattern).map_err(|e| bad(format!("pattern: {e}")))?,
            special_pattern,
        })
    }

    /// `tiktoken.model` plus the special tokens of the `tokenizer_config.json` beside it,
    /// with Kimi's pattern.
    pub fn from_files(model: &Path, tokenizer_config: Option<&Path>) -> Result<Tiktoken> {
        let text = read_capped(model)?;
        let mut specials = Vec::new();
        if let Some(cfg) = tokenizer_config {
            let v: serde_json::Value =
                serde_json::from_str(&read_capped(cfg)?).map_err(|e| ChatError::BadFile {
                    path: cfg.to_path_buf(),
                    reason: e.to_string(),
                })?;
            if let Some(map) = v.get("added_tokens_decoder").and_then(|m| m.as_object()) {
                for (id, t) in map {
                    let id: u32 = id.parse().map_err(|_| ChatError::BadFile {
                        path: cfg.to_path_buf(),
                        reason: format!("added_tokens_decoder key `{id}` is not an id"),
                    })?;
                    if let Some(c) = t.get("content").and_then(|c| c.as_str()) {
                        specials.push((c.to_string(), id));
                    }
                }
            }
        }
        Tiktoken::new(&text, &specials, KIMI_PATTERN).map_err(|e| match e {
            ChatError::Tokenizer { reason, .. } => ChatError::BadFile {
                path: model.to_path_buf(),
                reason,
            },
            e => e,
        })
    }

    /// Token ids of `text`; special tokens in it are recognized when `allow_special`.
    pub fn encode(&self, text: &str, allow_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        let mut start = 0;
        if allow_special {
            if let Some(sp) = &self.special_pattern {
                for m in sp.find_iter(text).flatten() {
                    self.encode_ordinary(&text[start..m.start()], &mut out);
                    if let Some(&id) = self.specials.get(m.as_str()) {
                        out.push(id);
                    }
                    start = m.end();
                }
            }
        }
        self.encode_ordinary(&text[start..], &mut out);
        out
    }

    fn encode_ordinary(&self, text: &str, out: &mut Vec<u32>) {
        let mut pos = 0;
        while pos < text.len() {
            // A pattern error (backtracking limit) falls back to the rest as one piece.
            let m = match self.pattern.find_from_pos(text, pos) {
                Ok(Some(m)) if m.end() > pos => m,
                _ => {
                    self.merge(&text.as_bytes()[pos..], out);
                    return;
                }
            };
            if m.start() > pos {
                self.merge(&text.as_bytes()[pos..m.start()], out);
            }
            self.merge(m.as_str().as_bytes(), out);
            pos = m.end();
        }
    }

    /// tiktoken's byte-pair merge of one piece.
    fn merge(&self, piece: &[u8], out: &mut Vec<u32>) {
        if piece.is_empty() {
            return;
        }
        if let Some(&r) = self.ranks.get(piece) {
            out.push(r);
            return;
        }
        // Part boundaries; merge the adjacent pair of lowest rank until none has one.
        let mut bounds: Vec<usize> = (0..=piece.len()).collect();
        loop {
            let mut best: Option<(u32, usize)> = None;
            for i in 0..bounds.len().saturating_sub(2) {
                if let Some(&r) = self.ranks.get(&piece[bounds[i]..bounds[i + 2]]) {
                    if best.is_none_or(|(b, _)| r < b) {
                        best = Some((r, i));
                    }
                }
            }
            match best {
                Some((_, i)) => {
                    bounds.remove(i + 1);
                }
                None => break,
            }
        }
        for w in bounds.windows(2) {
            match self.ranks.get(&piece[w[0]..w[1]]) {
                Some(&r) => out.push(r),
                // A byte with no rank of its own: not a complete byte-level vocabulary.
                None => out.extend(
                    piece[w[0]..w[1]]
                        .iter()
                        .filter_map(|b| self.ranks.get(&[*b][..])),
                ),
            }
        }
    }

    /// The bytes of `ids` (special tokens as their text unless `skip_special`); unknown ids
    /// are skipped.
    pub fn decode_bytes(&self, ids: &[u32], skip_special: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for &id in ids {
            if let Some(s) = self.special_decoder.get(&id) {
                if !skip_special {
                    out.extend_from_slice(s.as_bytes());
                }
            } else if let Some(Some(b)) = self.decoder.get(id as usize) {
                out.extend_from_slice(b);
            }
        }
        out
    }

    /// The id of a special token.
    pub fn special_id(&self, text: &str) -> Option<u32> {
        self.specials.get(text).copied()
    }

    /// Ids the vocabulary spans (ordinary and special).
    pub fn vocab_size(&self) -> usize {
        self.decoder.len()
    }
}

fn read_capped(path: &Path) -> Result<String> {
    let io = |source| ChatError::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() || meta.len() > MAX_FILE_BYTES {
        return Err(ChatError::BadFile {
            path: path.to_path_buf(),
            reason: format!("not a regular file of at most {MAX_FILE_BYTES} bytes"),
        });
    }
    std::fs::read_to_string(path).map_err(io)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn tiny() -> Tiktoken {
        let b64 = |s: &[u8]| base64::engine::general_purpose::STANDARD.encode(s);
        let mut model = String::new();
        for b in 0u8..=255 {
            model.push_str(&format!("{} {}\n", b64(&[b]), b));
        }
        for (i, t) in ["ab", "abc", "he", "hel", "hell", "hello", " w"]
            .iter()
            .enumerate()
        {
            model.push_str(&format!("{} {}\n", b64(t.as_bytes()), 256 + i));
        }
        Tiktoken::new(&model, &[("<|end|>".into(), 300)], KIMI_PATTERN).unwrap()
    }

    #[test]
    fn merges_by_rank_and_cuts_at_special_tokens() {
        let t = tiny();
        assert_eq!(t.encode("abc", true), vec![257]);
        assert_eq!(t.encode("hello", true), vec![261]);
        assert_eq!(t.encode("abd", true), vec![256, b'd' as u32]);
        let ids = t.encode("hello<|end|>", true);
        assert_eq!(ids, vec![261, 300]);
        assert_eq!(t.encode("hello<|end|>", false).len(), 1 + "<|end|>".len());
        assert_eq!(t.decode_bytes(&ids, false), b"hello<|end|>");
        assert_eq!(t.decode_bytes(&ids, true), b"hello");
        // Non-ASCII round-trips through bytes.
        let s = "héllo 世界 123456";
        assert_eq!(t.decode_bytes(&t.encode(s, true), false), s.as_bytes());
    }
}
