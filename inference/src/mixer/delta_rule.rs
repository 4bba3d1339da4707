//! The gated delta rule of one KDA head, one position at a time, and what a KDA state records
//! of a short forward to replay it (rollback inside a speculative verification batch).

use rayon::prelude::*;

/// One position's inputs to the recurrence, and its raw convolution inputs.
#[derive(Debug, Clone, Default)]
pub(crate) struct Recorded {
    /// `[H, D]` each: normalised query and key, value, log-decay.
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub g: Vec<f32>,
    /// `[H]`
    pub beta: Vec<f32>,
    /// `[3 * H * D]` the pre-convolution q ‖ k ‖ v of this position.
    pub raw: Vec<f32>,
}

/// One position of the gated delta rule for one head: `dst = S'` where
/// `S' = diag(exp(g)) S + k u^T`, `u = beta (v - (diag(exp(g)) S)^T k)`, `S` read from `src`
/// (or `dst` itself when `None`); returns `o = S'^T q` into `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn delta_step(
    dst: &mut [f32],
    src: Option<&[f32]>,
    d: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: f32,
    w: &mut [f32],
    out: &mut [f32],
) {
    w.iter_mut().for_each(|x| *x = 0.0);
    // Decay each key row, and w = (decayed S)^T k in the same pass.
    for i in 0..d {
        let dec = g[i].exp();
        let ki = k[i];
        let row = &mut dst[i * d..(i + 1) * d];
        match src {
            Some(s) => {
                for ((r, &sv), wj) in row.iter_mut().zip(&s[i * d..(i + 1) * d]).zip(w.iter_mut()) {
                    let x = sv * dec;
                    *r = x;
                    *wj += x * ki;
                }
            }
            None => {
                for (r, wj) in row.iter_mut().zip(w.iter_mut()) {
                    let x = *r * dec;
                    *r = x;
                    *wj += x * ki;
                }
            }
        }
    }
    // u = beta (v - w); S += k u^T and o = S^T q in the same pass.
    for (wj, &vj) in w.iter_mut().zip(v) {
        *wj = beta * (vj - *wj);
    }
    out.iter_mut().for_each(|x| *x = 0.0);
    for i in 0..d {
        let (ki, qi) = (k[i], q[i]);
        let row = &mut dst[i * d..(i + 1) * d];
        for ((r, &uj), oj) in row.iter_mut().zip(w.iter()).zip(out.iter_mut()) {
            let x = *r + ki * uj;
            *r = x;
            *oj += x * qi;
        }
    }
}

/// Run recorded positions through the recurrence from `checkpoint` into `current` (every head
/// in parallel).
pub(crate) fn replay(
    checkpoint: &[f32],
    current: &mut [f32],
    heads: usize,
    d: usize,
    recorded: &[Recorded],
) {
    current
        .par_chunks_mut(d * d)
        .zip(checkpoint.par_chunks(d * d))
        .take(heads)
        .enumerate()
        .for_each(|(h, (dst, src))| {
            let (mut w, mut o) = (vec![0f32; d], vec![0f32; d]);
            for (t, r) in recorded.iter().enumerate() {
                let at = h * d..(h + 1) * d;
                delta_step(
                    dst,
                    (t == 0).then_some(src),
                    d,
                    &r.q[at.clone()],
                    &r.k[at.clone()],
                    &r.v[at.clone()],
                    &r.g[at],
                    r.beta[h],
                    &mut w,
                    &mut o,
                );
            }
        });
}

/// Append one position's raw conv inputs (`[C]`) to a `[C, K-1]` tail (oldest first).
pub(crate) fn push_tail(tail: &mut [f32], raw: &[f32], k1: usize) {
    if k1 == 0 {
        return;
    }
    for (c, &x) in raw.iter().enumerate() {
        let row = &mut tail[c * k1..(c + 1) * k1];
        row.copy_within(1.., 0);
        row[k1 - 1] = x;
    }
}
