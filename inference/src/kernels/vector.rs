//! f32 vector operations (`dot`, `axpy` of the attention cores, SwiGLU's `silu_mul`, the
//! reference row decoder MLA applies to `kv_b_proj` every forward), compiled once portably and
//! again for AVX2 and AVX-512, chosen at run time. The baseline x86-64 target vectorizes the
//! portable loops to 4-wide SSE2 only: MLA's per-head work (absorbed queries, scores,
//! contexts) ran at ~4 GFLOP/s and took as long as a layer's projections at decode.
//!
//! Every version computes the same operations in the same order (64 lane accumulators, then a
//! fixed reduction; no fused multiply-add), so
//! the results are bit-identical on every instruction set (tested), and the `DELTAFIN_KERNELS`
//! cap need not reach here.

#[cfg(target_arch = "x86_64")]
use crate::kernels::shape::KernelShape;
#[cfg(target_arch = "x86_64")]
use crate::kernels::x86_avx512;

/// Lane accumulators per dot product: four 16-lane chains, so that an AVX-512 build runs four
/// independent add chains (one chain was bound by the add latency: 5% of a decode token).
const LANES: usize = 64;
/// The width of one chain: the tail of whole 16-blocks goes to the first chain.
const CHAIN: usize = 16;

#[inline(always)]
fn dot_body(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..LANES {
            acc[j] += x[j] * y[j];
        }
    }
    let ca = ta.chunks_exact(CHAIN);
    let cb = tb.chunks_exact(CHAIN);
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..CHAIN {
            acc[j] += x[j] * y[j];
        }
    }
    for (j, (x, y)) in ta.iter().zip(tb).enumerate() {
        acc[j] += x * y;
    }
    reduce64(&mut acc)
}

/// `acc[j] += acc[j + w]` for `w` = 32, 16, .., 1, then `acc[0]`: the lane accumulators of a
/// dot product summed pairwise in a fixed order. Each level written out with a constant
/// width so that it vectorizes (a `while` over `w` compiled to 63 scalar additions, most of
/// a 256-value dot product).
#[inline(always)]
pub(crate) fn reduce64(acc: &mut [f32; LANES]) -> f32 {
    for j in 0..32 {
        acc[j] += acc[j + 32];
    }
    for j in 0..16 {
        acc[j] += acc[j + 16];
    }
    reduce_last16(acc);
    acc[0]
}

/// The levels `w` = 8, 4, 2, 1 of the pairwise sum of `acc[..16]`.
#[inline(always)]
fn reduce_last16(acc: &mut [f32]) {
    for j in 0..8 {
        acc[j] += acc[j + 8];
    }
    for j in 0..4 {
        acc[j] += acc[j + 4];
    }
    for j in 0..2 {
        acc[j] += acc[j + 2];
    }
    acc[0] += acc[1];
}

/// One row of [`dots`]: 16 lane accumulators, the tail into the first lanes, a fixed pairwise
/// reduction.
#[inline(always)]
fn reduce16(mut acc: [f32; CHAIN]) -> f32 {
    reduce_last16(&mut acc);
    acc[0]
}

/// [`reduce16`] in place.
#[inline(always)]
pub(crate) fn reduce16_of(acc: &mut [f32; CHAIN]) -> f32 {
    reduce_last16(acc);
    acc[0]
}

#[inline(always)]
fn dots_body(q: &[f32], rows: &[f32], out: &mut [f32]) {
    let w = q.len();
    if w == 0 {
        out.iter_mut().for_each(|o| *o = 0.0);
        return;
    }
    let full = w / CHAIN * CHAIN;
    let row_dot = |acc: &mut [f32; CHAIN], r: &[f32]| {
        for (x, y) in q[..full]
            .chunks_exact(CHAIN)
            .zip(r[..full].chunks_exact(CHAIN))
        {
            for j in 0..CHAIN {
                acc[j] += x[j] * y[j];
            }
        }
        for (j, (x, y)) in q[full..].iter().zip(&r[full..w]).enumerate() {
            acc[j] += x * y;
        }
    };
    let mut groups = out.chunks_exact_mut(4);
    let mut r = 0;
    for o in &mut groups {
        // Four rows at a time: four independent add chains, `q` loaded once for all four.
        let row = |k: usize| &rows[(r + k) * w..(r + k + 1) * w];
        let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
        let (mut a0, mut a1, mut a2, mut a3) =
            ([0f32; CHAIN], [0f32; CHAIN], [0f32; CHAIN], [0f32; CHAIN]);
        for ((((x, y0), y1), y2), y3) in q[..full]
            .chunks_exact(CHAIN)
            .zip(r0[..full].chunks_exact(CHAIN))
            .zip(r1[..full].chunks_exact(CHAIN))
            .zip(r2[..full].chunks_exact(CHAIN))
            .zip(r3[..full].chunks_exact(CHAIN))
        {
            for j in 0..CHAIN {
                a0[j] += x[j] * y0[j];
                a1[j] += x[j] * y1[j];
                a2[j] += x[j] * y2[j];
                a3[j] += x[j] * y3[j];
            }
        }
        for (k, (a, rk)) in [(&mut a0, r0), (&mut a1, r1), (&mut a2, r2), (&mut a3, r3)]
            .into_iter()
            .enumerate()
        {
            for (j, (x, y)) in q[full..].iter().zip(&rk[full..]).enumerate() {
                a[j] += x * y;
            }
            o[k] = reduce16(*a);
        }
        r += 4;
    }
    for o in groups.into_remainder() {
        let mut acc = [0f32; CHAIN];
        row_dot(&mut acc, &rows[r * w..(r + 1) * w]);
        *o = reduce16(acc);
        r += 1;
    }
}

#[inline(always)]
fn axpy_body(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// `e^x` without branches or calls, so that loops over it vectorize: `x = n ln2 + r` with
/// `|r| <= ln2 / 2` (round to nearest by the 1.5 * 2^23 trick), Cephes' degree-6 polynomial for
/// `e^r` (relative error ~1e-7, tested), times `2^n` built in the exponent bits. `x` is clamped
/// to [-87.33, 88.37] (so that `2^n` stays a normal f32): below, the result is ~1.2e-38; above,
/// ~2.5e38 (SiLU only needs it to be large there).
#[inline(always)]
fn exp_body(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23
    let x = x.clamp(-87.336_54, 88.376_26);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    // n in [-126, 127]: 2^n from its exponent bits.
    e * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[inline(always)]
fn silu_mul_body(g: &[f32], u: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        *o = g / (1.0 + exp_body(-g)) * u;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use deltafin_formats::WeightFormat;

    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) fn decode_row_avx512(
        kind: WeightFormat,
        row: &[u8],
        scales: &[f32],
        cols: usize,
        out: &mut [f32],
    ) {
        crate::kernels::scalar::decode_row_body(kind, row, scales, cols, out)
    }
    #[target_feature(enable = "avx2")]
    pub(super) fn decode_row_avx2(
        kind: WeightFormat,
        row: &[u8],
        scales: &[f32],
        cols: usize,
        out: &mut [f32],
    ) {
        let group = kind.group(cols);
        let whole = cols.is_multiple_of(32) && group.is_multiple_of(32);
        let fits = out.len() >= cols && scales.len() >= cols / group.max(1);
        match kind {
            WeightFormat::Int4 { .. } if whole && fits && row.len() >= cols / 2 => {
                crate::kernels::avx2_decode::int4_row(
                    &row[..cols / 2],
                    group,
                    scales,
                    &mut out[..cols],
                )
            }
            WeightFormat::Q8 { .. } if whole && fits && row.len() >= cols => {
                crate::kernels::avx2_decode::q8_row(&row[..cols], group, scales, &mut out[..cols])
            }
            _ => crate::kernels::scalar::decode_row_body(kind, row, scales, cols, out),
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn silu_mul_avx512(g: &[f32], u: &[f32], out: &mut [f32]) {
        crate::kernels::vector::silu_mul_body(g, u, out)
    }
    #[target_feature(enable = "avx2")]
    pub(super) fn silu_mul_avx2(g: &[f32], u: &[f32], out: &mut [f32]) {
        crate::kernels::vector::silu_mul_body(g, u, out)
    }
    #[target_feature(enable = "avx512f")]
    pub(super) fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        crate::kernels::vector::dot_body(a, b)
    }
    #[target_feature(enable = "avx2")]
    pub(super) fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        crate::kernels::vector::dot_body(a, b)
    }
    #[target_feature(enable = "avx512f")]
    pub(super) fn dots_avx512(q: &[f32], rows: &[f32], out: &mut [f32]) {
        crate::kernels::vector::dots_body(q, rows, out)
    }
    #[target_feature(enable = "avx2")]
    pub(super) fn dots_avx2(q: &[f32], rows: &[f32], out: &mut [f32]) {
        crate::kernels::vector::dots_body(q, rows, out)
    }
    #[target_feature(enable = "avx512f")]
    pub(super) fn axpy_avx512(y: &mut [f32], a: f32, x: &[f32]) {
        crate::kernels::vector::axpy_body(y, a, x)
    }
    #[target_feature(enable = "avx2")]
    pub(super) fn axpy_avx2(y: &mut [f32], a: f32, x: &[f32]) {
        crate::kernels::vector::axpy_body(y, a, x)
    }
}

/// Which version runs here (detected once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Level {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

pub(crate) fn level() -> Level {
    static LEVEL: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
            {
                return Level::Avx512;
            }
            if is_x86_feature_detected!("avx2") {
                return Level::Avx2;
            }
        }
        Level::Portable
    })
}

fn dot_at(level: Level, a: &[f32], b: &[f32]) -> f32 {
    match level {
        Level::Portable => dot_body(a, b),
        // SAFETY: the level is only chosen when the CPU has the feature.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::dot_avx2(a, b) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { x86::dot_avx512(a, b) },
    }
}

fn axpy_at(level: Level, y: &mut [f32], a: f32, x: &[f32]) {
    match level {
        Level::Portable => axpy_body(y, a, x),
        // SAFETY: the level is only chosen when the CPU has the feature.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::axpy_avx2(y, a, x) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { x86::axpy_avx512(y, a, x) },
    }
}

fn silu_mul_at(level: Level, g: &[f32], u: &[f32], out: &mut [f32]) {
    match level {
        Level::Portable => silu_mul_body(g, u, out),
        // SAFETY: the level is only chosen when the CPU has the feature.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::silu_mul_avx2(g, u, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { x86::silu_mul_avx512(g, u, out) },
    }
}

/// [`crate::kernels::scalar::decode_row`] on the widest vectors this CPU has (the same
/// bits: every value is an exact conversion times one scale).
pub fn decode_row(
    kind: deltafin_formats::WeightFormat,
    row: &[u8],
    scales: &[f32],
    cols: usize,
    out: &mut [f32],
) {
    match level() {
        Level::Portable => crate::kernels::scalar::decode_row_body(kind, row, scales, cols, out),
        // SAFETY: the level is only chosen when the CPU has the feature.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::decode_row_avx2(kind, row, scales, cols, out) },
        // SAFETY: as above (AVX-512 BW comes with F on every CPU this level is chosen for,
        // checked at detection).
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => {
            if x86_avx512::decode_row_packed_supports(kind, cols)
                && row.len() >= kind.row_len(cols)
                && out.len() >= cols
                && scales.len() >= cols.div_ceil(kind.group(cols))
            {
                // SAFETY: AVX-512 F/BW (and VL, which every AVX-512 BW CPU has) were detected
                // for this level; the lengths are the ones the kernel documents, checked above.
                unsafe { x86_avx512::decode_row_packed(kind, row, scales, cols, out) };
                return;
            }
            // SAFETY: as for the other levels.
            unsafe { x86::decode_row_avx512(kind, row, scales, cols, out) }
        }
    }
}

/// SwiGLU's hidden values: `out[i] = silu(g[i]) * u[i]` over the shortest length.
pub fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
    silu_mul_at(level(), g, u, out)
}

/// `sum_i a[i] * b[i]` over the shorter length.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_at(level(), a, b)
}

/// `out[j] = q . rows[j]` for the `out.len()` rows of `q.len()` values each laid end to end in
/// `rows` (an attention head's scores over its cache). Each row is summed the same way
/// whichever rows share its tile.
///
/// # Panics
/// If `rows` holds fewer than `out.len()` rows.
pub fn dots(q: &[f32], rows: &[f32], out: &mut [f32]) {
    assert!(
        rows.len() >= q.len() * out.len(),
        "dots: a row for every output"
    );
    match level() {
        Level::Portable => dots_body(q, rows, out),
        // SAFETY: the level is only chosen when the CPU has the feature.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::dots_avx2(q, rows, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { x86::dots_avx512(q, rows, out) },
    }
}

/// `y[i] += a * x[i]` over the shorter length.
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    axpy_at(level(), y, a, x)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(not(target_arch = "x86_64"))]
    use crate::kernels::shape::KernelShape;

    fn levels() -> Vec<Level> {
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut v = vec![Level::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") {
                v.push(Level::Avx2);
            }
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                v.push(Level::Avx512);
            }
        }
        v
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = (i as u32 ^ seed).wrapping_mul(2_654_435_761);
                (h >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect()
    }

    #[test]
    fn every_level_gives_the_same_bits() {
        for n in [0, 1, 7, 16, 31, 33, 64, 95, 256, 1000] {
            let (a, b) = (data(n, 1), data(n, 2));
            let want = dot_at(Level::Portable, &a, &b);
            let naive: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!(
                (want as f64 - naive).abs() <= 1e-5 * (1.0 + naive.abs()),
                "n={n}"
            );
            let mut y0 = data(n, 3);
            axpy_at(Level::Portable, &mut y0, 0.37, &a);
            for l in levels() {
                assert_eq!(
                    dot_at(l, &a, &b).to_bits(),
                    want.to_bits(),
                    "dot n={n} {l:?}"
                );
                let mut y = data(n, 3);
                axpy_at(l, &mut y, 0.37, &a);
                assert_eq!(y, y0, "axpy n={n} {l:?}");
            }
        }
    }

    #[test]
    fn exp_is_close_and_silu_agrees_everywhere() {
        for i in -1970..=1990 {
            let x = i as f32 * 0.0443;
            let want = (x as f64).exp();
            let got = exp_body(x) as f64;
            assert!(
                ((got - want) / want).abs() < 2.5e-7,
                "exp({x}) = {got}, not {want}"
            );
        }
        assert_eq!(exp_body(-200.0), exp_body(-87.336_54));
        assert!(
            exp_body(-200.0) < 1.2e-38 && exp_body(200.0) > 2.4e38 && exp_body(200.0).is_finite()
        );
        let g: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.2).collect();
        let u = data(1000, 5);
        let mut want = vec![0f32; 1000];
        silu_mul_at(Level::Portable, &g, &u, &mut want);
        for (i, (&w, (&g, &u))) in want.iter().zip(g.iter().zip(&u)).enumerate() {
            let exact = g as f64 / (1.0 + (-g as f64).exp()) * u as f64;
            assert!(
                (w as f64 - exact).abs() <= 1e-6 * (1.0 + exact.abs()),
                "{i}: {w} vs {exact}"
            );
        }
        for l in levels() {
            let mut out = vec![0f32; 1000];
            silu_mul_at(l, &g, &u, &mut out);
            assert_eq!(out, want, "{l:?}");
        }
    }

    #[test]
    fn dots_match_each_row_alone_on_every_level() {
        for (w, rows) in [(256, 13), (32, 9), (17, 4), (5, 3), (0, 2), (64, 1)] {
            let q = data(w, 7);
            let m = data(w * rows, 8);
            let mut want = vec![0f32; rows];
            dots_body(&q, &m, &mut want);
            for (j, &v) in want.iter().enumerate() {
                let naive: f64 = q
                    .iter()
                    .zip(&m[j * w..])
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum();
                assert!(
                    (v as f64 - naive).abs() <= 1e-5 * (1.0 + naive.abs()),
                    "w={w} row {j}"
                );
                // A row alone (the remainder path) sums as in a tile of four.
                let mut one = [0f32];
                dots_body(&q, &m[j * w..(j + 1) * w], &mut one);
                assert_eq!(one[0].to_bits(), v.to_bits(), "w={w} row {j} alone");
            }
            for l in levels() {
                let mut got = vec![0f32; rows];
                match l {
                    Level::Portable => dots_body(&q, &m, &mut got),
                    // SAFETY: `levels` lists only what this CPU has.
                    #[cfg(target_arch = "x86_64")]
                    Level::Avx2 => unsafe { x86::dots_avx2(&q, &m, &mut got) },
                    // SAFETY: as above.
                    #[cfg(target_arch = "x86_64")]
                    Level::Avx512 => unsafe { x86::dots_avx512(&q, &m, &mut got) },
                }
                assert_eq!(got, want, "w={w} {l:?}");
            }
        }
    }

    #[test]
    fn row_decoder_equals_the_reference() {
        use deltafin_formats::WeightFormat;
        for kind in [
            WeightFormat::Int4 { group: 32 },
            WeightFormat::Mxfp4 { group: 32 },
            WeightFormat::Q8 { group: 32 },
            WeightFormat::Int4 { group: 128 },
            WeightFormat::Bf16,
        ] {
            for cols in [32, 256, 288] {
                if cols % kind.group(cols) != 0 {
                    continue;
                }
                let bytes: Vec<u8> = (0..kind.row_len(cols))
                    .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 13) as u8)
                    .collect();
                let scales: Vec<f32> = (0..cols.div_ceil(kind.group(cols)))
                    .map(|i| 0.01 + i as f32 * 0.37)
                    .collect();
                let mut want = vec![0f32; cols];
                crate::kernels::scalar::decode_row(kind, &bytes, &scales, cols, &mut want);
                let mut got = vec![f32::NAN; cols];
                decode_row(kind, &bytes, &scales, cols, &mut got);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{kind:?} cols={cols}");
            }
        }
    }

    #[test]
    fn shorter_length_wins() {
        assert_eq!(dot(&[1.0, 2.0, 3.0], &[4.0, 5.0]), 14.0);
        let mut y = vec![1.0, 1.0];
        axpy(&mut y, 2.0, &[1.0, 2.0, 3.0]);
        assert_eq!(y, vec![3.0, 5.0]);
    }
}
