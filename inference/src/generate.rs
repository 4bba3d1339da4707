//! The generation loop: prefill the prompt, then sample one token per step with the cache,
//! streaming each token to a callback, until a stop token, the token budget or the callback ends
//! it.

use crate::error::{InferenceError, Result};
use crate::model::{LogitsMode, Model, Session};
use crate::sampler::{Sampler, SamplerConfig};

/// Default [`GenerateConfig::prefill_chunk`].
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// Settings of one [`generate`] call.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateConfig {
    /// Upper bound on generated tokens (stop tokens not counted).
    pub max_new_tokens: usize,
    pub sampler: SamplerConfig,
    /// Tokens that end generation. [`GenerateConfig::for_model`] fills in the config's EOS ids.
    pub stop_tokens: Vec<u32>,
    /// Prefill the prompt in chunks of this many positions (0 = the whole prompt at once).
    /// Each chunk is one forward pass, so each routed expert is read at most once per layer
    /// per chunk; smaller chunks need less activation memory.
    pub prefill_chunk: usize,
}

impl GenerateConfig {
    /// `max_new_tokens` with the model's EOS ids as stop tokens and greedy sampling.
    pub fn for_model(model: &Model, max_new_tokens: usize) -> GenerateConfig {
        GenerateConfig {
            max_new_tokens,
            sampler: SamplerConfig::greedy(),
            stop_tokens: model.eos_token_ids().to_vec(),
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
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
/// The positions a generation can fill (`held` already in the session, the prompt, the new
/// tokens) must fit the model's context (`max_position_embeddings`); refused up front, not
/// after a long prefill.
pub fn check_context(model: &Model, held: usize, prompt: usize, new_tokens: usize) -> Result<()> {
    let max = model.config().max_position_embeddings();
    let need = held.saturating_add(prompt).saturating_add(new_tokens);
    if need > max {
        return Err(InferenceError::InvalidArgument(format!(
            "{held} positions held + a {prompt}-token prompt + {new_tokens} new tokens = {need} \
             positions, over the model's context of {max} (max_position_embeddings)"
        )));
    }
    Ok(())
}

pub fn generate(
    model: &Model,
    session: &mut Session,
    prompt: &[u32],
    config: &GenerateConfig,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<GenerateOutput> {
    check_context(model, session.len(), prompt.len(), config.max_new_tokens)?;
    let mut sampler = Sampler::new(config.sampler.clone())?;
    let mut tokens = Vec::new();
    let chunk = if config.prefill_chunk == 0 {
        prompt.len().max(1)
    } else {
        config.prefill_chunk
    };
    let start = session.len();
    let prefill = |session: &mut Session, upto: usize| -> Result<()> {
        for c in prompt[..upto].chunks(chunk) {
            if let Err(e) = model.forward_with(session, c, LogitsMode::None, None) {
                // Roll back the chunks already fed (cannot fail: start <= len).
                let _ = session.truncate(start);
                return Err(e);
            }
        }
        Ok(())
    };
    if config.max_new_tokens == 0 {
        prefill(session, prompt.len())?;
        return Ok(GenerateOutput {
            tokens,
            stop: StopReason::MaxTokens,
        });
    }
    let mut logits = if prompt.is_empty() {
        // The whole prompt came from a snapshot: resume from its last position's output.
        model
            .logits_from_recorded(session)
            .ok_or(InferenceError::EmptyInput)?
    } else {
        // All chunks but the last without logits; the last gives the first token's logits.
        let last_start = (prompt.len() - 1) / chunk * chunk;
        prefill(session, last_start)?;
        match model.forward_last(session, &prompt[last_start..]) {
            Ok(l) => l,
            Err(e) => {
                let _ = session.truncate(start);
                return Err(e);
            }
        }
    };
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
