//! Many matrix products in one parallel pass: each job its own matrix, inputs and output (a
//! layer's routed experts: every expert's gate and up projections in one pass, then every
//! down projection in another), instead of one hand-out to the threads per matrix. Inputs
//! shared by several jobs are prepared once. Each job's output is bit-identical to
//! [`super::dispatch::matmul`] on that job alone: the same row blocks through the same row
//! kernels.

use crate::kernels::pool::pool;

use crate::kernels::dispatch::rows_task;
use crate::kernels::inputs::Inputs;
use crate::kernels::isa::Isa;
use crate::kernels::prepare::{prepare_owned, Prepared};
use crate::kernels::tasks::{task_rows, untranspose};
use crate::linear::matrix::WeightMatrix;
use crate::scratch::Scratch;

/// `out = x @ m^T`: `x` is `[n, m.cols()]`, `out` is `[n, m.rows()]`.
#[derive(Debug)]
pub struct MatmulJob<'a, 'w> {
    pub m: &'a WeightMatrix<'w>,
    pub x: &'a [f32],
    pub n: usize,
    pub out: &'a mut [f32],
}

/// Run every job, all of their row blocks as tasks of one parallel pass.
pub fn matmul_jobs(jobs: &mut [MatmulJob<'_, '_>]) {
    for j in jobs.iter() {
        assert_eq!(j.x.len(), j.n * j.m.cols(), "matmul input length");
        assert_eq!(j.out.len(), j.n * j.m.rows(), "matmul output length");
    }
    // Each job's kernels and activation precision, as `matmul` picks them.
    let plan: Vec<(Isa, crate::kernels::isa::Act)> = jobs
        .iter()
        .map(|j| {
            let k = j.m.kernels();
            (k.isa.for_format(j.m.format()), k.act(j.m.format()))
        })
        .collect();
    // Prepare each distinct input once (same slice, format, width and kernels): job `i` reads
    // `unique[input_of[i]]`.
    let mut input_of: Vec<usize> = Vec::with_capacity(jobs.len());
    let mut owners: Vec<usize> = Vec::new();
    for (i, j) in jobs.iter().enumerate() {
        let same = owners.iter().position(|&k| {
            let o = &jobs[k];
            std::ptr::eq(o.x, j.x)
                && o.n == j.n
                && o.m.format() == j.m.format()
                && o.m.cols() == j.m.cols()
                && plan[k] == plan[i]
        });
        input_of.push(same.unwrap_or_else(|| {
            owners.push(i);
            owners.len() - 1
        }));
    }
    // A prefill's ~100 experts per layer each have their own (gathered) inputs: prepared on
    // the pool's threads, where one at a time on the caller's they were several percent of
    // the pass.
    let owner_x: Vec<(&WeightMatrix<'_>, &[f32])> =
        owners.iter().map(|&i| (jobs[i].m, jobs[i].x)).collect();
    let prepare = |k: usize| {
        let (m, x) = owner_x[k];
        let (isa, act) = plan[owners[k]];
        prepare_owned(isa, m.format(), m.cols(), act, x)
    };
    let values: usize = owner_x.iter().map(|(_, x)| x.len()).sum();
    let prepared: Vec<Prepared> = if owners.len() > 1 && values >= PARALLEL_VALUES {
        pool().map(owners.len(), prepare)
    } else {
        (0..owners.len()).map(prepare).collect()
    };
    // The reordered inputs move into one vector first, so that the prepared inputs can
    // borrow from it.
    enum Place {
        AsGiven,
        RoundedToBf16,
        Reordered(usize),
        Quantized(Inputs<'static>),
        #[cfg(target_arch = "x86_64")]
        Pairs(crate::kernels::x86_amx::Bf16Pairs),
    }
    let mut reordered: Vec<Vec<f32>> = Vec::new();
    let places: Vec<Place> = prepared
        .into_iter()
        .map(|p| match p {
            Prepared::AsGiven => Place::AsGiven,
            Prepared::RoundedToBf16 => Place::RoundedToBf16,
            Prepared::Reordered(v) => {
                reordered.push(v);
                Place::Reordered(reordered.len() - 1)
            }
            Prepared::Quantized(q) => Place::Quantized(q),
            #[cfg(target_arch = "x86_64")]
            Prepared::Pairs(p) => Place::Pairs(p),
        })
        .collect();
    let unique: Vec<Inputs<'_>> = places
        .into_iter()
        .zip(&owner_x)
        .map(|(place, &(_, x))| match place {
            Place::AsGiven => Inputs::F32(x),
            Place::RoundedToBf16 => Inputs::Bf16(x),
            Place::Reordered(j) => Inputs::F32(&reordered[j]),
            Place::Quantized(q) => q,
            #[cfg(target_arch = "x86_64")]
            Place::Pairs(pairs) => Inputs::Bf16Pairs { x, pairs },
        })
        .collect();
    // What the tasks read of each job, apart from its output.
    let metas: Vec<(&WeightMatrix<'_>, usize)> = jobs.iter().map(|j| (j.m, j.n)).collect();
    // Outputs of jobs with several inputs go through a transposed scratch `[rows, n]`, so
    // that each task writes one contiguous range (as `matmul` does).
    let mut tmps: Vec<Scratch<f32>> = metas
        .iter()
        .map(|&(m, n)| Scratch::for_overwrite(if n > 1 { m.rows() * n } else { 0 }))
        .collect();
    {
        let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
        for (i, (j, tmp)) in jobs.iter_mut().zip(tmps.iter_mut()).enumerate() {
            let block = task_rows(j.m.format(), j.m.cols(), j.n, plan[i].1);
            let (buf, chunk): (&mut [f32], usize) = if j.n > 1 {
                (&mut tmp[..], block * j.n)
            } else {
                (&mut *j.out, block)
            };
            tasks.extend(buf.chunks_mut(chunk).enumerate().map(|(bi, o)| (i, bi, o)));
        }
        pool().for_each_mut(&mut tasks, |_, (i, bi, o)| {
            let (i, bi) = (*i, *bi);
            let (m, n) = metas[i];
            let kind = m.format();
            let block = task_rows(kind, m.cols(), n, plan[i].1);
            rows_task(plan[i].0, m, kind, &unique[input_of[i]], n, block, bi, o);
        });
    }
    let mut back: Vec<(&Scratch<f32>, &mut MatmulJob<'_, '_>)> = tmps
        .iter()
        .zip(jobs.iter_mut())
        .filter(|(_, j)| j.n > 1)
        .collect();
    let values: usize = back.iter().map(|(t, _)| t.len()).sum();
    let untranspose_job = |(tmp, j): &mut (&Scratch<f32>, &mut MatmulJob<'_, '_>)| {
        untranspose(tmp, j.n, j.m.rows(), j.out)
    };
    if back.len() > 1 && values >= PARALLEL_VALUES {
        pool().for_each_mut(&mut back, |_, b| untranspose_job(b));
    } else {
        back.iter_mut().for_each(untranspose_job);
    }
}

/// Input or output values of a pass's jobs above which preparing the inputs and reordering
/// the outputs run on the pool's threads (a pass costs a few microseconds: a decode token's
/// jobs stay on the caller's).
const PARALLEL_VALUES: usize = 1 << 15;
