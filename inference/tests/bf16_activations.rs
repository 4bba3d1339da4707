//! `Act::Bf16` (opt-in BF16 activations on AVX-512 BF16): every output within a budget of the
//! scalar reference that rounds the inputs the same way, and a matrix-vector product equal to
//! the matching row of a matrix product bit for bit (what keeps chunked prefill equal to
//! decoding token by token in this mode).
mod common;

use deltafin_formats::WeightFormat;
use deltafin_inference::kernels::{scalar, Act, KernelConfig};
use deltafin_inference::linear::WeightMatrix;
use deltafin_inference::run::calibrate::packed_matrix;

use common::lcg_scaled as values;

fn config() -> Option<KernelConfig> {
    let k = KernelConfig {
        bf16_activations: true,
        ..KernelConfig::best()
    };
    if k.act(WeightFormat::Bf16) == Act::Bf16 {
        Some(k)
    } else {
        eprintln!("no AVX-512 BF16 here: Act::Bf16 falls back to f32, nothing to compare");
        None
    }
}

#[test]
fn bf16_activations_match_the_rounding_reference() {
    let Some(k) = config() else {
        // The fallback is the exact path: asked-for BF16 activations give f32 ones.
        assert_eq!(
            KernelConfig {
                bf16_activations: true,
                ..KernelConfig::best()
            }
            .act(WeightFormat::Bf16),
            Act::F32
        );
        return;
    };
    for &(rows, cols) in &[(1, 32), (5, 96), (8, 1024), (130, 512), (7, 2048)] {
        let w = values(rows * cols, rows as u64 * 31 + cols as u64, 0.2);
        let (format, data, scale, st) = packed_matrix("bf16", &w, rows, cols);
        assert_eq!(format, WeightFormat::Bf16);
        let m = WeightMatrix::new(rows, cols, format, &data, &scale, st)
            .expect("matrix")
            .with_kernels(k);
        let rb = 2 * cols;
        for &n in &[1usize, 3, 4, 5, 9, 33] {
            let mut x = values(n * cols, n as u64 + 7, 4.0);
            // Values that round: ties, subnormals, zeros of both signs.
            x[0] = 1.0 + 1.0 / 256.0;
            x[1] = 1e-40;
            if x.len() > 2 {
                x[2] = -0.0;
            }
            let mut out = vec![0f32; n * rows];
            m.matmul(&x, n, &mut out);
            for r in 0..rows {
                let mut want = vec![0f32; n];
                scalar::row_bf16_act(&data[r * rb..(r + 1) * rb], &x, cols, n, &mut want);
                for t in 0..n {
                    let got = out[t * rows + r];
                    // f32 summation order only: the products are the reference's exactly.
                    let norm: f32 = (0..cols)
                        .map(|c| (w[r * cols + c] * scalar::round_bf16(x[t * cols + c])).abs())
                        .sum();
                    let tol = 1e-6 * norm + 1e-30;
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
fn rounding_matches_round_to_nearest_even() {
    assert_eq!(scalar::round_bf16(1.0 + 1.0 / 256.0), 1.0); // tie, to even
    assert_eq!(scalar::round_bf16(1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0); // tie, to even
    assert_eq!(scalar::round_bf16(1e-40), 0.0);
    assert!(scalar::round_bf16(-1e-40).is_sign_negative());
    assert!(scalar::round_bf16(f32::NAN).is_nan());
    assert_eq!(scalar::round_bf16(f32::INFINITY), f32::INFINITY);
}
