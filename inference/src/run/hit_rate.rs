//! The expert cache's hit rate `deltafin plan` expects, from the routing assumed: uniform and
//! independent between positions (a floor for real routing), or each expert's probability of
//! being chosen as recorded by `generate --save-routing` (real and synthetic routers are
//! skewed, which a frequency-aware cache turns into hits).
//!
//! Steady state ([`hit_rate`]): the cache (frequency-aware, shared by the layers) is taken to
//! hold the `slots` experts most likely to be chosen over all layers, so the hit rate is the
//! held experts' share of the choices.
//!
//! A short run from a cold cache ([`simulated_hit_rate`]) is simulated instead: the runtime's
//! own [`ExpertCache`] with its policy and `slots` experts of room serves routing drawn from
//! the assumed probabilities (the prompt's chunk first, each layer's chosen experts once, then
//! each decoded position's), averaged over several draws. The cache counts uses only while an
//! expert is held, so what the prompt brought in tends to stay; a closed form that assumes the
//! most chosen experts held from the start (each missing once) overestimated the hits of a
//! 40-token run on the k3-width synth at 7.5 GiB by half (0.40 vs 0.27 measured).

use std::collections::BTreeMap;

use deltafin_storage::store::cache::{CacheBuffer, CachePolicy, ExpertCache, Lookup};

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

/// A cached expert of one unit of room.
struct Unit;
impl CacheBuffer for Unit {
    fn bytes(&self) -> u64 {
        1
    }
}

/// Draws of the routing averaged by [`simulated_hit_rate`].
const DRAWS: u64 = 12;

/// The hit rate of the decoded positions of a run of `tokens` = `(T, P)` (`T` decoded after a
/// `P`-position prompt) from a cold cache of `slots` experts under `policy`, simulated (see
/// the module docs).
pub fn simulated_hit_rate(
    routing: &RoutingAssumed,
    slots: f64,
    tokens: (usize, usize),
    policy: CachePolicy,
) -> f64 {
    let (t, p) = tokens;
    let cap = slots.max(0.0).floor() as u64;
    let (mut hits, mut lookups) = (0u64, 0u64);
    for draw in 0..DRAWS {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ draw.wrapping_mul(0xd1b5_4a32_d192_ed03);
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut cache = ExpertCache::<Unit>::new(cap, policy);
        let mut now = 0u64;
        // One position's choice in one layer: `k` distinct experts, drawn in proportion to
        // their probabilities.
        let choose = |probs: &[f64], next: &mut dyn FnMut() -> f64| -> Vec<u32> {
            let k = probs.iter().sum::<f64>().round().max(1.0) as usize;
            let mut w: Vec<f64> = probs.to_vec();
            let mut out = Vec::with_capacity(k);
            for _ in 0..k.min(w.len()) {
                let total: f64 = w.iter().sum();
                if total <= 0.0 {
                    break;
                }
                let mut x = next() * total;
                let mut pick = w.len() - 1;
                for (i, &v) in w.iter().enumerate() {
                    if x < v {
                        pick = i;
                        break;
                    }
                    x -= v;
                }
                out.push(pick as u32);
                w[pick] = 0.0;
            }
            out
        };
        // Serve one layer's experts as the store does: pinned together, a miss read and
        // landed at once.
        let mut serve =
            |cache: &mut ExpertCache<Unit>, layer: u32, experts: &[u32], count: bool| {
                let mut h = 0u64;
                for &e in experts {
                    cache.pin((layer, e));
                }
                for &e in experts {
                    now += 1;
                    let key = (layer, e);
                    match cache.lookup(key, now) {
                        Lookup::Ready(_) => h += 1,
                        _ => {
                            if let Ok(spare) = cache.reserve(key, 1, false, &|_| true) {
                                cache.land(key, Some(spare.unwrap_or(Unit)), now);
                                cache.touch(key, now);
                            }
                        }
                    }
                    cache.unpin(key);
                }
                if count {
                    hits += h;
                    lookups += experts.len() as u64;
                }
            };
        if p > 0 {
            for (l, probs) in routing.layers.iter().enumerate() {
                let mut chunk: Vec<u32> = (0..p).flat_map(|_| choose(probs, &mut next)).collect();
                chunk.sort_unstable();
                chunk.dedup();
                serve(&mut cache, l as u32, &chunk, false);
            }
        }
        for _ in 0..t.max(1) {
            for (l, probs) in routing.layers.iter().enumerate() {
                let experts = choose(probs, &mut next);
                serve(&mut cache, l as u32, &experts, true);
            }
        }
    }
    if lookups == 0 {
        return 0.0;
    }
    hits as f64 / lookups as f64
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

    #[test]
    fn the_simulated_cache_agrees_with_the_closed_forms_where_they_are_exact() {
        // Room for every expert: only the first use of each misses.
        let u = RoutingAssumed::new(2, 16, 2, None);
        let all = simulated_hit_rate(&u, 32.0, (200, 0), CachePolicy::Lfu);
        let closed = hit_rate(&u, 32.0, Some((200, 0)));
        assert!((all - closed).abs() < 0.01, "{all} vs {closed}");
        // No room: nothing hits.
        assert_eq!(simulated_hit_rate(&u, 0.0, (50, 8), CachePolicy::Lfu), 0.0);
        // Uniform routing and half the experts held: about half the lookups hit in a long
        // run, whatever the policy.
        for policy in [CachePolicy::Lfu, CachePolicy::Lru] {
            let h = simulated_hit_rate(&u, 16.0, (2000, 0), policy);
            assert!((h - 0.5).abs() < 0.05, "{policy:?}: {h}");
        }
        // Skew helps a frequency-aware cache.
        let mut rec = BTreeMap::new();
        rec.insert(0usize, vec![0.45, 0.45, 0.05, 0.05]);
        let s = RoutingAssumed::new(1, 4, 1, Some(&rec));
        let h = simulated_hit_rate(&s, 2.0, (2000, 0), CachePolicy::Lfu);
        assert!(h > 0.8, "{h}");
    }
}
