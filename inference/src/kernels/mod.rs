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
    /// [`Isa::Avx2`] plus AVX-VNNI (Alder Lake and later, Zen 5): the AVX2 kernels with
    /// `vpdpbusd` for the 16-bit-activation path.
    AvxVnni,
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
            Isa::AvxVnni => Isa::Avx2.available() && is_x86_feature_detected!("avxvnni"),
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

    /// The best available instruction set; `DELTAFIN_KERNELS=scalar|avx2|avxvnni` caps it (the
    /// reference, AVX2 without VNNI, or AVX-VNNI on an AVX-512 machine).
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let cap = std::env::var("DELTAFIN_KERNELS").unwrap_or_default();
            if cap == "scalar" {
                return Isa::Scalar;
            }
            [Isa::Avx512, Isa::AvxVnni, Isa::Avx2, Isa::Neon]
                .into_iter()
                .filter(|&i| match cap.as_str() {
                    "avx2" => !matches!(i, Isa::Avx512 | Isa::AvxVnni),
                    "avxvnni" => i != Isa::Avx512,
                    _ => true,
                })
                .find(|i| i.available())
                .unwrap_or(Isa::Scalar)
        })
    }

    /// Whether the AVX2 kernels run on this ISA (AVX-512 machines run them too).
    #[cfg(target_arch = "x86_64")]
    fn has_avx2(self) -> bool {
        matches!(self, Isa::Avx2 | Isa::AvxVnni | Isa::Avx512)
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
/// on x86_64 with AVX2, AVX-VNNI or AVX-512 VNNI (within the fixtures' tolerance; AVX-512: at
/// memory speed; AVX2: INT4 / MXFP4 twice the f32 kernels' speed, Q8 1.0-1.4x), f32 elsewhere
/// (NEON has no 16-bit kernels yet). `DELTAFIN_ACTIVATIONS=f32` forces f32.
pub fn model_act(kind: Kind) -> Act {
    static FORCE_F32: OnceLock<bool> = OnceLock::new();
    let force = *FORCE_F32.get_or_init(|| {
        std::env::var("DELTAFIN_ACTIVATIONS").is_ok_and(|v| v.eq_ignore_ascii_case("f32"))
    });
    if !force && kind.integer() && matches!(Isa::detect(), Isa::Avx512 | Isa::AvxVnni | Isa::Avx2) {
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

/// Round to nearest (ties to even) for `|v| < 2^22`, in plain adds the compiler vectorizes:
/// `f32::round` is a libm call on baseline x86_64, which costed more than the quantization.
#[inline]
fn round_small(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it leaves no fraction bits.
    (v + MAGIC) - MAGIC
}

/// Where one 32-block's values go in the [`I16Inputs`] order: two runs of 16 slots, the first
/// at the block's base slot, the second `run_b` further on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockRuns {
    /// `src[k]`: the block element stored at run slot `k` (`k < 16`: run A, else run B).
    pub src: [u8; BLOCK],
    /// Offset of run B from run A.
    pub run_b: usize,
}

impl BlockRuns {
    /// The runs for a block whose element `e` goes to `rel[e]` slots after its element 0.
    fn from_rel(rel: &[usize; BLOCK]) -> Self {
        let run_b = rel.iter().copied().filter(|&r| r >= 16).min().unwrap_or(16);
        let mut src = [0u8; BLOCK];
        for (e, &r) in rel.iter().enumerate() {
            let k = if r < 16 { r } else { 16 + r - run_b };
            src[k] = e as u8;
        }
        debug_assert!(
            (0..BLOCK).all(|k| {
                let r = rel[src[k] as usize];
                r == if k < 16 { k } else { run_b + k - 16 }
            }),
            "every block layout is two runs of 16 slots"
        );
        BlockRuns { src, run_b }
    }
}

/// Quantize `x [n, cols]` (cols a multiple of 32) to 16-bit blocks for `kind`; the SIMD
/// paths give the same bytes as the portable one. `isa` falls back to the portable loop when
/// this machine lacks it.
///
/// # Panics
/// When `cols` is not a positive multiple of 32 or `x` not a whole number of rows.
pub fn quantize_inputs_i16(isa: Isa, kind: Kind, x: &[f32], cols: usize) -> I16Inputs {
    // The SIMD block writers below rely on both (whole rows of whole blocks, real features).
    assert!(
        cols > 0 && cols.is_multiple_of(BLOCK) && x.len().is_multiple_of(cols),
        "quantize_inputs_i16: {} values are not rows of {cols} (a multiple of {BLOCK})",
        x.len()
    );
    let isa = if isa.available() { isa } else { Isa::Scalar };
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
    // Where each element of a block goes relative to the block's element 0: the same for
    // every block of a run of four (and for every block after the runs).
    let quads = cols / BLOCK / 4;
    let in_run: [usize; BLOCK] = std::array::from_fn(|e| i16_slot(kind, cols, e));
    let single: [usize; BLOCK] = std::array::from_fn(|e| block_slot(kind, e) - block_slot(kind, 0));
    let runs = [BlockRuns::from_rel(&in_run), BlockRuns::from_rel(&single)];
    let per_row = cols / BLOCK;
    for (b, xb) in x.chunks_exact(BLOCK).enumerate() {
        let (row, bi) = (b / per_row, b % per_row);
        let base = row * cols + i16_slot(kind, cols, bi * BLOCK);
        let r = &runs[usize::from(bi >= quads * 4)];
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512 {
            // SAFETY: `Isa::Avx512` means AVX-512 F/BW/VL were detected; `xb` is one block
            // and both runs of 16 slots from `base` lie inside `out.hi` / `out.lo` (the
            // block's own slots).
            let (d, dsum) = unsafe {
                x86_avx512::quantize_block_i16(xb, extra, r, base, &mut out.hi, &mut out.lo)
            };
            out.d[b] = d;
            out.dsums[b] = dsum;
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if isa.has_avx2() {
            // SAFETY: `has_avx2` means AVX2, FMA and F16C were detected; `xb` is one block and
            // both runs of 16 slots from `base` lie inside `out.hi` / `out.lo`.
            let quantized =
                unsafe { x86::quantize_block_i16(xb, extra, r, base, &mut out.hi, &mut out.lo) };
            if let Some((d, dsum)) = quantized {
                out.d[b] = d;
                out.dsums[b] = dsum;
                continue;
            }
        }
        let _ = isa;
        let s = block_amax(xb) / 127.0;
        let (inv, inv_lo) = i16_inverses(s);
        let mut h = [0f32; BLOCK];
        let mut l = [0f32; BLOCK];
        for ((h, l), &v) in h.iter_mut().zip(&mut l).zip(xb) {
            *h = round_small(v * inv).clamp(-127.0, 127.0);
            // |v - h*s| <= s/2, so the remainder is within +-128 steps of s/256 (clamped).
            *l = round_small((v - *h * s) * inv_lo).clamp(-127.0, 127.0);
        }
        let mut sum = 0i32;
        for (k, &e) in r.src.iter().enumerate() {
            let slot = base + if k < 16 { k } else { r.run_b + k - 16 };
            // `as` saturates NaN to 0: a NaN input gives a zero code, not UB.
            let (hq, lq) = (h[e as usize] as i8, l[e as usize] as i8);
            out.hi[slot] = hq;
            out.lo[slot] = lq;
            sum += 256 * hq as i32 + lq as i32;
        }
        (out.d[b], out.dsums[b]) = i16_block_scales(s, extra, sum);
    }
    out
}

/// Largest `|v|` of a block, NaNs skipped (`max` ignores them): every quantizer's block
/// maximum; the SIMD ones fall back to it for a block holding a NaN.
#[inline]
pub(crate) fn block_amax(xb: &[f32]) -> f32 {
    xb.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// A 16-bit block's `(d, dsum)` from its high step `s = amax / 127` and the integer sum of
/// `256 * hi + lo`: the same arithmetic on every path, so that they agree bit for bit.
#[inline]
pub(crate) fn i16_block_scales(s: f32, extra: f32, sum: i32) -> (f32, f32) {
    let d = s / 256.0 * extra;
    (d, d * sum as f32)
}

/// `(1 / s, 256 / s)`, or zeros for an all-zero block.
#[inline]
pub(crate) fn i16_inverses(s: f32) -> (f32, f32) {
    if s > 0.0 {
        (1.0 / s, 256.0 / s)
    } else {
        (0.0, 0.0)
    }
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
        let s = block_amax(xb) / 127.0;
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        *db = s * extra;
        for (i, &v) in xb.iter().enumerate() {
            qb[block_slot(kind, i)] = round_small(v * inv).clamp(-127.0, 127.0) as i8;
        }
    }
    Inputs::I8 { q, d }
}

/// Scale bytes `bytes` (of type `st`) appended to `out` as f32, in loops the compiler
/// vectorizes (F16 through F16C when available): this runs once per task, not per weight, but
/// a per-element `match` here costed as much as the INT4 kernel itself.
fn scales_to_f32(isa: Isa, st: ScaleType, bytes: &[u8], out: &mut Vec<f32>) {
    // A task's scales are one short pass, too short for the hardware prefetcher to ramp up
    // (the loads stalled on DRAM: 8 GB/s for E8M0): convert them in chunks, each after asking
    // for the chunk two ahead. `matmul_many_with`'s tasks also ask for the next task's.
    for (k, chunk) in bytes.chunks(SCALE_CHUNK).enumerate() {
        if let Some(ahead) = bytes.get((k + 2) * SCALE_CHUNK..) {
            prefetch_l2(&ahead[..ahead.len().min(SCALE_CHUNK)]);
        }
        scales_chunk_to_f32(isa, st, chunk, out);
    }
}

/// Bytes per prefetch step of [`scales_to_f32`]: a multiple of every scale size, so that no
/// scale straddles two chunks.
const SCALE_CHUNK: usize = 1024;
const _: () = assert!(SCALE_CHUNK.is_multiple_of(4));

fn scales_chunk_to_f32(isa: Isa, st: ScaleType, bytes: &[u8], out: &mut Vec<f32>) {
    let start = out.len();
    let count = match st {
        ScaleType::None => 0,
        ScaleType::E8m0 => bytes.len(),
        ScaleType::F16 | ScaleType::Bf16 => bytes.len() / 2,
        ScaleType::F32 => bytes.len() / 4,
    };
    out.resize(start + count, 0.0);
    let out = &mut out[start..];
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && matches!(st, ScaleType::E8m0 | ScaleType::Bf16) {
        // SAFETY: `Isa::Avx512` means AVX-512 F/BW were detected; `out` holds exactly one
        // value per scale in `bytes`.
        unsafe {
            match st {
                ScaleType::E8m0 => x86_avx512::e8m0_to_f32(bytes, out),
                _ => x86_avx512::bf16_to_f32(bytes, out),
            }
        }
        return;
    }
    match st {
        ScaleType::None => {}
        ScaleType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        ScaleType::Bf16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
            }
        }
        ScaleType::E8m0 => {
            for (o, &e) in out.iter_mut().zip(bytes) {
                *o = f32::from_bits(e8m0_bits(e));
            }
        }
        ScaleType::F16 => {
            #[cfg(target_arch = "x86_64")]
            if isa.has_avx2() {
                // SAFETY: Avx2 implies F16C was detected; `out` holds exactly
                // `bytes.len() / 2` values.
                unsafe { x86::f16_to_f32(bytes, out) };
                return;
            }
            let _ = isa;
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
    }
}

/// The f32 bits of an OCP e8m0 scale `2^(e - 127)`: 0 is the subnormal 2^-127, 255 is NaN.
/// Written with selects so that loops over it vectorize.
#[inline]
pub(crate) fn e8m0_bits(e: u8) -> u32 {
    let e = e as u32;
    let bits = if e == 0 { 0x0040_0000 } else { e << 23 };
    if e == 255 {
        0x7fc0_0000
    } else {
        bits
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
        WeightFormat::Int4Group { .. } | WeightFormat::Mxfp4 { .. } | WeightFormat::Q8 { .. } => {
            scales_to_f32(isa, st, group_scale_bytes(m, r0, r1), out);
        }
    }
}

/// The scale bytes of rows `r0..r1` of a per-group format (INT4, MXFP4, Q8); empty otherwise.
fn group_scale_bytes<'m>(m: &WeightMatrix<'m>, r0: usize, r1: usize) -> &'m [u8] {
    let sz = match m.scale_type() {
        ScaleType::None => 0,
        ScaleType::E8m0 => 1,
        ScaleType::F16 | ScaleType::Bf16 => 2,
        ScaleType::F32 => 4,
    };
    match m.format() {
        WeightFormat::Int4Group { group }
        | WeightFormat::Mxfp4 { group }
        | WeightFormat::Q8 { group } => {
            let g = m.cols().div_ceil(group);
            let rows = m.rows();
            &m.scale_bytes()[r0.min(rows) * g * sz..r1.min(rows) * g * sz]
        }
        _ => &[],
    }
}

/// Hints the CPU to bring `bytes` into L2 (a few KiB at a time: a long burst of prefetches
/// outruns the miss buffers and is dropped).
fn prefetch_l2(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..bytes.len()).step_by(64) {
        // SAFETY: SSE is part of the x86_64 baseline; a prefetch is a hint that neither
        // faults nor changes memory, and `line` is inside `bytes`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                bytes[line..].as_ptr() as *const i8,
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
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
                    // SAFETY: `Isa::Avx2`/`AvxVnni`/`Avx512` are only selected when
                    // `available()` saw AVX2, FMA and F16C; `simd_shape` holds and the slices
                    // have the lengths `x86::row_f32` documents (row = row_bytes(cols), scales
                    // = cols/group, x = n*cols, out = n), all checked by `matmul`.
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
                unsafe {
                    x86_avx512::row_i16(
                        kind,
                        row,
                        x86_avx512::BlockScales::F32(scales),
                        x,
                        cols,
                        n,
                        out,
                    )
                };
                return;
            }
            #[cfg(target_arch = "x86_64")]
            if simd && isa.has_avx2() {
                // SAFETY: `has_avx2` means AVX2, FMA and F16C were detected; the slices are
                // as for the AVX-512 kernel above.
                unsafe { x86::row_i16(isa == Isa::AvxVnni, kind, row, scales, x, cols, n, out) };
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
    matmul_many_with(isa, &[m], x, n, &mut [out], act)
}

/// Several matrices of the same format and width against the same inputs, in one parallel
/// pass: the inputs are quantized once and every matrix's row blocks are tasks of the same
/// pass (a SwiGLU's gate and up projections: one quantization and one hand-out to the
/// threads instead of two). `outs[i]` is `[n, mats[i].rows()]`; each output is bit-identical
/// to [`matmul_with`] on that matrix alone. Matrices of different formats or widths run one
/// after another.
pub fn matmul_many_with(
    isa: Isa,
    mats: &[&WeightMatrix<'_>],
    x: &[f32],
    n: usize,
    outs: &mut [&mut [f32]],
    act: Act,
) {
    assert_eq!(mats.len(), outs.len(), "one output per matrix");
    let Some(first) = mats.first() else {
        return;
    };
    let (kind, cols) = (Kind::of(first.format()), first.cols());
    if mats
        .iter()
        .any(|m| Kind::of(m.format()) != kind || m.cols() != cols)
    {
        for (m, out) in mats.iter().zip(outs.iter_mut()) {
            matmul_many_with(isa, &[m], x, n, &mut [&mut **out], act);
        }
        return;
    }
    assert_eq!(x.len(), n * cols, "matmul input length");
    for (m, out) in mats.iter().zip(outs.iter()) {
        assert_eq!(out.len(), n * m.rows(), "matmul output length");
    }
    if n == 0 {
        return;
    }
    let isa = if isa.available() { isa } else { Isa::Scalar };
    let integer_ok = kind.integer() && kind.simd_shape(cols);
    let xin = match act {
        Act::I8 if integer_ok => quantize_inputs(kind, x, cols),
        Act::I16 if integer_ok => Inputs::I16(quantize_inputs_i16(isa, kind, x, cols)),
        _ => Inputs::F32(x),
    };
    let rb = kind.row_bytes(cols);
    let block = (TASK_BYTES / rb.max(1)).clamp(1, 1024);
    let task = |m: &WeightMatrix<'_>, bi: usize, o: &mut [f32]| {
        rows_task(isa, m, kind, &xin, n, block, bi, o)
    };
    // Every matrix's row blocks (`chunk` output values each) as tasks of one parallel pass.
    let run_all = |bufs: &mut [&mut [f32]], chunk: usize| {
        let tasks: Vec<(usize, usize, &mut [f32])> = bufs
            .iter_mut()
            .enumerate()
            .flat_map(|(i, buf)| {
                buf.chunks_mut(chunk)
                    .enumerate()
                    .map(move |(bi, o)| (i, bi, o))
            })
            .collect();
        tasks
            .into_par_iter()
            .for_each(|(i, bi, o)| task(mats[i], bi, o));
    };
    if n == 1 {
        run_all(outs, block);
        return;
    }
    // Transposed scratch [rows, n] per matrix so that each task writes a contiguous range.
    let mut tmps: Vec<Vec<f32>> = mats.iter().map(|m| vec![0f32; m.rows() * n]).collect();
    run_all(
        &mut tmps
            .iter_mut()
            .map(|t| t.as_mut_slice())
            .collect::<Vec<_>>(),
        block * n,
    );
    for ((m, tmp), out) in mats.iter().zip(&tmps).zip(outs.iter_mut()) {
        let rows = m.rows();
        for (r, trow) in tmp.chunks(n).enumerate() {
            for (t, &v) in trow.iter().enumerate() {
                out[t * rows + r] = v;
            }
        }
    }
}

/// Rows `bi * block ..` of `m` (as many as `o` holds, `n` outputs each) against prepared
/// inputs: one task of [`matmul_many_with`].
#[allow(clippy::too_many_arguments)]
fn rows_task(
    isa: Isa,
    m: &WeightMatrix<'_>,
    kind: Kind,
    xin: &Inputs<'_>,
    n: usize,
    block: usize,
    bi: usize,
    o: &mut [f32],
) {
    let cols = m.cols();
    let rb = kind.row_bytes(cols);
    let data = m.data_bytes();
    let r0 = bi * block;
    let nr = o.len() / n;
    let group = kind.group(cols);
    let expand = !matches!(xin, Inputs::F32(_)) && group != BLOCK;
    // Scales of the task's rows `a..b` as f32 into `buf`; the integer kernels take one
    // scale per 32-block.
    let scales_of = |a: usize, b: usize, buf: &mut Vec<f32>| {
        row_scales(isa, m, r0 + a, r0 + b, buf);
        if expand {
            *buf = buf
                .chunks(cols.div_ceil(group))
                .flat_map(|g| (0..cols / BLOCK).map(move |b| g[b * BLOCK / group]))
                .collect();
        }
    };
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut first = 0;
    // Matrix-vector products with a long `x` (over half of a 32 KiB L1 data cache): four
    // rows at a time share each load of `x` instead of re-reading it from L2 per row.
    // With a short `x` the single-row tile (four accumulators) measured faster
    // (benches/results/kernels_idle_rows4_all_shapes.json vs kernels_idle.json), except
    // for FP8 on AVX-512, whose decode leaves fewer spare loads (22.3 vs 19.9 GiB/s at
    // 7168x2048). The AVX-512 tiles prefetch the next tile's rows in software.
    #[cfg(target_arch = "x86_64")]
    if n == 1 && isa == Isa::Avx512 && kind.simd_shape(cols) && group == BLOCK {
        if let Inputs::I16(xq) = xin {
            // Eight rows at a time, then four, share each input load. The tiles read the
            // matrix's scale bytes themselves: a separate conversion pass per task stalled
            // on DRAM (6-14% of the INT4 / MXFP4 / Q8 matvec time, prefetching or not).
            let st = m.scale_type();
            let sb = group_scale_bytes(m, r0, r0 + nr);
            let per_row = sb.len() / nr;
            macro_rules! tile {
                ($r:literal) => {
                    while first + $r <= nr {
                        let r = r0 + first;
                        let rows: [&[u8]; $r] =
                            std::array::from_fn(|k| &data[(r + k) * rb..(r + k + 1) * rb]);
                        let sc: [x86_avx512::BlockScales<'_>; $r] = std::array::from_fn(|k| {
                            let i = first + k;
                            x86_avx512::BlockScales::Raw(&sb[i * per_row..(i + 1) * per_row], st)
                        });
                        // SAFETY: `Isa::Avx512` implies AVX-512 F/BW/VL/VNNI, AVX2 and FMA
                        // were detected; `simd_shape` holds; each row is `row_bytes(cols)`
                        // long, each scale slice holds the row's `cols / 32` block scales
                        // (group 32) in the matrix's type, `xq` one input of `cols`,
                        // `o[first..first + R]` the outputs.
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
    // The other rows' scales as f32: `scales[(i - s0) * per_row..]` for task row `i`.
    let s0 = first;
    let mut scales = Vec::new();
    scales_of(s0, nr, &mut scales);
    if s0 == 0 {
        // One conversion pass for the task: ask for the next task's scales now, or that
        // pass stalls on DRAM, too short for the hardware prefetcher to ramp up.
        prefetch_l2(group_scale_bytes(m, r0 + nr, r0 + 2 * nr));
    }
    let per_row = scales.len() / (nr - s0).max(1);
    #[cfg(target_arch = "x86_64")]
    if n == 1
        && (cols * 4 > 16 << 10 || (isa == Isa::Avx512 && matches!(kind, Kind::Fp8 { .. })))
        && isa.has_avx2()
        && kind.simd_shape(cols)
    {
        if let Inputs::F32(xf) = xin {
            while first + 4 <= nr {
                let r = r0 + first;
                let row = |k: usize| &data[(r + k) * rb..(r + k + 1) * rb];
                let sc = |k: usize| {
                    let i = first + k - s0;
                    &scales[i * per_row..(i + 1) * per_row]
                };
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
            &scales[(i - s0) * per_row..(i - s0 + 1) * per_row],
            xin,
            cols,
            n,
            orow,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each ISA's scale conversion equals the per-value definition bit for bit, for every
    /// e8m0 code (0 and 255 included) and bf16 patterns with NaNs, at lengths covering the
    /// vector bodies and their tails.
    #[test]
    fn scale_conversions_match_the_definitions() {
        let e8m0: Vec<u8> = (0..3).flat_map(|_| 0..=255u8).collect();
        let bf16: Vec<u8> = (0..700u32)
            .flat_map(|i| {
                let bits = match i % 7 {
                    0 => 0x7fc1,
                    1 => 0xff80,
                    2 => 0x0001,
                    _ => (i.wrapping_mul(0x9e37) >> 3) as u16,
                };
                bits.to_le_bytes()
            })
            .collect();
        for isa in [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512, Isa::Neon] {
            if !isa.available() {
                continue;
            }
            for len in (0..40).chain([255, 256, 300, 512]) {
                for start in [0usize, 1, 5] {
                    let bytes = &e8m0[start..start + len];
                    let mut got = vec![1.0f32];
                    scales_to_f32(isa, ScaleType::E8m0, bytes, &mut got);
                    assert_eq!(got.len(), 1 + len);
                    for (i, (&g, &e)) in got[1..].iter().zip(bytes).enumerate() {
                        let want = if e == 0 {
                            2f32.powi(-127)
                        } else if e == 255 {
                            f32::NAN
                        } else {
                            2f32.powi(e as i32 - 127)
                        };
                        assert_eq!(g.to_bits(), want.to_bits(), "{isa:?} e8m0 {e} at {i}");
                    }
                    let bytes = &bf16[2 * start..2 * (start + len)];
                    let mut got = Vec::new();
                    scales_to_f32(isa, ScaleType::Bf16, bytes, &mut got);
                    assert_eq!(got.len(), len);
                    for (g, b) in got.iter().zip(bytes.chunks_exact(2)) {
                        let want = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]]));
                        assert_eq!(g.to_bits(), want.to_f32().to_bits(), "{isa:?} bf16 {b:?}");
                    }
                }
            }
        }
    }

    /// Each ISA's 16-bit quantization gives the portable bytes, NaN, infinity, zero blocks and
    /// ties included.
    #[test]
    fn i16_quantizers_agree() {
        for kind in [
            Kind::Int4 { group: 32 },
            Kind::Mxfp4 { group: 32 },
            Kind::Q8 { group: 32 },
        ] {
            for cols in [32, 96, 128, 160, 288] {
                let n = 4;
                let mut x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) * 0.013)
                    .collect();
                x[3] = f32::NAN;
                x[cols + 40 % cols] = f32::INFINITY;
                x[cols / 2] = f32::NEG_INFINITY;
                for v in &mut x[2 * cols..2 * cols + 32] {
                    *v = 0.0;
                }
                // Exact ties of the high code: 0.5 steps of amax / 127.
                for (k, v) in x[3 * cols..3 * cols + 32].iter_mut().enumerate() {
                    *v = if k == 0 { 127.0 } else { k as f32 + 0.5 };
                }
                let want = quantize_inputs_i16(Isa::Scalar, kind, &x, cols);
                for isa in [Isa::Avx2, Isa::AvxVnni, Isa::Avx512, Isa::Neon] {
                    if !isa.available() {
                        continue;
                    }
                    let got = quantize_inputs_i16(isa, kind, &x, cols);
                    assert_eq!(got.hi, want.hi, "{isa:?} {kind:?} {cols}: hi");
                    assert_eq!(got.lo, want.lo, "{isa:?} {kind:?} {cols}: lo");
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got.d), bits(&want.d), "{isa:?} {kind:?} {cols}: d");
                    assert_eq!(
                        bits(&got.dsums),
                        bits(&want.dsums),
                        "{isa:?} {kind:?}: dsums"
                    );
                }
            }
        }
    }

    /// The 16-bit inputs rebuild each value within one low step (half a step of rounding; the
    /// low byte's clamp to +-127 can add the other half), in the documented order.
    #[test]
    fn i16_inputs_rebuild_the_values() {
        for kind in [
            Kind::Int4 { group: 32 },
            Kind::Mxfp4 { group: 32 },
            Kind::Q8 { group: 32 },
        ] {
            for cols in [32, 64, 128, 160, 224, 288] {
                let n = 3;
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) * if i % 9 == 0 { 10.0 } else { 0.1 })
                    .collect();
                let q = quantize_inputs_i16(Isa::Scalar, kind, &x, cols);
                let extra = if matches!(kind, Kind::Mxfp4 { .. }) {
                    0.5
                } else {
                    1.0
                };
                for t in 0..n {
                    for i in 0..cols {
                        let b = (t * cols + i) / BLOCK;
                        let slot = t * cols + i16_slot(kind, cols, i);
                        let v = (256.0 * q.hi[slot] as f32 + q.lo[slot] as f32) * q.d[b] / extra;
                        let step = q.d[b] / extra;
                        let want = x[t * cols + i];
                        assert!(
                            (v - want).abs() <= step + want.abs() * 1e-6,
                            "{kind:?} cols {cols} t {t} i {i}: {v} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
