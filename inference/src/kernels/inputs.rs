//! The inputs of one kernel call, prepared once: f32 as given, or quantized per 32-value block
//! to int8 ([`Inputs::I8`]) or 16 bits held as two int8 planes ([`I16Inputs`]), stored in the
//! order each format's weights unpack in; and the per-block arithmetic every quantizer path
//! shares so that they agree bit for bit.

use deltafin_formats::WeightFormat;

use crate::kernels::shape::BLOCK;
use crate::scratch::Scratch;

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
    /// `[n, cols]` f32 that the kernels round to BF16 ([`super::Act::Bf16`], BF16 weights).
    Bf16(&'x [f32]),
    /// `[n, cols]` f32 (`x`) split into BF16 pairs for the AMX tiles ([`super::Act::Bf16x2`],
    /// BF16 weights); `x` for any path that takes f32 instead.
    #[cfg(target_arch = "x86_64")]
    Bf16Pairs {
        x: &'x [f32],
        pairs: super::x86_amx::Bf16Pairs,
    },
}

/// Inputs quantized to 16 bits per 32-value block: `x ~ d[b] * (256 * hi + lo)`.
///
/// Element order inside each input row ([`i16_slot`]), [`I16Order::Quads`]: each run of four
/// blocks `4q..4q+4` (128 values) is stored as two halves of 64, each holding 16 values of
/// every block in block order: for the 4-bit formats the evens then the odds (the order one
/// 64-byte load of nibbles splits into), for Q8 the first 16 then the last 16 of each block.
/// Blocks after the last whole run are stored one by one (4-bit: evens then odds; Q8: natural
/// order). [`I16Order::Groups`] stores whole groups of 16 blocks transposed first,
/// [`I16Order::Groups8`] groups of 8.
#[derive(Debug, Default)]
pub struct I16Inputs {
    /// Which element order `hi` / `lo` are in.
    pub order: I16Order,
    /// `[n, cols]` high bytes (`round(x / (amax / 127))`).
    pub hi: Scratch<i8>,
    /// `[n, cols]` low bytes: the remainder in 1/256 steps.
    pub lo: Scratch<i8>,
    /// `[n, cols/32]` scales (of `256 * hi + lo`; halved for MXFP4's doubled codes).
    pub d: Scratch<f32>,
    /// `[n, cols/32]` each block's input sum, `d * sum(256 * hi + lo)` (the kernels' offset
    /// correction).
    pub dsums: Scratch<f32>,
    /// `lo` is all zeros: the inputs are 8-bit ([`super::Act::I8`]'s values, `hi` alone), and
    /// the AVX-512 tiles skip the low plane (half the integer products). Every other kernel
    /// reads the zeros and gives the same values.
    pub hi_only: bool,
    /// `[n, cols]` the 16-bit values `256 * hi + lo` in natural element order, for Q8 on AVX2
    /// without VNNI (`kernels/avx2_q8.rs`: sign-extended codes times these in `vpmaddwd`,
    /// instead of the sign trick on each plane), also for 8-bit inputs (`256 * hi`); empty
    /// otherwise.
    pub wide: Vec<i16>,
}

/// Position of element `i` of a 32-block in the kernels' input order for `kind`.
pub(crate) fn block_slot(kind: WeightFormat, i: usize) -> usize {
    if matches!(kind, WeightFormat::Int4 { .. } | WeightFormat::Mxfp4 { .. }) {
        if i.is_multiple_of(2) {
            i / 2
        } else {
            16 + i / 2
        }
    } else {
        i
    }
}

/// The element orders of [`I16Inputs`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum I16Order {
    /// Runs of four blocks, then single blocks (see [`I16Inputs`]).
    #[default]
    Quads,
    /// The 4-bit formats on AVX-512: each whole group of 16 blocks `16g..16g + 16` (512
    /// values) as eight 64-byte vectors `v = 2u + p` (`u` in 0..4, `p` the parity), vector `v`
    /// holding, for each block, the four values `8u + p + 2k` (`k` in 0..4) in 32-bit lane
    /// [`group_lane`] of the block: the order a 4x4 transpose of the group's 256 packed bytes
    /// then a nibble split gives, so that one 32-bit lane sums a whole block and the tile
    /// scales each block once, not once per quarter. The blocks after the last whole group
    /// as in [`I16Order::Quads`].
    Groups,
    /// The 4-bit formats on AVX2: as [`I16Order::Groups`] for groups of 8 blocks `8g..8g + 8`
    /// (256 values) in eight 32-byte vectors, block `j` in 32-bit lane [`group8_lane`]`(j)`:
    /// the order a 4x4 transpose inside each 128-bit half of the group's four 32-byte loads
    /// gives. The blocks after the last whole group as in [`I16Order::Quads`].
    Groups8,
}

impl I16Order {
    /// Blocks per transposed group, the bytes of one of its eight vectors, and the 32-bit lane
    /// of the group's block `j`; `None` for [`I16Order::Quads`].
    pub(crate) fn group_shape(self) -> Option<GroupShape> {
        match self {
            I16Order::Quads => None,
            I16Order::Groups => Some((16, 64, group_lane)),
            I16Order::Groups8 => Some((8, 32, group8_lane)),
        }
    }
}

/// Blocks per group, bytes per vector, and the lane of a group's block ([`I16Order::group_shape`]).
pub(crate) type GroupShape = (usize, usize, fn(usize) -> usize);

/// The 32-bit lane that block `j` (0..16) of a group takes in [`I16Order::Groups`]: lane
/// `4l + m` holds block `4m + l` (an involution: the same map takes lanes to blocks).
pub(crate) const fn group_lane(j: usize) -> usize {
    4 * (j % 4) + j / 4
}

/// The 32-bit lane that block `j` (0..8) of a group takes in [`I16Order::Groups8`]: the two
/// 128-bit halves hold the even blocks then the odd ones.
pub(crate) const fn group8_lane(j: usize) -> usize {
    4 * (j % 2) + j / 2
}

/// Position of element `i` (of a row of `cols`) in the [`I16Inputs`] order `order` for `kind`.
pub fn i16_slot(kind: WeightFormat, cols: usize, order: I16Order, i: usize) -> usize {
    let (b, e) = (i / BLOCK, i % BLOCK);
    let quads = cols / BLOCK / 4;
    if let Some((size, vbytes, lane)) = order.group_shape() {
        if b < cols / BLOCK / size * size {
            let (u, p, k) = (e / 8, e % 2, (e % 8) / 2);
            return (b / size) * size * BLOCK + (2 * u + p) * vbytes + lane(b % size) * 4 + k;
        }
    }
    match kind {
        WeightFormat::Int4 { .. } | WeightFormat::Mxfp4 { .. } if b < quads * 4 => {
            (b / 4) * 4 * BLOCK + (e % 2) * 64 + (b % 4) * 16 + e / 2
        }
        WeightFormat::Q8 { .. } if b < quads * 4 => {
            (b / 4) * 4 * BLOCK + (e / 16) * 64 + (b % 4) * 16 + e % 16
        }
        _ => b * BLOCK + block_slot(kind, e),
    }
}

/// Round to nearest (ties to even) for `|v| < 2^22`, in plain adds the compiler vectorizes:
/// `f32::round` is a libm call on baseline x86_64, which costed more than the quantization.
#[inline]
pub(crate) fn round_small(v: f32) -> f32 {
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
    pub(crate) fn from_rel(rel: &[usize; BLOCK]) -> Self {
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
