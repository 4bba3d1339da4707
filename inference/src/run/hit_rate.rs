//! The expert cache's hit rate `deltafin plan` expects, from the routing assumed: uniform and
//! independent between positions (a floor for real routing), or each expert's probability of
//! being chosen as recorded by `generate --save-routing` (real and synthetic routers are
//! skewed, which a frequency-aware cache turns into hits).
//!
//! The cache (frequency-aware, shared by the layers) is taken to hold the `slots` experts most
//! likely to be chosen over all layers. Steady state: a position's lookup of expert `e` hits
//! when `e` is held, so the hit rate is the held experts' share of the choices. Over `T`
//! decoded positions after a `P`-position prompt from a cold cache, a held expert also misses
//! once when first chosen, unless the prompt chose it: `(1 - p)^P (1 - (1 - p)^T)` misses
//! expected; an expert not held misses `p T` times.

use std::collections::BTreeMap;

/// Probabilities of choice per MoE layer (each layer's sum to the experts per position).
#[derive(Clone, Debug)]
pub struct RoutingAssumed {
    /// One vector of `experts` probabilities per MoE layer.
    pub layers: Vec<Vec<f64>>,
    /// How many layers came from a recording (the rest are uniform).
    pub recorded_layers: usize,
}

impl RoutingAssumed {
    /// `moe_layers` layers of `experts` experts, `top_k` chosen per position: the recorded
    /// probabilities where given (`recorded`, by decoder layer), uniform for the rest.
    pub fn new(
        moe_layers: usize,
        experts: usize,
        top_k: usize,
        recorded: Option<&BTreeMap<usize, Vec<f64>>>,
    ) -> RoutingAssumed {
        let uniform = vec![top_k as f64 / experts.max(1) as f64; experts];
        let mut layers: Vec<Vec<f64>> = recorded
            .map(|r| r.values().take(moe_layers).cloned().collect())
            .unwrap_or_default();
        let recorded_layers = layers.len();
        layers.resize(moe_layers, uniform);
        RoutingAssumed {
            layers,
            recorded_layers,
        }
    }
}

/// The expected hit rate with `slots` experts cached (see the module docs); `tokens` = `None`
/// for the steady state, else `(T, P)`: decoded positions averaged over and the prompt
/// positions before them.
pub fn hit_rate(routing: &RoutingAssumed, slots: f64, tokens: Option<(usize, usize)>) -> f64 {
    let mut all: Vec<f64> = routing.layers.iter().flatten().copied().collect();
    let choices: f64 = all.iter().sum();
    if choices <= 0.0 {
        return 0.0;
    }
    all.sort_by(|a, b| b.total_cmp(a));
    let held = (slots.max(0.0).floor() as usize).min(all.len());
    let (cached, rest) = all.split_at(held);
    match tokens {
        None => cached.iter().sum::<f64>() / choices,
        Some((t, p)) => {
            let t = t.max(1) as f64;
            let first_uses: f64 = cached
                .iter()
                .map(|&q| (1.0 - q).powf(p as f64) * (1.0 - (1.0 - q).powf(t)))
                .sum();
            let misses = rest.iter().sum::<f64>() * t + first_uses;
            (1.0 - misses / (choices * t)).clamp(0.0, 1.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_steady_state_is_the_cached_share() {
        let r = RoutingAssumed::new(4, 64, 8, None);
        assert_eq!(r.recorded_layers, 0);
        // 64 of 256 experts held: a quarter of the choices.
        assert!((hit_rate(&r, 64.0, None) - 0.25).abs() < 1e-12);
        assert_eq!(hit_rate(&r, 0.0, None), 0.0);
        assert!((hit_rate(&r, 1e9, None) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn skew_raises_the_hit_rate_and_a_cold_start_lowers_it() {
        // One layer, 4 experts, 1 chosen per position, two of them popular.
        let mut rec = BTreeMap::new();
        rec.insert(3usize, vec![0.45, 0.45, 0.05, 0.05]);
        let skewed = RoutingAssumed::new(1, 4, 1, Some(&rec));
        let uniform = RoutingAssumed::new(1, 4, 1, None);
        assert_eq!(skewed.recorded_layers, 1);
        assert!((hit_rate(&skewed, 2.0, None) - 0.9).abs() < 1e-12);
        assert!((hit_rate(&uniform, 2.0, None) - 0.5).abs() < 1e-12);
        // From a cold cache, 10 positions, no prompt: each held expert misses once (almost
        // surely): 0.9 - 2 / 10.
        let cold = hit_rate(&skewed, 2.0, Some((10, 0)));
        assert!((cold - (0.9 - 2.0 * (1.0 - 0.55f64.powi(10)) / 10.0)).abs() < 1e-12);
        // A long prompt warmed the cache: back to the steady state.
        let warm = hit_rate(&skewed, 2.0, Some((10, 200)));
        assert!((warm - 0.9).abs() < 1e-9 && warm > cold);
    }
}
