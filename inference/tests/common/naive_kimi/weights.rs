//! Checkpoint access and plain math for the naive Kimi reference.
#![allow(dead_code, clippy::unwrap_used, clippy::needless_range_loop)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::safetensors::{self, Dtype};
use serde_json::Value;

// ---------------------------------------------------------------------------------------------
// Checkpoint access

/// Tensor bytes: through `Checkpoint` when it accepts the directory, else by reading the
/// safetensors files directly (the storage crate may not list the Kimi model types).
pub(crate) enum Source {
    Ck(Checkpoint),
    Raw(Vec<(safetensors::Header, Vec<u8>)>),
}

impl Source {
    pub(crate) fn open(dir: &Path) -> (Source, Value) {
        if let Ok(ck) = Checkpoint::open(dir) {
            let config = ck.config.clone();
            return (Source::Ck(ck), config);
        }
        let config: Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        let index = dir.join("model.safetensors.index.json");
        let mut files: Vec<PathBuf> = if index.exists() {
            let v: Value = serde_json::from_slice(&std::fs::read(&index).unwrap()).unwrap();
            let mut names: Vec<String> = v["weight_map"]
                .as_object()
                .unwrap()
                .values()
                .map(|f| f.as_str().unwrap().to_string())
                .collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            std::fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| {
                    p.extension().and_then(|e| e.to_str()) == Some("safetensors")
                        && p.file_name().and_then(|n| n.to_str()) != Some("reference.safetensors")
                })
                .collect()
        };
        files.sort();
        assert!(!files.is_empty(), "no safetensors in {}", dir.display());
        let shards = files
            .iter()
            .map(|f| {
                let bytes = std::fs::read(f).unwrap();
                let header = safetensors::parse_bytes(&bytes).unwrap();
                (header, bytes)
            })
            .collect();
        (Source::Raw(shards), config)
    }

    /// (dtype, shape, bytes) of a tensor.
    pub(crate) fn get(&self, name: &str) -> Option<(Dtype, Vec<usize>, &[u8])> {
        let shape = |s: &[u64]| s.iter().map(|&d| d as usize).collect::<Vec<usize>>();
        match self {
            Source::Ck(ck) => {
                let t = ck.get(name)?;
                Some((t.info.dtype.clone(), shape(&t.info.shape), ck.bytes(name)?))
            }
            Source::Raw(shards) => shards.iter().find_map(|(h, b)| {
                h.get(name).map(|t| {
                    (
                        t.dtype.clone(),
                        shape(&t.shape),
                        &b[t.offset as usize..(t.offset + t.len) as usize],
                    )
                })
            }),
        }
    }
}

/// A `[rows, cols]` matrix in f32.
pub(crate) struct Mat {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) w: Vec<f32>,
}

pub(crate) struct W {
    pub(crate) src: Source,
    /// `language_model.` for K3 checkpoints, empty otherwise.
    pub(crate) prefix: String,
    pub(crate) vecs: RefCell<HashMap<String, Rc<Vec<f32>>>>,
    pub(crate) mats: RefCell<HashMap<String, Rc<Mat>>>,
}

pub(crate) fn widen(name: &str, dtype: &Dtype, b: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::Bf16 => b
            .chunks_exact(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        d => panic!("{name}: unexpected dtype {d}"),
    }
}

/// E2M1 magnitudes by 3-bit index.
pub(crate) const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// MXFP4 (`weight_packed` U8 [out, in/2], `weight_scale` U8 [out, in/32]) to f32 [out, in]:
/// element 2b is the low nibble of byte b, 2b+1 the high one; nibble = sign (bit 3) | E2M1
/// index; scale = 2^(e − 127).
pub fn decode_mxfp4(packed: &[u8], scale: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    assert_eq!(packed.len(), rows * cols / 2);
    let groups = scale.len() / rows;
    assert_eq!(groups * rows, scale.len());
    assert_eq!(
        cols.div_ceil(32),
        groups,
        "weight_scale has {groups} groups per row"
    );
    let mut w = vec![0f32; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            let byte = packed[r * cols / 2 + c / 2];
            let nib = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
            let mag = E2M1[(nib & 7) as usize] as f64;
            let e = scale[r * groups + c / 32] as i32;
            let v = mag * 2f64.powi(e - 127);
            w[r * cols + c] = if nib & 8 != 0 { -v as f32 } else { v as f32 };
        }
    }
    w
}

impl W {
    pub(crate) fn full(&self, name: &str) -> String {
        format!("{}{}", self.prefix, name)
    }

    pub(crate) fn has(&self, name: &str) -> bool {
        self.src.get(&self.full(name)).is_some()
    }

    pub(crate) fn shape(&self, name: &str) -> Vec<usize> {
        let full = self.full(name);
        self.src
            .get(&full)
            .unwrap_or_else(|| panic!("missing {full}"))
            .1
    }

    pub(crate) fn dtype(&self, name: &str) -> Dtype {
        let full = self.full(name);
        self.src
            .get(&full)
            .unwrap_or_else(|| panic!("missing {full}"))
            .0
    }

    /// Any float tensor as a flat f32 vector.
    pub(crate) fn t(&self, name: &str) -> Rc<Vec<f32>> {
        if let Some(v) = self.vecs.borrow().get(name) {
            return v.clone();
        }
        let full = self.full(name);
        let (d, _, b) = self
            .src
            .get(&full)
            .unwrap_or_else(|| panic!("missing {full}"));
        let v = Rc::new(widen(&full, &d, b));
        self.vecs.borrow_mut().insert(name.to_string(), v.clone());
        v
    }

    /// The weight of linear `prefix`: `.weight` (BF16/F32) or MXFP4 `.weight_packed` +
    /// `.weight_scale`.
    pub(crate) fn mat(&self, prefix: &str) -> Rc<Mat> {
        if let Some(m) = self.mats.borrow().get(prefix) {
            return m.clone();
        }
        let wn = format!("{prefix}.weight");
        let m = if self.has(&wn) {
            let s = self.shape(&wn);
            assert_eq!(s.len(), 2, "{wn}: {s:?}");
            Mat {
                rows: s[0],
                cols: s[1],
                w: self.t(&wn).to_vec(),
            }
        } else {
            let pn = self.full(&format!("{prefix}.weight_packed"));
            let sn = self.full(&format!("{prefix}.weight_scale"));
            let (pd, ps, pb) = self
                .src
                .get(&pn)
                .unwrap_or_else(|| panic!("missing {} (or {pn})", self.full(&wn)));
            let (sd, ss, sb) = self.src.get(&sn).unwrap_or_else(|| panic!("missing {sn}"));
            assert_eq!(
                (pd, sd),
                (Dtype::U8, Dtype::U8),
                "{pn}: only MXFP4 (U8) is known"
            );
            assert_eq!(ps.len(), 2);
            assert_eq!(ss[0], ps[0]);
            let (rows, cols) = (ps[0], ps[1] * 2);
            Mat {
                rows,
                cols,
                w: decode_mxfp4(pb, sb, rows, cols),
            }
        };
        let m = Rc::new(m);
        self.mats.borrow_mut().insert(prefix.to_string(), m.clone());
        m
    }

    /// `W x (+ b)`.
    pub(crate) fn lin(&self, prefix: &str, x: &[f32]) -> Vec<f32> {
        let m = self.mat(prefix);
        let mut y = matvec(&m.w, m.rows, m.cols, x);
        let bn = format!("{prefix}.bias");
        if self.has(&bn) {
            for (y, b) in y.iter_mut().zip(self.t(&bn).iter()) {
                *y += b;
            }
        }
        y
    }
}

// ---------------------------------------------------------------------------------------------
// Math helpers

pub(crate) fn matvec(w: &[f32], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
    assert_eq!(
        x.len(),
        cols,
        "matvec: input has {} values, matrix {rows}x{cols}",
        x.len()
    );
    assert_eq!(w.len(), rows * cols);
    (0..rows)
        .map(|r| {
            let row = &w[r * cols..(r + 1) * cols];
            row.iter()
                .zip(x)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>() as f32
        })
        .collect()
}

/// `w * x / sqrt(mean(x²) + eps)`.
pub(crate) fn rms(x: &[f32], w: &[f32], eps: f64) -> Vec<f32> {
    assert_eq!(x.len(), w.len());
    let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, w)| (*v as f64 * inv * *w as f64) as f32)
        .collect()
}

pub(crate) fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

pub(crate) fn silu(x: f64) -> f64 {
    x * sigmoid(x)
}

pub(crate) fn softplus(x: f64) -> f64 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x / sqrt(Σx² + 1e-6)`.
pub(crate) fn l2norm(x: &[f32]) -> Vec<f64> {
    let ss: f64 = x.iter().map(|v| (*v as f64).powi(2)).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt();
    x.iter().map(|v| *v as f64 * inv).collect()
}

pub(crate) fn softmax(v: &[f64]) -> Vec<f64> {
    let m = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = v.iter().map(|x| (x - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

/// Indices of `v` in descending order (ties by lower index).
pub(crate) fn order(v: &[f64]) -> Vec<usize> {
    let mut i: Vec<usize> = (0..v.len()).collect();
    i.sort_by(|&a, &b| v[b].partial_cmp(&v[a]).unwrap().then(a.cmp(&b)));
    i
}

pub(crate) fn flat(rows: &[Vec<f32>]) -> Vec<f32> {
    rows.iter().flatten().cloned().collect()
}

pub(crate) fn add(a: &[Vec<f32>], b: &[Vec<f32>]) -> Vec<Vec<f32>> {
    a.iter()
        .zip(b)
        .map(|(x, y)| x.iter().zip(y).map(|(p, q)| p + q).collect())
        .collect()
}
