//! Weight-format kernels: `y = W x` for one input (matvec, decode) or a few (matmul, up to 16
//! rows per weight pass), organised like `memchr`: one portable reference in [`scalar`], one
//! AVX2+FMA(+F16C) implementation in `x86` chosen at run time with `is_x86_feature_detected!`,
//! one NEON implementation in `aarch64` (compiled only there), and a scalar fallback.
//!
//! Every implementation works on one weight row at a time: `row_dot(row bytes, row scales,
//! inputs) -> [n]`. The driver ([`matmul`]) splits the rows into rayon tasks, converts each
//! task's scales to f32 once (so every kernel reads plain f32 scales), prepares the inputs once
//! per call, and picks the implementation.
//!
//! Two activation precisions ([`Act`]):
//! - [`Act::F32`]: inputs stay f32, weights are dequantized in registers and multiplied in f32.
//!   This is what the model uses (fixture logits stay within 1e-4 of the f32 reference).
//! - [`Act::I8`]: for the integer formats (INT4, MXFP4, Q8), inputs are quantized on the fly to
//!   int8 per 32-value block (absmax / 127, like llama.cpp's Q8_0) and the dot products run in
//!   integer arithmetic (`vpmaddubsw`/`vpmaddwd`), scaled per block. Relative error stays within
//!   about 1% of the output's norm; other formats ignore it and run in f32.

use std::sync::OnceLock;

use rayon::prelude::*;

use crate::linear::{ScaleType, WeightFormat, WeightMatrix};

#[cfg(target_arch = "aarch64")]
mod aarch64;
pub mod quant;
pub mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

/// Columns per activation-quantization block and per SIMD step of the packed formats.
pub const BLOCK: usize = 32;

/// Instruction set used by the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust (the reference).
    Scalar,
    /// x86_64 AVX2 + FMA + F16C.
    Avx2,
    /// aarch64 Advanced SIMD.
    Neon,
}

impl Isa {
    /// Whether this machine can run `self`.
    pub fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The best available instruction set; `DELTAFIN_KERNELS=scalar` forces the reference.
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            if std::env::var("DELTAFIN_KERNELS").is_ok_and(|v| v == "scalar") {
                return Isa::Scalar;
            }
            [Isa::Avx2, Isa::Neon]
                .into_iter()
                .find(|i| i.available())
                .unwrap_or(Isa::Scalar)
        })
    }
}

/// Precision of the activations inside the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    F32,
    /// int8 per 32-value block (INT4 / MXFP4 / Q8 weights only; others run in f32).
    I8,
}

/// The per-row view of a format the kernels take: row bytes plus f32 scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    F32,
    F16,
    Bf16,
    /// e4m3 bytes; one scale per `block` columns.
    Fp8 {
        block: usize,
    },
    /// offset-binary nibbles, 8 per LE u32 word; one scale per `group` columns.
    Int4 {
        group: usize,
    },
    /// e2m1 nibbles, element 2b = low nibble of byte b; one scale per `group` columns.
    Mxfp4 {
        group: usize,
    },
    /// int8 values; one scale per `group` columns.
    Q8 {
        group: usize,
    },
}

impl Kind {
    pub fn of(f: WeightFormat) -> Kind {
        match f {
            WeightFormat::F32 => Kind::F32,
            WeightFormat::F16 => Kind::F16,
            WeightFormat::Bf16 => Kind::Bf16,
            WeightFormat::Fp8Block { block_cols, .. } => Kind::Fp8 { block: block_cols },
            WeightFormat::Int4Group { group } => Kind::Int4 { group },
            WeightFormat::Mxfp4 { group } => Kind::Mxfp4 { group },
            WeightFormat::Q8 { group } => Kind::Q8 { group },
        }
    }

    /// Columns sharing one scale (`cols` for unscaled formats).
    pub fn group(self, cols: usize) -> usize {
        match self {
            Kind::F32 | Kind::F16 | Kind::Bf16 => cols.max(1),
            Kind::Fp8 { block } => block,
            Kind::Int4 { group } | Kind::Mxfp4 { group } | Kind::Q8 { group } => group,
        }
    }

    /// Bytes of one row of `cols` values.
    pub fn row_bytes(self, cols: usize) -> usize {
        match self {
            Kind::F32 => cols * 4,
            Kind::F16 | Kind::Bf16 => cols * 2,
            Kind::Fp8 { .. } | Kind::Q8 { .. } => cols,
            Kind::Int4 { .. } => cols.div_ceil(8) * 4,
            Kind::Mxfp4 { .. } => cols.div_ceil(2),
        }
    }

    /// Whether the integer-activation path applies.
    pub fn integer(self) -> bool {
        matches!(
            self,
            Kind::Int4 { .. } | Kind::Mxfp4 { .. } | Kind::Q8 { .. }
        )
    }

    /// Whether the SIMD kernels handle this shape (whole 32-column steps inside each group);
    /// other shapes run the scalar reference.
    pub fn simd_shape(self, cols: usize) -> bool {
        cols % BLOCK == 0 && self.group(cols) % BLOCK == 0
    }
}

/// Inputs prepared once per call.
#[derive(Debug)]
pub enum Inputs<'x> {
    /// `[n, cols]` f32.
    F32(&'x [f32]),
    /// `[n, cols]` int8 with `[n, cols/32]` scales; for 4-bit formats every 32-block is stored
    /// evens first then odds (the order the nibbles unpack in).
    I8 { q: Vec<i8>, d: Vec<f32> },
}

/// Quantize `x [n, cols]` (cols a multiple of 32) to int8 blocks for `kind`.
pub fn quantize_inputs(kind: Kind, x: &[f32], cols: usize) -> Inputs<'static> {
    let blocks = x.len() / BLOCK;
    let mut q = vec![0i8; x.len()];
    let mut d = vec![0f32; blocks];
    let four_bit = matches!(kind, Kind::Int4 { .. } | Kind::Mxfp4 { .. });
    // MXFP4 codes are stored doubled (integers -12..12), so halve the block scale.
    let extra = if matches!(kind, Kind::Mxfp4 { .. }) {
        0.5
    } else {
        1.0
    };
    debug_assert_eq!(cols % BLOCK, 0);
    for ((xb, qb), db) in x
        .chunks_exact(BLOCK)
        .zip(q.chunks_exact_mut(BLOCK))
        .zip(d.iter_mut())
    {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = amax / 127.0;
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        *db = s * extra;
        for (i, &v) in xb.iter().enumerate() {
            let dst = if four_bit {
                if i % 2 == 0 {
                    i / 2
                } else {
                    16 + i / 2
                }
            } else {
                i
            };
            qb[dst] = (v * inv).round().clamp(-127.0, 127.0) as i8;
        }
    }
    Inputs::I8 { q, d }
}

/// Scale bytes `bytes` (of type `st`) appended to `out` as f32, in loops the compiler
/// vectorizes (F16 through F16C when available): this runs once per task, not per weight, but
/// a per-element `match` here costed as much as the INT4 kernel itself.
fn scales_to_f32(isa: Isa, st: ScaleType, bytes: &[u8], out: &mut Vec<f32>) {
    match st {
        ScaleType::None => {}
        ScaleType::F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
        ScaleType::Bf16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)),
        ),
        ScaleType::E8m0 => out.extend(bytes.iter().map(|&e| {
            let bits = match e {
                0 => 0x0040_0000,
                255 => 0x7fc0_0000,
                e => (e as u32) << 23,
            };
            f32::from_bits(bits)
        })),
        ScaleType::F16 => {
            #[cfg(target_arch = "x86_64")]
            if isa == Isa::Avx2 {
                let start = out.len();
                out.resize(start + bytes.len() / 2, 0.0);
                // SAFETY: Avx2 implies F16C was detected; `out[start..]` holds exactly
                // `bytes.len() / 2` values.
                unsafe { x86::f16_to_f32(bytes, &mut out[start..]) };
                return;
            }
            let _ = isa;
            out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()),
            )
        }
    }
}

/// Scales of rows `r0..r1` as f32, `[r1-r0, groups]` (FP8: the scale row of each row's block).
fn row_scales(isa: Isa, m: &WeightMatrix<'_>, r0: usize, r1: usize, out: &mut Vec<f32>) {
    let (scale, st) = (m.scale_bytes(), m.scale_type());
    out.clear();
    let cols = m.cols();
    let sz = match st {
        ScaleType::None => 0,
        ScaleType::E8m0 => 1,
        ScaleType::F16 | ScaleType::Bf16 => 2,
        ScaleType::F32 => 4,
    };
    match m.format() {
        WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 => {
            out.resize(r1 - r0, 1.0);
        }
        WeightFormat::Fp8Block {
            block_rows,
            block_cols,
        } => {
            let sc = cols.div_ceil(block_cols);
            for r in r0..r1 {
                let base = (r / block_rows) * sc;
                scales_to_f32(isa, st, &scale[base * sz..(base + sc) * sz], out);
            }
        }
        WeightFormat::Int4Group { group }
        | WeightFormat::Mxfp4 { group }
        | WeightFormat::Q8 { group } => {
            let g = cols.div_ceil(group);
            scales_to_f32(isa, st, &scale[r0 * g * sz..r1 * g * sz], out);
        }
    }
}

/// One row against `n` inputs: `out[t] = dot(W[row], x[t])`.
#[allow(clippy::too_many_arguments)]
fn row_dot(
    isa: Isa,
    kind: Kind,
    row: &[u8],
    scales: &[f32],
    x: &Inputs<'_>,
    cols: usize,
    n: usize,
    out: &mut [f32],
) {
    let simd = isa != Isa::Scalar && kind.simd_shape(cols);
    match x {
        Inputs::F32(x) => {
            if simd {
                #[cfg(target_arch = "x86_64")]
                if isa == Isa::Avx2 {
                    // SAFETY: `Isa::Avx2` is only selected when `available()` saw AVX2, FMA
                    // and F16C; `simd_shape` holds and the slices have the lengths
                    // `x86::row_f32` documents (row = row_bytes(cols), scales = cols/group,
                    // x = n*cols, out = n), all checked by `matmul`.
                    unsafe { x86::row_f32(kind, row, scales, x, cols, n, out) };
                    return;
                }
                #[cfg(target_arch = "aarch64")]
                if isa == Isa::Neon && aarch64::supports(kind) {
                    // SAFETY: `Isa::Neon` is only selected when NEON was detected; the lengths
                    // are the ones `aarch64::row_f32` documents, checked by `matmul`.
                    unsafe { aarch64::row_f32(kind, row, scales, x, cols, n, out) };
                    return;
                }
            }
            scalar::row_f32(kind, row, scales, x, cols, n, out)
        }
        Inputs::I8 { q, d } => {
            #[cfg(target_arch = "x86_64")]
            if simd && isa == Isa::Avx2 {
                // SAFETY: as above; `q` is `n*cols` and `d` is `n*cols/32`.
                unsafe { x86::row_i8(kind, row, scales, q, d, cols, n, out) };
                return;
            }
            scalar::row_i8(kind, row, scales, q, d, cols, n, out)
        }
    }
}

/// `out[t, r] = dot(W[r], x[t])`: `x` is `[n, cols]`, `out` is `[n, rows]`, on the detected ISA.
pub fn matmul(m: &WeightMatrix<'_>, x: &[f32], n: usize, out: &mut [f32], act: Act) {
    matmul_with(Isa::detect(), m, x, n, out, act)
}

/// [`matmul`] on a chosen instruction set (falls back to scalar if `isa` is unavailable).
pub fn matmul_with(isa: Isa, m: &WeightMatrix<'_>, x: &[f32], n: usize, out: &mut [f32], act: Act) {
    let (rows, cols) = (m.rows(), m.cols());
    assert_eq!(x.len(), n * cols, "matmul input length");
    assert_eq!(out.len(), n * rows, "matmul output length");
    if n == 0 || rows == 0 {
        return;
    }
    let isa = if isa.available() { isa } else { Isa::Scalar };
    let kind = Kind::of(m.format());
    let xin = if act == Act::I8 && kind.integer() && kind.simd_shape(cols) {
        quantize_inputs(kind, x, cols)
    } else {
        Inputs::F32(x)
    };
    let rb = kind.row_bytes(cols);
    let data = m.data_bytes();
    // About 64 KiB of weights per task.
    let block = (65536 / rb.max(1)).clamp(1, 256);
    let task = |bi: usize, o: &mut [f32]| {
        let r0 = bi * block;
        let nr = o.len() / n;
        let mut scales = Vec::new();
        row_scales(isa, m, r0, r0 + nr, &mut scales);
        let group = kind.group(cols);
        if matches!(xin, Inputs::I8 { .. }) && group != BLOCK {
            // The int8 kernels take one scale per 32-block.
            scales = scales
                .chunks(cols.div_ceil(group))
                .flat_map(|g| (0..cols / BLOCK).map(move |b| g[b * BLOCK / group]))
                .collect();
        }
        let per_row = scales.len() / nr;
        let mut first = 0;
        // Matrix-vector products on AVX2 with a long `x` (over half of a 32 KiB L1 data cache):
        // four rows at a time share each load of `x` instead of re-reading it from L2 per row.
        // With a short `x` the single-row tile (four accumulators) measured faster
        // (benches/results/kernels_idle_rows4_all_shapes.json vs kernels_idle.json).
        #[cfg(target_arch = "x86_64")]
        if n == 1
            && cols * 4 > 16 << 10
            && isa == Isa::Avx2
            && kind.simd_shape(cols)
            && matches!(xin, Inputs::F32(_))
        {
            if let Inputs::F32(xf) = &xin {
                while first + 4 <= nr {
                    let r = r0 + first;
                    let row = |k: usize| &data[(r + k) * rb..(r + k + 1) * rb];
                    let sc = |k: usize| &scales[(first + k) * per_row..(first + k + 1) * per_row];
                    // SAFETY: `Isa::Avx2` is only selected when AVX2, FMA and F16C were
                    // detected; `simd_shape` holds; each row is `row_bytes(cols)` long, each
                    // scale slice covers the row's groups, `x` is `cols` long (n == 1, checked
                    // by `matmul`) and `o[first..first + 4]` holds the four outputs.
                    unsafe {
                        x86::rows4_f32(
                            kind,
                            [row(0), row(1), row(2), row(3)],
                            [sc(0), sc(1), sc(2), sc(3)],
                            xf,
                            cols,
                            &mut o[first..first + 4],
                        )
                    };
                    first += 4;
                }
            }
        }
        for (i, orow) in o.chunks_mut(n).enumerate().skip(first) {
            let r = r0 + i;
            row_dot(
                isa,
                kind,
                &data[r * rb..(r + 1) * rb],
                &scales[i * per_row..(i + 1) * per_row],
                &xin,
                cols,
                n,
                orow,
            );
        }
    };
    if n == 1 {
        out.par_chunks_mut(block)
            .enumerate()
            .for_each(|(bi, o)| task(bi, o));
        return;
    }
    // Transposed scratch [rows, n] so that each task writes a contiguous range.
    let mut tmp = vec![0f32; rows * n];
    tmp.par_chunks_mut(block * n)
        .enumerate()
        .for_each(|(bi, o)| task(bi, o));
    for (r, trow) in tmp.chunks(n).enumerate() {
        for (t, &v) in trow.iter().enumerate() {
            out[t * rows + r] = v;
        }
    }
}

/// Fused SwiGLU front half: `out[t, r] = silu(dot(G[r], x[t])) * dot(U[r], x[t])`, gate and up
/// rows of the same index computed by the same task (one pass, no `[n, rows]` intermediates).
pub fn gate_up_silu(
    gate: &WeightMatrix<'_>,
    up: &WeightMatrix<'_>,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    act: Act,
) {
    assert_eq!(gate.rows(), up.rows(), "gate/up rows");
    assert_eq!(gate.cols(), up.cols(), "gate/up cols");
    let rows = gate.rows();
    let mut g = vec![0f32; n * rows];
    let mut u = vec![0f32; n * rows];
    rayon::join(
        || matmul(gate, x, n, &mut g, act),
        || matmul(up, x, n, &mut u, act),
    );
    for ((o, &g), &u) in out.iter_mut().zip(&g).zip(&u) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}
