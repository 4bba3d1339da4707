//! Speculative decoding: a [`Drafter`] proposes `k` tokens, one batched forward pass of the
//! target over the pending token and the `k` drafts verifies them (each MoE layer reads the
//! union of the positions' experts once), rejected positions are rolled back with
//! [`Session::truncate`] (no copy).
//!
//! Lossless: with greedy sampling the output is exactly the target's greedy output; with
//! temperature > 0 drafts are accepted with the speculative-sampling rule (accept `d` with
//! probability `min(1, p(d) / q(d))`, otherwise sample from `norm(max(0, p - q))`), so every
//! emitted token is distributed as the target's sampler would draw it. `p` is the target
//! sampler's distribution (after temperature / top-k / top-p); deterministic drafters have a
//! one-hot `q`.
//!
//! `k` adapts ([`KController`]): it keeps an estimate of the per-token acceptance probability
//! `a` and the measured wall time of a step with `k` drafts (drafting + verification, which on
//! streamed models grows with `k` as more experts are read), and picks the `k` maximising
//! expected tokens per second, `(1 - a^(k+1)) / (1 - a) / cost(k)`; `k = 0` is a plain decode
//! step. When drafting does not pay it is switched off and re-probed with exponential backoff.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{InferenceError, Result};
use crate::generate::{GenerateConfig, GenerateOutput, StopReason};
use crate::model::{LogitsMode, Model, Session};
use crate::sampler::{Rng, Sampler, SamplerConfig};

/// Tokens proposed by a drafter.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Draft {
    pub tokens: Vec<u32>,
    /// The distribution each token was drawn from (`(token, probability)` lists), for the
    /// sampling acceptance rule. `None`: the tokens were chosen deterministically (one-hot).
    pub probs: Option<Vec<Vec<(u32, f32)>>>,
}

/// Proposes continuations.
pub trait Drafter: Send {
    /// Short name for reports.
    fn name(&self) -> &str;
    /// Up to `k` tokens to follow `context` (prompt + every generated token so far, including
    /// the last one, which the target has not processed yet). Fewer (or none) is fine.
    fn draft(&mut self, context: &[u32], k: usize) -> Result<Draft>;
}

/// Prompt lookup: find the latest earlier occurrence of the context's last `n` tokens
/// (`n = max_ngram ..= min_ngram`) and propose what followed it.
#[derive(Debug, Clone)]
pub struct NgramDrafter {
    pub max_ngram: usize,
    pub min_ngram: usize,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        NgramDrafter {
            max_ngram: 3,
            min_ngram: 1,
        }
    }
}

impl Drafter for NgramDrafter {
    fn name(&self) -> &str {
        "ngram"
    }
    fn draft(&mut self, context: &[u32], k: usize) -> Result<Draft> {
        let len = context.len();
        for n in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            if n >= len {
                continue;
            }
            let suffix = &context[len - n..];
            // Latest start s < len - n with context[s..s+n] == suffix.
            if let Some(s) = (0..len - n).rev().find(|&s| &context[s..s + n] == suffix) {
                let from = s + n;
                let to = (from + k).min(len);
                if to > from {
                    return Ok(Draft {
                        tokens: context[from..to].to_vec(),
                        probs: None,
                    });
                }
            }
        }
        Ok(Draft::default())
    }
}

/// For benchmarks: proposes a recorded continuation of a prompt (e.g. the target's own greedy
/// output), replacing each token by another one with probability `corruption`, so that the
/// per-token acceptance probability of greedy decoding is `1 - corruption`.
#[derive(Debug, Clone)]
pub struct ReplayDrafter {
    prompt_len: usize,
    recorded: Vec<u32>,
    corruption: f64,
    vocab: u32,
    rng: Rng,
}

impl ReplayDrafter {
    pub fn new(
        prompt_len: usize,
        recorded: Vec<u32>,
        corruption: f64,
        vocab: usize,
        seed: u64,
    ) -> Result<ReplayDrafter> {
        if !(0.0..=1.0).contains(&corruption) {
            return Err(InferenceError::InvalidArgument(format!(
                "replay corruption rate {corruption} must be in [0, 1]"
            )));
        }
        if vocab < 2 || vocab > u32::MAX as usize {
            return Err(InferenceError::InvalidArgument(format!(
                "vocabulary size {vocab} cannot be corrupted into"
            )));
        }
        Ok(ReplayDrafter {
            prompt_len,
            recorded,
            corruption,
            vocab: vocab as u32,
            rng: Rng::new(seed ^ 0x5245_504c_4159),
        })
    }
}

impl Drafter for ReplayDrafter {
    fn name(&self) -> &str {
        "replay"
    }
    fn draft(&mut self, context: &[u32], k: usize) -> Result<Draft> {
        let done = context.len().saturating_sub(self.prompt_len);
        let end = (done + k).min(self.recorded.len());
        let tokens = self
            .recorded
            .get(done..end)
            .unwrap_or(&[])
            .iter()
            .map(|&t| {
                if self.rng.next_f64() < self.corruption {
                    let off = 1 + self.rng.next_u32() % (self.vocab - 1);
                    ((t as u64 + off as u64) % self.vocab as u64) as u32
                } else {
                    t
                }
            })
            .collect();
        Ok(Draft {
            tokens,
            probs: None,
        })
    }
}

/// A small model of a supported architecture sharing the target's vocabulary, run with its own
/// session (kept in sync with the context by rolling back to the longest common prefix).
#[derive(Debug)]
pub struct ModelDrafter {
    model: Arc<Model>,
    session: Session,
    /// Tokens the draft session holds.
    history: Vec<u32>,
    sampler: Sampler,
    rng: Rng,
}

impl ModelDrafter {
    /// `target_vocab`: the target's vocabulary size; the draft model's must not be larger.
    /// `sampler`: how drafts are drawn, usually the target's settings (greedy drafts when
    /// greedy; any settings keep the output lossless, they only change the acceptance).
    pub fn new(model: Arc<Model>, target_vocab: usize, sampler: &SamplerConfig) -> Result<Self> {
        if model.vocab_size() > target_vocab {
            return Err(InferenceError::InvalidArgument(format!(
                "the draft model's vocabulary ({}) is larger than the target's ({target_vocab})",
                model.vocab_size()
            )));
        }
        let session = model.new_session();
        Ok(ModelDrafter {
            session,
            history: Vec::new(),
            sampler: Sampler::new(sampler.clone())?,
            rng: Rng::new(sampler.seed ^ 0x4452_4146_5400),
            model,
        })
    }

    fn pick(&mut self, logits: &[f32], greedy: bool) -> Result<(u32, Vec<(u32, f32)>)> {
        let dist = self.sampler.distribution(logits)?;
        if greedy || dist.len() == 1 {
            return Ok((dist[0].0, dist));
        }
        let u = self.rng.next_f64();
        let mut cum = 0f64;
        let mut tok = dist[dist.len() - 1].0;
        for &(id, p) in &dist {
            cum += p as f64;
            if u < cum {
                tok = id;
                break;
            }
        }
        Ok((tok, dist))
    }
}

impl Drafter for ModelDrafter {
    fn name(&self) -> &str {
        "model"
    }
    fn draft(&mut self, context: &[u32], k: usize) -> Result<Draft> {
        if k == 0 || context.is_empty() {
            return Ok(Draft::default());
        }
        let vocab = self.model.vocab_size();
        if context.iter().any(|&t| t as usize >= vocab) {
            // Tokens the draft model does not know: nothing to propose.
            return Ok(Draft::default());
        }
        let common = self
            .history
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count();
        let keep = common.min(context.len() - 1).min(self.session.len());
        self.session.truncate(keep)?;
        self.history.truncate(keep);
        let mut logits = self
            .model
            .forward_last(&mut self.session, &context[keep..])?;
        self.history.extend_from_slice(&context[keep..]);
        let greedy = self.sampler.config().is_greedy();
        let mut tokens = Vec::with_capacity(k);
        let mut probs = Vec::with_capacity(k);
        for i in 0..k {
            let (tok, dist) = self.pick(&logits, greedy)?;
            tokens.push(tok);
            probs.push(dist);
            if i + 1 < k {
                logits = self.model.forward_last(&mut self.session, &[tok])?;
                self.history.push(tok);
            }
        }
        Ok(Draft {
            tokens,
            probs: if greedy { None } else { Some(probs) },
        })
    }
}

/// Settings of [`speculative_generate`].
#[derive(Clone)]
pub struct SpecConfig {
    /// Largest number of drafted tokens per verification pass.
    pub max_k: usize,
    /// Adapt `k` to measured acceptance and cost; `false` always drafts `max_k`.
    pub adaptive: bool,
    /// Counts bytes read by the weight source (for `bytes_read_per_verify`).
    pub bytes_read: Option<Arc<dyn Fn() -> u64 + Send + Sync>>,
}

impl std::fmt::Debug for SpecConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpecConfig")
            .field("max_k", &self.max_k)
            .field("adaptive", &self.adaptive)
            .field("bytes_read", &self.bytes_read.is_some())
            .finish()
    }
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            max_k: 8,
            adaptive: true,
            bytes_read: None,
        }
    }
}

/// What speculative decoding did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecStats {
    /// Tokens proposed and verified.
    pub draft_tokens: u64,
    /// Drafted tokens the target accepted.
    pub accepted_tokens: u64,
    /// Batched verification passes (with at least one drafted token).
    pub verify_passes: u64,
    /// Single-token decode steps (drafting off or nothing proposed).
    pub plain_steps: u64,
    /// Bytes the source read during verification passes.
    pub verify_bytes: u64,
    pub verify_time: Duration,
    pub draft_time: Duration,
    /// `k_histogram[k]`: steps that asked the drafter for `k` tokens.
    pub k_histogram: Vec<u64>,
}

impl SpecStats {
    pub fn acceptance_rate(&self) -> f64 {
        if self.draft_tokens == 0 {
            0.0
        } else {
            self.accepted_tokens as f64 / self.draft_tokens as f64
        }
    }
    pub fn bytes_read_per_verify(&self) -> f64 {
        if self.verify_passes == 0 {
            0.0
        } else {
            self.verify_bytes as f64 / self.verify_passes as f64
        }
    }
}

/// Adaptive choice of `k` (see the module docs).
#[derive(Debug, Clone)]
pub struct KController {
    max_k: usize,
    adaptive: bool,
    /// Decayed counts of accepted drafts and of rejections (geometric model).
    acc: f64,
    rej: f64,
    /// Decayed mean seconds of a step with `k` drafts.
    cost: Vec<Option<f64>>,
    plain_since_probe: usize,
    probe_every: usize,
    /// Plain steps recorded so far.
    plain_steps: usize,
}

impl KController {
    const DECAY: f64 = 0.85;
    const COST_DECAY: f64 = 0.7;
    const PROBE_MIN: usize = 32;
    /// Drafting must beat plain decoding by this factor in the model before it is chosen:
    /// step-time estimates are noisy (cache hits, drive jitter) and a wrong switch to drafting
    /// costs a whole extra verify pass.
    const MARGIN: f64 = 1.05;
    const PROBE_MAX: usize = 256;
    /// Plain steps measured before the first draft: the first steps after a prefill run with
    /// an unusual cache (the prompt's experts), so one of them is a poor baseline.
    const WARMUP: usize = 4;

    pub fn new(max_k: usize, adaptive: bool) -> KController {
        KController {
            max_k,
            adaptive,
            // Prior: acceptance 0.5 with the weight of two observations.
            acc: 1.0,
            rej: 1.0,
            cost: vec![None; max_k + 1],
            plain_since_probe: 0,
            probe_every: Self::PROBE_MIN,
            plain_steps: 0,
        }
    }

    /// Estimated per-token acceptance probability.
    pub fn acceptance(&self) -> f64 {
        self.acc / (self.acc + self.rej)
    }

    fn cost_of(&self, k: usize) -> Option<f64> {
        if let Some(c) = self.cost[k] {
            return Some(c);
        }
        let c0 = self.cost[0]?;
        // Interpolate / extrapolate linearly from the nearest measured k's.
        let below = (1..k).rev().find_map(|j| self.cost[j].map(|c| (j, c)));
        let above = (k + 1..=self.max_k).find_map(|j| self.cost[j].map(|c| (j, c)));
        Some(match (below, above) {
            (_, Some((j, c))) if below.is_none() => c0 + (c - c0) * k as f64 / j as f64,
            (Some((i, ci)), Some((j, cj))) => ci + (cj - ci) * (k - i) as f64 / (j - i) as f64,
            (Some((i, ci)), None) => c0 + (ci - c0).max(0.0) * k as f64 / i as f64,
            // Nothing measured but plain steps: assume a draft token costs 25% of a step.
            _ => c0 * (1.0 + 0.25 * k as f64),
        })
    }

    /// Drafts to ask for, at most `limit`.
    pub fn choose(&mut self, limit: usize) -> usize {
        let cap = self.max_k.min(limit);
        if !self.adaptive || cap == 0 {
            return cap;
        }
        if self.plain_steps < Self::WARMUP {
            return 0; // measure plain steps first
        }
        let a = self.acceptance();
        let rate = |k: usize| {
            self.cost_of(k).map(|c| {
                let expected: f64 = (0..=k).map(|i| a.powi(i as i32)).sum();
                expected / c.max(1e-12)
            })
        };
        let plain = rate(0).unwrap_or(0.0);
        let mut best = (0usize, plain * Self::MARGIN);
        for k in 1..=cap {
            let Some(r) = rate(k) else { continue };
            if r > best.1 * 1.000_001 {
                best = (k, r);
            }
        }
        if best.0 == 0 {
            self.plain_since_probe += 1;
            if self.plain_since_probe >= self.probe_every {
                self.plain_since_probe = 0;
                self.probe_every = (self.probe_every * 2).min(Self::PROBE_MAX);
                return cap.min(1);
            }
        }
        best.0
    }

    /// Record a step that verified `drafted` tokens (0: a plain decode step), accepted
    /// `accepted` of them and took `secs` (drafting included).
    pub fn record(&mut self, drafted: usize, accepted: usize, secs: f64) {
        let slot = drafted.min(self.max_k);
        if drafted == 0 {
            self.plain_steps += 1;
        }
        self.cost[slot] = Some(match self.cost[slot] {
            Some(c) => c * Self::COST_DECAY + secs * (1.0 - Self::COST_DECAY),
            None => secs,
        });
        if drafted > 0 {
            self.acc = self.acc * Self::DECAY + accepted as f64;
            self.rej = self.rej * Self::DECAY + if accepted < drafted { 1.0 } else { 0.0 };
            if accepted * 2 >= drafted {
                self.probe_every = Self::PROBE_MIN;
            }
        }
    }
}

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

/// Like [`crate::generate()`], with a drafter. Greedy output is identical to `generate`;
/// with temperature > 0 the output distribution is the target's. On return the session holds
/// the prompt and the generated tokens that were fed (as with `generate`).
///
/// `held`: the tokens `session` already holds (e.g. a prefix restored from a snapshot); the
/// drafter sees `held + prompt + generated`.
#[allow(clippy::too_many_arguments)]
pub fn speculative_generate(
    model: &Model,
    session: &mut Session,
    held: &[u32],
    prompt: &[u32],
    config: &GenerateConfig,
    spec: &SpecConfig,
    drafter: &mut dyn Drafter,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<(GenerateOutput, SpecStats)> {
    let mut sampler = Sampler::new(config.sampler.clone())?;
    let greedy = config.sampler.is_greedy();
    let mut rng = Rng::new(config.sampler.seed ^ 0x5350_4543_5f41_4343);
    let mut stats = SpecStats {
        k_histogram: vec![0; spec.max_k + 1],
        ..SpecStats::default()
    };
    let mut ctl = KController::new(spec.max_k, spec.adaptive);
    let start = session.len();
    let chunk = if config.prefill_chunk == 0 {
        prompt.len().max(1)
    } else {
        config.prefill_chunk
    };
    let last_start = prompt.len().saturating_sub(1) / chunk * chunk;
    let prefill = (|| -> Result<Vec<f32>> {
        if prompt.is_empty() {
            // The whole prompt came from a snapshot: resume from its last position's output.
            return model
                .logits_from_recorded(session)
                .ok_or(InferenceError::EmptyInput);
        }
        for c in prompt[..last_start].chunks(chunk) {
            model.forward_with(session, c, LogitsMode::None, None)?;
        }
        if config.max_new_tokens == 0 {
            model.forward_with(session, &prompt[last_start..], LogitsMode::None, None)?;
            return Ok(Vec::new());
        }
        model.forward_last(session, &prompt[last_start..])
    })();
    let logits = match prefill {
        Ok(l) => l,
        Err(e) => {
            let _ = session.truncate(start);
            return Err(e);
        }
    };
    let mut tokens: Vec<u32> = Vec::new();
    if config.max_new_tokens == 0 {
        return Ok((
            GenerateOutput {
                tokens,
                stop: StopReason::MaxTokens,
            },
            stats,
        ));
    }
    let mut context = held.to_vec();
    context.extend_from_slice(prompt);
    let base = start + prompt.len(); // session positions before the generated tokens
    let mut tok = sampler.sample(&logits)?;
    // Emit one token; Some(reason) ends generation. The session is trimmed so that it holds
    // the prompt and the fed generated tokens, like `generate`.
    let finish = |session: &mut Session, keep: usize| {
        if session.len() > keep {
            let _ = session.truncate(keep);
        }
    };
    let mut pending: Vec<u32> = Vec::new(); // accepted drafts to emit before `tok`
    loop {
        for t in pending.drain(..).chain(std::iter::once(tok)) {
            if config.stop_tokens.contains(&t) {
                finish(session, base + tokens.len());
                return Ok((
                    GenerateOutput {
                        tokens,
                        stop: StopReason::StopToken(t),
                    },
                    stats,
                ));
            }
            tokens.push(t);
            context.push(t);
            let stop = if !on_token(t) {
                Some(StopReason::Callback)
            } else if tokens.len() >= config.max_new_tokens {
                Some(StopReason::MaxTokens)
            } else {
                None
            };
            if let Some(stop) = stop {
                finish(session, base + tokens.len() - 1);
                return Ok((GenerateOutput { tokens, stop }, stats));
            }
        }
        // `tok` (the context's last token) is pending: not yet in the session.
        let remaining = config.max_new_tokens - tokens.len();
        let k = ctl.choose(remaining.saturating_sub(1));
        let step = Instant::now();
        let mut draft = if k > 0 {
            let t = Instant::now();
            let d = drafter.draft(&context, k)?;
            stats.draft_time += t.elapsed();
            d
        } else {
            Draft::default()
        };
        stats.k_histogram[k.min(spec.max_k)] += 1;
        draft.tokens.truncate(k);
        let vocab = model.vocab_size();
        if draft.tokens.iter().any(|&t| t as usize >= vocab) {
            return Err(InferenceError::InvalidArgument(format!(
                "drafter `{}` proposed a token outside the vocabulary ({vocab})",
                drafter.name()
            )));
        }
        let kd = draft.tokens.len();
        if kd == 0 {
            let logits = model.forward_last(session, &[tok])?;
            tok = sampler.sample(&logits)?;
            stats.plain_steps += 1;
            ctl.record(0, 0, step.elapsed().as_secs_f64());
            continue;
        }
        let before = session.len();
        let bytes0 = spec.bytes_read.as_ref().map(|f| f());
        let vt = Instant::now();
        let mut batch = Vec::with_capacity(kd + 1);
        batch.push(tok);
        batch.extend_from_slice(&draft.tokens);
        let logits = model.forward(session, &batch)?;
        stats.verify_time += vt.elapsed();
        if let (Some(b0), Some(f)) = (bytes0, spec.bytes_read.as_ref()) {
            stats.verify_bytes += f().saturating_sub(b0);
        }
        stats.verify_passes += 1;
        stats.draft_tokens += kd as u64;
        let mut accepted = 0usize;
        let mut next = None;
        let row_of = |i: usize| {
            logits.row(i).ok_or_else(|| {
                InferenceError::InvalidArgument(format!(
                    "verify pass returned {} rows; row {i} wanted",
                    logits.rows
                ))
            })
        };
        for (i, &d) in draft.tokens.iter().enumerate() {
            let row = row_of(i)?;
            if greedy {
                let c = sampler.sample(row)?;
                if c == d {
                    accepted += 1;
                    continue;
                }
                next = Some(c);
                break;
            }
            let p = sampler.distribution(row)?;
            let q = draft
                .probs
                .as_ref()
                .and_then(|ps| ps.get(i))
                .map(|v| v.as_slice());
            match accept_or_resample(&p, q, d, &mut rng) {
                None => accepted += 1,
                Some(t) => {
                    next = Some(t);
                    break;
                }
            }
        }
        let next = match next {
            Some(t) => t,
            None => sampler.sample(row_of(kd)?)?,
        };
        session.truncate(before + 1 + accepted)?;
        stats.accepted_tokens += accepted as u64;
        ctl.record(kd, accepted, step.elapsed().as_secs_f64());
        pending.extend_from_slice(&draft.tokens[..accepted]);
        tok = next;
    }
}

#[cfg(test)]
mod tests {
    use super::KController;

    /// Runs the controller against a simulated target: per-token acceptance `a` (deterministic
    /// pseudo-random draws) and step cost `cost(k)`; returns (tokens per unit time relative to
    /// plain decoding, fraction of steps that drafted).
    fn simulate(a: f64, cost: impl Fn(usize) -> f64, steps: usize) -> (f64, f64) {
        let mut ctl = KController::new(8, true);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut uniform = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        let (mut tokens, mut time, mut drafting) = (0usize, 0f64, 0usize);
        for _ in 0..steps {
            let k = ctl.choose(8);
            let accepted = (0..k).take_while(|_| uniform() < a).count();
            let secs = cost(k);
            ctl.record(k, accepted, secs);
            tokens += accepted + 1;
            time += secs;
            drafting += usize::from(k > 0);
        }
        (
            tokens as f64 / time / (1.0 / cost(0)),
            drafting as f64 / steps as f64,
        )
    }

    #[test]
    fn drafting_switches_off_when_nothing_is_accepted() {
        // Streamed model, no shared experts: verifying k drafts costs k + 1 steps.
        let (speed, drafted) = simulate(0.0, |k| 1.0 + k as f64, 200);
        assert!(speed >= 0.95, "speed {speed} at 0% acceptance");
        assert!(drafted < 0.05, "drafted on {drafted} of steps");
    }

    #[test]
    fn drafting_stays_off_when_verification_costs_as_much_as_it_saves() {
        // 80% acceptance but every verified position reads its own experts.
        let (speed, _) = simulate(0.8, |k| 1.0 + k as f64, 200);
        assert!(speed >= 0.95, "speed {speed}");
    }

    #[test]
    fn drafting_pays_when_verification_is_cheap() {
        // Positions share most experts: a draft adds 15% to a step.
        let (speed, drafted) = simulate(0.8, |k| 1.0 + 0.15 * k as f64, 200);
        assert!(speed >= 1.5, "speed {speed} at 80% acceptance");
        assert!(drafted > 0.9, "drafted on only {drafted} of steps");
        let (speed, _) = simulate(1.0, |k| 1.0 + 0.15 * k as f64, 200);
        assert!(speed >= 2.5, "speed {speed} at 100% acceptance");
    }
}
