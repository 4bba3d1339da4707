//! The generation loop: prefill the prompt, then sample one token per step with the cache,
//! streaming each token to a callback, until a stop token, the token budget or the callback ends
//! it.

use crate::error::Result;
use crate::model::{LogitsMode, Model, Session};
use crate::sampler::{Sampler, SamplerConfig};

/// Settings of one [`generate`] call.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateConfig {
    /// Upper bound on generated tokens (stop tokens not counted).
    pub max_new_tokens: usize,
    pub sampler: SamplerConfig,
    /// Tokens that end generation. [`GenerateConfig::for_model`] fills in the config's EOS ids.
    pub stop_tokens: Vec<u32>,
}

impl GenerateConfig {
    /// `max_new_tokens` with the model's EOS ids as stop tokens and greedy sampling.
    pub fn for_model(model: &Model, max_new_tokens: usize) -> GenerateConfig {
        GenerateConfig {
            max_new_tokens,
            sampler: SamplerConfig::greedy(),
            stop_tokens: model.eos_token_ids().to_vec(),
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// `max_new_tokens` tokens were generated.
    MaxTokens,
    /// This stop token was sampled (it is not in `tokens` and was not fed to the model).
    StopToken(u32),
    /// The callback returned `false`.
    Callback,
}

/// Result of [`generate`].
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOutput {
    /// Generated tokens, in order (without the stop token).
    pub tokens: Vec<u32>,
    pub stop: StopReason,
}

/// Feed `prompt` to `session`, then generate. `on_token(token)` is called for every generated
/// token as soon as it is sampled and may return `false` to stop.
///
/// On return the session holds the prompt and every generated token except the last one
/// (that token's logits were never needed); feed it first if the conversation continues.
pub fn generate(
    model: &Model,
    session: &mut Session,
    prompt: &[u32],
    config: &GenerateConfig,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<GenerateOutput> {
    let mut sampler = Sampler::new(config.sampler.clone())?;
    let mut tokens = Vec::new();
    if config.max_new_tokens == 0 {
        if !prompt.is_empty() {
            model.forward_with(session, prompt, LogitsMode::None, None)?;
        }
        return Ok(GenerateOutput {
            tokens,
            stop: StopReason::MaxTokens,
        });
    }
    let mut logits = model.forward_last(session, prompt)?;
    loop {
        let tok = sampler.sample(&logits)?;
        if config.stop_tokens.contains(&tok) {
            return Ok(GenerateOutput {
                tokens,
                stop: StopReason::StopToken(tok),
            });
        }
        tokens.push(tok);
        if !on_token(tok) {
            return Ok(GenerateOutput {
                tokens,
                stop: StopReason::Callback,
            });
        }
        if tokens.len() >= config.max_new_tokens {
            return Ok(GenerateOutput {
                tokens,
                stop: StopReason::MaxTokens,
            });
        }
        logits = model.forward_last(session, &[tok])?;
    }
}
