//! Any bytes: manifest parsing and validation return a manifest or an error, never panic; an
//! accepted manifest's records lie inside its logical space.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::path::Path::new("fuzz/manifest.json");
    if let Ok(m) = deltafin_storage::manifest::Manifest::from_bytes(path, data) {
        for r in &m.records {
            assert!(r.offset + r.len <= m.logical_len);
        }
        let p = m.placement();
        for r in m.records.iter().take(16) {
            let _ = p.pieces(r.offset, r.len.min(1 << 20));
        }
    }
});
