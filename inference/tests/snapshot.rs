//! Session snapshots: exact round trip (MLA and GQA), prefix reuse gives the cold run's tokens,
//! and every single flipped byte / every truncation / other model / newer version is refused.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::fixture_dir;
use deltafin_inference::snapshot::{
    self, decode, encode, model_hash, reuse_prefix, SnapshotError, SNAPSHOT_VERSION,
};
use deltafin_inference::{generate, DirSource, GenerateConfig, Model};

fn load(name: &str) -> Model {
    Model::load(Arc::new(DirSource::open(&fixture_dir(name)).unwrap())).unwrap()
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % 500).collect()
}

/// A session holding `toks` and its snapshot bytes.
fn snap(model: &Model, toks: &[u32]) -> Vec<u8> {
    let mut s = model.new_session();
    model.forward_last(&mut s, toks).unwrap();
    encode(model, &model_hash(model, b""), &s, toks).unwrap()
}

#[test]
fn round_trip_is_exact() {
    for name in ["qwen3_moe_a", "deepseek_v3_a"] {
        let model = load(name);
        let hash = model_hash(&model, b"");
        let toks = prompt(13);
        let mut a = model.new_session();
        model.forward_last(&mut a, &toks).unwrap();
        let bytes = encode(&model, &hash, &a, &toks).unwrap();
        let (mut b, hist) = decode(&bytes, &model, &hash).unwrap();
        assert_eq!(hist, toks);
        assert_eq!(b.len(), 13);
        // Continue both: identical logits (bit-exact cache).
        let la = model.forward(&mut a, &[5, 6, 7]).unwrap();
        let lb = model.forward(&mut b, &[5, 6, 7]).unwrap();
        assert_eq!(la.data, lb.data, "{name}");
        // Re-encoding the restored session (after rollback) gives the same bytes.
        b.truncate(13).unwrap();
        assert_eq!(encode(&model, &hash, &b, &toks).unwrap(), bytes, "{name}");
        // Empty sessions round-trip too.
        let e = encode(&model, &hash, &model.new_session(), &[]).unwrap();
        let (s, h) = decode(&e, &model, &hash).unwrap();
        assert!(s.is_empty() && h.is_empty());
    }
}

#[test]
fn history_must_match_session() {
    let model = load("qwen3_moe_a");
    let mut s = model.new_session();
    model.forward_last(&mut s, &[1, 2, 3]).unwrap();
    let err = encode(&model, &model_hash(&model, b""), &s, &[1, 2]).unwrap_err();
    assert!(matches!(err, SnapshotError::Unsupported(_)), "{err}");
}

#[test]
fn prefix_reuse_gives_the_cold_tokens() {
    for name in ["qwen3_moe_a", "deepseek_v3_a"] {
        let model = load(name);
        let hash = model_hash(&model, b"");
        let mut config = GenerateConfig::for_model(&model, 12);
        config.stop_tokens.clear();
        let full = prompt(40);
        let cold = generate(
            &model,
            &mut model.new_session(),
            &full,
            &config,
            &mut |_| true,
        )
        .unwrap()
        .tokens;
        for (saved_len, extra_diverging) in [(24usize, false), (40, false), (30, true)] {
            let mut saved = full[..saved_len].to_vec();
            if extra_diverging {
                // The snapshot continues differently after position 20.
                saved[20] = (saved[20] + 1) % 500;
            }
            let bytes = snap(&model, &saved);
            let (mut s, hist) = decode(&bytes, &model, &hash).unwrap();
            let reused = reuse_prefix(&mut s, &hist, &full).unwrap();
            let want = if extra_diverging {
                20
            } else {
                saved_len.min(full.len() - 1)
            };
            assert_eq!(reused, want, "{name}");
            assert_eq!(s.len(), reused);
            let warm = generate(&model, &mut s, &full[reused..], &config, &mut |_| true)
                .unwrap()
                .tokens;
            assert_eq!(warm, cold, "{name} saved {saved_len}");
        }
    }
}

fn refused(bytes: &[u8], model: &Model, hash: &[u8; 32]) -> bool {
    decode(bytes, model, hash).is_err()
}

#[test]
fn every_flipped_byte_and_every_cut_is_refused() {
    let model = load("qwen3_moe_a");
    let hash = model_hash(&model, b"");
    let bytes = snap(&model, &prompt(6));
    assert!(!refused(&bytes, &model, &hash));
    assert!(bytes.len() > 1000, "{}", bytes.len());
    let mut b = bytes.clone();
    for i in 0..bytes.len() {
        for mask in [0xFFu8, 0x01, 0x80] {
            b[i] ^= mask;
            assert!(refused(&b, &model, &hash), "flip {mask:#x} at {i} accepted");
            b[i] ^= mask;
        }
    }
    for cut in 0..bytes.len() {
        assert!(
            refused(&bytes[..cut], &model, &hash),
            "cut at {cut} accepted"
        );
    }
    // Appending bytes is refused too.
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(refused(&longer, &model, &hash));
}

#[test]
fn refusals_say_why() {
    let model = load("qwen3_moe_a");
    let hash = model_hash(&model, b"");
    let bytes = snap(&model, &prompt(5));
    let err = |b: &[u8]| decode(b, &model, &hash).unwrap_err();

    let mut b = bytes.clone();
    b[0] = b'X';
    assert!(matches!(err(&b), SnapshotError::BadMagic));
    assert!(matches!(
        err(&bytes[..bytes.len() - 1]),
        SnapshotError::Checksum
    ));
    assert!(matches!(err(&bytes[..20]), SnapshotError::Truncated { .. }));
    let mut b = bytes.clone();
    let mid = b.len() / 2;
    b[mid] ^= 4;
    assert!(matches!(err(&b), SnapshotError::Checksum));

    // A newer version (with a valid checksum) names both versions.
    let mut b = bytes[..bytes.len() - 32].to_vec();
    b[8..12].copy_from_slice(&(SNAPSHOT_VERSION + 1).to_le_bytes());
    let sum = *blake3::hash(&b).as_bytes();
    b.extend_from_slice(&sum);
    let e = err(&b);
    assert!(
        matches!(e, SnapshotError::NewerVersion { found, .. } if found == SNAPSHOT_VERSION + 1)
    );
    assert!(e.to_string().contains("newer"), "{e}");

    // Another model: another architecture, and the same config with other weights.
    let other = load("deepseek_v3_a");
    let e = decode(&bytes, &other, &model_hash(&other, b"")).unwrap_err();
    assert!(matches!(e, SnapshotError::OtherModel { .. }), "{e}");
    assert!(e.to_string().contains("another model"));
    let (a, b) = (load("deepseek_v3_a"), load("deepseek_v3_fp8"));
    assert_ne!(model_hash(&a, b""), model_hash(&b, b""));
    // Caller bytes (a layout's manifest) change the hash.
    assert_ne!(model_hash(&model, b"m1"), model_hash(&model, b"m2"));
    assert_eq!(
        model_hash(&model, b"m1"),
        model_hash(&load("qwen3_moe_a"), b"m1")
    );
}

#[test]
fn same_config_other_weights_is_another_model() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    for (p, seed) in [(&a, 1u64), (&b, 2u64)] {
        common::synth_preset(p, "qwen3_moe", seed, &[]);
    }
    let ma = Model::load(Arc::new(DirSource::open(&a).unwrap())).unwrap();
    let mb = Model::load(Arc::new(DirSource::open(&b).unwrap())).unwrap();
    let bytes = snap(&ma, &[1, 2, 3]);
    let e = decode(&bytes, &mb, &model_hash(&mb, b"")).unwrap_err();
    assert!(matches!(e, SnapshotError::OtherModel { .. }), "{e}");
}

#[test]
fn save_is_atomic_and_load_reads_back() {
    let model = load("deepseek_v3_a");
    let hash = model_hash(&model, b"");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.dfsnap");
    let toks = prompt(9);
    let mut s = model.new_session();
    model.forward_last(&mut s, &toks).unwrap();
    snapshot::save(&path, &model, &hash, &s, &toks).unwrap();
    // Overwrite with a longer one; no temp files are left behind.
    model.forward_last(&mut s, &[3]).unwrap();
    let mut toks2 = toks.clone();
    toks2.push(3);
    snapshot::save(&path, &model, &hash, &s, &toks2).unwrap();
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    let (r, hist) = snapshot::load(&path, &model, &hash).unwrap();
    assert_eq!(hist, toks2);
    assert_eq!(r.len(), 10);
    let missing = snapshot::load(&dir.path().join("nope"), &model, &hash).unwrap_err();
    assert!(matches!(missing, SnapshotError::Io { .. }));
    assert!(missing.to_string().contains("nope"));
    // Saving into a missing directory fails cleanly.
    let bad = dir.path().join("no/such/dir/s");
    assert!(snapshot::save(&bad, &model, &hash, &s, &toks2).is_err());
}

/// With recorded outputs, a prompt that lies entirely inside the snapshot resumes without a
/// forward pass (the first token's logits come from the stored output of its last position),
/// and generates exactly the cold run's tokens; a prompt ending earlier inside it too.
#[test]
fn recorded_outputs_resume_the_whole_prompt() {
    for name in ["qwen3_moe_a", "deepseek_v3_a"] {
        let model = load(name);
        let hash = model_hash(&model, b"");
        let mut config = GenerateConfig::for_model(&model, 10);
        config.stop_tokens.clear();
        let full = prompt(40);
        // A cold run that records outputs, saved like `generate --save-session` does.
        let mut s = model.new_session();
        model.record_outputs(&mut s);
        let cold = generate(&model, &mut s, &full, &config, &mut |_| true)
            .unwrap()
            .tokens;
        let mut history = full.clone();
        history.extend_from_slice(&cold);
        history.truncate(s.len());
        let bytes = encode(&model, &hash, &s, &history).unwrap();
        for cut in [40usize, 25] {
            let p = &full[..cut];
            let want = generate(&model, &mut model.new_session(), p, &config, &mut |_| true)
                .unwrap()
                .tokens;
            let (mut s, hist) = decode(&bytes, &model, &hash).unwrap();
            let reused = reuse_prefix(&mut s, &hist, p).unwrap();
            assert_eq!(reused, cut, "{name}: the whole prompt is reused");
            // The stored output gives the logits a forward pass over the last token would.
            let stored = model.logits_from_recorded(&s).unwrap();
            let mut fresh = model.new_session();
            let recomputed = model.forward_last(&mut fresh, p).unwrap();
            let err = stored
                .iter()
                .zip(&recomputed)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                err < 1e-4,
                "{name}: stored vs recomputed logits differ by {err}"
            );
            let warm = generate(&model, &mut s, &[], &config, &mut |_| true)
                .unwrap()
                .tokens;
            assert_eq!(warm, want, "{name}: prompt of {cut}");
        }
        // Without recorded outputs the last prompt token is fed again.
        let plain = snap(&model, &full);
        let (mut s, hist) = decode(&plain, &model, &hash).unwrap();
        assert_eq!(reuse_prefix(&mut s, &hist, &full).unwrap(), full.len() - 1);
    }
}

/// Every flipped byte and cut inside the outputs section of a snapshot that has one is refused.
#[test]
fn corrupt_outputs_section_is_refused() {
    let model = load("qwen3_moe_a");
    let hash = model_hash(&model, b"");
    let toks = prompt(3);
    let mut s = model.new_session();
    model.record_outputs(&mut s);
    model.forward_last(&mut s, &toks).unwrap();
    let bytes = encode(&model, &hash, &s, &toks).unwrap();
    assert!(!refused(&bytes, &model, &hash));
    let section = 17 + 3 * model.hidden_size() * 4 + 32;
    let mut b = bytes.clone();
    for i in bytes.len() - section..bytes.len() {
        b[i] ^= 0x01;
        assert!(refused(&b, &model, &hash), "flip at {i} accepted");
        b[i] ^= 0x01;
        assert!(refused(&bytes[..i], &model, &hash), "cut at {i} accepted");
    }
}

/// A version 3 snapshot of a model without recurrent state, rewritten without the per-layer
/// fixed-array counts (all zero) that version 3 added: a version 2 body, checksum dropped.
fn v2_body(v3: &[u8]) -> Vec<u8> {
    let body = &v3[..v3.len() - 32];
    let u32_at = |i: usize| u32::from_le_bytes(body[i..i + 4].try_into().unwrap()) as usize;
    let u64_at = |i: usize| u64::from_le_bytes(body[i..i + 8].try_into().unwrap()) as usize;
    let mut pos = 8 + 4 + 32;
    pos += 8 + 4 * u64_at(pos);
    let layers = u32_at(pos);
    pos += 4;
    let mut out = body[..pos].to_vec();
    for _ in 0..layers {
        let start = pos;
        let arrays = u32_at(pos);
        pos += 4;
        for _ in 0..arrays {
            pos += 8 + 4 * u64_at(pos);
        }
        out.extend_from_slice(&body[start..pos]);
        assert_eq!(
            u32_at(pos),
            0,
            "a fixed-size state: no older version can hold it"
        );
        pos += 4;
    }
    out.extend_from_slice(&body[pos..]);
    out
}

fn seal(mut body: Vec<u8>, version: u32) -> Vec<u8> {
    body[8..12].copy_from_slice(&version.to_le_bytes());
    let sum = *blake3::hash(&body).as_bytes();
    body.extend_from_slice(&sum);
    body
}

/// Version 1 files (written before the outputs section existed) and version 2 files (before
/// recurrent states) still load.
#[test]
fn version_1_and_2_snapshots_still_load() {
    let model = load("deepseek_v3_a");
    let hash = model_hash(&model, b"");
    let toks = prompt(9);
    let v3 = snap(&model, &toks);
    let v2 = v2_body(&v3);
    // Version 1: no outputs section (flag, start, count; empty here).
    let v1 = seal(v2[..v2.len() - 17].to_vec(), 1);
    let v2 = seal(v2, 2);
    for (version, bytes) in [(1, &v1), (2, &v2)] {
        let (s, hist) = decode(bytes, &model, &hash).unwrap();
        assert_eq!(hist, toks, "v{version}");
        assert_eq!(s.len(), toks.len(), "v{version}");
        assert!(!s.has_output(toks.len() - 1), "v{version}");
    }
}
