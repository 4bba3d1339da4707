//! Many matrix products in one parallel pass: each job its own matrix, inputs and output (a
//! layer's routed experts: every expert's gate and up projections in one pass, then every
//! down projection in another), instead of one hand-out to the threads per matrix. Inputs
//! shared by several jobs are prepared once. Each job's output is bit-identical to
//! [`super::dispatch::matmul`] on that job alone: the same row blocks through the same row
//! kernels.

use crate::kernels::pool::pool;

use crate::kernels::dispatch::{prepare_inputs, rows_task, task_rows, untranspose};
use crate::kernels::inputs::Inputs;
use crate::kernels::isa::Isa;
use crate::linear::matrix::WeightMatrix;

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
            let isa = if k.isa.available() {
                k.isa
            } else {
                Isa::Scalar
            };
            (isa, k.act(j.m.format()))
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
    let mut slots: Vec<Vec<f32>> = vec![Vec::new(); owners.len()];
    let unique: Vec<Inputs<'_>> = owners
        .iter()
        .zip(slots.iter_mut())
        .map(|(&i, slot)| {
            let (m, x): (&WeightMatrix<'_>, &[f32]) = (jobs[i].m, jobs[i].x);
            prepare_inputs(plan[i].0, m.format(), m.cols(), plan[i].1, x, slot)
        })
        .collect();
    // What the tasks read of each job, apart from its output.
    let metas: Vec<(&WeightMatrix<'_>, usize)> = jobs.iter().map(|j| (j.m, j.n)).collect();
    // Outputs of jobs with several inputs go through a transposed scratch `[rows, n]`, so
    // that each task writes one contiguous range (as `matmul` does).
    let mut tmps: Vec<Vec<f32>> = metas
        .iter()
        .map(|&(m, n)| {
            if n > 1 {
                vec![0f32; m.rows() * n]
            } else {
                Vec::new()
            }
        })
        .collect();
    {
        let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
        for (i, (j, tmp)) in jobs.iter_mut().zip(tmps.iter_mut()).enumerate() {
            let block = task_rows(j.m.format(), j.m.cols());
            let (buf, chunk): (&mut [f32], usize) = if j.n > 1 {
                (tmp.as_mut_slice(), block * j.n)
            } else {
                (&mut *j.out, block)
            };
            tasks.extend(buf.chunks_mut(chunk).enumerate().map(|(bi, o)| (i, bi, o)));
        }
        pool().for_each_mut(&mut tasks, |_, (i, bi, o)| {
            let (i, bi) = (*i, *bi);
            let (m, n) = metas[i];
            let kind = m.format();
            let block = task_rows(kind, m.cols());
            rows_task(plan[i].0, m, kind, &unique[input_of[i]], n, block, bi, o);
        });
    }
    for (j, tmp) in jobs.iter_mut().zip(&tmps) {
        if j.n > 1 {
            untranspose(tmp, j.n, j.m.rows(), j.out);
        }
    }
}
