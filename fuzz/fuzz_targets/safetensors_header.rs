//! Any bytes: the safetensors parser returns a header or an error, never panics, and every
//! tensor it accepts lies inside the input.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = deltafin_storage::safetensors::parse_bytes(data) {
        for t in &h.tensors {
            assert!(t.offset + t.len <= data.len() as u64);
        }
    }
});
