//! A task's rows on AVX2 without AVX-512 ([`super::dispatch::rows_task`]): matrix-vector
//! products in one kernel call per task (the single-row kernels inlined into a loop over the
//! rows: a call and its set-up per row were a quarter of an INT4 matvec), matrix products over
//! the inputs in chunks that stay in L1 (every row of the task once per chunk, from L2; without
//! chunks each row streamed all `n` inputs from L2). Every output is the single-row kernel's
//! value for its row and input, whatever the chunk or loop.

use deltafin_formats::WeightFormat;

use crate::kernels::inputs::Inputs;
use crate::kernels::isa::Isa;
use crate::kernels::shape::{l1_input_chunk, KernelShape, BLOCK};
use crate::kernels::x86;

/// A task's rows `r0..r0 + nr` of a matrix (`rb` bytes each in `data`) with the f32 scales of
/// its rows `s0..nr` (`per_row` each, task-relative).
#[derive(Debug)]
pub(crate) struct TaskRows<'a> {
    pub data: &'a [u8],
    pub rb: usize,
    pub r0: usize,
    pub s0: usize,
    pub nr: usize,
    pub scales: &'a [f32],
    pub per_row: usize,
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
    let (rb, per_row) = (t.rb, t.per_row);
    let row_bytes = |a: usize, b: usize| &t.data[(t.r0 + a) * rb..(t.r0 + b) * rb];
    let scales = |a: usize, b: usize| &t.scales[(a - t.s0) * per_row..(b - t.s0) * per_row];
    let vnni = isa == Isa::AvxVnni;
    if n == 1 {
        let (rows, sc, out) = (
            row_bytes(first, t.nr),
            scales(first, t.nr),
            &mut o[first..t.nr],
        );
        match xin {
            // SAFETY: `has_avx2` means AVX2, FMA and F16C were detected (AVX-VNNI for
            // `Isa::AvxVnni`); `simd_shape` holds; `rows` holds `out.len()` rows of `rb =
            // row_bytes(cols)` bytes with `per_row` block scales each, `xq` one input.
            Inputs::I16(xq) => unsafe {
                x86::rows_i16_one_input(vnni, kind, rows, rb, sc, per_row, xq, cols, out)
            },
            // SAFETY: as above; `xf` holds one input of `cols` (checked by `matmul`).
            Inputs::F32(xf) => unsafe {
                x86::rows_f32_one_input(kind, rows, rb, sc, per_row, xf, cols, out)
            },
            Inputs::I8 { .. } | Inputs::Bf16(_) => return first,
        }
        return t.nr;
    }
    let blocks = cols / BLOCK;
    let chunk = match xin {
        Inputs::F32(_) => l1_input_chunk(4 * cols),
        Inputs::I16(_) => l1_input_chunk(2 * cols + 8 * blocks),
        Inputs::I8 { .. } | Inputs::Bf16(_) => return first,
    };
    if chunk >= n {
        // One chunk: the row kernels take the inputs as they are.
        return first;
    }
    for t0 in (0..n).step_by(chunk) {
        let nn = chunk.min(n - t0);
        for i in first..t.nr {
            let (row, sc) = (row_bytes(i, i + 1), scales(i, i + 1));
            let out = &mut o[i * n + t0..i * n + t0 + nn];
            match xin {
                // SAFETY: as above; the row is `row_bytes(cols)` long with its scales, the
                // input slice holds `nn` inputs and `out` `nn` outputs.
                Inputs::F32(xf) => unsafe {
                    x86::row_f32(
                        kind,
                        row,
                        sc,
                        &xf[t0 * cols..(t0 + nn) * cols],
                        cols,
                        nn,
                        out,
                    )
                },
                // SAFETY: as above; `xq` holds `n >= t0 + nn` inputs.
                Inputs::I16(xq) => unsafe {
                    x86::row_i16(vnni, kind, row, sc, xq, t0, cols, nn, out)
                },
                Inputs::I8 { .. } | Inputs::Bf16(_) => unreachable!("returned above"),
            }
        }
    }
    t.nr
}
