//! What `deltafin chat` and `deltafin serve` share: a conversation rendered with the model's
//! chat template, tokenized with its tokenizer, and generated on a session that reuses the
//! longest prefix a recent conversation already holds ([`cache`]), with stop strings,
//! end-of-turn tokens, cancellation and reasoning split off.

pub(crate) mod cache;
pub(crate) mod stops;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use deltafin_chat::detok::Detok;
use deltafin_chat::reasoning::{Delta, ReasoningStream, ThinkTags};
use deltafin_chat::template::TemplateTokens;
use deltafin_chat::{ChatTemplate, ChatTokenizer};
use deltafin_inference::{generate, GenerateConfig, SamplerConfig};

use crate::conversation::cache::{Reuse, SessionCache};
use crate::conversation::stops::StopStrings;
use crate::generate::loaded::Loaded;

/// How to generate one reply.
#[derive(Debug, Clone)]
pub(crate) struct Params {
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    /// Keep generating past end-of-turn and EOS tokens (vLLM's `ignore_eos`).
    pub ignore_eos: bool,
    /// Leave special tokens out of the text, except those that make up the thinking tags
    /// (vLLM's `skip_special_tokens`, default true).
    pub skip_special_tokens: bool,
    /// Reuse (and keep) conversation states (llama-server's `cache_prompt`, default true);
    /// false prefills the whole prompt on a fresh session and keeps nothing.
    pub cache_prompt: bool,
}

/// One finished reply.
#[derive(Debug, Clone)]
pub(crate) struct Reply {
    /// The reply's text (reasoning included, special tokens kept).
    pub text: String,
    pub reasoning: Option<String>,
    pub content: String,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens a kept conversation state already held (not prefilled again).
    pub reused_tokens: usize,
    pub reuse: Reuse,
    /// `stop` (end of turn or a stop string), `length`, or `cancelled`.
    pub finish_reason: &'static str,
    pub ttft: Option<Duration>,
    pub total: Duration,
}

/// The model, its tokenizer and template, and the kept conversation states.
pub(crate) struct Engine<'l> {
    pub loaded: &'l Loaded,
    pub tokenizer: &'l ChatTokenizer,
    pub template: ChatTemplate,
    pub tokens: TemplateTokens,
    /// End-of-turn ids: the config's EOS and the template's end tokens.
    pub stop_ids: Vec<u32>,
    pub cache: SessionCache,
    pub prefill_chunk: usize,
}

/// Tokens chat templates end a turn with, besides the config's EOS.
const END_OF_TURN: &[&str] = &[
    "<|im_end|>",
    "<|end_of_msg|>",
    "<|endoftext|>",
    "<｜end▁of▁sentence｜>",
    "[EOS]",
    "</s>",
];

impl<'l> Engine<'l> {
    /// `template_dir`: where the chat template is (the model directory, or a layout's source
    /// checkpoint); `cache_bytes` of kept states in memory, and snapshots in `snapshot_dir`.
    pub(crate) fn new(
        loaded: &'l Loaded,
        template_dir: &Path,
        template_file: Option<&Path>,
        cache_bytes: usize,
        snapshot_dir: Option<&Path>,
        prefill_chunk: usize,
    ) -> anyhow::Result<Engine<'l>> {
        let Some((_, tokenizer)) = &loaded.tokenizer else {
            bail!("a chat needs the model's tokenizer (tokenizer.json or tiktoken.model); give --tokenizer FILE")
        };
        let (template, tokens) = match template_file {
            Some(f) => {
                let src = std::fs::read_to_string(f)
                    .with_context(|| format!("reading {}", f.display()))?;
                let t = ChatTemplate::new(&src).with_context(|| f.display().to_string())?;
                (t, TemplateTokens::from_model_dir(template_dir))
            }
            None => ChatTemplate::from_model_dir(template_dir)?,
        };
        let model = loaded.model();
        let mut stop_ids: Vec<u32> = model.eos_token_ids().to_vec();
        for t in END_OF_TURN
            .iter()
            .copied()
            .chain(tokens.eos_token.as_deref())
        {
            if let Some(id) = tokenizer.token_id(t) {
                if !stop_ids.contains(&id) {
                    stop_ids.push(id);
                }
            }
        }
        Ok(Engine {
            loaded,
            tokenizer,
            template,
            tokens,
            stop_ids,
            cache: SessionCache::new(model, cache_bytes, snapshot_dir),
            prefill_chunk,
        })
    }

    /// The prompt a conversation becomes: `inputs` is the template's input object (`messages`,
    /// `tools`, ...); `add_generation_prompt` defaults to true and the special-token variables
    /// to tokenizer_config's.
    pub(crate) fn render(&self, inputs: &minijinja::Value) -> anyhow::Result<String> {
        let mut pairs: Vec<(String, minijinja::Value)> = Vec::new();
        for k in inputs
            .try_iter()
            .context("the template inputs must be an object")?
        {
            if let Some(key) = k.as_str() {
                pairs.push((key.to_string(), inputs.get_item(&k).unwrap_or_default()));
            }
        }
        let has = |k: &str, pairs: &[(String, minijinja::Value)]| pairs.iter().any(|(n, _)| n == k);
        if !has("add_generation_prompt", &pairs) {
            pairs.push(("add_generation_prompt".into(), true.into()));
        }
        for (k, v) in [
            ("bos_token", &self.tokens.bos_token),
            ("eos_token", &self.tokens.eos_token),
        ] {
            if let (false, Some(v)) = (has(k, &pairs), v) {
                pairs.push((k.into(), v.as_str().into()));
            }
        }
        Ok(self.template.render(&minijinja::Value::from_iter(pairs))?)
    }

    /// Token ids of a rendered prompt (special tokens written in it count as such).
    pub(crate) fn encode(&self, prompt: &str) -> anyhow::Result<Vec<u32>> {
        Ok(self.tokenizer.encode(prompt, true)?)
    }

    /// Generate a reply to `prompt_ids`. `on_delta` gets the reply as it becomes final (split
    /// into reasoning and content when the prompt opened a thinking section); returning false
    /// stops generation (a client gone, Ctrl-C).
    pub(crate) fn complete(
        &mut self,
        prompt_text: &str,
        prompt_ids: &[u32],
        params: &Params,
        on_delta: &mut dyn FnMut(&Delta) -> bool,
    ) -> anyhow::Result<Reply> {
        let start = Instant::now();
        let model = self.loaded.model();
        deltafin_inference::generate::check_context(model, 0, prompt_ids.len(), params.max_tokens)?;
        let (mut session, reused, reuse) = if params.cache_prompt {
            self.cache.take(model, prompt_ids)
        } else {
            (model.new_session(), 0, Reuse::None)
        };
        let mut config = GenerateConfig::for_model(model, params.max_tokens);
        config.sampler = params.sampler.clone();
        config.stop_tokens = if params.ignore_eos {
            Vec::new()
        } else {
            self.stop_ids.clone()
        };
        config.prefill_chunk = self.prefill_chunk;
        // A prompt that ends by opening the thinking section makes the reply start inside it.
        let tags = self
            .template
            .think_tags()
            .cloned()
            .or_else(|| ThinkTags::detect(prompt_text));
        let inside = tags
            .as_ref()
            .is_some_and(|t| prompt_text.trim_end().ends_with(t.open.trim_end()));
        let mut split = tags.clone().map(|t| ReasoningStream::new(t, inside));
        let tokenizer = self.tokenizer;
        let mut detok = Detok::new(tokenizer, false);
        let mut stops = StopStrings::new(&params.stop);
        let mut ttft = None;
        let mut stopped_by_string = false;
        let mut cancelled = false;
        let mut failure: Option<anyhow::Error> = None;
        let mut text = String::new();
        let mut emit = |piece: &str, split: &mut Option<ReasoningStream>| -> bool {
            let deltas = match split {
                Some(s) => s.push(piece),
                None => vec![Delta::Content(piece.to_string())],
            };
            deltas.iter().all(&mut *on_delta)
        };
        let out = generate(
            model,
            &mut session,
            &prompt_ids[reused..],
            &config,
            &mut |id| {
                ttft.get_or_insert_with(|| start.elapsed());
                if params.skip_special_tokens {
                    if let Some(special) = tokenizer.special_text(id) {
                        let in_tags = tags.as_ref().is_some_and(|t| {
                            t.open.contains(&special)
                                || t.close.contains(&special)
                                || t.answer.as_ref().is_some_and(|(o, c)| {
                                    o.contains(&special) || c.contains(&special)
                                })
                        });
                        if !in_tags {
                            return true;
                        }
                    }
                }
                let piece = match detok.push(id) {
                    Ok(p) => p,
                    Err(e) => {
                        failure = Some(e.into());
                        return false;
                    }
                };
                let (ready, hit) = stops.push(&piece);
                text.push_str(&ready);
                if !ready.is_empty() && !emit(&ready, &mut split) {
                    cancelled = true;
                    return false;
                }
                if hit {
                    stopped_by_string = true;
                    return false;
                }
                true
            },
        );
        if let Some(e) = failure {
            return Err(e);
        }
        let out = out?;
        if !stopped_by_string && !cancelled {
            let tail = detok.finish().unwrap_or_default();
            let (ready, _) = stops.push(&tail);
            let ready = ready + &stops.finish();
            text.push_str(&ready);
            if !ready.is_empty() {
                emit(&ready, &mut split);
            }
        }
        if let Some(s) = split.as_mut() {
            for d in s.finish() {
                on_delta(&d);
            }
        }
        // Keep the state for the next turn: the prompt and the tokens fed after it.
        let mut history = prompt_ids.to_vec();
        history.extend_from_slice(&out.tokens);
        history.truncate(session.len());
        if params.cache_prompt {
            self.cache.put(model, history, session);
        }
        let (reasoning, content) = match &tags {
            Some(t) => {
                let s = deltafin_chat::reasoning::split(&text, t, inside);
                (s.reasoning, s.content)
            }
            None => (None, text.clone()),
        };
        let finish_reason = if cancelled {
            "cancelled"
        } else if stopped_by_string
            || matches!(out.stop, deltafin_inference::StopReason::StopToken(_))
        {
            "stop"
        } else {
            "length"
        };
        Ok(Reply {
            text,
            reasoning,
            content,
            prompt_tokens: prompt_ids.len(),
            completion_tokens: out.tokens.len(),
            reused_tokens: reused,
            reuse,
            finish_reason,
            ttft,
            total: start.elapsed(),
        })
    }
}
