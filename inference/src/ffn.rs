//! Feed-forward modules: dense gated MLPs and routed Mixture-of-Experts, with pluggable routers.
//!
//! ```text
//! DenseMlp:  down(act(gate(x)) * up(x))                              [n, hidden]
//! MoE:       sum_k w_k * expert_{e_k}(x) (+ shared_experts(x))       [n, hidden]
//! ```
//! Routed experts are not held by the model: [`MoeFfn`] asks the [`WeightSource`] for the experts
//! the router chose and computes each one as soon as the source hands it over.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::error::{InferenceError, Result};
use crate::linear::{Linear, QuantHints, WeightMatrix};
use crate::loader::expert_matrix;
use crate::ops::{sigmoid, softmax_inplace, Activation};
use crate::weights::{ExpertView, WeightSource};

/// The experts one position is routed to, in selection order, with their combine weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Per-call context of a feed-forward module.
pub struct FfnContext<'a> {
    pub source: &'a dyn WeightSource,
    /// Decoder layer index (names the experts to fetch).
    pub layer: usize,
    /// When set, MoE layers push each position's routing here.
    pub routing: Option<&'a mut Vec<Routing>>,
}

impl std::fmt::Debug for FfnContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FfnContext")
            .field("layer", &self.layer)
            .finish_non_exhaustive()
    }
}

/// The channel-mixing module of a decoder layer.
pub trait FeedForward: Send + Sync + std::fmt::Debug {
    /// `x [n, hidden] -> [n, hidden]`.
    fn forward(&self, x: &[f32], n: usize, ctx: &mut FfnContext<'_>) -> Result<Vec<f32>>;

    /// The routed experts this module would request for input `x [n, hidden]` (already
    /// normed), deduplicated, likeliest first; `None` when it routes nothing. Used to prefetch a
    /// layer's experts from an earlier hidden state.
    fn predict_experts(&self, _x: &[f32], _n: usize) -> Option<Vec<usize>> {
        None
    }
}

/// `down(act(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub struct DenseMlp {
    /// `[inter, hidden]`
    pub gate_proj: Linear,
    /// `[inter, hidden]`
    pub up_proj: Linear,
    /// `[hidden, inter]`
    pub down_proj: Linear,
    pub act: Arc<dyn Activation>,
}

impl DenseMlp {
    pub fn apply(&self, x: &[f32], n: usize) -> Vec<f32> {
        // Gate and up in one pass over the same (once-quantized) inputs.
        let mut gu = Linear::forward_many(&[&self.gate_proj, &self.up_proj], x, n).into_iter();
        let (g, u) = (gu.next().unwrap_or_default(), gu.next().unwrap_or_default());
        let h: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| self.act.apply(g) * u)
            .collect();
        self.down_proj.forward(&h, n)
    }
}

impl FeedForward for DenseMlp {
    fn forward(&self, x: &[f32], n: usize, _ctx: &mut FfnContext<'_>) -> Result<Vec<f32>> {
        Ok(self.apply(x, n))
    }
}

/// Chooses experts per position.
pub trait Router: Send + Sync + std::fmt::Debug {
    /// `x [n, hidden]` -> one [`Routing`] per position.
    fn route(&self, x: &[f32], n: usize) -> Vec<Routing>;
    fn num_experts(&self) -> usize;
}

/// Indices of the `k` largest values, largest first (ties: lower index first).
pub fn top_k_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// DeepSeek-V3 `noaux_tc`: sigmoid scores, bias-corrected group-limited selection, weights from
/// the unbiased scores.
#[derive(Debug, Clone)]
pub struct NoauxTcRouter {
    /// `[E, hidden]`
    pub gate: Linear,
    /// `e_score_correction_bias` `[E]` (selection only).
    pub bias: Vec<f32>,
    pub n_group: usize,
    pub topk_group: usize,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
}

impl NoauxTcRouter {
    /// Route one position given its gate logits.
    pub fn route_logits(&self, logits: &[f32]) -> Routing {
        let e = logits.len();
        let scores: Vec<f32> = logits.iter().map(|&l| sigmoid(l)).collect();
        let choice: Vec<f32> = scores.iter().zip(&self.bias).map(|(s, b)| s + b).collect();
        let per_group = e / self.n_group;
        let group_scores: Vec<f32> = (0..self.n_group)
            .map(|g| {
                let grp = &choice[g * per_group..(g + 1) * per_group];
                top_k_indices(grp, 2).iter().map(|&i| grp[i]).sum()
            })
            .collect();
        let keep = top_k_indices(&group_scores, self.topk_group);
        // Experts of dropped groups score 0 (transformers' masked_fill(~mask, 0.0)).
        let masked: Vec<f32> = (0..e)
            .map(|i| {
                if keep.contains(&(i / per_group)) {
                    choice[i]
                } else {
                    0.0
                }
            })
            .collect();
        let experts = top_k_indices(&masked, self.top_k);
        let mut weights: Vec<f32> = experts.iter().map(|&i| scores[i]).collect();
        if self.norm_topk_prob {
            let denom = weights.iter().sum::<f32>() + 1e-20;
            weights.iter_mut().for_each(|w| *w /= denom);
        }
        weights
            .iter_mut()
            .for_each(|w| *w *= self.routed_scaling_factor);
        Routing { experts, weights }
    }
}

impl Router for NoauxTcRouter {
    fn route(&self, x: &[f32], n: usize) -> Vec<Routing> {
        let e = self.gate.rows();
        let logits = self.gate.forward(x, n);
        logits.chunks(e).map(|l| self.route_logits(l)).collect()
    }
    fn num_experts(&self) -> usize {
        self.gate.rows()
    }
}

/// Softmax over all experts, top-k, optional renormalisation (Qwen3-MoE).
#[derive(Debug, Clone)]
pub struct SoftmaxTopKRouter {
    /// `[E, hidden]`
    pub gate: Linear,
    pub top_k: usize,
    pub norm_topk_prob: bool,
}

impl Router for SoftmaxTopKRouter {
    fn route(&self, x: &[f32], n: usize) -> Vec<Routing> {
        let e = self.gate.rows();
        let mut logits = self.gate.forward(x, n);
        logits
            .chunks_mut(e)
            .map(|p| {
                softmax_inplace(p);
                let experts = top_k_indices(p, self.top_k);
                let mut weights: Vec<f32> = experts.iter().map(|&i| p[i]).collect();
                if self.norm_topk_prob {
                    let s: f32 = weights.iter().sum();
                    weights.iter_mut().for_each(|w| *w /= s);
                }
                Routing { experts, weights }
            })
            .collect()
    }
    fn num_experts(&self) -> usize {
        self.gate.rows()
    }
}

/// A routed gated expert computed from an [`ExpertView`] (separate or fused parts, any packed
/// format `linear::resolve_matrix` understands).
#[derive(Debug, Clone)]
pub struct ExpertShape {
    pub hidden: usize,
    pub intermediate: usize,
    pub hints: QuantHints,
}

impl ExpertShape {
    /// `x [m, hidden] -> [m, hidden]` through expert `expert` of `layer`.
    pub fn forward(
        &self,
        view: &ExpertView<'_>,
        layer: usize,
        expert: usize,
        act: &dyn Activation,
        x: &[f32],
        m: usize,
    ) -> Result<Vec<f32>> {
        let (hd, it) = (self.hidden, self.intermediate);
        let mat = |part: &str, rows: usize, cols: usize| -> Result<WeightMatrix<'_>> {
            expert_matrix(view, layer, expert, part, rows, cols, &self.hints)
        };
        let mut h = vec![0f32; m * it];
        // Fused as shipped (`gate_up_proj`) or quantized at layout time (`gate_up_proj.*`).
        if view.has_matrix("gate_up_proj") {
            // transformers-5 fused layout: [2I, H], gate rows first.
            let gu = mat("gate_up_proj", 2 * it, hd)?;
            let mut y = vec![0f32; m * 2 * it];
            gu.matmul(x, m, &mut y);
            for (hrow, yrow) in h.chunks_mut(it).zip(y.chunks(2 * it)) {
                let (g, u) = yrow.split_at(it);
                for ((o, &g), &u) in hrow.iter_mut().zip(g).zip(u) {
                    *o = act.apply(g) * u;
                }
            }
        } else {
            let gate = mat("gate_proj", it, hd)?;
            let up = mat("up_proj", it, hd)?;
            let mut g = vec![0f32; m * it];
            let mut u = vec![0f32; m * it];
            // One pass over the same (once-quantized) inputs for both.
            crate::linear::matmul_many(&[&gate, &up], x, m, &mut [&mut g, &mut u]);
            for ((o, &g), &u) in h.iter_mut().zip(&g).zip(&u) {
                *o = act.apply(g) * u;
            }
        }
        let down = mat("down_proj", hd, it)?;
        let mut out = vec![0f32; m * hd];
        down.matmul(&h, m, &mut out);
        Ok(out)
    }
}

/// Routed experts plus optional always-on shared experts.
#[derive(Debug)]
pub struct MoeFfn {
    pub router: Box<dyn Router>,
    pub experts: ExpertShape,
    pub shared_experts: Option<DenseMlp>,
    pub act: Arc<dyn Activation>,
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

    fn forward(&self, x: &[f32], n: usize, ctx: &mut FfnContext<'_>) -> Result<Vec<f32>> {
        let hd = self.experts.hidden;
        let layer = ctx.layer;
        let routes = self.router.route(x, n);
        let top_k = routes.iter().map(|r| r.experts.len()).max().unwrap_or(0);
        // expert -> [(position, slot)]
        let mut by_expert: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
        for (t, r) in routes.iter().enumerate() {
            for (slot, &e) in r.experts.iter().enumerate() {
                by_expert.entry(e).or_default().push((t, slot));
            }
        }
        let wanted: Vec<usize> = by_expert.keys().copied().collect();
        let mut delivered = vec![false; wanted.len()];
        // Per (position, slot) weighted outputs, summed in slot order afterwards so the result
        // does not depend on the order in which experts arrive.
        let mut slots = vec![0f32; n * top_k * hd];
        let act: &dyn Activation = &*self.act;
        ctx.source
            .with_experts(layer, &wanted, &mut |e: usize, view: &ExpertView<'_>| {
                let Ok(k) = wanted.binary_search(&e) else {
                    return Err(InferenceError::MissingExpert {
                        layer,
                        expert: e,
                        reason: "the weight source delivered an expert that was not requested"
                            .into(),
                    });
                };
                delivered[k] = true;
                let assign = &by_expert[&e];
                let mut xs = Vec::with_capacity(assign.len() * hd);
                for &(t, _) in assign {
                    xs.extend_from_slice(&x[t * hd..(t + 1) * hd]);
                }
                let ys = self
                    .experts
                    .forward(view, layer, e, act, &xs, assign.len())?;
                for (i, &(t, slot)) in assign.iter().enumerate() {
                    let w = routes[t].weights[slot];
                    let dst = &mut slots[(t * top_k + slot) * hd..(t * top_k + slot + 1) * hd];
                    for (d, &y) in dst.iter_mut().zip(&ys[i * hd..(i + 1) * hd]) {
                        *d = w * y;
                    }
                }
                Ok(())
            })?;
        if let Some(k) = delivered.iter().position(|d| !d) {
            return Err(InferenceError::MissingExpert {
                layer,
                expert: wanted[k],
                reason: "the weight source returned without delivering it".into(),
            });
        }
        let mut out = vec![0f32; n * hd];
        for (t, o) in out.chunks_mut(hd).enumerate() {
            for slot in 0..top_k {
                let s = &slots[(t * top_k + slot) * hd..(t * top_k + slot + 1) * hd];
                for (o, &v) in o.iter_mut().zip(s) {
                    *o += v;
                }
            }
        }
        if let Some(shared) = &self.shared_experts {
            let s = shared.apply(x, n);
            for (o, v) in out.iter_mut().zip(&s) {
                *o += v;
            }
        }
        if let Some(trace) = ctx.routing.as_deref_mut() {
            trace.extend(routes);
        }
        Ok(out)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn router(n_group: usize, topk_group: usize, top_k: usize, bias: Vec<f32>) -> NoauxTcRouter {
        NoauxTcRouter {
            gate: Linear::from_f32(1, 1, &[0.0]).unwrap(),
            bias,
            n_group,
            topk_group,
            top_k,
            norm_topk_prob: true,
            routed_scaling_factor: 2.0,
        }
    }

    #[test]
    fn grouped_routing_limits_groups() {
        // 8 experts, 4 groups of 2; group scores are sums of both members.
        let logits = [3.0f32, -3.0, 2.0, 2.0, 0.5, 0.4, -1.0, 2.5];
        let r = router(4, 2, 3, vec![0.0; 8]);
        let out = r.route_logits(&logits);
        // groups: g0 = s(3)+s(-3) ~ 1.0, g1 = 2*s(2) ~ 1.76, g2 ~ 1.22, g3 = s(-1)+s(2.5) ~ 1.19
        // keep g1 and g2 -> experts 2, 3, 4 (expert 0 has the top score but its group is dropped)
        let mut got = out.experts.clone();
        got.sort();
        assert_eq!(got, vec![2, 3, 4]);
        let sum: f32 = out.weights.iter().sum();
        assert!((sum - 2.0).abs() < 1e-5, "normalised then scaled by 2");
    }

    #[test]
    fn bias_changes_selection_not_weights() {
        let logits = [1.0f32, 0.9, 0.0, -1.0];
        let r = router(1, 1, 1, vec![0.0, 0.5, 0.0, 0.0]);
        let out = r.route_logits(&logits);
        assert_eq!(out.experts, vec![1]);
        assert!((out.weights[0] - 2.0).abs() < 1e-6);
        let mut r = r;
        r.norm_topk_prob = false;
        let out = r.route_logits(&logits);
        assert!((out.weights[0] - 2.0 * sigmoid(0.9)).abs() < 1e-6);
    }

    #[test]
    fn top_k_order() {
        assert_eq!(top_k_indices(&[0.1, 0.5, 0.5, 0.2], 3), vec![1, 2, 3]);
    }
}
