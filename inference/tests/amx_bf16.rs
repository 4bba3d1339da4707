//! `Act::Bf16x2` (BF16 weights on AMX tiles, each f32 input split into two BF16 values): every
//! output within a budget of the exact f32 reference, a matrix-vector product equal to the
//! matching row of a matrix product bit for bit (chunked prefill equals decoding token by
//! token), and many products in one pass (`matmul_jobs`) equal to each alone. Skipped where the
//! CPU has no AMX-BF16 (the config then picks the f32 path, checked here too).
mod common;

use deltafin_formats::WeightFormat;
use deltafin_inference::kernels::{matmul_jobs, scalar, Act, KernelConfig, MatmulJob};
use deltafin_inference::linear::WeightMatrix;
use deltafin_inference::run::calibrate::packed_matrix;

use common::lcg_scaled as values;

fn config() -> Option<KernelConfig> {
    let k = KernelConfig {
        amx: true,
        ..KernelConfig::best()
    };
    if k.act(WeightFormat::Bf16) == Act::Bf16x2 {
        Some(k)
    } else {
        eprintln!("no AMX-BF16 here: BF16 weights take the f32 path");
        None
    }
}

#[test]
fn amx_is_only_chosen_where_asked_and_available() {
    // Not by default.
    assert_eq!(KernelConfig::best().act(WeightFormat::Bf16), Act::F32);
    let asked = KernelConfig {
        amx: true,
        ..KernelConfig::best()
    };
    let f32_acts = KernelConfig {
        f32_activations: true,
        ..asked
    };
    assert_eq!(f32_acts.act(WeightFormat::Bf16), Act::F32);
    // Never for other formats, nor below AVX-512.
    assert_ne!(asked.act(WeightFormat::F16), Act::Bf16x2);
    let avx2 = KernelConfig {
        amx: true,
        ..KernelConfig::with_isa(deltafin_inference::kernels::Isa::Avx2)
    };
    assert_eq!(avx2.act(WeightFormat::Bf16), Act::F32);
}

#[test]
fn amx_products_match_the_f32_reference_and_decode_equals_prefill() {
    let Some(k) = config() else {
        return;
    };
    for &(rows, cols) in &[
        (1, 32),
        (5, 96),
        (16, 64),
        (70, 1024),
        (130, 512),
        (7, 2048),
        // Tasks of 128 rows of 2 KiB (sized by bytes): with fewer than 16 inputs each is one
        // span of rows 16 KiB apart, and a tail after.
        (300, 1024),
    ] {
        let w = values(rows * cols, rows as u64 * 31 + cols as u64, 0.2);
        let (format, data, scale, st) = packed_matrix("bf16", &w, rows, cols);
        assert_eq!(format, WeightFormat::Bf16);
        let m = WeightMatrix::new(rows, cols, format, &data, &scale, st)
            .expect("matrix")
            .with_kernels(k);
        let exact = WeightMatrix::new(rows, cols, format, &data, &scale, st)
            .expect("matrix")
            .with_kernels(KernelConfig::with_isa(
                deltafin_inference::kernels::Isa::Scalar,
            ));
        let rb = 2 * cols;
        for &n in &[1usize, 2, 5, 16, 17, 33] {
            let mut x = values(n * cols, n as u64 + 7, 4.0);
            // Values the split handles apart: a tie, a subnormal, both zeros, a large one.
            x[0] = 1.0 + 1.0 / 256.0;
            if x.len() > 3 {
                (x[1], x[2], x[3]) = (1e-40, -0.0, 3.0e4);
            }
            let mut out = vec![0f32; n * rows];
            m.matmul(&x, n, &mut out);
            let mut reference = vec![0f32; n * rows];
            exact.matmul(&x, n, &mut reference);
            for r in 0..rows {
                let mut want = vec![0f32; n];
                scalar::row_f32(
                    format,
                    &data[r * rb..(r + 1) * rb],
                    &[],
                    &x,
                    cols,
                    n,
                    &mut want,
                );
                for t in 0..n {
                    let got = out[t * rows + r];
                    assert_eq!(want[t].to_bits(), reference[t * rows + r].to_bits());
                    // The split's 2^-17 per input (summed in magnitude) plus f32 rounding.
                    let norm: f32 = (0..cols)
                        .map(|c| (w[r * cols + c] * x[t * cols + c]).abs())
                        .sum();
                    let tol = 2e-5 * norm + 1e-30;
                    assert!(
                        (got - want[t]).abs() <= tol,
                        "{rows}x{cols} n={n} row {r} input {t}: {got} vs {} (tol {tol})",
                        want[t]
                    );
                }
            }
            // Each input alone (decode) equals its row of the product bit for bit.
            common::assert_each_input_alone_equals_its_row(&m, &x, n, &out);
        }
    }
}

#[test]
fn amx_jobs_in_one_pass_equal_each_alone() {
    let Some(k) = config() else {
        return;
    };
    let (rows, cols) = (48, 256);
    let mats: Vec<_> = (0..3)
        .map(|i| {
            let w = values(rows * cols, 100 + i, 0.3);
            packed_matrix("bf16", &w, rows, cols)
        })
        .collect();
    let ms: Vec<WeightMatrix<'_>> = mats
        .iter()
        .map(|(f, d, s, st)| {
            WeightMatrix::new(rows, cols, *f, d, s, *st)
                .expect("matrix")
                .with_kernels(k)
        })
        .collect();
    let ns = [1usize, 3, 20];
    let xs: Vec<Vec<f32>> = ns
        .iter()
        .map(|&n| values(n * cols, n as u64, 2.0))
        .collect();
    let mut outs: Vec<Vec<f32>> = ns.iter().map(|&n| vec![0f32; n * rows]).collect();
    {
        let mut jobs: Vec<MatmulJob<'_, '_>> = outs
            .iter_mut()
            .enumerate()
            .map(|(i, out)| MatmulJob {
                m: &ms[i],
                x: &xs[i],
                n: ns[i],
                out,
            })
            .collect();
        matmul_jobs(&mut jobs);
    }
    for i in 0..3 {
        let mut alone = vec![0f32; ns[i] * rows];
        ms[i].matmul(&xs[i], ns[i], &mut alone);
        assert!(
            alone
                .iter()
                .zip(&outs[i])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "job {i} differs from its product alone"
        );
    }
}
