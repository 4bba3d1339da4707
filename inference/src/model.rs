//! The decoder: embeddings, a stack of [`DecoderLayer`]s (token mixer + feed-forward, each
//! pre-normed, joined by a [`ResidualMixer`]), the final norm and the LM head.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::{InferenceError, Result};
use crate::ffn::{FeedForward, FfnContext, Routing};
use crate::linear::Linear;
use crate::mixer::{MixerState, TokenMixer};
use crate::ops::RmsNorm;
use crate::weights::WeightSource;

/// How sub-block outputs join the residual stream(s). The default, [`AddResidual`], is the
/// usual `h = h + f(norm(h))`; models that mix several residual streams across blocks plug in
/// their own.
pub trait ResidualMixer: Send + Sync + std::fmt::Debug {
    /// Streams carried from the embeddings (`[n, hidden]` each).
    fn init(&self, embeddings: Vec<f32>) -> Vec<Vec<f32>>;
    /// Input of sub-block `sub` (0 = token mixer, 1 = feed-forward) of `layer`, before its norm.
    fn block_input<'s>(&self, layer: usize, sub: usize, streams: &'s [Vec<f32>]) -> Cow<'s, [f32]>;
    /// Fold the sub-block's output into the streams.
    fn block_output(&self, layer: usize, sub: usize, streams: &mut [Vec<f32>], out: &[f32]);
    /// The hidden state after the last layer (before the final norm). Also used for traces.
    fn output<'s>(&self, streams: &'s [Vec<f32>]) -> Cow<'s, [f32]>;
}

/// One residual stream, `h = h + f(norm(h))`.
#[derive(Debug, Clone, Copy, Default)]
pub struct AddResidual;

impl ResidualMixer for AddResidual {
    fn init(&self, embeddings: Vec<f32>) -> Vec<Vec<f32>> {
        vec![embeddings]
    }
    fn block_input<'s>(&self, _: usize, _: usize, streams: &'s [Vec<f32>]) -> Cow<'s, [f32]> {
        Cow::Borrowed(&streams[0])
    }
    fn block_output(&self, _: usize, _: usize, streams: &mut [Vec<f32>], out: &[f32]) {
        for (h, o) in streams[0].iter_mut().zip(out) {
            *h += o;
        }
    }
    fn output<'s>(&self, streams: &'s [Vec<f32>]) -> Cow<'s, [f32]> {
        Cow::Borrowed(&streams[0])
    }
}

/// One decoder layer: `mixer(input_layernorm(h))`, then `ffn(post_attention_layernorm(h))`.
#[derive(Debug)]
pub struct DecoderLayer {
    pub index: usize,
    pub input_layernorm: RmsNorm,
    pub mixer: Box<dyn TokenMixer>,
    pub post_attention_layernorm: RmsNorm,
    pub ffn: Box<dyn FeedForward>,
}

/// Which logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogitsMode {
    /// One row per input position.
    #[default]
    All,
    /// Only the last input position.
    Last,
    /// No logits (e.g. prefill whose logits are not needed).
    None,
}

/// Logits `[rows, vocab]`, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Logits {
    pub rows: usize,
    pub vocab: usize,
    pub data: Vec<f32>,
}

impl Logits {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
    pub fn last(&self) -> Option<&[f32]> {
        self.rows.checked_sub(1).map(|i| self.row(i))
    }
}

/// Optional per-forward diagnostics.
#[derive(Debug, Clone, Default)]
pub struct ForwardTrace {
    /// `[layers + 1]` of `[n, hidden]`: `[0]` = embeddings, `[i]` = residual after layer i-1.
    pub hidden_states: Vec<Vec<f32>>,
    /// `(layer, routing of each input position)` for every MoE layer.
    pub routing: Vec<(usize, Vec<Routing>)>,
}

/// One sequence's state: per-layer mixer states and the number of positions processed.
#[derive(Debug)]
pub struct Session {
    model_id: u64,
    states: Vec<Box<dyn MixerState>>,
    len: usize,
    /// The last layer's output (before the final norm) of each position from `start` on, when
    /// recording ([`Model::record_outputs`]): a snapshot that holds them lets a later prompt
    /// that is entirely a prefix of the snapshot start generating without a forward pass.
    outputs: Option<OutputStates>,
}

/// Per-position outputs of the last layer, `[len - start, hidden]`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OutputStates {
    pub(crate) start: usize,
    pub(crate) data: Vec<f32>,
}

impl Session {
    /// Positions processed so far (the next token's position).
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Roll back to the first `len` positions (speculative decoding); nothing is copied.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(InferenceError::Truncate {
                len: self.len,
                requested: len,
            });
        }
        for s in &mut self.states {
            s.truncate(len)?;
        }
        self.truncate_outputs(len);
        self.len = len;
        Ok(())
    }
    fn truncate_outputs(&mut self, len: usize) {
        if let Some(o) = &mut self.outputs {
            if len <= o.start {
                o.start = len;
                o.data.clear();
            } else if let Some(per) = o.data.len().checked_div(self.len - o.start) {
                o.data.truncate((len - o.start) * per);
            }
        }
    }
    /// Bytes held by the caches.
    pub fn memory_bytes(&self) -> usize {
        self.states.iter().map(|s| s.memory_bytes()).sum::<usize>()
            + self.outputs.as_ref().map_or(0, |o| o.data.len() * 4)
    }
    /// Whether the last layer's output of position `pos` is recorded.
    pub fn has_output(&self, pos: usize) -> bool {
        self.outputs
            .as_ref()
            .is_some_and(|o| pos >= o.start && pos < self.len)
    }
    /// Recorded outputs (snapshots).
    pub(crate) fn outputs(&self) -> Option<&OutputStates> {
        self.outputs.as_ref()
    }
    pub(crate) fn set_outputs(&mut self, outputs: Option<OutputStates>) {
        self.outputs = outputs;
    }
    /// Per-layer mixer states (snapshots).
    pub(crate) fn states(&self) -> &[Box<dyn MixerState>] {
        &self.states
    }
    /// Per-layer mixer states and the length to set once they are restored (snapshots).
    pub(crate) fn restore_parts(&mut self) -> (&mut [Box<dyn MixerState>], &mut usize) {
        (&mut self.states, &mut self.len)
    }
}

static NEXT_MODEL_ID: AtomicU64 = AtomicU64::new(1);

/// A loaded model. Resident weights are prepared at load; routed experts are requested from the
/// [`WeightSource`] during each forward pass.
#[derive(Debug)]
pub struct Model {
    id: u64,
    config: ModelConfig,
    source: Arc<dyn WeightSource>,
    /// `[vocab, hidden]`
    embed_tokens: Linear,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// `[vocab, hidden]`; `None` when tied to the embeddings.
    lm_head: Option<Linear>,
    residual: Box<dyn ResidualMixer>,
    /// Predict each next MoE layer's experts and ask the source to prefetch them.
    prefetch: AtomicBool,
    /// Identity of the weights for snapshots, taken while the resident tensors were available.
    weights_digest: [u8; 32],
}

impl std::fmt::Debug for dyn WeightSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WeightSource")
    }
}

/// The parts a model is assembled from (see `arch` builders).
#[derive(Debug)]
pub struct ModelParts {
    pub config: ModelConfig,
    pub embed_tokens: Linear,
    pub layers: Vec<DecoderLayer>,
    pub norm: RmsNorm,
    pub lm_head: Option<Linear>,
    pub residual: Box<dyn ResidualMixer>,
}

impl Model {
    /// Parse the source's config, then load and prepare every resident weight.
    pub fn load(source: Arc<dyn WeightSource>) -> Result<Model> {
        let config = ModelConfig::from_json(source.config())?;
        let parts = crate::arch::build(config, &*source)?;
        Ok(Model::from_parts(parts, source))
    }

    /// Like [`Model::load`], but takes the source by value so that, once the model holds its
    /// own copy of the resident weights, the source can drop its copy
    /// ([`WeightSource::release_resident`]): resident weights are held once, not twice. Returns
    /// the source too (shared with the model) for its statistics.
    pub fn load_owned<S: WeightSource + 'static>(mut source: S) -> Result<(Model, Arc<S>)> {
        let config = ModelConfig::from_json(source.config())?;
        let parts = crate::arch::build(config, &source)?;
        let digest = crate::snapshot::weights_digest(&source);
        source.release_resident();
        let source = Arc::new(source);
        let shared: Arc<dyn WeightSource> = source.clone();
        Ok((Model::assemble(parts, shared, digest), source))
    }

    /// Assemble a model from prepared parts (custom architectures).
    pub fn from_parts(parts: ModelParts, source: Arc<dyn WeightSource>) -> Model {
        let digest = crate::snapshot::weights_digest(&*source);
        Model::assemble(parts, source, digest)
    }

    fn assemble(
        parts: ModelParts,
        source: Arc<dyn WeightSource>,
        weights_digest: [u8; 32],
    ) -> Model {
        let prefetch = AtomicBool::new(source.wants_prefetch());
        Model {
            id: NEXT_MODEL_ID.fetch_add(1, Ordering::Relaxed),
            config: parts.config,
            source,
            embed_tokens: parts.embed_tokens,
            layers: parts.layers,
            norm: parts.norm,
            lm_head: parts.lm_head,
            residual: parts.residual,
            prefetch,
            weights_digest,
        }
    }

    /// Next-layer prefetch: while layer L runs, apply layer L+1's router to the hidden state
    /// after L's attention and pass the predicted experts to [`WeightSource::prefetch`]. On by
    /// default when the source [wants it](WeightSource::wants_prefetch). Results do not depend
    /// on it.
    pub fn set_next_layer_prefetch(&self, on: bool) {
        self.prefetch.store(on, Ordering::Relaxed);
    }

    pub fn next_layer_prefetch(&self) -> bool {
        self.prefetch.load(Ordering::Relaxed)
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    pub fn vocab_size(&self) -> usize {
        self.embed_tokens.rows()
    }
    pub fn hidden_size(&self) -> usize {
        self.embed_tokens.cols()
    }
    pub fn layers(&self) -> &[DecoderLayer] {
        &self.layers
    }
    pub fn source(&self) -> &Arc<dyn WeightSource> {
        &self.source
    }

    /// blake3 of the config and samples of the embeddings, LM head and final norm, taken at load
    /// ([`crate::snapshot::weights_digest`]); snapshots use it to recognise the model.
    pub fn weights_digest(&self) -> &[u8; 32] {
        &self.weights_digest
    }
    /// End-of-sequence ids from the config.
    pub fn eos_token_ids(&self) -> &[u32] {
        self.config.eos_token_ids()
    }

    /// A fresh, empty sequence.
    pub fn new_session(&self) -> Session {
        Session {
            model_id: self.id,
            states: self.layers.iter().map(|l| l.mixer.new_state()).collect(),
            len: 0,
            outputs: None,
        }
    }

    /// Record the last layer's output of every position `session` processes from now on
    /// (`hidden_size` f32 per position), so that a snapshot of it can resume a prompt that ends
    /// anywhere inside it without recomputing the prompt's last position.
    pub fn record_outputs(&self, session: &mut Session) {
        if session.outputs.is_none() {
            session.outputs = Some(OutputStates {
                start: session.len,
                data: Vec::new(),
            });
        }
    }

    /// Logits of the session's last position from its recorded output (final norm and LM
    /// head only); `None` if that output was not recorded.
    pub fn logits_from_recorded(&self, session: &Session) -> Option<Vec<f32>> {
        let last = session.len.checked_sub(1)?;
        if !session.has_output(last) || session.model_id != self.id {
            return None;
        }
        let o = session.outputs.as_ref()?;
        let hd = self.hidden_size();
        let row = o
            .data
            .get((last - o.start) * hd..(last - o.start + 1) * hd)?;
        let x = self.norm.apply(row);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        Some(head.forward(&x, 1))
    }

    /// Process `tokens` at positions `session.len()..` (a prompt chunk, a verification batch or
    /// a single decode step) and return logits for every position.
    pub fn forward(&self, session: &mut Session, tokens: &[u32]) -> Result<Logits> {
        self.forward_with(session, tokens, LogitsMode::All, None)
    }

    /// Like [`Model::forward`] but returns only the last position's logits `[vocab]`.
    pub fn forward_last(&self, session: &mut Session, tokens: &[u32]) -> Result<Vec<f32>> {
        let l = self.forward_with(session, tokens, LogitsMode::Last, None)?;
        Ok(l.data)
    }

    /// The general forward pass. On error the session is rolled back to its previous length.
    pub fn forward_with(
        &self,
        session: &mut Session,
        tokens: &[u32],
        mode: LogitsMode,
        trace: Option<&mut ForwardTrace>,
    ) -> Result<Logits> {
        if session.model_id != self.id || session.states.len() != self.layers.len() {
            return Err(InferenceError::StateMismatch(
                "the session was created by another model".into(),
            ));
        }
        let start = session.len;
        let result = self.forward_inner(session, tokens, mode, trace);
        match result {
            Ok(l) => {
                session.len = start + tokens.len();
                Ok(l)
            }
            Err(e) => {
                for s in &mut session.states {
                    if s.len() > start {
                        // Cannot fail: start <= len.
                        let _ = s.truncate(start);
                    }
                }
                if let Some(o) = &mut session.outputs {
                    let hd = self.hidden_size();
                    o.data.truncate(start.saturating_sub(o.start) * hd);
                }
                session.len = start;
                Err(e)
            }
        }
    }

    fn forward_inner(
        &self,
        session: &mut Session,
        tokens: &[u32],
        mode: LogitsMode,
        mut trace: Option<&mut ForwardTrace>,
    ) -> Result<Logits> {
        let n = tokens.len();
        if n == 0 {
            return Err(InferenceError::EmptyInput);
        }
        let vocab = self.vocab_size();
        let hd = self.hidden_size();
        for (index, &t) in tokens.iter().enumerate() {
            if t as usize >= vocab {
                return Err(InferenceError::TokenOutOfRange {
                    token: t,
                    index,
                    vocab_size: vocab,
                });
            }
        }
        // Embeddings [n, hidden]
        let mut emb = vec![0f32; n * hd];
        let ev = self.embed_tokens.view();
        for (t, row) in tokens.iter().zip(emb.chunks_mut(hd)) {
            ev.decode_row(*t as usize, row);
        }
        if let Some(tr) = trace.as_deref_mut() {
            tr.hidden_states.clear();
            tr.routing.clear();
            tr.hidden_states.push(emb.clone());
        }
        let mut streams = self.residual.init(emb);
        for (li, layer) in self.layers.iter().enumerate() {
            let state = &mut *session.states[li];
            let x = layer
                .input_layernorm
                .apply(&self.residual.block_input(li, 0, &streams));
            let y = layer.mixer.forward(&x, n, state)?;
            self.residual.block_output(li, 0, &mut streams, &y);

            if let Some(next) = self
                .layers
                .get(li + 1)
                .filter(|_| self.next_layer_prefetch())
            {
                let xn = next
                    .post_attention_layernorm
                    .apply(&self.residual.block_input(li + 1, 1, &streams));
                if let Some(experts) = next.ffn.predict_experts(&xn, n) {
                    self.source.prefetch(next.index, &experts);
                }
            }

            let x = layer
                .post_attention_layernorm
                .apply(&self.residual.block_input(li, 1, &streams));
            let mut routing = Vec::new();
            let mut ctx = FfnContext {
                source: &*self.source,
                layer: layer.index,
                routing: if trace.is_some() {
                    Some(&mut routing)
                } else {
                    None
                },
            };
            let y = layer.ffn.forward(&x, n, &mut ctx)?;
            self.residual.block_output(li, 1, &mut streams, &y);
            if let Some(tr) = trace.as_deref_mut() {
                tr.hidden_states
                    .push(self.residual.output(&streams).into_owned());
                if !routing.is_empty() {
                    tr.routing.push((layer.index, routing));
                }
            }
        }
        let h = self.residual.output(&streams);
        if let Some(o) = &mut session.outputs {
            o.data.extend_from_slice(&h);
        }
        let (rows, hs): (usize, &[f32]) = match mode {
            LogitsMode::All => (n, &h),
            LogitsMode::Last => (1, &h[(n - 1) * hd..]),
            LogitsMode::None => {
                return Ok(Logits {
                    rows: 0,
                    vocab,
                    data: Vec::new(),
                })
            }
        };
        let x = self.norm.apply(hs);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        Ok(Logits {
            rows,
            vocab,
            data: head.forward(&x, rows),
        })
    }
}
