//! Any bytes as a session snapshot: decoding against a real model (the DeepSeek-V3 fixture)
//! returns a session or an error, never panics or allocates past the file's own size; an
//! accepted snapshot's session holds as many positions as its token history.
#![no_main]
use std::sync::{Arc, OnceLock};

use deltafin_inference::{snapshot, DirSource, Model};
use libfuzzer_sys::fuzz_target;

fn model() -> &'static (Model, [u8; 32]) {
    static M: OnceLock<(Model, [u8; 32])> = OnceLock::new();
    M.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../testdata/fixtures/deepseek_v3_a");
        let model = Model::load(Arc::new(DirSource::open(&dir).expect("fixture"))).expect("load");
        let hash = snapshot::model_hash(&model, b"");
        (model, hash)
    })
}

fuzz_target!(|data: &[u8]| {
    let (model, hash) = model();
    // Half the inputs carry the right framing (magic, version, model hash) so the fuzzer
    // reaches the layer arrays; the checksum is recomputed over whatever follows.
    let sealed;
    let bytes = if data.first().is_some_and(|b| b & 1 == 1) && data.len() > 1 {
        let mut b = b"DFSNAP\r\n".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(hash);
        b.extend_from_slice(&data[1..]);
        let sum = *blake3::hash(&b).as_bytes();
        b.extend_from_slice(&sum);
        sealed = b;
        &sealed[..]
    } else {
        data
    };
    if let Ok((session, history)) = snapshot::decode(bytes, model, hash) {
        assert_eq!(session.len(), history.len());
    }
});
