//! How a matrix product is split into tasks of one parallel pass: rows per task, and the
//! transposed scratch those tasks write, put back in `[n, rows]` order.

use deltafin_formats::WeightFormat;

use crate::kernels::isa::Act;
use crate::kernels::shape::KernelShape;

/// Weight bytes per task: large enough that task overhead (scale conversion, scheduling)
/// stays small against streaming them from DRAM, small enough to balance two to a few dozen
/// threads on a 2048-row expert matrix.
const TASK_BYTES: usize = 256 << 10;

/// Rows per task for rows of `kind` `cols` wide against `n` inputs: [`TASK_BYTES`] of weights
/// per run of 4 inputs, so that a task's work, not its bytes, stays about the same. With a
/// task's bytes fixed, a prefill's projections (32 inputs) were one or two tasks for two
/// threads, e.g. 910 rows and 114 (MLA's o_proj, INT4 1024x512), or one (q_b, 768 rows):
/// one thread did most of the work.
///
/// On the AMX tiles ([`Act::Bf16x2`]) a task's time follows its bytes, not its inputs (16 inputs
/// per tile cost what one does), so the task is sized as for one input: with 16-row tasks a
/// 512-token prefill's expert products ran one row block per task and spent their time setting
/// up tiles (152-168 vs 228-230 GMAC/s at 32 inputs; benches/results/amx_session35.txt, 4.).
pub(crate) fn task_rows(kind: WeightFormat, cols: usize, n: usize, act: Act) -> usize {
    let n = if act == Act::Bf16x2 { 1 } else { n };
    let runs = n.div_ceil(4).max(1);
    (TASK_BYTES / (kind.row_len(cols).max(1) * runs)).clamp(MIN_TASK_ROWS, 1024)
}

/// The fewest rows a task takes (the row kernels' tiles are up to 8 rows; a task's set-up,
/// scales and scheduling stay small against 16 rows of a prefill chunk's inputs).
const MIN_TASK_ROWS: usize = 16;

/// `out[t * rows + r] = tmp[r * n + t]` (`tmp` is `[rows, n]`, `out` `[n, rows]`), 16 rows at a
/// time so that each output row is written in runs of 16 and the 16 rows read stay in L1: a
/// row-by-row loop stored one value per cache line and took a fifth of a 32-input product.
pub(crate) fn untranspose(tmp: &[f32], n: usize, rows: usize, out: &mut [f32]) {
    const R: usize = 16;
    for r0 in (0..rows).step_by(R) {
        let nr = R.min(rows - r0);
        let block = &tmp[r0 * n..(r0 + nr) * n];
        for (t, orow) in out.chunks_mut(rows).enumerate().take(n) {
            for (i, o) in orow[r0..r0 + nr].iter_mut().enumerate() {
                *o = block[i * n + t];
            }
        }
    }
}
