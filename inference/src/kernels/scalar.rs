//! Portable reference kernels: decode a row to f32 exactly as the bit layouts say
//! (testdata/fixtures/README.md), then take f32 dot products. The SIMD kernels are tested
//! against these, and these against plain f32 math.

use deltafin_formats::WeightFormat;

use crate::kernels::shape::BLOCK;

pub use deltafin_formats::codec::{bf16_to_f32, fp8_e4m3_to_f32, MXFP4_LUT};

fn fp8_lut() -> &'static [f32; 256] {
    static LUT: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    LUT.get_or_init(|| {
        let mut t = [0f32; 256];
        for (i, v) in t.iter_mut().enumerate() {
            *v = fp8_e4m3_to_f32(i as u8);
        }
        t
    })
}

/// E2M1 nibble -> twice its value, as an integer (the integer kernels' codes).
pub const MXFP4_X2: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Decode one row (`row` = its bytes, `scales` = its f32 scales) into `out[..cols]`.
pub fn decode_row(kind: WeightFormat, row: &[u8], scales: &[f32], cols: usize, out: &mut [f32]) {
    decode_row_body(kind, row, scales, cols, out)
}

/// [`decode_row`]'s body, also compiled for wider vectors (`kernels::vector::decode_row`:
/// exact conversions and one multiply each, so the same bits on every instruction set).
#[inline(always)]
pub(crate) fn decode_row_body(
    kind: WeightFormat,
    row: &[u8],
    scales: &[f32],
    cols: usize,
    out: &mut [f32],
) {
    let out = &mut out[..cols];
    match kind {
        WeightFormat::F32 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        WeightFormat::Bf16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        WeightFormat::F16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        WeightFormat::Fp8Block {
            block_cols: block, ..
        } => {
            let lut = fp8_lut();
            for ((o, w), &s) in out.chunks_mut(block).zip(row.chunks(block)).zip(scales) {
                for (o, &w) in o.iter_mut().zip(w) {
                    *o = lut[w as usize] * s;
                }
            }
        }
        WeightFormat::Int4 { group } => {
            // Eight nibbles per little-endian I32 word, lowest first: byte `i` of the row holds
            // values `2i` (low nibble) and `2i + 1`, each offset by 8. (Byte by byte, so that
            // the compiler vectorizes it: MLA decodes kv_b_proj rows on every forward.)
            for (&b, o) in row.iter().zip(out.chunks_exact_mut(2)) {
                o[0] = ((b & 0xf) as i32 - 8) as f32;
                o[1] = ((b >> 4) as i32 - 8) as f32;
            }
            scale_groups(out, group, scales);
        }
        WeightFormat::Mxfp4 { group } => {
            for (&b, o) in row.iter().zip(out.chunks_mut(2)) {
                o[0] = MXFP4_LUT[(b & 0xf) as usize];
                if let Some(hi) = o.get_mut(1) {
                    *hi = MXFP4_LUT[(b >> 4) as usize];
                }
            }
            scale_groups(out, group, scales);
        }
        WeightFormat::Q8 { group } => {
            for (o, &b) in out.iter_mut().zip(row) {
                *o = b as i8 as f32;
            }
            scale_groups(out, group, scales);
        }
    }
}

#[inline(always)]
fn scale_groups(out: &mut [f32], group: usize, scales: &[f32]) {
    for (chunk, &s) in out.chunks_mut(group).zip(scales) {
        chunk.iter_mut().for_each(|v| *v *= s);
    }
}

/// Dot product with 8 independent f32 accumulators.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ta.iter().zip(tb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `out[t] = dot(decode(row), x[t*cols..])` for `t < n`.
pub fn row_f32(
    kind: WeightFormat,
    row: &[u8],
    scales: &[f32],
    x: &[f32],
    cols: usize,
    n: usize,
    out: &mut [f32],
) {
    thread_local! {
        static BUF: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    BUF.with(|b| {
        let mut buf = b.borrow_mut();
        buf.resize(cols, 0.0);
        decode_row(kind, row, scales, cols, &mut buf);
        for (t, o) in out[..n].iter_mut().enumerate() {
            *o = dot(&buf, &x[t * cols..(t + 1) * cols]);
        }
    })
}

/// `x` rounded to BF16 the way `vcvtne2ps2bf16` rounds it: to nearest even, subnormals
/// flushed to zero (of the same sign), NaN kept a NaN.
pub fn round_bf16(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x != 0.0 && x.abs() < f32::MIN_POSITIVE {
        return 0.0f32.copysign(x);
    }
    half::bf16::from_f32(x).to_f32()
}

/// [`super::Act::Bf16`]'s reference: `out[t] = dot(decode(row), round_bf16(x[t*cols..]))`
/// (BF16 weights).
pub fn row_bf16_act(row: &[u8], x: &[f32], cols: usize, n: usize, out: &mut [f32]) {
    let mut w = vec![0f32; cols];
    decode_row(WeightFormat::Bf16, row, &[], cols, &mut w);
    for (t, o) in out[..n].iter_mut().enumerate() {
        let xr: Vec<f32> = x[t * cols..(t + 1) * cols]
            .iter()
            .map(|&v| round_bf16(v))
            .collect();
        *o = dot(&w, &xr);
    }
}

/// The integer codes of one 32-column block at column `c`, in the order
/// [`super::quantize_inputs`] stores the inputs for `kind`, and the code-to-value factor that
/// the block's f32 scale and the input scale leave out (none: MXFP4's halving is in the input
/// scale).
fn block_codes(kind: WeightFormat, row: &[u8], c: usize) -> [i32; BLOCK] {
    let mut w = [0i32; BLOCK];
    match kind {
        WeightFormat::Int4 { .. } | WeightFormat::Mxfp4 { .. } => {
            let bytes = &row[c / 2..c / 2 + BLOCK / 2];
            for (i, &b) in bytes.iter().enumerate() {
                let (lo, hi) = ((b & 0xf) as usize, (b >> 4) as usize);
                let (lo, hi) = match kind {
                    WeightFormat::Int4 { .. } => (lo as i32 - 8, hi as i32 - 8),
                    _ => (MXFP4_X2[lo] as i32, MXFP4_X2[hi] as i32),
                };
                // Evens first, then odds.
                w[i] = lo;
                w[16 + i] = hi;
            }
        }
        WeightFormat::Q8 { .. } => {
            for (o, &b) in w.iter_mut().zip(&row[c..c + BLOCK]) {
                *o = b as i8 as i32;
            }
        }
        _ => unreachable!("integer kernels only take INT4, MXFP4 and Q8"),
    }
    w
}

/// Integer reference: per 32-block `sum(code_w * q_x) * scale_w * d_x`, summed in f32.
/// `scales` holds one value per 32-block (the driver expands larger groups); needs
/// `cols % 32 == 0` (the driver only quantizes then).
#[allow(clippy::too_many_arguments)]
pub fn row_i8(
    kind: WeightFormat,
    row: &[u8],
    scales: &[f32],
    q: &[i8],
    d: &[f32],
    cols: usize,
    n: usize,
    out: &mut [f32],
) {
    let blocks = cols / BLOCK;
    out[..n].fill(0.0);
    for b in 0..blocks {
        let c = b * BLOCK;
        let w = block_codes(kind, row, c);
        let sw = scales[b];
        for (t, o) in out[..n].iter_mut().enumerate() {
            let xq = &q[t * cols + c..t * cols + c + BLOCK];
            let s: i32 = w.iter().zip(xq).map(|(&w, &x)| w * x as i32).sum();
            *o += s as f32 * sw * d[t * blocks + b];
        }
    }
}

/// The integer code of element `c` of a row (INT4: nibble - 8; MXFP4: twice the e2m1 value;
/// Q8: the byte).
fn code_at(kind: WeightFormat, row: &[u8], c: usize) -> i32 {
    match kind {
        WeightFormat::Int4 { .. } | WeightFormat::Mxfp4 { .. } => {
            let b = row[c / 2];
            let nib = if c.is_multiple_of(2) { b & 0xf } else { b >> 4 } as usize;
            match kind {
                WeightFormat::Int4 { .. } => nib as i32 - 8,
                _ => MXFP4_X2[nib] as i32,
            }
        }
        WeightFormat::Q8 { .. } => row[c] as i8 as i32,
        _ => unreachable!("integer kernels only take INT4, MXFP4 and Q8"),
    }
}

/// 16-bit-activation reference: each input block is `d * (256 * hi + lo)` (stored in the order
/// [`super::i16_slot`] gives); per 32-block `sum(code_w * (256 * hi + lo)) * scale_w * d_x` in
/// exact integer arithmetic, summed in f32. Same shape rules as [`row_i8`].
#[allow(clippy::too_many_arguments)]
pub fn row_i16(
    kind: WeightFormat,
    row: &[u8],
    scales: &[f32],
    x: &crate::kernels::inputs::I16Inputs,
    cols: usize,
    n: usize,
    out: &mut [f32],
) {
    let blocks = cols / BLOCK;
    out[..n].fill(0.0);
    for (b, &sw) in scales[..blocks].iter().enumerate() {
        for (t, o) in out[..n].iter_mut().enumerate() {
            let mut s = 0i32;
            for c in b * BLOCK..(b + 1) * BLOCK {
                let at = t * cols + crate::kernels::inputs::i16_slot(kind, cols, x.order, c);
                s += code_at(kind, row, c) * (256 * x.hi[at] as i32 + x.lo[at] as i32);
            }
            *o += s as f32 * sw * x.d[t * blocks + b];
        }
    }
}
