//! [`MoeFfn`]: a routed Mixture-of-Experts block. The router chooses experts per position; the
//! weight source hands over each chosen expert's record as it becomes available (from memory,
//! or streamed from drives); [`RoutedExperts`] computes the experts from their records; the
//! weighted outputs are summed per position in slot order (whatever order the experts
//! arrived in), plus optional always-on shared experts.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;

use crate::error::{InferenceError, Result};
use crate::ffn::dense::DenseMlp;
use crate::ffn::feed_forward::{FeedForward, FfnContext};
pub use crate::ffn::routed_experts::{ExpertMatrixNames, GroupOutputs, RoutedExperts};
use crate::ffn::router::{Router, Routing};
use crate::linear::owned::Linear;
use crate::ops::{Activation, RmsNorm};
use crate::scratch::Scratch;
use crate::spans::{span, timed, Phase};
use crate::weights::{ExpertHints, ExpertView};

/// Weighted expert outputs summed per position above which the sum runs on the pool's threads
/// (a 32-token prefill of a top-8 layer 1024 wide: 262144), below which one pass costs more
/// than it saves (decode: 8192).
const PARALLEL_COMBINE_VALUES: usize = 1 << 16;

/// Routed experts plus optional always-on shared experts.
#[derive(Debug)]
pub struct MoeFfn {
    pub router: Box<dyn Router>,
    pub experts: RoutedExperts,
    pub shared_experts: Option<DenseMlp>,
    pub act: Arc<dyn Activation>,
    /// Kimi K3's latent MoE: the routed experts run in a smaller space.
    pub latent: Option<LatentMoe>,
}

/// The projections around latent routed experts (Kimi K3): `x_r = down(x)` `[R, hidden]`,
/// the experts' weighted sum `y` `[R]`, optionally `RMSNorm(y)`, then `up(y)` `[hidden, R]`.
/// The router and the shared experts see the full hidden state.
#[derive(Debug, Clone)]
pub struct LatentMoe {
    pub down: Linear,
    pub up: Linear,
    pub norm: Option<RmsNorm>,
}

impl MoeFfn {
    /// The routed experts' weighted sum `out` `[n, width]` made into the layer's output: up
    /// from the latent space (Kimi K3), plus the shared experts' output `shared` `[n, hidden]`
    /// where given.
    fn finish(&self, mut out: Vec<f32>, n: usize, shared: Option<&[f32]>) -> Vec<f32> {
        if let Some(l) = &self.latent {
            let _latent_span = span(Phase::Latent);
            if let Some(norm) = &l.norm {
                norm.apply_inplace(&mut out);
            }
            out = l.up.forward(&out, n);
        }
        if let Some(s) = shared {
            for (o, v) in out.iter_mut().zip(s) {
                *o += v;
            }
        }
        out
    }
}

/// `out[t] = sum over slots in order of weight * expert output` `[n, hd]`, from each
/// (position, slot)'s place in `outputs` (`source`: index into `outputs`, row). A slot whose
/// expert has no output (yet, or no expert filled it because the position chose fewer than
/// `top_k`) adds nothing.
fn weighted_sum(
    outputs: &[Option<Scratch<f32>>],
    source: &[(usize, usize)],
    routes: &[Routing],
    n: usize,
    top_k: usize,
    hd: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; n * hd];
    let combine = |t: usize, o: &mut [f32]| {
        for slot in 0..top_k {
            let (k, i) = source[t * top_k + slot];
            let Some(ys) = outputs.get(k).and_then(Option::as_ref) else {
                continue;
            };
            let w = routes[t].weights[slot];
            for (o, &y) in o.iter_mut().zip(&ys[i * hd..(i + 1) * hd]) {
                *o += w * y;
            }
        }
    };
    if n * top_k * hd >= PARALLEL_COMBINE_VALUES {
        let mut rows: Vec<&mut [f32]> = out.chunks_mut(hd).collect();
        crate::kernels::pool::pool().for_each_mut(&mut rows, |t, o| combine(t, o));
    } else {
        for (t, o) in out.chunks_mut(hd).enumerate() {
            combine(t, o);
        }
    }
    out
}

impl FeedForward for MoeFfn {
    fn predict_experts(&self, x: &[f32], n: usize) -> Option<Vec<usize>> {
        // Most likely first (chosen by more positions, then by a higher rank), so that when
        // bandwidth is short the reads that land first are the likeliest to be used and the
        // unlikely ones are still queued, and so cancellable, when the guess is checked.
        let mut score: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
        for r in self.router.route(x, n) {
            for (rank, e) in r.experts.into_iter().enumerate() {
                let s = score.entry(e).or_insert((0, usize::MAX));
                s.0 += 1;
                s.1 = s.1.min(rank);
            }
        }
        let mut e: Vec<(usize, (usize, usize))> = score.into_iter().collect();
        e.sort_by(|a, b| {
            b.1 .0
                .cmp(&a.1 .0)
                .then(a.1 .1.cmp(&b.1 .1))
                .then(a.0.cmp(&b.0))
        });
        Some(e.into_iter().map(|(e, _)| e).collect())
    }

    fn router_gate(&self) -> Option<&Linear> {
        Some(self.router.gate())
    }

    fn forward(&self, full: &[f32], n: usize, ctx: &mut FfnContext<'_>) -> Result<Vec<f32>> {
        let hd = self.experts.hidden;
        let layer = ctx.layer;
        let routes = timed(Phase::Router, || self.router.route(full, n));
        let latent_x;
        let x: &[f32] = match &self.latent {
            Some(l) => {
                latent_x = timed(Phase::Latent, || l.down.forward(full, n));
                &latent_x
            }
            None => full,
        };
        let top_k = routes.iter().map(|r| r.experts.len()).max().unwrap_or(0);
        // expert -> [(position, slot)], indexed by expert id (every id the router can pick is
        // below its expert count; a larger one would be a router bug, so grow rather than
        // index out of bounds).
        let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); self.router.num_experts()];
        for (t, r) in routes.iter().enumerate() {
            for (slot, &e) in r.experts.iter().enumerate() {
                if e >= by_expert.len() {
                    by_expert.resize(e + 1, Vec::new());
                }
                by_expert[e].push((t, slot));
            }
        }
        let wanted: Vec<usize> = (0..by_expert.len())
            .filter(|&e| !by_expert[e].is_empty())
            .collect();
        // Each wanted expert's outputs `[m, hd]` (its positions in `by_expert` order), kept
        // until every expert has been computed and then summed per position in slot order,
        // so the result does not depend on the order or grouping in which experts arrive.
        // (RefCells: the idle work reads what the group callback has filled in so far.)
        let outputs: RefCell<Vec<Option<Scratch<f32>>>> =
            RefCell::new((0..wanted.len()).map(|_| None).collect());
        // Where each (position, slot) output lives: (index into `outputs`, row).
        let mut source = vec![(usize::MAX, 0usize); n * top_k];
        for (k, &e) in wanted.iter().enumerate() {
            for (i, &(t, slot)) in by_expert[e].iter().enumerate() {
                source[t * top_k + slot] = (k, i);
            }
        }
        let act: &dyn Activation = &*self.act;
        // The shared expert rides along with the first group (biases: computed on its own).
        let fuse_shared = self.shared_experts.as_ref().filter(|m| {
            !m.gate_proj.has_bias() && !m.up_proj.has_bias() && !m.down_proj.has_bias()
        });
        let shared_out: RefCell<Option<Scratch<f32>>> = RefCell::new(None);
        // While the drives read this layer's last experts, the forward may run the next
        // layer's mixer on the output so far to predict that layer's experts better than it
        // could before this layer's experts were computed: once, after the first group.
        let idle = &mut *ctx.idle;
        let mut speculate = ctx.speculate.as_deref_mut();
        let mut speculated = false;
        let mut speculate_error = None;
        let mut on_idle = |hints: &mut dyn ExpertHints| -> bool {
            if !speculated && outputs.borrow().iter().any(Option::is_some) {
                speculated = true;
                if let Some(spec) = speculate.as_deref_mut() {
                    let partial = self.finish(
                        weighted_sum(&outputs.borrow(), &source, &routes, n, top_k, hd),
                        n,
                        shared_out.borrow().as_deref(),
                    );
                    match spec(&partial) {
                        Ok(Some((l, e))) => hints.repredict(l, &e),
                        Ok(None) => {}
                        Err(e) => speculate_error = Some(e),
                    }
                    return speculate_error.is_none();
                }
            }
            idle()
        };
        // Every position in order: the experts can read `x` itself (and share its prepared
        // form) instead of a gathered copy.
        ctx.source.with_expert_groups_idle(
            layer,
            &wanted,
            &mut |group: &[(usize, ExpertView<'_>)]| {
                let mut gathered: Vec<Scratch<f32>> = Vec::with_capacity(group.len());
                let mut whole: Vec<bool> = Vec::with_capacity(group.len());
                let mut index: Vec<usize> = Vec::with_capacity(group.len());
                for &(e, _) in group {
                    let Ok(k) = wanted.binary_search(&e) else {
                        return Err(InferenceError::MissingExpert {
                            layer,
                            expert: e,
                            reason: "the weight source delivered an expert that was not requested"
                                .into(),
                        });
                    };
                    if outputs.borrow()[k].is_some() || index.contains(&k) {
                        return Err(InferenceError::MissingExpert {
                            layer,
                            expert: e,
                            reason: "the weight source delivered it twice".into(),
                        });
                    }
                    index.push(k);
                    let assign = &by_expert[e];
                    let in_order =
                        assign.len() == n && assign.iter().enumerate().all(|(i, a)| a.0 == i);
                    whole.push(in_order);
                    let mut xs =
                        Scratch::for_overwrite(if in_order { 0 } else { assign.len() * hd });
                    for (row, &(t, _)) in xs.chunks_mut(hd.max(1)).zip(assign) {
                        row.copy_from_slice(&x[t * hd..(t + 1) * hd]);
                    }
                    gathered.push(xs);
                }
                let inputs: Vec<(&[f32], usize)> = group
                    .iter()
                    .zip(gathered.iter().zip(&whole))
                    .map(|((e, _), (xs, &w))| {
                        let m = by_expert[*e].len();
                        if w {
                            (x, m)
                        } else {
                            (&xs[..], m)
                        }
                    })
                    .collect();
                let shared_job = match (fuse_shared, shared_out.borrow().is_some()) {
                    (Some(mlp), false) => Some((mlp, full, n)),
                    _ => None,
                };
                let (ys, s) = self
                    .experts
                    .forward_group_with(group, layer, act, &inputs, shared_job)?;
                if s.is_some() {
                    *shared_out.borrow_mut() = s;
                }
                let mut outputs = outputs.borrow_mut();
                for (k, ys) in index.into_iter().zip(ys) {
                    outputs[k] = Some(ys);
                }
                Ok(())
            },
            &mut on_idle,
        )?;
        if let Some(e) = speculate_error {
            return Err(e);
        }
        let outputs = outputs.into_inner();
        if let Some(k) = outputs.iter().position(|o| o.is_none()) {
            return Err(InferenceError::MissingExpert {
                layer,
                expert: wanted[k],
                reason: "the weight source returned without delivering it".into(),
            });
        }
        let combine_span = span(Phase::ExpertsCombine);
        let out = weighted_sum(&outputs, &source, &routes, n, top_k, hd);
        drop(combine_span);
        let shared = match shared_out.into_inner() {
            Some(s) => Some(s),
            None => self
                .shared_experts
                .as_ref()
                .map(|shared| Scratch::from_vec(timed(Phase::Shared, || shared.apply(full, n)))),
        };
        let out = self.finish(out, n, shared.as_deref());
        if let Some(trace) = ctx.routing.as_deref_mut() {
            trace.extend(routes);
        }
        Ok(out)
    }
}
