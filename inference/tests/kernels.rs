//! Kernels: every SIMD path against the scalar reference, and the reference against f64 math on
//! the dequantized weights, per format, with the error budgets stated below.
//!
//! Budgets (S = sum_c |w_c x_c|, the scale of rounding error in a dot product of length C):
//! - f32 activations, reference vs f64 math: |err| <= 1e-5 * S + 1e-30 (f32 accumulation; the
//!   weights are decoded exactly, so all formats share it).
//! - f32 activations, SIMD vs reference: |err| <= 1e-5 * S + 1e-30 (summation order only).
//! - int8 activations (INT4/MXFP4/Q8), reference vs f64 math with the *unquantized* inputs:
//!   |err| <= sum_blocks (sum_{c in block} |w_c|) * amax_block(x) / 254 * 1.0001 + 1e-5 * S
//!   (each input moves by at most half a step, amax/254, when rounded to int8).
//! - int8 activations, SIMD vs reference: |err| <= 1e-5 * S (identical integer sums, f32
//!   order).
//! - 16-bit activations (two int8 planes), reference vs f64 math: as int8 with amax / 32512
//!   (127 * 256) per unit of |w| instead of amax / 254; SIMD vs reference as int8.

mod kernel_cases;

use deltafin_formats::quantize as quant;
use deltafin_inference::kernels::{self, Act, Isa};
use deltafin_inference::linear::{ScaleType, WeightFormat, WeightMatrix};
use kernel_cases::*;

#[test]
fn reference_matches_f64_math() {
    for &name in FORMATS {
        for (rows, cols) in shapes(name) {
            let mat = make(name, rows, cols, 1);
            let m = mat.view();
            let w = m.to_f32();
            for n in [1, 3, 16] {
                let x = inputs(n, cols, 2);
                let acts = [Act::F32, Act::I8, Act::I16];
                for act in acts.into_iter().filter(|&a| a == Act::F32 || integer(name)) {
                    let got = run(Isa::Scalar, &m, &x, n, act);
                    for t in 0..n {
                        let xt = &x[t * cols..(t + 1) * cols];
                        for r in 0..rows {
                            let wr = &w[r * cols..(r + 1) * cols];
                            let want: f64 =
                                wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                            let s: f64 = wr
                                .iter()
                                .zip(xt)
                                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                                .sum();
                            let mut budget = 1e-5 * s + 1e-30;
                            if act != Act::F32 {
                                let step = if act == Act::I8 { 254.0 } else { 32512.0 };
                                budget += wr
                                    .chunks(32)
                                    .zip(xt.chunks(32))
                                    .map(|(wb, xb)| {
                                        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                                        wb.iter().map(|v| v.abs() as f64).sum::<f64>() * amax as f64
                                            / step
                                            * 1.0001
                                    })
                                    .sum::<f64>();
                            }
                            let err = (got[t * rows + r] as f64 - want).abs();
                            assert!(
                                err <= budget,
                                "{name} {rows}x{cols} n={n} {act:?} t={t} r={r}: err {err:e} > {budget:e}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn simd_matches_reference() {
    let isas = simd_isas();
    eprintln!("SIMD paths tested: {isas:?}");
    for isa in isas {
        for &name in FORMATS {
            for (rows, cols) in shapes(name) {
                let mat = make(name, rows, cols, 3);
                let m = mat.view();
                let w = m.to_f32();
                for n in [1, 2, 3, 4, 5, 8, 16] {
                    let x = inputs(n, cols, 4 + n as u64);
                    let acts = [Act::F32, Act::I8, Act::I16];
                    for act in acts.into_iter().filter(|&a| a == Act::F32 || integer(name)) {
                        let want = run(Isa::Scalar, &m, &x, n, act);
                        let got = run(isa, &m, &x, n, act);
                        for t in 0..n {
                            for r in 0..rows {
                                let s: f64 = w[r * cols..(r + 1) * cols]
                                    .iter()
                                    .zip(&x[t * cols..(t + 1) * cols])
                                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                                    .sum();
                                let budget = 1e-5 * s + 1e-30;
                                let err =
                                    (got[t * rows + r] as f64 - want[t * rows + r] as f64).abs();
                                assert!(
                                    err <= budget,
                                    "{isa:?} {name} {rows}x{cols} n={n} {act:?} t={t} r={r}: err {err:e} > {budget:e}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A matrix-vector product equals the matching row of a matrix product bit for bit, for
/// short and long rows (the four-row tiles take matrix-vector products over 16 KiB of input,
/// and every AVX-512 BF16 / FP8 one): batched verification and chunked prefill then give
/// exactly what token-by-token decoding gives.
#[test]
fn matvec_equals_matmul_row() {
    for isa in std::iter::once(Isa::Scalar).chain(simd_isas()) {
        for &name in FORMATS {
            for cols in [256usize, 4608] {
                let mat = make(name, 13, cols, 5);
                let m = mat.view();
                // Nine inputs: at 4608 columns the AVX-512 products take them in chunks of
                // four (what fits L1), so the chunks' offsets are covered too.
                let n = 9;
                let x = inputs(n, cols, 6);
                let acts = [Act::F32, Act::I8, Act::I16];
                for act in acts.into_iter().filter(|&a| a == Act::F32 || integer(name)) {
                    let all = run(isa, &m, &x, n, act);
                    // The AVX2 four-row f32 tile (long rows of the scaled formats; on AVX-512
                    // also the integer formats with f32 activations) sums in another order:
                    // within f32 rounding. AVX2's dense tiles (F32, BF16, F16): one order.
                    let strict = cols <= 4096
                        || isa == Isa::Scalar
                        || (matches!(isa, Isa::Avx512 | Isa::Avx512Bw)
                            && (!integer(name) || act != Act::F32))
                        || (matches!(isa, Isa::Avx2 | Isa::AvxVnni)
                            && matches!(name, "f32" | "bf16" | "f16"));
                    for t in 0..n {
                        let one = run(isa, &m, &x[t * cols..(t + 1) * cols], 1, act);
                        let row = &all[t * 13..(t + 1) * 13];
                        if strict {
                            assert_eq!(one, row, "{isa:?} {name} {act:?} cols={cols} t={t}");
                        } else {
                            for (a, b) in one.iter().zip(row) {
                                assert!(
                                    (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                                    "{isa:?} {name} {act:?} cols={cols} t={t}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn quantizers_round_trip_through_the_decoders() {
    let (rows, cols) = (16, 256);
    let mut r = rng(9);
    let w: Vec<f32> = (0..rows * cols).map(|_| r() * 0.05).collect();
    let cases = [
        (
            "q8",
            quant::quantize_q8(&w, rows, cols, 32),
            WeightFormat::Q8 { group: 32 },
            ScaleType::F16,
            0.005,
        ),
        (
            "int4",
            quant::quantize_int4(&w, rows, cols, 32),
            WeightFormat::Int4 { group: 32 },
            ScaleType::Bf16,
            0.12,
        ),
        (
            "mxfp4",
            quant::quantize_mxfp4(&w, rows, cols, 32),
            WeightFormat::Mxfp4 { group: 32 },
            ScaleType::E8m0,
            0.15,
        ),
    ];
    for (name, q, format, st, rel_budget) in cases {
        let m = WeightMatrix::new(rows, cols, format, &q.data, &q.scale, st).expect(name);
        let back = m.to_f32();
        // The decoder reads back what the quantizer says it wrote: same error figures.
        let (mut num, mut den, mut max_abs) = (0f64, 0f64, 0f32);
        for (&a, &b) in w.iter().zip(&back) {
            max_abs = max_abs.max((a - b).abs());
            num += ((a - b) as f64).powi(2);
            den += (a as f64).powi(2);
        }
        let rel = (num / den).sqrt() as f32;
        assert!(
            (rel - q.error.rel_rms).abs() <= 1e-6 && max_abs == q.error.max_abs,
            "{name}: decoder disagrees with quantizer ({rel} vs {:?})",
            q.error
        );
        assert!(
            rel <= rel_budget,
            "{name}: relative RMS error {rel} > {rel_budget}"
        );
        eprintln!("{name}: rel RMS {rel:.4}, max abs {max_abs:.2e}");
    }
}

/// Matrices run together in one pass (a SwiGLU's gate and up) give exactly the outputs of
/// separate calls, for every ISA, activation precision and input count (matrix-vector and
/// products), and matrices of different formats fall back to separate passes.
#[test]
fn matmul_many_equals_separate_calls() {
    for isa in std::iter::once(Isa::Scalar).chain(simd_isas()) {
        for name in ["mxfp4", "int4", "q8", "bf16", "fp8"] {
            let g = make(name, 96, 256, 11);
            let u = make(name, 40, 256, 12);
            let (gv, uv) = (g.view(), u.view());
            for n in [1, 3] {
                let x = inputs(n, 256, 13);
                for act in [Act::F32, Act::I16] {
                    let (mut a, mut b) = (vec![0f32; n * 96], vec![0f32; n * 40]);
                    kernels::matmul_many_with(isa, &[&gv, &uv], &x, n, &mut [&mut a, &mut b], act);
                    assert_eq!(
                        a,
                        run(isa, &gv, &x, n, act),
                        "{isa:?} {name} n={n} {act:?} gate"
                    );
                    assert_eq!(
                        b,
                        run(isa, &uv, &x, n, act),
                        "{isa:?} {name} n={n} {act:?} up"
                    );
                }
            }
        }
        let (g, u) = (make("mxfp4", 96, 256, 11), make("int4", 40, 256, 12));
        let (gv, uv) = (g.view(), u.view());
        let x = inputs(2, 256, 14);
        let (mut a, mut b) = (vec![0f32; 2 * 96], vec![0f32; 2 * 40]);
        kernels::matmul_many_with(isa, &[&gv, &uv], &x, 2, &mut [&mut a, &mut b], Act::I16);
        assert_eq!(a, run(isa, &gv, &x, 2, Act::I16));
        assert_eq!(b, run(isa, &uv, &x, 2, Act::I16));
    }
}

/// MXFP4 scale bytes 0 (2^-127), 255 (NaN), 200 and 1: every SIMD path gives the reference's
/// NaN rows and finite rows within the usual budget, whether the kernel converts the scale
/// bytes itself (matrix-vector tiles) or takes converted scales (matrix products).
#[test]
fn mxfp4_special_scales_match_reference() {
    let (rows, cols) = (19, 736);
    let mut mat = make("mxfp4", rows, cols, 11);
    let blocks = cols / 32;
    // Row 2: a NaN scale; rows 3 and 17: the smallest scale in a full group and in the tail;
    // row 5: 2^73 and 2^-126 (2^127 overflows to inf in the reference and, through the offset
    // correction, to NaN in the 16-bit kernels).
    mat.scale[2 * blocks + 20] = 255;
    mat.scale[3 * blocks + 4] = 0;
    mat.scale[17 * blocks + 22] = 0;
    mat.scale[5 * blocks] = 200;
    mat.scale[5 * blocks + 17] = 1;
    // Row 7: every scale 2^-127, a subnormal: the outputs are tiny but not zero.
    mat.scale[7 * blocks..8 * blocks].fill(0);
    let m = mat.view();
    for n in [1, 3] {
        let x = inputs(n, cols, 12);
        let want = run(Isa::Scalar, &m, &x, n, Act::I16);
        for isa in simd_isas() {
            let got = run(isa, &m, &x, n, Act::I16);
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                let r = i % rows;
                if r == 2 {
                    assert!(g.is_nan() && w.is_nan(), "{isa:?} n={n} row 2: {g} {w}");
                } else if r == 7 {
                    assert!(w != 0.0 && w.abs() < 1e-30, "reference row 7: {w}");
                    assert!(
                        g != 0.0 && g.signum() == w.signum(),
                        "{isa:?} n={n} row 7: {g} {w}"
                    );
                } else {
                    let budget = 1e-5 * (w.abs() as f64 + 1.0) * 1e3;
                    assert!(
                        ((g - w).abs() as f64) <= budget,
                        "{isa:?} n={n} i={i}: {g} vs {w}"
                    );
                }
            }
        }
    }
}

/// The kernels a matrix carries decide its path, per matrix and in one process: each config's
/// product equals `matmul_with` on that config's ISA and activation precision, bit for bit.
#[test]
fn a_matrix_runs_the_kernels_it_carries() {
    use deltafin_inference::kernels::KernelConfig;
    use deltafin_inference::linear::{ScaleType, WeightFormat, WeightMatrix};
    let (rows, cols) = (64, 1024);
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) * 0.001)
        .collect();
    let q = quant::quantize_int4(&w, rows, cols, 32);
    let x: Vec<f32> = (0..cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.02)
        .collect();
    let base = WeightMatrix::new(
        rows,
        cols,
        WeightFormat::Int4 { group: 32 },
        &q.data,
        &q.scale,
        ScaleType::Bf16,
    )
    .unwrap();
    let mut outs = Vec::new();
    for isa in [
        Isa::Scalar,
        Isa::Avx2,
        Isa::AvxVnni,
        Isa::Avx512Bw,
        Isa::Avx512,
        Isa::Neon,
    ] {
        let k = KernelConfig::with_isa(isa);
        if k.isa != isa {
            continue;
        }
        let m = base.with_kernels(k);
        let mut got = vec![0f32; rows];
        m.matvec(&x, &mut got);
        let mut want = vec![0f32; rows];
        kernels::matmul_with(isa, &base, &x, 1, &mut want, k.act(m.format()));
        assert_eq!(got, want, "{isa:?}");
        outs.push((isa, got));
    }
    if outs.len() > 1 {
        // Scalar (f32 activations) and a SIMD path (16-bit activations on x86) differ in their
        // last bits: the two configs really ran two paths.
        assert_ne!(outs[0].1, outs[1].1, "{:?} vs {:?}", outs[0].0, outs[1].0);
    }
}

/// Many jobs in one pass (a layer's experts: each its own matrix, inputs and output; some
/// sharing inputs, some with several inputs, formats mixed) give exactly what each matrix's
/// own `matmul` gives, on every instruction set the matrices are loaded with.
#[test]
fn matmul_jobs_equal_separate_calls() {
    for isa in std::iter::once(Isa::Scalar).chain(simd_isas()) {
        let k = kernels::KernelConfig::with_isa(isa);
        let mats: Vec<Mat> = ["bf16", "int4", "q8", "mxfp4", "bf16", "fp8", "f32"]
            .iter()
            .enumerate()
            .map(|(i, name)| make(name, 64 + 32 * i, 256, 20 + i as u64))
            .collect();
        let views: Vec<WeightMatrix<'_>> = mats.iter().map(|m| m.view().with_kernels(k)).collect();
        let shared = inputs(1, 256, 30);
        let three = inputs(3, 256, 31);
        // Jobs 0, 1 and 4 share one input (one token's hidden state), 2 and 5 take three.
        let xs: Vec<(&[f32], usize)> = vec![
            (&shared, 1),
            (&shared, 1),
            (&three, 3),
            (&shared, 1),
            (&shared, 1),
            (&three, 3),
            (&shared, 1),
        ];
        let mut outs: Vec<Vec<f32>> = views
            .iter()
            .zip(&xs)
            .map(|(v, &(_, n))| vec![0f32; n * v.rows()])
            .collect();
        let mut jobs: Vec<kernels::MatmulJob<'_, '_>> = views
            .iter()
            .zip(&xs)
            .zip(outs.iter_mut())
            .map(|((m, &(x, n)), out)| kernels::MatmulJob { m, x, n, out })
            .collect();
        kernels::matmul_jobs(&mut jobs);
        for (i, ((v, &(x, n)), out)) in views.iter().zip(&xs).zip(&outs).enumerate() {
            let mut alone = vec![0f32; n * v.rows()];
            kernels::matmul(v, x, n, &mut alone);
            assert_eq!(out, &alone, "{isa:?} job {i}");
        }
    }
}

/// AVX-512 without VNNI (`vpmaddubsw` / `vpmaddwd`) equals the VNNI kernels bit for bit on the
/// 16-bit path: products of 1-9 inputs, every integer format, all tails. Q8 runs the AVX2
/// kernels there, and equals them bit for bit.
#[test]
fn avx512_without_vnni_equals_vnni() {
    if !(Isa::Avx512.available() && Isa::Avx512Bw.available()) {
        eprintln!("skipped: needs AVX-512 VNNI");
        return;
    }
    for &name in FORMATS.iter().filter(|n| integer(n)) {
        // 34 and 33 blocks: tails of a pair and of a single block after the runs of four.
        let odd = if name == "int4g64" { 1088 } else { 1056 };
        for cols in [256usize, 1088, odd, 4608] {
            let mat = make(name, 19, cols, 3);
            let m = mat.view();
            for n in [1usize, 2, 5, 9] {
                let x = inputs(n, cols, 8);
                let like = if name.starts_with("q8") {
                    Isa::Avx2
                } else {
                    Isa::Avx512
                };
                for act in [Act::I16, Act::I8] {
                    let got = [like, Isa::Avx512Bw].map(|isa| run(isa, &m, &x, n, act));
                    assert_eq!(
                        got[0], got[1],
                        "{name} {act:?} cols={cols} n={n} vs {like:?}"
                    );
                }
            }
        }
    }
}

/// The largest integer sums the 16-bit kernels meet: INT4 codes all 15 (or all 0) against
/// inputs at the quantizer's extremes (every value of a block at +-amax: high bytes +-127;
/// and values one low-plane step off). Each input of a matrix product equals its
/// matrix-vector product bit for bit (the AVX2 kernels sum two or more inputs' products in
/// i16 first, one input's in i32), and both stay within the I16 budget of the f64 result.
#[test]
fn extreme_int4_sums_do_not_overflow() {
    let (rows, cols) = (6, 512);
    for sign in [1.0f32, -1.0] {
        let w = vec![sign; rows * cols];
        let q = quant::quantize_int4(&w, rows, cols, 32);
        let mat = Mat {
            rows,
            cols,
            format: WeightFormat::Int4 { group: 32 },
            st: ScaleType::Bf16,
            data: q.data,
            scale: q.scale,
        };
        let m = mat.view();
        let wf = m.to_f32();
        let n = 4;
        // Inputs: all -1, all +1, then values 1 and 1 - 1/32512 alternating (a low plane
        // of -1 or -128 steps), then the mirror.
        let step = 1.0 / 32512.0;
        let x: Vec<f32> = (0..n * cols)
            .map(|i| match i / cols {
                0 => -1.0,
                1 => 1.0,
                2 => {
                    if i % 2 == 0 {
                        1.0
                    } else {
                        1.0 - 128.0 * step
                    }
                }
                _ => {
                    if i % 2 == 0 {
                        -1.0
                    } else {
                        -1.0 + 127.5 * step
                    }
                }
            })
            .collect();
        for isa in std::iter::once(Isa::Scalar).chain(simd_isas()) {
            let all = run(isa, &m, &x, n, Act::I16);
            for t in 0..n {
                let xt = &x[t * cols..(t + 1) * cols];
                let one = run(isa, &m, xt, 1, Act::I16);
                assert_eq!(one, &all[t * rows..(t + 1) * rows], "{isa:?} {sign} t={t}");
                for (r, &got) in one.iter().enumerate() {
                    let want: f64 = wf[r * cols..(r + 1) * cols]
                        .iter()
                        .zip(xt)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum();
                    assert!(
                        (got as f64 - want).abs() <= 1e-3 * want.abs().max(1.0),
                        "{isa:?} {sign} t={t} row {r}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
