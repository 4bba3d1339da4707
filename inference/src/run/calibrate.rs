//! The compute rates `deltafin plan` predicts with, measured on this machine in about two seconds:
//! each format's matrix-vector products streaming weights from DRAM (decode) and 32-input
//! products (prefill), on the kernels the runtime would use.

use std::collections::BTreeMap;
use std::time::Instant;

use deltafin_formats::quantize::{quantize_int4, quantize_mxfp4, quantize_q8};
use deltafin_formats::{ScaleType, WeightFormat};

use crate::kernels::KernelConfig;
use crate::linear::matrix::WeightMatrix;
use crate::run::plan::ComputeRates;

/// `w` (`[rows, cols]`) stored in the format named `name` (`q8`, `int4`, `mxfp4`, anything
/// else BF16), group 32: the format, weight bytes, scale bytes and scale type a
/// [`WeightMatrix`] takes.
pub fn packed_matrix(
    name: &str,
    w: &[f32],
    rows: usize,
    cols: usize,
) -> (WeightFormat, Vec<u8>, Vec<u8>, ScaleType) {
    match name {
        "q8" => {
            let q = quantize_q8(w, rows, cols, 32);
            (
                WeightFormat::Q8 { group: 32 },
                q.data,
                q.scale,
                ScaleType::F16,
            )
        }
        "int4" => {
            let q = quantize_int4(w, rows, cols, 32);
            (
                WeightFormat::Int4 { group: 32 },
                q.data,
                q.scale,
                ScaleType::Bf16,
            )
        }
        "mxfp4" => {
            let q = quantize_mxfp4(w, rows, cols, 32);
            (
                WeightFormat::Mxfp4 { group: 32 },
                q.data,
                q.scale,
                ScaleType::E8m0,
            )
        }
        _ => (
            WeightFormat::Bf16,
            w.iter()
                .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
                .collect(),
            Vec::new(),
            ScaleType::None,
        ),
    }
}

/// One format's copies of the test matrix, enough that they do not fit any cache.
struct Ring {
    name: String,
    format: WeightFormat,
    scale: Vec<u8>,
    scale_type: ScaleType,
    copies: Vec<Vec<u8>>,
}

/// Measure this machine's kernels for `formats` (names as [`ExpertFormat`] and `bf16`):
/// matrix-vector products over a 256 MiB ring of 4096x4096 matrices (weights from DRAM, as
/// decode reads them) and 32-input products of one matrix (prefill), the median of five rounds.
/// About two seconds.
pub fn calibrate(formats: &[String]) -> ComputeRates {
    let kernels = KernelConfig::default();
    let (rows, cols) = (4096usize, 4096usize);
    let mut seed = 0x9e37_79b9u64;
    let w: Vec<f32> = (0..rows * cols)
        .map(|_| {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
        })
        .collect();
    let x: Vec<f32> = (0..32 * cols)
        .map(|i| ((i % 97) as f32 - 48.0) / 64.0)
        .collect();
    let mut out = vec![0f32; 32 * rows];
    // Every format's ring, built before any timing.
    let rings: Vec<Ring> = formats
        .iter()
        .map(|name| {
            let (format, data, scale, scale_type) = packed_matrix(name, &w, rows, cols);
            let copies = ((256usize << 20) / data.len().max(1)).max(2);
            Ring {
                name: name.clone(),
                format,
                scale,
                scale_type,
                copies: vec![data; copies],
            }
        })
        .collect();
    let matrices: Vec<(&str, usize, Vec<WeightMatrix<'_>>)> = rings
        .iter()
        .map(|r| {
            let mats = r
                .copies
                .iter()
                .filter_map(|d| {
                    WeightMatrix::new(rows, cols, r.format, d, &r.scale, r.scale_type)
                        .ok()
                        .map(|m| m.with_kernels(kernels))
                })
                .collect();
            let len = r.copies.first().map_or(0, Vec::len);
            (r.name.as_str(), len, mats)
        })
        .collect();
    // Rounds taking turns between the formats, and each format's median round: on a shared
    // machine one pass can run at two thirds of the next one's speed, and the formats should
    // be measured at the same moments.
    const ROUNDS: usize = 5;
    const PASSES: usize = 2;
    let mut vec_rounds: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut mat_rounds: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for (_, _, mats) in &matrices {
        for m in mats {
            m.matmul(&x[..cols], 1, &mut out[..rows]); // warm-up
        }
    }
    for _ in 0..ROUNDS {
        for (name, len, mats) in &matrices {
            let t = Instant::now();
            for _ in 0..PASSES {
                for m in mats {
                    m.matmul(&x[..cols], 1, &mut out[..rows]);
                }
            }
            let secs = t.elapsed().as_secs_f64().max(1e-9);
            vec_rounds
                .entry(name)
                .or_default()
                .push((PASSES * mats.len() * len) as f64 / secs);
            if let Some(m) = mats.first() {
                let t = Instant::now();
                for _ in 0..PASSES {
                    m.matmul(&x, 32, &mut out);
                }
                let secs = t.elapsed().as_secs_f64().max(1e-9);
                mat_rounds
                    .entry(name)
                    .or_default()
                    .push((PASSES * 32 * rows * cols) as f64 / secs);
            }
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let matvec: BTreeMap<String, f64> = vec_rounds
        .into_iter()
        .map(|(k, v)| (k.to_string(), median(v)))
        .collect();
    let matmul: BTreeMap<String, f64> = mat_rounds
        .into_iter()
        .map(|(k, v)| (k.to_string(), median(v)))
        .collect();
    ComputeRates {
        matvec_bytes_per_s: matvec,
        matmul_macs_per_s: matmul,
        kernels: kernels.label(),
        threads: rayon::current_num_threads(),
    }
}
