//! Routers: which experts each position goes to, with their combine weights.

use crate::linear::owned::Linear;
use crate::ops::{sigmoid, softmax_inplace};

/// The experts one position is routed to, in selection order, with their combine weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Chooses experts per position.
pub trait Router: Send + Sync + std::fmt::Debug {
    /// `x [n, hidden]` -> one [`Routing`] per position.
    fn route(&self, x: &[f32], n: usize) -> Vec<Routing>;
    fn num_experts(&self) -> usize;
    /// The scoring matrix `[experts, hidden]`.
    fn gate(&self) -> &Linear;
}

/// Indices of the `k` largest values, largest first (ties: lower index first).
pub fn top_k_indices(values: &[f32], k: usize) -> Vec<usize> {
    // A total order (value descending, then index), so selecting the first `k` and sorting
    // only them gives exactly what sorting everything gives: a full sort of 128-384 experts
    // three times per position was most of the router's time in a 32-token prefill.
    let order = |a: &usize, b: &usize| values[*b].total_cmp(&values[*a]).then(a.cmp(b));
    let mut idx: Vec<usize> = (0..values.len()).collect();
    if k == 0 {
        return Vec::new();
    }
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, order);
        idx.truncate(k);
    }
    idx.sort_unstable_by(order);
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
    /// Scores from logits: sigmoid (DeepSeek-V3, Kimi) or softmax over the experts.
    pub softmax_scores: bool,
    /// Choice score of experts in dropped groups: 0 (transformers' DeepSeek-V3) or -inf
    /// (Kimi).
    pub dropped_group_score: f32,
    /// Renormalise a single chosen expert's weight too (DeepSeek-V3); Kimi renormalises only
    /// when `top_k > 1`.
    pub renormalize_single: bool,
}

impl NoauxTcRouter {
    /// Route one position given its gate logits.
    pub fn route_logits(&self, logits: &[f32]) -> Routing {
        let e = logits.len();
        let scores: Vec<f32> = if self.softmax_scores {
            let mut p = logits.to_vec();
            softmax_inplace(&mut p);
            p
        } else {
            logits.iter().map(|&l| sigmoid(l)).collect()
        };
        let choice: Vec<f32> = scores.iter().zip(&self.bias).map(|(s, b)| s + b).collect();
        let per_group = e / self.n_group;
        let group_scores: Vec<f32> = (0..self.n_group)
            .map(|g| {
                let grp = &choice[g * per_group..(g + 1) * per_group];
                top_k_indices(grp, 2).iter().map(|&i| grp[i]).sum()
            })
            .collect();
        let keep = top_k_indices(&group_scores, self.topk_group);
        // Experts of dropped groups score `dropped_group_score` (transformers' DeepSeek-V3:
        // masked_fill(~mask, 0.0); Kimi: -inf).
        let masked: Vec<f32> = (0..e)
            .map(|i| {
                if keep.contains(&(i / per_group)) {
                    choice[i]
                } else {
                    self.dropped_group_score
                }
            })
            .collect();
        let experts = top_k_indices(&masked, self.top_k);
        let mut weights: Vec<f32> = experts.iter().map(|&i| scores[i]).collect();
        if self.norm_topk_prob && (self.renormalize_single || self.top_k > 1) {
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

    fn gate(&self) -> &Linear {
        &self.gate
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

    fn gate(&self) -> &Linear {
        &self.gate
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
            softmax_scores: false,
            dropped_group_score: 0.0,
            renormalize_single: true,
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

    #[test]
    fn top_k_equals_a_full_sort() {
        // The naive oracle: sort every index, keep the first k.
        let naive = |v: &[f32], k: usize| {
            let mut idx: Vec<usize> = (0..v.len()).collect();
            idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
            idx.truncate(k);
            idx
        };
        let mut s = 7u64;
        for len in [1usize, 2, 7, 64, 128, 384] {
            // Few distinct values: many ties; plus signed zeros and infinities.
            let v: Vec<f32> = (0..len)
                .map(|i| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    match (s >> 60) as usize % 8 {
                        0 => -0.0,
                        1 => f32::NEG_INFINITY,
                        2 => f32::INFINITY,
                        r => (r as f32 + (i % 3) as f32) * 0.25,
                    }
                })
                .collect();
            for k in [0, 1, 2, 8, len / 2, len, len + 3] {
                assert_eq!(top_k_indices(&v, k), naive(&v, k), "len {len} k {k}");
            }
        }
    }
}
