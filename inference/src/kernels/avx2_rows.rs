//! A task's rows on AVX2 without AVX-512 ([`super::dispatch::rows_task`]): one kernel call per
//! task and chunk of inputs (the single-row kernels inlined into a loop over the rows: a call
//! and its set-up per row were a quarter of an INT4 matvec, and of a prefill's expert products,
//! whose experts meet a few inputs each), over the inputs in chunks that stay in L1 (every row
//! of the task once per chunk, from L2; without chunks each row streamed all `n` inputs from
//! L2). Every output is the single-row kernel's
//! value for its row and input, whatever the chunk or loop.

use deltafin_formats::{ScaleType, WeightFormat};

use crate::kernels::inputs::Inputs;
use crate::kernels::isa::Isa;
use crate::kernels::shape::{l1_input_chunk, l1_input_chunk_of, KernelShape, BLOCK};
use crate::kernels::x86;
use crate::kernels::{avx2_dense, avx2_q8};

/// A task's rows `r0..r0 + nr` of a matrix (`rb` bytes each in `data`) with the f32 scales of
/// its rows `s0..nr` (`per_row` each, task-relative), and, when `raw` is set, the matrix's own
/// scale bytes of the task's rows `0..nr` (one per 32-block, `per_row` per row) for the
/// 16-bit kernels instead.
#[derive(Debug)]
pub(crate) struct TaskRows<'a> {
    pub data: &'a [u8],
    pub rb: usize,
    pub r0: usize,
    pub s0: usize,
    pub nr: usize,
    pub scales: &'a [f32],
    pub per_row: usize,
    pub raw: Option<(&'a [u8], ScaleType)>,
}

/// Rows `first..t.nr` of the task against the prepared inputs `xin` (`n` of `cols`), written to
/// `o` (`[t.nr, n]`); returns the first row left undone (`t.nr` when all were done; `first`
/// for inputs these loops do not take: int8 and BF16-rounded ones).
///
/// `isa` has AVX2 (`Isa::has_avx2`) and `kind.simd_shape(cols)` holds.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rows(
    isa: Isa,
    kind: WeightFormat,
    t: &TaskRows<'_>,
    first: usize,
    xin: &Inputs<'_>,
    n: usize,
    cols: usize,
    o: &mut [f32],
) -> usize {
    debug_assert!(isa.has_avx2() && kind.simd_shape(cols) && first >= t.s0);
    if first >= t.nr || n == 0 {
        return first;
    }
    let (rb, per_row) = (t.rb, t.per_row);
    debug_assert!(t.raw.is_none() || matches!(xin, Inputs::I16(_)));
    let blocks = cols / BLOCK;
    let chunk = match xin {
        // The dense tiles take three inputs at a time.
        Inputs::F32(_) if avx2_dense::supports(kind) => l1_input_chunk_of(4 * cols, 3),
        Inputs::F32(_) => l1_input_chunk(4 * cols),
        Inputs::I16(_) => l1_input_chunk(2 * cols + 8 * blocks),
        Inputs::I8 { .. } | Inputs::Bf16(_) | Inputs::Bf16Pairs { .. } => return first,
    };
    let rows = &t.data[(t.r0 + first) * rb..(t.r0 + t.nr) * rb];
    let sc = match t.raw {
        Some(_) => &[][..],
        None => &t.scales[(first - t.s0) * per_row..(t.nr - t.s0) * per_row],
    };
    let i16_scales = match t.raw {
        Some((b, st)) => x86::RowScales::Raw(&b[first * per_row * st.size()..], st),
        None => x86::RowScales::F32(sc),
    };
    let last = (t.nr - first - 1) * n;
    let vnni = isa == Isa::AvxVnni;
    for t0 in (0..n).step_by(chunk.max(1)) {
        let nn = chunk.min(n - t0);
        // Output `t0 + k` of task row `first + r` is `o[(first + r) * n + t0 + k]`.
        let out = &mut o[first * n + t0..first * n + t0 + last + nn];
        match xin {
            // SAFETY: `has_avx2` means AVX2, FMA and F16C were detected (AVX-VNNI for
            // `Isa::AvxVnni`); `simd_shape` holds; `rows` holds `t.nr - first` rows of
            // `rb = row_bytes(cols)` bytes with `per_row` block scales each in `sc`; `xq`
            // holds `n >= t0 + nn` inputs (checked by `matmul`); `out` ends at the last row's
            // output `t0 + nn - 1`, with `nn <= n` (the stride).
            Inputs::I16(xq) => unsafe {
                avx2_q8::rows_i16(
                    vnni, kind, rows, rb, i16_scales, per_row, xq, t0, nn, cols, out, n,
                )
            },
            // SAFETY: as above (`supports`: the dense tiles take the format).
            Inputs::F32(xf) if avx2_dense::supports(kind) => unsafe {
                avx2_dense::rows(kind, rows, rb, xf, t0, nn, cols, out, n)
            },
            // SAFETY: as above; `xf` holds `n * cols` values (checked by `matmul`).
            Inputs::F32(xf) => unsafe {
                x86::rows_f32_inputs(kind, rows, rb, sc, per_row, xf, t0, nn, cols, out, n)
            },
            Inputs::I8 { .. } | Inputs::Bf16(_) | Inputs::Bf16Pairs { .. } => {
                unreachable!("returned above")
            }
        }
    }
    t.nr
}
