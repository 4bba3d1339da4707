//! [`speculative_generate`]: generation with a drafter and batched verification, and its
//! settings and statistics.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{InferenceError, Result};
use crate::generate::{GenerateConfig, GenerateOutput, StopReason};
use crate::model::forward::Model;
use crate::model::logits::LogitsMode;
use crate::model::session::Session;
use crate::sampler::{Rng, Sampler};
use crate::speculative::accept::accept_or_resample;
use crate::speculative::controller::KController;
use crate::speculative::drafters::{Draft, Drafter};

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
    crate::generate::check_context(model, session.len(), prompt.len(), config.max_new_tokens)?;
    let mut sampler = Sampler::new(config.sampler.clone())?;
    let greedy = config.sampler.is_greedy();
    let mut rng = Rng::new(config.sampler.seed ^ 0x5350_4543_5f41_4343);
    let mut stats = SpecStats {
        k_histogram: vec![0; spec.max_k + 1],
        ..SpecStats::default()
    };
    // A verification batch (the pending token and k drafts) must fit the window in which
    // recurrent layers can roll back; larger k are drafted as that many.
    let max_k = match model.rollback_window() {
        Some(w) => spec.max_k.min(w.saturating_sub(1)),
        None => spec.max_k,
    };
    let mut ctl = KController::new(max_k, spec.adaptive);
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
    let finish = |session: &mut Session, keep: usize| -> Result<()> {
        if session.len() > keep {
            session.truncate(keep)?;
        }
        Ok(())
    };
    let mut pending: Vec<u32> = Vec::new(); // accepted drafts to emit before `tok`
    loop {
        for t in pending.drain(..).chain(std::iter::once(tok)) {
            if config.stop_tokens.contains(&t) {
                finish(session, base + tokens.len())?;
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
                finish(session, base + tokens.len() - 1)?;
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
