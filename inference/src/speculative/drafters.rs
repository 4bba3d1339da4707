//! Drafters: what proposes the tokens a verification pass checks ([`NgramDrafter`] prompt
//! lookup, [`ReplayDrafter`] for benchmarks, [`ModelDrafter`] a small model).

use std::sync::Arc;

use crate::error::{InferenceError, Result};
use crate::model::forward::Model;
use crate::model::session::Session;
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
