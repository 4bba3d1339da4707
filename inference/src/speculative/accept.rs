//! The speculative-sampling acceptance rule.

use crate::sampler::Rng;

/// Sample from `(token, p)` with `u` in [0, 1).
fn draw(dist: &[(u32, f32)], u: f64) -> Option<u32> {
    let total: f64 = dist.iter().map(|d| d.1 as f64).sum();
    if total <= 0.0 {
        return None;
    }
    let mut cum = 0f64;
    for &(id, p) in dist {
        cum += p as f64 / total;
        if u < cum {
            return Some(id);
        }
    }
    dist.iter().rev().find(|d| d.1 > 0.0).map(|d| d.0)
}

/// The speculative-sampling decision for one drafted token `d` drawn from `q` given the target
/// distribution `p`: `Ok(None)` accepts it, `Ok(Some(t))` rejects it and emits `t` instead.
pub fn accept_or_resample(
    p: &[(u32, f32)],
    q: Option<&[(u32, f32)]>,
    d: u32,
    rng: &mut Rng,
) -> Option<u32> {
    let prob =
        |dist: &[(u32, f32)], t: u32| dist.iter().find(|x| x.0 == t).map_or(0.0, |x| x.1 as f64);
    let pd = prob(p, d);
    let qd = q.map_or(1.0, |q| prob(q, d));
    let u = rng.next_f64();
    if qd > 0.0 && u < pd / qd {
        return None;
    }
    let residual: Vec<(u32, f32)> = p
        .iter()
        .map(|&(t, pt)| {
            let qt = q.map_or(if t == d { 1.0 } else { 0.0 }, |q| prob(q, t));
            (t, (pt as f64 - qt).max(0.0) as f32)
        })
        .collect();
    let u = rng.next_f64();
    // p == q on p's support: fall back to p (the rejection then has probability 0 anyway).
    draw(&residual, u).or_else(|| draw(p, u))
}
