//! Quantizing a call's f32 inputs for the integer kernels: to int8 blocks, or to 16-bit blocks
//! with AVX-512 / AVX2 block writers that give the portable loop's bytes.

use deltafin_formats::WeightFormat;

use crate::kernels::inputs::{
    block_amax, block_slot, i16_block_scales, i16_inverses, i16_slot, round_small, BlockRuns,
    I16Inputs, I16Order, Inputs,
};
use crate::kernels::isa::Isa;
use crate::kernels::shape::BLOCK;
#[cfg(target_arch = "x86_64")]
use crate::kernels::{x86, x86_avx512};
use crate::scratch::Scratch;

/// The [`I16Order`] the 16-bit kernels of `isa` take for `kind`: the 4-bit formats transposed
/// by groups on AVX-512 ([`I16Order::Groups`]) and AVX2 ([`I16Order::Groups8`]), else
/// [`I16Order::Quads`].
pub fn i16_order(kind: WeightFormat, isa: Isa) -> I16Order {
    let four_bit = matches!(kind, WeightFormat::Int4 { .. } | WeightFormat::Mxfp4 { .. });
    #[cfg(target_arch = "x86_64")]
    if four_bit && isa.has_avx512() {
        return I16Order::Groups;
    } else if four_bit && isa.has_avx2() {
        return I16Order::Groups8;
    }
    let _ = (four_bit, isa);
    I16Order::Quads
}

/// Quantize `x [n, cols]` (cols a multiple of 32) to 16-bit blocks for `kind`; the SIMD
/// paths give the same bytes as the portable one. `isa` falls back to the portable loop when
/// this machine lacks it.
///
/// # Panics
/// When `cols` is not a positive multiple of 32 or `x` not a whole number of rows.
pub fn quantize_inputs_i16(isa: Isa, kind: WeightFormat, x: &[f32], cols: usize) -> I16Inputs {
    // The SIMD block writers below rely on both (whole rows of whole blocks, real features).
    assert!(
        cols > 0 && cols.is_multiple_of(BLOCK) && x.len().is_multiple_of(cols),
        "quantize_inputs_i16: {} values are not rows of {cols} (a multiple of {BLOCK})",
        x.len()
    );
    let isa = if isa.available() { isa } else { Isa::Scalar };
    let blocks = x.len() / BLOCK;
    let order = i16_order(kind, isa);
    let mut out = I16Inputs {
        order,
        hi: Scratch::for_overwrite(x.len()),
        lo: Scratch::for_overwrite(x.len()),
        d: Scratch::for_overwrite(blocks),
        dsums: Scratch::for_overwrite(blocks),
        hi_only: false,
        wide: Vec::new(),
    };
    let extra = if matches!(kind, WeightFormat::Mxfp4 { .. }) {
        0.5
    } else {
        1.0
    };
    // Where each element of a block goes relative to the block's element 0: the same for
    // every block of a run of four (and for every block after the runs).
    let per_row = cols / BLOCK;
    let quads = per_row / 4;
    // Blocks of the row in whole transposed groups (none in the quad order).
    let (gsize, vbytes, lane_of) = order.group_shape().unwrap_or((1, 0, |_| 0));
    let grouped = order.group_shape().map_or(0, |_| per_row / gsize * gsize);
    let in_run: [usize; BLOCK] = std::array::from_fn(|e| i16_slot(kind, cols, I16Order::Quads, e));
    let single: [usize; BLOCK] = std::array::from_fn(|e| block_slot(kind, e) - block_slot(kind, 0));
    let runs = [BlockRuns::from_rel(&in_run), BlockRuns::from_rel(&single)];
    for (b, xb) in x.chunks_exact(BLOCK).enumerate() {
        let (row, bi) = (b / per_row, b % per_row);
        if bi < grouped {
            // A block of a transposed group: quantized in its single-block order (evens, then
            // odds: eight 4-value lanes), whose lane `j` then goes to vector `2 (j % 4) + j / 4`
            // of the group at the block's lane.
            let (mut h, mut l) = ([0i8; BLOCK], [0i8; BLOCK]);
            (out.d[b], out.dsums[b]) = quantize_block(isa, xb, extra, &runs[1], 0, &mut h, &mut l);
            let group = row * cols + bi / gsize * gsize * BLOCK;
            let lane = 4 * lane_of(bi % gsize);
            for j in 0..8 {
                let at = group + (2 * (j % 4) + j / 4) * vbytes + lane;
                out.hi[at..at + 4].copy_from_slice(&h[4 * j..4 * j + 4]);
                out.lo[at..at + 4].copy_from_slice(&l[4 * j..4 * j + 4]);
            }
            continue;
        }
        let base = row * cols + i16_slot(kind, cols, I16Order::Quads, bi * BLOCK);
        let r = &runs[usize::from(bi >= quads * 4)];
        (out.d[b], out.dsums[b]) =
            quantize_block(isa, xb, extra, r, base, &mut out.hi, &mut out.lo);
    }
    if matches!(kind, WeightFormat::Q8 { .. }) && isa == Isa::Avx2 {
        out.wide = wide_values(kind, cols, &out);
    }
    out
}

/// The 16-bit values `256 * hi + lo` of `q` in natural element order ([`I16Inputs::wide`]):
/// `hi` in -127..=127 and `lo` in -128..=127 keep them inside i16.
fn wide_values(kind: WeightFormat, cols: usize, q: &I16Inputs) -> Vec<i16> {
    let slots = slot_of_element(kind, cols, q.order);
    let mut wide = vec![0i16; q.hi.len()];
    for ((w, hi), lo) in wide
        .chunks_exact_mut(cols)
        .zip(q.hi.chunks_exact(cols))
        .zip(q.lo.chunks_exact(cols))
    {
        for (w, &s) in w.iter_mut().zip(slots.iter()) {
            let s = s as usize;
            let v = 256 * i32::from(hi[s]) + i32::from(lo[s]);
            debug_assert!(i16::try_from(v).is_ok(), "16-bit input {v}");
            *w = v.clamp(i16::MIN.into(), i16::MAX.into()) as i16;
        }
    }
    wide
}

/// One 32-block of [`quantize_inputs_i16`] written to its two runs of 16 slots from `base`
/// (`runs`), by the SIMD block writer `isa` has or the portable loop (the same bytes);
/// returns `(d, dsum)`.
fn quantize_block(
    isa: Isa,
    xb: &[f32],
    extra: f32,
    r: &BlockRuns,
    base: usize,
    hi: &mut [i8],
    lo: &mut [i8],
) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx512() {
        // SAFETY: `Isa::Avx512` / `Avx512Bw` mean AVX-512 F/BW/VL were detected (`isa` is
        // available); `xb` is one block and both runs of 16 slots from `base` lie inside `hi`
        // / `lo` (the block's own slots).
        return unsafe { x86_avx512::quantize_block_i16(xb, extra, r, base, hi, lo) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        // SAFETY: `has_avx2` means AVX2, FMA and F16C were detected; `xb` is one block and
        // both runs of 16 slots from `base` lie inside `hi` / `lo`.
        if let Some(q) = unsafe { x86::quantize_block_i16(xb, extra, r, base, hi, lo) } {
            return q;
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
        hi[slot] = hq;
        lo[slot] = lq;
        sum += 256 * hq as i32 + lq as i32;
    }
    i16_block_scales(s, extra, sum)
}

/// `x [n, cols]` as 8-bit blocks held in the 16-bit layout ([`Act::I8`] on AVX-512): the
/// high plane of [`quantize_inputs_i16`] (`round(x / (amax / 127))`, [`quantize_inputs`]'s
/// codes and scale), the low plane zeroed and each block's sum taken over the high plane
/// alone, flagged [`I16Inputs::hi_only`] so that the AVX-512 tiles skip the low plane.
///
/// [`Act::I8`]: crate::kernels::isa::Act::I8
///
/// # Panics
/// As [`quantize_inputs_i16`].
pub fn quantize_inputs_i8_planes(
    isa: Isa,
    kind: WeightFormat,
    x: &[f32],
    cols: usize,
) -> I16Inputs {
    let mut q = quantize_inputs_i16(isa, kind, x, cols);
    let per_row = cols / BLOCK;
    let mut sums = vec![0i32; q.d.len()];
    // Each slot's block (a block's sum does not depend on the order of its values), once
    // per call: the slot formula per value per input was 8% of an `i8` prefill's samples.
    let block_of_slot = block_of_slot(kind, cols, q.order);
    for ((hi, lo), sums) in
        q.hi.chunks_exact(cols)
            .zip(q.lo.chunks_exact_mut(cols))
            .zip(sums.chunks_exact_mut(per_row))
    {
        for (&h, &b) in hi.iter().zip(block_of_slot.iter()) {
            sums[b as usize] += 256 * i32::from(h);
        }
        lo.fill(0);
    }
    // The 16-bit copy held the low plane too: now `256 * hi`, the values the planes hold.
    // Q8 on AVX2 then takes the widened-code kernel (`kernels/avx2_q8.rs`), whose integer
    // sums are the hi plane's times 256 as the two-plane kernel forms them: the i8 prefill of
    // the 3.1B synth with Q8 dense weights was 0.89-0.98x its 16-bit one through the
    // two-plane kernel (benches/results/avx2_q8_i8_session31.txt).
    // `256 * hi + lo` with `lo` in -128..=127 rounds back to `256 * hi` as
    // `((v + 128) >> 8) << 8`: no pass through the slots.
    for w in &mut q.wide {
        *w = (((i32::from(*w) + 128) >> 8) << 8) as i16;
    }
    for ((ds, &d), sum) in q.dsums.iter_mut().zip(&q.d).zip(sums) {
        *ds = d * sum as f32;
    }
    q.hi_only = true;
    q
}

/// `out[slot]`: the block (within the input) of the value [`i16_slot`] puts at `slot`; kept
/// per thread for the few shapes a model has (a decode step quantizes ~100 inputs).
fn block_of_slot(kind: WeightFormat, cols: usize, order: I16Order) -> std::rc::Rc<[u32]> {
    cached_map(MapKind::BlockOfSlot, kind, cols, order)
}

/// `out[e]`: the slot [`i16_slot`] puts element `e` at; kept per thread as
/// [`block_of_slot`] (computed per call, `i16_slot` was ~1% of a Q8 prefill's samples on
/// AVX2).
fn slot_of_element(kind: WeightFormat, cols: usize, order: I16Order) -> std::rc::Rc<[u32]> {
    cached_map(MapKind::SlotOfElement, kind, cols, order)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MapKind {
    BlockOfSlot,
    SlotOfElement,
}

fn cached_map(
    what: MapKind,
    kind: WeightFormat,
    cols: usize,
    order: I16Order,
) -> std::rc::Rc<[u32]> {
    type Key = (MapKind, WeightFormat, usize, I16Order);
    thread_local! {
        static MAPS: std::cell::RefCell<Vec<(Key, std::rc::Rc<[u32]>)>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }
    let key = (what, kind, cols, order);
    MAPS.with(|maps| {
        let mut maps = maps.borrow_mut();
        if let Some((_, m)) = maps.iter().find(|(k, _)| *k == key) {
            return m.clone();
        }
        let mut out = vec![0u32; cols];
        for e in 0..cols {
            let slot = i16_slot(kind, cols, order, e);
            // Slots and blocks are below `cols`, which fits u32 for any input that fits in
            // memory as f32 (a row of 2^32 values is 16 GiB).
            match what {
                MapKind::BlockOfSlot => out[slot] = (e / BLOCK) as u32,
                MapKind::SlotOfElement => out[e] = slot as u32,
            }
        }
        let m: std::rc::Rc<[u32]> = out.into();
        // A bound on the cache for callers with many shapes: the oldest goes.
        if maps.len() >= 32 {
            maps.remove(0);
        }
        maps.push((key, m.clone()));
        m
    })
}

/// Quantize `x [n, cols]` (cols a multiple of 32) to int8 blocks for `kind`.
pub fn quantize_inputs(kind: WeightFormat, x: &[f32], cols: usize) -> Inputs<'static> {
    let blocks = x.len() / BLOCK;
    let mut q = vec![0i8; x.len()];
    let mut d = vec![0f32; blocks];
    // MXFP4 codes are stored doubled (integers -12..12), so halve the block scale.
    let extra = if matches!(kind, WeightFormat::Mxfp4 { .. }) {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The formats the integer kernels take, at their one block size.
    const INTEGER_KINDS: [WeightFormat; 3] = [
        WeightFormat::Int4 { group: 32 },
        WeightFormat::Mxfp4 { group: 32 },
        WeightFormat::Q8 { group: 32 },
    ];

    /// The 8-bit planes hold [`quantize_inputs`]'s codes and scales, a zero low plane and the
    /// high plane's block sums.
    #[test]
    fn i8_planes_are_the_int8_quantization() {
        for kind in INTEGER_KINDS {
            for cols in [32, 160, 288, 544] {
                let n = 3;
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) * if i % 13 == 0 { 9.0 } else { 0.1 })
                    .collect();
                let p = quantize_inputs_i8_planes(Isa::best(), kind, &x, cols);
                let Inputs::I8 { q, d } = quantize_inputs(kind, &x, cols) else {
                    unreachable!("quantize_inputs gives int8 inputs")
                };
                assert!(p.hi_only && p.lo.iter().all(|&l| l == 0));
                let per_row = cols / BLOCK;
                for row in 0..n {
                    for b in 0..per_row {
                        let i = row * per_row + b;
                        assert_eq!(p.d[i] * 256.0, d[i], "{kind:?} cols={cols} block {i}");
                        let mut sum = 0i32;
                        for e in 0..BLOCK {
                            let hi =
                                p.hi[row * cols + i16_slot(kind, cols, p.order, b * BLOCK + e)];
                            let want = q[row * cols + b * BLOCK + block_slot(kind, e)];
                            assert_eq!(hi, want, "{kind:?} cols={cols} row {row} block {b} e {e}");
                            sum += 256 * i32::from(hi);
                        }
                        assert_eq!(p.dsums[i], p.d[i] * sum as f32);
                    }
                }
            }
        }
    }

    /// Each ISA's 16-bit quantization gives the portable bytes, NaN, infinity, zero blocks and
    /// ties included.
    #[test]
    fn i16_quantizers_agree() {
        for kind in INTEGER_KINDS {
            for cols in [32, 96, 128, 160, 288, 512, 608] {
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
                for isa in [
                    Isa::Avx2,
                    Isa::AvxVnni,
                    Isa::Avx512Bw,
                    Isa::Avx512,
                    Isa::Neon,
                ] {
                    if !isa.available() {
                        continue;
                    }
                    let got = quantize_inputs_i16(isa, kind, &x, cols);
                    assert_eq!(got.order, i16_order(kind, isa));
                    // Element by element, each in its own order.
                    let planes = |q: &I16Inputs| {
                        (0..n * cols)
                            .map(|i| {
                                let at = i / cols * cols + i16_slot(kind, cols, q.order, i % cols);
                                (q.hi[at], q.lo[at])
                            })
                            .collect::<Vec<_>>()
                    };
                    assert_eq!(
                        planes(&got),
                        planes(&want),
                        "{isa:?} {kind:?} {cols}: codes"
                    );
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
        for kind in INTEGER_KINDS {
            for cols in [32, 64, 128, 160, 224, 288, 512, 544, 1056] {
                let n = 3;
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) * if i % 9 == 0 { 10.0 } else { 0.1 })
                    .collect();
                for isa in [Isa::Scalar, Isa::best()] {
                    let q = quantize_inputs_i16(isa, kind, &x, cols);
                    let extra = if matches!(kind, WeightFormat::Mxfp4 { .. }) {
                        0.5
                    } else {
                        1.0
                    };
                    for t in 0..n {
                        for i in 0..cols {
                            let b = (t * cols + i) / BLOCK;
                            let slot = t * cols + i16_slot(kind, cols, q.order, i);
                            let v =
                                (256.0 * q.hi[slot] as f32 + q.lo[slot] as f32) * q.d[b] / extra;
                            let step = q.d[b] / extra;
                            let want = x[t * cols + i];
                            assert!(
                                (v - want).abs() <= step + want.abs() * 1e-6,
                                "{isa:?} {kind:?} cols {cols} t {t} i {i}: {v} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The 16-bit copy is Q8's on AVX2 only and holds `256 * hi + lo` of every element in
    /// natural order (the 8-bit planes' too, whose `lo` is 0).
    #[test]
    fn wide_inputs_are_the_planes_values() {
        for kind in INTEGER_KINDS {
            for cols in [32, 160, 288, 1056] {
                let n = 2;
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 53 % 97) as f32 - 48.0) * if i % 7 == 0 { 9.0 } else { 0.3 })
                    .collect();
                for isa in [Isa::Scalar, Isa::Avx2, Isa::best()] {
                    let q = quantize_inputs_i16(isa, kind, &x, cols);
                    let wanted = matches!(kind, WeightFormat::Q8 { .. })
                        && isa == Isa::Avx2
                        && isa.available();
                    assert_eq!(!q.wide.is_empty(), wanted, "{isa:?} {kind:?}");
                    for (i, &w) in q.wide.iter().enumerate() {
                        let slot = i / cols * cols + i16_slot(kind, cols, q.order, i % cols);
                        assert_eq!(
                            i32::from(w),
                            256 * i32::from(q.hi[slot]) + i32::from(q.lo[slot]),
                            "{kind:?} {cols} {i}"
                        );
                    }
                    // The 8-bit planes keep the copy, of `256 * hi` (their low plane is 0).
                    let q8 = quantize_inputs_i8_planes(isa, kind, &x, cols);
                    assert_eq!(!q8.wide.is_empty(), wanted, "{isa:?} {kind:?} (8-bit)");
                    for (i, &w) in q8.wide.iter().enumerate() {
                        let slot = i / cols * cols + i16_slot(kind, cols, q8.order, i % cols);
                        assert_eq!(q8.lo[slot], 0);
                        assert_eq!(i32::from(w), 256 * i32::from(q8.hi[slot]), "{kind:?} {i}");
                    }
                }
            }
        }
    }

    /// [`I16Order::Groups`] and [`I16Order::Groups8`] put every element of a row in its own
    /// slot.
    #[test]
    fn group_order_is_a_permutation() {
        for order in [I16Order::Groups, I16Order::Groups8] {
            for kind in INTEGER_KINDS {
                for cols in [256, 288, 512, 544, 1024, 1120] {
                    let mut seen = vec![false; cols];
                    for i in 0..cols {
                        let at = i16_slot(kind, cols, order, i);
                        assert!(
                            !std::mem::replace(&mut seen[at], true),
                            "{order:?} {kind:?} {cols}: {i}"
                        );
                    }
                }
            }
        }
    }
}
