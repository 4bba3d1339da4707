//! Intel AMX kernels for BF16 weights ([`super::Act::Bf16x2`]), on CPUs with AMX-TILE and
//! AMX-BF16 (Sapphire Rapids and later). One `tdpbf16ps` multiplies a tile of 16 weight rows by
//! 16 inputs over 32 columns (8192 multiply-adds, f32 accumulation) where the AVX-512 f32 path
//! does 16 per FMA.
//!
//! Precision: AMX multiplies BF16 by BF16. Rounding the inputs to BF16 (llama.cpp's BF16
//! precision, [`super::Act::Bf16`]) is beyond the fixtures' tolerance, so each f32 input is
//! split into two BF16 values, `hi = bf16(x)` and `lo = bf16(x - hi)`, and every tile is
//! multiplied by both: `w * x ~ w * hi + w * lo` with a relative error of about 2^-17 per
//! input, against the f32 path's 2^-24 rounding of each product sum. Weights are BF16 already:
//! exact in either. One more difference: the tiles read denormal BF16 values as zero and flush
//! denormal results (below 2^-126), so inputs under about 2^-117 lose their lo half and
//! denormal weights count as zero; the f32 path keeps them.
//!
//! Layout: the weight rows are read where they lie (a tile is 16 rows of 64 bytes, the rows
//! `2 * cols` bytes apart), so the product is computed transposed, `C[row][input]`, with the
//! inputs as the tiles' second operand in the pair-interleaved order `tdpbf16ps` wants
//! ([`Bf16Pairs`]). Every output is the same accumulation, tile by tile over the columns in
//! order, hi then lo, whatever the number of inputs or rows beside it (`tdpbf16ps` computes
//! each result element on its own): a matrix-vector product equals the matching row of a
//! matrix product bit for bit, as on the other paths.
//!
//! Tiles: tmm0-3 hold four row blocks' results, tmm4-5 their weights (alternating), tmm6-7 the
//! inputs' hi and lo planes. Rust never uses the tile registers, so they keep their contents
//! from one `asm!` block to the next within a task; the kernel saves them on a context switch.

use std::arch::asm;
use std::sync::OnceLock;

use crate::kernels::shape::BLOCK;

/// Inputs per tile: the result tiles' 16 f32 columns.
pub const TILE_INPUTS: usize = 16;
/// Weight rows per tile.
const TILE_ROWS: usize = 16;
/// Bytes of one tile row (32 BF16 columns, one [`BLOCK`]).
const TILE_ROW_BYTES: usize = 64;
/// How far apart (bytes) the rows of one tile are read when the inputs do not fill a tile.
const SPAN_BYTES: usize = 16384;

/// Whether this machine runs these kernels: the CPU has AMX-TILE, AMX-BF16 and AVX-512 F,
/// and the operating system lets this process use the tile registers (Linux asks each process
/// to request them, `arch_prctl(ARCH_REQ_XCOMP_PERM)`; asked once here).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
        let amx_bf16 = leaf7.edx >> 22 & 1 == 1;
        let amx_tile = leaf7.edx >> 24 & 1 == 1;
        amx_bf16 && amx_tile && is_x86_feature_detected!("avx512f") && request_tile_data()
    })
}

/// Ask Linux for the tile data state (XTILEDATA) for this process; `true` once granted.
#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: `arch_prctl(ARCH_REQ_XCOMP_PERM, feature)` takes two integers and changes only
    // which extended states this process may use; an older kernel answers EINVAL.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

/// Other systems: not used (each has its own way of enabling the tile state).
#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// `x` rounded to BF16 bits (in the low 16), to nearest with ties to even; NaN stays NaN.
/// Branch-free, so that row loops vectorize.
#[inline(always)]
fn bf16_bits(x: f32) -> u32 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let quiet_nan = (b >> 16) | 0x40;
    if b & 0x7fff_ffff > 0x7f80_0000 {
        quiet_nan
    } else {
        rounded
    }
}

/// `x` as `(hi, lo)` BF16 bits, `x ~ hi + lo`; `lo` is zero where `hi` is not finite.
#[inline(always)]
pub(crate) fn split(x: f32) -> (u32, u32) {
    let hi = bf16_bits(x);
    let lo = bf16_bits(x - f32::from_bits(hi << 16));
    (hi, if hi & 0x7f80 == 0x7f80 { 0 } else { lo })
}

/// One input row's column pairs split: `hi[p]` holds `hi(x[2p])` in its low half and
/// `hi(x[2p + 1])` in its high half (the order `tdpbf16ps` pairs them in), `lo[p]` the same.
#[inline(always)]
fn split_row_body(x: &[f32], hi: &mut [u32], lo: &mut [u32]) {
    for ((pair, h), l) in x.chunks_exact(2).zip(hi.iter_mut()).zip(lo.iter_mut()) {
        let (h0, l0) = split(pair[0]);
        let (h1, l1) = split(pair[1]);
        (*h, *l) = (h0 | h1 << 16, l0 | l1 << 16);
    }
}

/// [`split_row_body`] vectorized with AVX-512.
///
/// # Safety
/// AVX-512 F/BW available.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn split_row_avx512(x: &[f32], hi: &mut [u32], lo: &mut [u32]) {
    split_row_body(x, hi, lo)
}

/// [`split_row_body`] on the best vectors this machine has.
fn split_row(x: &[f32], hi: &mut [u32], lo: &mut [u32]) {
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
        // SAFETY: AVX-512 F/BW were detected.
        unsafe { split_row_avx512(x, hi, lo) }
    } else {
        split_row_body(x, hi, lo)
    }
}

/// Inputs `[n, cols]` split into BF16 pairs ([`split`]) in the order the second operand of
/// `tdpbf16ps` reads them: per group of up to [`TILE_INPUTS`] inputs (`m` of them), a hi plane
/// then a lo plane, each `[cols / 2][m]` 32-bit column pairs (pair `p` of input `j` at
/// `p * m + j`). One tile of a plane (32 columns of the weights) is 16 rows of `4 * m` bytes,
/// contiguous.
#[derive(Debug, Default)]
pub struct Bf16Pairs {
    data: Vec<u32>,
    cols: usize,
    n: usize,
}

impl Bf16Pairs {
    /// Split `x` (`[n, cols]`, `cols` a multiple of 32).
    pub fn new(x: &[f32], cols: usize) -> Bf16Pairs {
        debug_assert!(cols.is_multiple_of(BLOCK) && x.len().is_multiple_of(cols.max(1)));
        let n = x.len().checked_div(cols).unwrap_or(0);
        let half = cols / 2;
        let mut data = vec![0u32; n * cols];
        let (mut hi_row, mut lo_row) = (vec![0u32; half], vec![0u32; half]);
        for g in 0..n.div_ceil(TILE_INPUTS) {
            let (base, m) = Self::group_at(cols, n, g);
            let (hi, lo) = data[base..base + m * cols].split_at_mut(m * half);
            for j in 0..m {
                let xr = &x[(g * TILE_INPUTS + j) * cols..][..cols];
                if m == 1 {
                    split_row(xr, hi, lo);
                    continue;
                }
                split_row(xr, &mut hi_row, &mut lo_row);
                for p in 0..half {
                    hi[p * m + j] = hi_row[p];
                    lo[p * m + j] = lo_row[p];
                }
            }
        }
        Bf16Pairs { data, cols, n }
    }

    /// Offset (in pairs) of group `g`'s hi plane and its number of inputs.
    fn group_at(cols: usize, n: usize, g: usize) -> (usize, usize) {
        let m = TILE_INPUTS.min(n - g * TILE_INPUTS);
        (g * TILE_INPUTS * cols, m)
    }

    /// Group `g`'s hi and lo planes and its number of inputs.
    fn group(&self, g: usize) -> (&[u32], &[u32], usize) {
        let (base, m) = Self::group_at(self.cols, self.n, g);
        let (hi, lo) = self.data[base..base + m * self.cols].split_at(m * self.cols / 2);
        (hi, lo, m)
    }
}

/// The tile configuration `ldtilecfg` loads (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// Results and weights of `rows` rows, inputs of `m` columns.
    fn new(rows: usize, m: usize) -> TileConfig {
        debug_assert!((1..=TILE_ROWS).contains(&rows) && (1..=TILE_INPUTS).contains(&m));
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for t in 0..4 {
            (c.rows[t], c.colsb[t]) = (rows as u8, (4 * m) as u16);
        }
        for t in 4..6 {
            (c.rows[t], c.colsb[t]) = (rows as u8, TILE_ROW_BYTES as u16);
        }
        for t in 6..8 {
            (c.rows[t], c.colsb[t]) = ((BLOCK / 2) as u8, (4 * m) as u16);
        }
        c
    }

    /// Load it.
    ///
    /// # Safety
    /// [`available`].
    #[inline]
    unsafe fn load(&self) {
        // SAFETY: the caller checked AMX; `self` is a valid 64-byte palette-1 configuration.
        unsafe { asm!("ldtilecfg [{}]", in(reg) self as *const TileConfig, options(nostack)) };
    }
}

/// A 16-row tile's results, `[row][16]` f32.
#[repr(C, align(64))]
struct ResultTile([f32; TILE_ROWS * TILE_INPUTS]);

/// `o[i * n + t] = dot(row i, x[t])` for the `o.len() / n` rows in `data` (`rb = 2 * cols`
/// bytes each) against `x` as [`Bf16Pairs`]: `dispatch::rows_task` for [`super::Act::Bf16x2`].
///
/// # Safety
/// [`available`]; `cols` a multiple of 32, `rb == 2 * cols`, `data` holding `o.len() / n` rows,
/// `x` `n` inputs of `cols`.
pub unsafe fn rows_task(data: &[u8], rb: usize, x: &Bf16Pairs, cols: usize, o: &mut [f32]) {
    let n = x.n;
    debug_assert!(cols.is_multiple_of(BLOCK) && rb == 2 * cols && x.cols == cols && n > 0);
    let nr = o.len() / n;
    debug_assert!(data.len() >= nr * rb);
    let full = nr / TILE_ROWS;
    let tail = nr % TILE_ROWS;
    let mut res = [
        ResultTile([0.0; 256]),
        ResultTile([0.0; 256]),
        ResultTile([0.0; 256]),
        ResultTile([0.0; 256]),
    ];
    for g in 0..n.div_ceil(TILE_INPUTS) {
        let (hi, lo, m) = x.group(g);
        let planes = (hi.as_ptr(), lo.as_ptr(), 4 * m);
        // Results `[rows][m]` of tile `k` (row `i` is output row `first + k * 16 * step +
        // i * step`) into the outputs.
        let put = |o: &mut [f32], res: &[ResultTile], first: usize, step: usize, rows: usize| {
            for (k, r) in res.iter().enumerate() {
                for i in 0..rows {
                    let at = (first + (k * TILE_ROWS + i) * step) * n + g * TILE_INPUTS;
                    o[at..at + m].copy_from_slice(&r.0[i * TILE_INPUTS..i * TILE_INPUTS + m]);
                }
            }
        };
        let scatter = |o: &mut [f32], res: &[ResultTile], b: usize, rows: usize| {
            put(o, res, b * TILE_ROWS, 1, rows)
        };
        // SAFETY: AMX is available (the caller's contract); the rows passed lie inside `data`
        // (a span's tiles read rows `first + sp * i` for `i < 16`, below `spans * span <= nr`;
        // the blocks `b * 16 + 16 * R <= full * 16 <= nr`; the tail's rows `full * 16 .. nr`),
        // the planes hold `cols / 2` rows of `m` pairs.
        unsafe {
            TileConfig::new(TILE_ROWS, m).load();
            // Fewer inputs than a tile takes (decode, a prefill's small expert batches): the
            // weights stream from DRAM at little work per byte. A tile's 16 rows side by side
            // are then 16 interleaved streams within a few pages, which the hardware
            // prefetcher does not follow: each tile takes every `sp`-th row instead, rows
            // `SPAN_BYTES` apart (one input from DRAM: 2048-byte rows 13.2-14.0 -> 18.3-18.8
            // GMAC/s, f32 path 19.9-20.3; 1024-byte rows 19.2-20.4 -> 22.5, f32 22.3). Full
            // tiles of inputs keep four neighbouring blocks per pass (230 vs 171-180 GMAC/s
            // with spans at 32 inputs).
            let sp = (SPAN_BYTES / rb).max(1);
            let span = TILE_ROWS * sp;
            let spans = if sp > 1 && m < TILE_INPUTS {
                nr / span
            } else {
                0
            };
            for si in 0..spans {
                for q in 0..sp {
                    let first = si * span + q;
                    blocks::<1>(data.as_ptr().add(first * rb), sp * rb, planes, cols);
                    store::<1>(&mut res);
                    put(o, &res[..1], first, sp, TILE_ROWS);
                }
            }
            let mut b = spans * span / TILE_ROWS;
            while b + 4 <= full {
                blocks::<4>(data.as_ptr().add(b * TILE_ROWS * rb), rb, planes, cols);
                store::<4>(&mut res);
                scatter(o, &res[..4], b, TILE_ROWS);
                b += 4;
            }
            while b < full {
                blocks::<1>(data.as_ptr().add(b * TILE_ROWS * rb), rb, planes, cols);
                store::<1>(&mut res);
                scatter(o, &res[..1], b, TILE_ROWS);
                b += 1;
            }
            if tail > 0 {
                TileConfig::new(tail, m).load();
                blocks::<1>(data.as_ptr().add(full * TILE_ROWS * rb), rb, planes, cols);
                store::<1>(&mut res);
                scatter(o, &res[..1], full, tail);
            }
        }
    }
    // SAFETY: AMX is available; releasing the tile state lets the kernel skip saving it.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// `R` (1 or 4) row blocks of the loaded configuration's rows from `a` (rows `rb` bytes apart,
/// block `k` at `a + k * 16 * rb`) times one input group's planes `(hi, lo, bytes per tile
/// row)`, into tmm0..tmm`R`: per column block, the hi product then the lo product.
///
/// # Safety
/// AMX available and configured by [`TileConfig::new`]; `a` the first of `16 * (R - 1) + rows`
/// rows of `cols` BF16 values; the planes `cols / 2` rows of the configured bytes each.
#[inline]
unsafe fn blocks<const R: usize>(
    a: *const u8,
    rb: usize,
    (hi, lo, stride): (*const u32, *const u32, usize),
    cols: usize,
) {
    // SAFETY: the caller's contract; every tile load reads the configured rows of the
    // configured bytes, inside the weights (`c * 64 + 64 <= 2 * cols` for column block `c`)
    // and the planes (`(c + 1) * 16` rows of `stride` bytes).
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        );
        for c in 0..cols / BLOCK {
            let bh = (hi as *const u8).add(c * 16 * stride);
            let bl = (lo as *const u8).add(c * 16 * stride);
            let a0 = a.add(c * TILE_ROW_BYTES);
            if R == 4 {
                let step = TILE_ROWS * rb;
                asm!(
                    "tileloadd tmm6, [{bh} + {s}*1]",
                    "tileloadd tmm7, [{bl} + {s}*1]",
                    "tileloadd tmm4, [{a0} + {rb}*1]",
                    "tileloadd tmm5, [{a1} + {rb}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm0, tmm4, tmm7",
                    "tileloadd tmm4, [{a2} + {rb}*1]",
                    "tdpbf16ps tmm1, tmm5, tmm6",
                    "tdpbf16ps tmm1, tmm5, tmm7",
                    "tileloadd tmm5, [{a3} + {rb}*1]",
                    "tdpbf16ps tmm2, tmm4, tmm6",
                    "tdpbf16ps tmm2, tmm4, tmm7",
                    "tdpbf16ps tmm3, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    bh = in(reg) bh,
                    bl = in(reg) bl,
                    s = in(reg) stride,
                    a0 = in(reg) a0,
                    a1 = in(reg) a0.add(step),
                    a2 = in(reg) a0.add(2 * step),
                    a3 = in(reg) a0.add(3 * step),
                    rb = in(reg) rb,
                    options(nostack, readonly)
                );
            } else {
                asm!(
                    "tileloadd tmm6, [{bh} + {s}*1]",
                    "tileloadd tmm7, [{bl} + {s}*1]",
                    "tileloadd tmm4, [{a0} + {rb}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm0, tmm4, tmm7",
                    bh = in(reg) bh,
                    bl = in(reg) bl,
                    s = in(reg) stride,
                    a0 = in(reg) a0,
                    rb = in(reg) rb,
                    options(nostack, readonly)
                );
            }
        }
    }
}

/// Store tmm0..tmm`R` into `res[..R]` (rows 64 bytes apart).
///
/// # Safety
/// AMX available and configured by [`TileConfig::new`] (at most 16 rows of at most 64 bytes).
#[inline]
unsafe fn store<const R: usize>(res: &mut [ResultTile; 4]) {
    let [p0, p1, p2, p3] = res.each_mut().map(|r| r.0.as_mut_ptr());
    // SAFETY: each store writes at most 16 rows of 64 bytes, one `ResultTile`.
    unsafe {
        if R == 4 {
            asm!(
                "tilestored [{p0} + {s}*1], tmm0",
                "tilestored [{p1} + {s}*1], tmm1",
                "tilestored [{p2} + {s}*1], tmm2",
                "tilestored [{p3} + {s}*1], tmm3",
                p0 = in(reg) p0,
                p1 = in(reg) p1,
                p2 = in(reg) p2,
                p3 = in(reg) p3,
                s = in(reg) TILE_INPUTS * 4,
                options(nostack)
            );
        } else {
            asm!(
                "tilestored [{p0} + {s}*1], tmm0",
                p0 = in(reg) p0,
                s = in(reg) TILE_INPUTS * 4,
                options(nostack)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `dot(row, hi + lo)` in f64: what the tiles compute, up to f32 accumulation.
    fn reference(row: &[u16], x: &[f32]) -> f64 {
        row.iter()
            .zip(x)
            .map(|(&w, &v)| {
                let (h, l) = split(v);
                let w = f32::from_bits((w as u32) << 16) as f64;
                w * (f32::from_bits(h << 16) as f64 + f32::from_bits(l << 16) as f64)
            })
            .sum()
    }

    #[test]
    fn split_is_close_to_f32() {
        for &v in &[1.0f32, -2.718_281_7, 1e-20, 6.5e4, 0.1, -0.0] {
            let (h, l) = split(v);
            let back = f32::from_bits(h << 16) + f32::from_bits(l << 16);
            assert!(
                (back - v).abs() <= v.abs() * 2f32.powi(-16),
                "{v} -> {back}"
            );
        }
        assert_eq!(split(f32::INFINITY), (0x7f80, 0));
        assert!(f32::from_bits(split(f32::NAN).0 << 16).is_nan());
    }

    #[test]
    fn tiles_match_the_reference_and_one_input_matches_many() {
        if !available() {
            eprintln!("no AMX here: skipped");
            return;
        }
        let mut seed = 0x9e37_79b9_u32;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            (seed as f32 / u32::MAX as f32) * 2.0 - 1.0
        };
        for &(rows, cols, n) in &[
            (16, 32, 1),
            (70, 96, 5),
            (64, 64, 16),
            (83, 160, 33),
            (5, 32, 17),
            // Spans of rows `SPAN_BYTES` apart (a span is 16 KiB / row bytes x 16 rows), then
            // blocks and a tail: rows of 2 KiB with one input and three, 1 KiB, 512 B; and 4 KiB
            // rows against 20 inputs (the second group of four takes spans, the first not, and
            // input 0 alone takes spans again).
            (290, 1024, 1),
            (300, 1024, 3),
            (530, 512, 1),
            (530, 256, 2),
            (300, 2048, 20),
        ] {
            let w: Vec<u16> = (0..rows * cols).map(|_| bf16_bits(rnd()) as u16).collect();
            let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
            let x: Vec<f32> = (0..n * cols).map(|_| rnd() * 3.0).collect();
            let pairs = Bf16Pairs::new(&x, cols);
            let mut o = vec![0f32; rows * n];
            // SAFETY: AMX checked above; the shapes are as `rows_task` asks.
            unsafe { rows_task(&bytes, 2 * cols, &pairs, cols, &mut o) };
            for r in 0..rows {
                for t in 0..n {
                    let want =
                        reference(&w[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                    let got = o[r * n + t] as f64;
                    // The reference takes the same split values exactly: what is left is f32
                    // accumulation, a few 2^-24 of the products' magnitudes (dropping the lo
                    // plane would be ~2^-9 of each product).
                    let norm: f64 = w[r * cols..(r + 1) * cols]
                        .iter()
                        .zip(&x[t * cols..(t + 1) * cols])
                        .map(|(&w, &v)| (f32::from_bits((w as u32) << 16) * v).abs() as f64)
                        .sum();
                    assert!(
                        (got - want).abs() <= 1e-6 * norm + 1e-30,
                        "{rows}x{cols} n={n} r={r} t={t}: {got} vs {want}"
                    );
                }
                // The same row against input 0 alone: bit for bit.
                let one = Bf16Pairs::new(&x[..cols], cols);
                let mut o1 = vec![0f32; 1];
                // SAFETY: as above, one row and one input.
                unsafe {
                    rows_task(
                        &bytes[r * 2 * cols..(r + 1) * 2 * cols],
                        2 * cols,
                        &one,
                        cols,
                        &mut o1,
                    )
                };
                assert_eq!(
                    o1[0].to_bits(),
                    o[r * n].to_bits(),
                    "row {r}: one input differs"
                );
            }
        }
    }
}
