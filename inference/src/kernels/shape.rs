//! What every kernel shares: the 32-column block, which shapes the SIMD paths take, how many
//! inputs a matrix product keeps in L1, and a prefetch hint.

use deltafin_formats::WeightFormat;

/// Columns per activation-quantization block and per SIMD step of the packed formats.
pub const BLOCK: usize = 32;

/// Kernel-side facts about a weight format.
pub trait KernelShape {
    /// Whether the SIMD kernels handle this shape (whole 32-column steps inside each group);
    /// other shapes run the scalar reference.
    fn simd_shape(self, cols: usize) -> bool;
    /// Bytes of one row of `cols` values (matrices are checked at construction, so this
    /// cannot overflow for a matrix the kernels are given).
    fn row_len(self, cols: usize) -> usize;
}

impl KernelShape for WeightFormat {
    fn simd_shape(self, cols: usize) -> bool {
        cols.is_multiple_of(BLOCK) && self.group(cols).is_multiple_of(BLOCK)
    }

    fn row_len(self, cols: usize) -> usize {
        self.row_bytes(cols).unwrap_or(usize::MAX)
    }
}

/// Bytes of prepared inputs a matrix-product tile keeps in L1 (32-48 KiB on the x86 cores
/// this runs on) while it walks a task's rows: measured best of 12-48 KiB on BF16 and INT4
/// 2048x1024 at 8 and 32 inputs (`examples/gemm_rate.rs`).
#[cfg(target_arch = "x86_64")]
const L1_INPUT_BYTES: usize = 24 << 10;

/// Inputs per chunk of a matrix product, `per_input` bytes each, that stay in L1: a multiple of
/// four (the 16-bit and BF16-activation tiles' width; the f32 tile takes two).
#[cfg(target_arch = "x86_64")]
pub(crate) fn l1_input_chunk(per_input: usize) -> usize {
    l1_input_chunk_of(per_input, 4)
}

/// Inputs per chunk that stay in L1, `per_input` bytes each: a multiple of the tile's `width`
/// (at least one tile).
#[cfg(target_arch = "x86_64")]
pub(crate) fn l1_input_chunk_of(per_input: usize, width: usize) -> usize {
    let width = width.max(1);
    (L1_INPUT_BYTES / per_input.max(1)).max(width) / width * width
}

/// Rows of a strided output of `len` values holding `n` per row, `stride` apart (the last
/// row's `n` values end the slice): `(rows - 1) * stride + n == len`; 0 without inputs.
#[cfg(target_arch = "x86_64")]
pub(crate) fn strided_rows(len: usize, n: usize, stride: usize) -> usize {
    if n == 0 || len < n {
        0
    } else {
        (len - n) / stride.max(1) + 1
    }
}

/// Hints the CPU to bring `bytes` into L2 (a few KiB at a time: a long burst of prefetches
/// outruns the miss buffers and is dropped).
pub(crate) fn prefetch_l2(bytes: &[u8]) {
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
