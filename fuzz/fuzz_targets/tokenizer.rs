//! Any bytes as `tokenizer.json`, and any text through a loaded tokenizer, the way deltafin
//! handles them (tools/src/generate/tokenizer.rs): loading returns a tokenizer or an error,
//! encoding and decoding never take the process down. The tokenizers crate panics on some
//! malformed files (found by this target: a bad `decoder` panics in its deserializer), so
//! deltafin catches panics around every tokenizer call; this target does the same and fails
//! only on what would still escape (an abort, a hang, runaway memory).
#![no_main]
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Once;

use libfuzzer_sys::fuzz_target;
use tokenizers::Tokenizer;

fuzz_target!(|data: &[u8]| {
    static QUIET: Once = Once::new();
    // libFuzzer's hook turns every panic into a crash; deltafin catches these.
    QUIET.call_once(|| std::panic::set_hook(Box::new(|_| {})));
    let split = data.iter().position(|&b| b == 0).unwrap_or(data.len());
    let (json, text) = data.split_at(split);
    let text = String::from_utf8_lossy(text.get(1..).unwrap_or(&[])).into_owned();
    let _ = catch_unwind(AssertUnwindSafe(|| {
        if let Ok(t) = Tokenizer::from_bytes(json) {
            if let Ok(enc) = t.encode(text.as_str(), true) {
                let _ = t.decode(enc.get_ids(), true);
                let _ = t.decode(enc.get_ids(), false);
            }
            let _ = t.decode(&[0, 1, 2, u32::MAX], true);
        }
    }));
});
