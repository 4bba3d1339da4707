//! Shared test helpers: fixture paths, reference tensors, tolerance checks.
#![allow(dead_code, clippy::unwrap_used)]

pub mod naive;
pub mod synth;

use std::path::{Path, PathBuf};

use deltafin_storage::safetensors::{self, Dtype};

pub fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/fixtures")
        .join(name)
}

/// A safetensors file read fully into memory.
pub struct Reference {
    bytes: Vec<u8>,
    header: safetensors::Header,
}

impl Reference {
    pub fn open(path: &Path) -> Reference {
        let bytes = std::fs::read(path).unwrap();
        let header = safetensors::parse_bytes(&bytes).unwrap();
        Reference { bytes, header }
    }

    pub fn has(&self, name: &str) -> bool {
        self.header.get(name).is_some()
    }

    pub fn shape(&self, name: &str) -> Vec<usize> {
        self.header
            .get(name)
            .unwrap_or_else(|| panic!("no {name}"))
            .shape
            .iter()
            .map(|&d| d as usize)
            .collect()
    }

    fn raw(&self, name: &str) -> (&Dtype, &[u8]) {
        let t = self
            .header
            .get(name)
            .unwrap_or_else(|| panic!("reference has no `{name}`"));
        (
            &t.dtype,
            &self.bytes[t.offset as usize..(t.offset + t.len) as usize],
        )
    }

    pub fn f32(&self, name: &str) -> Vec<f32> {
        let (d, b) = self.raw(name);
        assert_eq!(*d, Dtype::F32, "{name}");
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    pub fn i64(&self, name: &str) -> Vec<i64> {
        let (d, b) = self.raw(name);
        assert_eq!(*d, Dtype::I64, "{name}");
        b.chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.header.metadata.get(key).map(|s| s.as_str())
    }
}

/// `len` deterministic pseudo-random values in [-0.5, 0.5) (a 64-bit LCG from `seed`).
/// [`lcg_values`] times `scale`.
pub fn lcg_scaled(len: usize, seed: u64, scale: f32) -> Vec<f32> {
    lcg_values(len, seed)
        .into_iter()
        .map(|v| v * scale)
        .collect()
}

pub fn lcg_values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// max |a - b|
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn max_abs(a: &[f32]) -> f32 {
    a.iter().map(|x| x.abs()).fold(0.0, f32::max)
}

/// `max|ours - ref| <= 1e-3 * (1 + max|ref|)`; returns the error.
pub fn assert_close(what: &str, ours: &[f32], reference: &[f32]) -> f32 {
    let err = max_abs_diff(ours, reference);
    let tol = 1e-3 * (1.0 + max_abs(reference));
    assert!(err <= tol, "{what}: max abs error {err} > tolerance {tol}");
    err
}

pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// A BF16 synthetic checkpoint of `arch` at the `tiny` preset (with `--set` overrides `sets`)
/// in `dir`, as `deltafin synth` writes it.
pub fn synth_preset(dir: &Path, arch: &str, seed: u64, sets: &[&str]) {
    use deltafin_inference::synth::presets::{apply_overrides, preset_config};
    use deltafin_inference::synth::{write_synth, SynthFormat};
    let mut cfg = preset_config(arch, "tiny").unwrap();
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    apply_overrides(&mut cfg, &sets).unwrap();
    let opts = deltafin_storage::checkpoint_writer::WriteOptions {
        seed,
        shard_bytes: 1 << 30,
        force: false,
    };
    write_synth(
        dir,
        &cfg,
        SynthFormat::Bf16,
        &opts,
        &deltafin_storage::layout::NoProgress,
    )
    .unwrap();
}

/// Each of the `n` inputs in `x` alone (decode) through `m` equals its row of `all` (the
/// product of all `n` at once, `[n, m.rows()]`) bit for bit.
pub fn assert_each_input_alone_equals_its_row(
    m: &deltafin_inference::linear::WeightMatrix<'_>,
    x: &[f32],
    n: usize,
    all: &[f32],
) {
    let (rows, cols) = (m.rows(), m.cols());
    for t in 0..n {
        let mut one = vec![0f32; rows];
        m.matmul(&x[t * cols..(t + 1) * cols], 1, &mut one);
        for r in 0..rows {
            assert_eq!(
                one[r].to_bits(),
                all[t * rows + r].to_bits(),
                "{rows}x{cols} n={n}: input {t} row {r} alone differs"
            );
        }
    }
}
