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
//!   about 1% of the output's norm; other formats ignore it and run in f32. Too coarse for the
//!   fixtures' 1e-3 tolerance (measured 5.9e-3 on `deepseek_v3_int4`), so the model never uses it.
//! - [`Act::I16`]: the integer formats again, inputs quantized to 16 bits per 32-value block and
//!   held as two int8 planes (`x ~ d * (256 * hi + lo)`), so one AVX-512 VNNI `vpdpbusd` per
//!   plane does 64 multiply-adds. About 256x finer than `I8` (half a step is amax / 65024) and,
//!   with VNNI, as fast as the memory system; [`model_act`] picks it for the integer formats
//!   when the AVX-512 kernels run.
//!
//! [`Isa::Avx512`] (AVX-512 F/BW/VL/VNNI) has its own kernels for the f32 path of the 16-bit and
//! FP8 formats and for [`Act::I16`]; for the rest it runs the AVX2 kernels (an AVX-512 machine
//! has AVX2).

use std::sync::OnceLock;

use rayon::prelude::*;

use crate::linear::{ScaleType, WeightFormat, WeightMatrix};

#[cfg(target_arch = "aarch64")]
mod aarch64;
pub mod quant;
pub mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_avx512;

/// Columns per activation-quantization block and per SIMD step of the packed formats.
pub const BLOCK: usize = 32;

/// Instruction set used by the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust (the reference).
    Scalar,
    /// x86_64 AVX2 + FMA + F16C.
    Avx2,
    /// x86_64 AVX-512 F/BW/VL/VNNI on top of [`Isa::Avx2`].
    Avx512,
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
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The best available instruction set; `DELTAFIN_KERNELS=scalar|avx2` caps it (the
    /// reference, or AVX2 on an AVX-512 machine).
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let cap = std::env::var("DELTAFIN_KERNELS").unwrap_or_default();
            if cap == "scalar" {
                return Isa::Scalar;
            }
            [Isa::Avx512, Isa::Avx2, Isa::Neon]
                .into_iter()
                .filter(|&i| !(cap == "avx2" && i == Isa::Avx512))
                .find(|i| i.available())
                .unwrap_or(Isa::Scalar)
        })
    }

    /// Whether the AVX2 kernels run on this ISA (AVX-512 machines run them too).
    #[cfg(target_arch = "x86_64")]
    fn has_avx2(self) -> bool {
        matches!(self, Isa::Avx2 | Isa::Avx512)
    }
}

/// Precision of the activations inside the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    F32,
    /// int8 per 32-value block (INT4 / MXFP4 / Q8 weights only; others run in f32).
    I8,
    /// 16 bits per 32-value block as two int8 planes (INT4 / MXFP4 / Q8 only).
    I16,
}

/// The activation precision the model runs `kind` with: [`Act::I16`] for the integer formats
/// where the AVX-512 VNNI kernels run (within the fixtures' tolerance, and at memory speed),
/// f32 everywhere else. `DELTAFIN_ACTIVATIONS=f32` forces f32.
pub fn model_act(kind: Kind) -> Act {
    static FORCE_F32: OnceLock<bool> = OnceLock::new();
    let force = *FORCE_F32.get_or_init(|| {
        std::env::var("DELTAFIN_ACTIVATIONS").is_ok_and(|v| v.eq_ignore_ascii_case("f32"))
    });
    if !force && kind.integer() && Isa::detect() == Isa::Avx512 {
        Act::I16
    } else {
        Act::F32
    }
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
        cols.is_multiple_of(BLOCK) && self.group(cols).is_multiple_of(BLOCK)
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
    /// `[n, cols]` 16-bit inputs, block order as for `I8`.
    I16(I16Inputs),
}

/// Inputs quantized to 16 bits per 32-value block: `x ~ d[b] * (256 * hi + lo)`.
///
/// Element order inside each input row ([`i16_slot`]): each run of four blocks `4q..4q+4`
/// (128 values) is stored as two halves of 64, each holding 16 values of every block in block
/// order: for the 4-bit formats the evens then the odds (the order one 64-byte load of nibbles
/// splits into), for Q8 the first 16 then the last 16 of each block. Blocks after the last
/// whole run are stored one by one (4-bit: evens then odds; Q8: natural order).
#[derive(Debug, Default)]
pub struct I16Inputs {
    /// `[n, cols]` high bytes (`round(x / (amax / 127))`).
    pub hi: Vec<i8>,
    /// `[n, cols]` low bytes: the remainder in 1/256 steps.
    pub lo: Vec<i8>,
    /// `[n, cols/32]` scales (of `256 * hi + lo`; halved for MXFP4's doubled codes).
    pub d: Vec<f32>,
    /// `[n, cols/32]` each block's input sum, `d * sum(256 * hi + lo)` (the kernels' offset
    /// correction).
    pub dsums: Vec<f32>,
}

/// Position of element `i` of a 32-block in the kernels' input order for `kind`.
fn block_slot(kind: Kind, i: usize) -> usize {
    if matches!(kind, Kind::Int4 { .. } | Kind::Mxfp4 { .. }) {
        if i.is_multiple_of(2) {
            i / 2
        } else {
            16 + i / 2
        }
    } else {
        i
    }
}

/// Position of element `i` (of a row of `cols`) in the [`I16Inputs`] order for `kind`.
pub fn i16_slot(kind: Kind, cols: usize, i: usize) -> usize {
    let (b, e) = (i / BLOCK, i % BLOCK);
    let quads = cols / BLOCK / 4;
    match kind {
        Kind::Int4 { .. } | Kind::Mxfp4 { .. } if b < quads * 4 => {
            (b / 4) * 4 * BLOCK + (e % 2) * 64 + (b % 4) * 16 + e / 2
        }
        Kind::Q8 { .. } if b < quads * 4 => {
            (b / 4) * 4 * BLOCK + (e / 16) * 64 + (b % 4) * 16 + e % 16
        }
        _ => b * BLOCK + block_slot(kind, e),
    }
}

/// Quantize `x [n, cols]` (cols a multiple of 32) to 16-bit blocks for `kind`.
pub fn quantize_inputs_i16(kind: Kind, x: &[f32], cols: usize) -> I16Inputs {
    debug_assert_eq!(cols % BLOCK, 0);
    let blocks = x.len() / BLOCK;
    let mut out = I16Inputs {
        hi: vec![0; x.len()],
        lo: vec![0; x.len()],
        d: vec![0.0; blocks],
        dsums: vec![0.0; blocks],
    };
    let extra = if matches!(kind, Kind::Mxfp4 { .. }) {
        0.5
    } else {
        1.0
    };
    for (b, xb) in x.chunks_exact(BLOCK).enumerate() {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = amax / 127.0;
        let (inv, inv_lo) = if s > 0.0 {
            (1.0 / s, 256.0 / s)
        } else {
            (0.0, 0.0)
        };
        out.d[b] = s / 256.0 * extra;
        let mut sum = 0i32;
        for (i, &v) in xb.iter().enumerate() {
            let h = (v * inv).round().clamp(-127.0, 127.0);
            // |v - h*s| <= s/2, so the remainder is within +-128 steps of s/256 (clamped).
            let l = ((v - h * s) * inv_lo).round().clamp(-127.0, 127.0);
            let row_start = (b * BLOCK / cols) * cols;
            let dst = row_start + i16_slot(kind, cols, b * BLOCK - row_start + i);
            out.hi[dst] = h as i8;
            out.lo[dst] = l as i8;
            sum += 256 * h as i32 + l as i32;
        }
        out.dsums[b] = out.d[b] * sum as f32;
    }
    out
}

/// Quantize `x [n, cols]` (cols a multiple of 32) to int8 blocks for `kind`.
pub fn quantize_inputs(kind: Kind, x: &[f32], cols: usize) -> Inputs<'static> {
    let blocks = x.len() / BLOCK;
    let mut q = vec![0i8; x.len()];
    let mut d = vec![0f32; blocks];
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
            qb[block_slot(kind, i)] = (v * inv).round().clamp(-127.0, 127.0) as i8;
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
            if isa.has_avx2() {
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
                if isa == Isa::Avx512 && x86_avx512::supports_f32(kind) {
                    // SAFETY: `Isa::Avx512` is only selected when `available()` saw AVX-512
                    // F/BW/VL/VNNI, AVX2, FMA and F16C; the slice lengths are the ones
                    // `x86_avx512::row_f32` documents, checked by `matmul`.
                    unsafe { x86_avx512::row_f32(kind, row, scales, x, cols, n, out) };
                    return;
                }
                #[cfg(target_arch = "x86_64")]
                if isa.has_avx2() {
                    // SAFETY: `Isa::Avx2`/`Avx512` are only selected when `available()` saw
                    // AVX2, FMA and F16C; `simd_shape` holds and the slices have the lengths
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
            if simd && isa.has_avx2() {
                // SAFETY: as above; `q` is `n*cols` and `d` is `n*cols/32`.
                unsafe { x86::row_i8(kind, row, scales, q, d, cols, n, out) };
                return;
            }
            scalar::row_i8(kind, row, scales, q, d, cols, n, out)
        }
        Inputs::I16(x) => {
            #[cfg(target_arch = "x86_64")]
            if simd && isa == Isa::Avx512 {
                // SAFETY: as above; `x` holds `n*cols` codes per plane and `n*cols/32` scales
                // and sums, checked by `matmul`.
                unsafe { x86_avx512::row_i16(kind, row, scales, x, cols, n, out) };
                return;
            }
            scalar::row_i16(kind, row, scales, x, cols, n, out)
        }
    }
}

/// `out[t, r] = dot(W[r], x[t])`: `x` is `[n, cols]`, `out` is `[n, rows]`, on the detected ISA.
pub fn matmul(m: &WeightMatrix<'_>, x: &[f32], n: usize, out: &mut [f32], act: Act) {
    matmul_with(Isa::detect(), m, x, n, out, act)
}

/// Weight bytes per rayon task: large enough that task overhead (scale conversion, scheduling)
/// stays small against streaming them from DRAM, small enough to balance two to a few dozen
/// threads on a 2048-row expert matrix.
const TASK_BYTES: usize = 256 << 10;

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
    let integer_ok = kind.integer() && kind.simd_shape(cols);
    let xin = match act {
        Act::I8 if integer_ok => quantize_inputs(kind, x, cols),
        Act::I16 if integer_ok => Inputs::I16(quantize_inputs_i16(kind, x, cols)),
        _ => Inputs::F32(x),
    };
    let rb = kind.row_bytes(cols);
    let data = m.data_bytes();
    let block = (TASK_BYTES / rb.max(1)).clamp(1, 1024);
    let task = |bi: usize, o: &mut [f32]| {
        let r0 = bi * block;
        let nr = o.len() / n;
        let mut scales = Vec::new();
        row_scales(isa, m, r0, r0 + nr, &mut scales);
        let group = kind.group(cols);
        if !matches!(xin, Inputs::F32(_)) && group != BLOCK {
            // The integer kernels take one scale per 32-block.
            scales = scales
                .chunks(cols.div_ceil(group))
                .flat_map(|g| (0..cols / BLOCK).map(move |b| g[b * BLOCK / group]))
                .collect();
        }
        let per_row = scales.len() / nr;
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut first = 0;
        // Matrix-vector products with a long `x` (over half of a 32 KiB L1 data cache): four
        // rows at a time share each load of `x` instead of re-reading it from L2 per row.
        // With a short `x` the single-row tile (four accumulators) measured faster
        // (benches/results/kernels_idle_rows4_all_shapes.json vs kernels_idle.json), except
        // for FP8 on AVX-512, whose decode leaves fewer spare loads (22.3 vs 19.9 GiB/s at
        // 7168x2048). The AVX-512 tiles prefetch the next tile's rows in software.
        #[cfg(target_arch = "x86_64")]
        if n == 1 && isa == Isa::Avx512 && kind.simd_shape(cols) {
            // Loads bound the AVX-512 integer kernels: four rows share each input load.
            if let Inputs::I16(xq) = &xin {
                // Eight rows at a time, then four, share each input load.
                macro_rules! tile {
                    ($r:literal) => {
                        while first + $r <= nr {
                            let r = r0 + first;
                            let rows: [&[u8]; $r] =
                                std::array::from_fn(|k| &data[(r + k) * rb..(r + k + 1) * rb]);
                            let sc: [&[f32]; $r] = std::array::from_fn(|k| {
                                &scales[(first + k) * per_row..(first + k + 1) * per_row]
                            });
                            // SAFETY: `Isa::Avx512` implies AVX-512 F/BW/VL/VNNI, AVX2 and FMA
                            // were detected; `simd_shape` holds; each row is `row_bytes(cols)`
                            // long, each scale slice holds the row's `cols / 32` block scales,
                            // `xq` one input of `cols`, `o[first..first + R]` the outputs.
                            unsafe {
                                x86_avx512::rows_i16::<$r>(
                                    kind,
                                    rows,
                                    sc,
                                    xq,
                                    cols,
                                    &mut o[first..first + $r],
                                )
                            };
                            first += $r;
                        }
                    };
                }
                tile!(8);
                tile!(4);
            }
        }
        #[cfg(target_arch = "x86_64")]
        if n == 1
            && (cols * 4 > 16 << 10 || (isa == Isa::Avx512 && matches!(kind, Kind::Fp8 { .. })))
            && isa.has_avx2()
            && kind.simd_shape(cols)
        {
            if let Inputs::F32(xf) = &xin {
                while first + 4 <= nr {
                    let r = r0 + first;
                    let row = |k: usize| &data[(r + k) * rb..(r + k + 1) * rb];
                    let sc = |k: usize| &scales[(first + k) * per_row..(first + k + 1) * per_row];
                    let rows4 = [row(0), row(1), row(2), row(3)];
                    let sc4 = [sc(0), sc(1), sc(2), sc(3)];
                    let o4 = &mut o[first..first + 4];
                    if isa == Isa::Avx512 && x86_avx512::supports_f32(kind) {
                        // SAFETY: `Isa::Avx512` implies AVX-512 F/BW/VL/VNNI, AVX2, FMA and
                        // F16C were detected; the slices are as for `x86::rows4_f32` below.
                        unsafe { x86_avx512::rows4_f32(kind, rows4, sc4, xf, cols, o4) };
                    } else {
                        // SAFETY: `has_avx2` means AVX2, FMA and F16C were detected;
                        // `simd_shape` holds; each row is `row_bytes(cols)` long, each scale
                        // slice covers the row's groups, `x` is `cols` long (n == 1, checked
                        // by `matmul`) and `o4` holds the four outputs.
                        unsafe { x86::rows4_f32(kind, rows4, sc4, xf, cols, o4) };
                    }
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
