//! [`MoeFfn`]: routed experts (requested from the weight source, computed as they arrive) plus
//! optional always-on shared experts.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::error::{InferenceError, Result};
use crate::ffn::dense::DenseMlp;
use crate::ffn::experts::RoutedExperts;
use crate::ffn::feed_forward::{FeedForward, FfnContext};
use crate::ffn::router::Router;
use crate::ops::Activation;
use crate::weights::ExpertView;

/// Routed experts plus optional always-on shared experts.
#[derive(Debug)]
pub struct MoeFfn {
    pub router: Box<dyn Router>,
    pub experts: RoutedExperts,
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
