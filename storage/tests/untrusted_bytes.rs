//! Stable-toolchain companions of the cargo-fuzz targets: random and mutated inputs to the
//! safetensors header parser and the manifest parser never panic.

#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report

mod common;

use deltafin_storage::manifest::Manifest;
use deltafin_storage::safetensors::{parse_bytes, write_header, Dtype, TensorSpec};
use proptest::prelude::*;

fn valid_file() -> Vec<u8> {
    let specs = vec![
        TensorSpec::new("a", Dtype::Bf16, &[4, 4]),
        TensorSpec::new("b", Dtype::F32, &[3]),
    ];
    let mut out = Vec::new();
    write_header(&mut out, &specs, &Default::default()).unwrap();
    out.extend(std::iter::repeat_n(1u8, 32 + 12));
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn safetensors_random_bytes(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(h) = parse_bytes(&data) {
            for t in &h.tensors {
                prop_assert!(t.offset + t.len <= data.len() as u64);
            }
        }
    }

    #[test]
    fn safetensors_mutated(pos in 0usize..200, byte in any::<u8>(), cut in 0usize..200) {
        let mut f = valid_file();
        let p = pos % f.len();
        f[p] = byte;
        let cut = f.len() - cut % f.len();
        f.truncate(cut);
        if let Ok(h) = parse_bytes(&f) {
            for t in &h.tensors {
                prop_assert!(t.offset + t.len <= f.len() as u64);
            }
        }
    }

    #[test]
    fn manifest_random_json(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = Manifest::from_bytes(std::path::Path::new("m.json"), &data);
    }
}

/// Single-byte mutations and truncations of a real manifest never panic, and whatever still
/// parses passes validation (records inside the logical space).
#[test]
fn manifest_mutations() {
    use deltafin_storage::layout::{write_layout, LayoutOptions, NoProgress};
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    let ck = common::write_model(&model, common::MODEL_B, 3);
    let d = tmp.path().join("d0");
    std::fs::create_dir_all(&d).unwrap();
    let opts = LayoutOptions {
        name: "m".into(),
        drives: vec![d.clone()],
        mode: deltafin_storage::stripe::Mode::Stripe,
        stripe_unit: 8192,
        force: false,
        naming: common::naming(),
        transform: None,
        keep_free: 0,
    };
    write_layout(&ck, &opts, &NoProgress).unwrap();
    let bytes = std::fs::read(d.join("m/manifest.json")).unwrap();
    let path = std::path::Path::new("m.json");
    assert!(Manifest::from_bytes(path, &bytes).is_ok());
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut rejected = 0;
    for i in 0..3000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let mut m = bytes.clone();
        if i % 3 == 0 {
            m.truncate((state % bytes.len() as u64) as usize);
        } else {
            let p = (state % bytes.len() as u64) as usize;
            m[p] = (state >> 32) as u8;
        }
        match Manifest::from_bytes(path, &m) {
            Ok(parsed) => {
                for r in &parsed.records {
                    assert!(r.offset + r.len <= parsed.logical_len);
                }
            }
            Err(_) => rejected += 1,
        }
    }
    assert!(
        rejected > 500,
        "mutations should mostly be rejected, got {rejected}"
    );
}
