//! [`Model`]: a loaded model and its forward pass.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crate::arch::{build, LayerFactory};
use crate::config::ModelConfig;
use crate::digest::weights_digest;
use crate::error::{InferenceError, Result};
use crate::ffn::feed_forward::FfnContext;
use crate::kernels::isa::KernelConfig;
use crate::linear::owned::Linear;
use crate::model::boundary::{
    next_token_guess_through_recurrent, next_token_prefetch_enabled, settle_token_guess,
    NextTokenGuesser, TokenAgreement,
};
use crate::model::decoder::{DecoderLayer, LayerSlot, ModelParts};
use crate::model::guess_cost::{CostFigures, GuessCost};
use crate::model::logits::{ForwardTrace, Logits, LogitsMode};
use crate::model::lookahead::{lookahead_enabled, predict_from_partial, LOOKAHEAD_MAX_POSITIONS};
use crate::model::residual::ResidualMixer;
use crate::model::routing_counts::RoutingCounts;
use crate::model::session::{OutputStates, Session};
use crate::ops::RmsNorm;
use crate::spans::{span, timed, Phase};
use crate::warm::{warm_budget, warm_while_waiting, CacheWarmer, WARM_STEP_BYTES};
use crate::weights::WeightSource;

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
    layers: Vec<LayerSlot>,
    /// Rebuilds streamed layers over the weights read for each forward (`None` for a model
    /// assembled from custom parts, which has no streamed layers).
    factory: Option<LayerFactory>,
    norm: RmsNorm,
    /// `[vocab, hidden]`; `None` when tied to the embeddings.
    lm_head: Option<Linear>,
    residual: Box<dyn ResidualMixer>,
    /// Predict each next MoE layer's experts and ask the source to prefetch them.
    prefetch: AtomicBool,
    /// Identity of the weights for snapshots, taken while the resident tensors were available.
    weights_digest: [u8; 32],
    /// Expert choices counted while recording ([`Model::record_routing`]).
    routing: std::sync::Mutex<Option<RoutingCounts>>,
    /// How often next-token guesses held ([`crate::model::boundary`]).
    token_agreement: TokenAgreement,
    guess_cost: GuessCost,
}

/// A streamed layer built over its weights for one forward. The layer is declared first so it
/// is dropped first, and the weights' buffers can go back to the source for reuse.
struct HeldLayer<'a> {
    layer: DecoderLayer,
    _weights: Box<dyn WeightSource + 'a>,
}

impl std::fmt::Debug for dyn WeightSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WeightSource")
    }
}

impl Model {
    /// Parse the source's config, then load and prepare every resident weight.
    pub fn load(source: Arc<dyn WeightSource>) -> Result<Model> {
        Model::load_with(source, KernelConfig::default())
    }

    /// [`Model::load`] with every matrix on `kernels`.
    pub fn load_with(source: Arc<dyn WeightSource>, kernels: KernelConfig) -> Result<Model> {
        let config = ModelConfig::from_json(source.config())?;
        let (parts, factory) = build(config, &*source, kernels)?;
        let digest = weights_digest(&*source);
        let mut model = Model::assemble(parts, source, digest);
        model.factory = Some(factory);
        Ok(model)
    }

    /// Like [`Model::load`], but takes the source by value so that, once the model holds its
    /// own copy of the resident weights, the source can drop its copy
    /// ([`WeightSource::release_resident`]): resident weights are held once, not twice. Returns
    /// the source too (shared with the model) for its statistics.
    pub fn load_owned<S: WeightSource + 'static>(source: S) -> Result<(Model, Arc<S>)> {
        Model::load_owned_with(source, KernelConfig::default())
    }

    /// [`Model::load_owned`] with every matrix on `kernels`.
    pub fn load_owned_with<S: WeightSource + 'static>(
        mut source: S,
        kernels: KernelConfig,
    ) -> Result<(Model, Arc<S>)> {
        let config = ModelConfig::from_json(source.config())?;
        let (parts, factory) = build(config, &source, kernels)?;
        let digest = weights_digest(&source);
        source.release_resident();
        let source = Arc::new(source);
        let shared: Arc<dyn WeightSource> = source.clone();
        let mut model = Model::assemble(parts, shared, digest);
        model.factory = Some(factory);
        Ok((model, source))
    }

    /// Assemble a model from prepared parts (custom architectures).
    pub fn from_parts(parts: ModelParts, source: Arc<dyn WeightSource>) -> Model {
        let digest = weights_digest(&*source);
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
            factory: None,
            norm: parts.norm,
            lm_head: parts.lm_head,
            residual: parts.residual,
            prefetch,
            weights_digest,
            routing: std::sync::Mutex::new(None),
            token_agreement: TokenAgreement::default(),
            guess_cost: GuessCost::default(),
        }
    }

    /// Next-token guesses ([`crate::model::boundary`]): how often they matched the token that
    /// followed (moving average) and how many were compared; their cost against a layer's time.
    pub fn token_guess_figures(&self) -> ((f64, u64), CostFigures) {
        (self.token_agreement.figures(), self.guess_cost.figures())
    }

    pub(crate) fn guesser(&self) -> NextTokenGuesser<'_> {
        NextTokenGuesser {
            layers: &self.layers,
            embed_tokens: &self.embed_tokens,
            norm: &self.norm,
            head: self.lm_head.as_ref().unwrap_or(&self.embed_tokens),
            residual: &*self.residual,
            source: &*self.source,
            agreement: &self.token_agreement,
            cost: &self.guess_cost,
            through_recurrent: next_token_guess_through_recurrent(),
        }
    }

    /// Start (or stop) counting which routed experts every MoE layer chooses, position by
    /// position, from now on; [`Model::routing_counts`] returns the counts.
    pub fn record_routing(&self, on: bool) {
        let mut r = self.routing.lock().unwrap_or_else(|p| p.into_inner());
        *r = on.then(|| RoutingCounts {
            model_type: self.config.model_type().to_string(),
            ..Default::default()
        });
    }

    /// The counts since [`Model::record_routing`] turned recording on.
    pub fn routing_counts(&self) -> Option<RoutingCounts> {
        self.routing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn recording_routing(&self) -> bool {
        self.routing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
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
    /// The output projection (`None` when tied to the embeddings).
    pub fn lm_head(&self) -> Option<&Linear> {
        self.lm_head.as_ref()
    }

    /// The decoder layers as held: built, or streamed (see [`LayerSlot`]).
    pub fn layers(&self) -> &[LayerSlot] {
        &self.layers
    }

    /// Streamed layer `li` built over its weights: waiting for them (`wait`), or `None` unless
    /// they have been read already.
    fn hold_layer(&self, li: usize, wait: bool) -> Result<Option<HeldLayer<'_>>> {
        let Some(weights) = self.source.layer_weights(li, wait)? else {
            if wait {
                return Err(InferenceError::InvalidArgument(format!(
                    "decoder layer {li} is streamed but its source has no weights for it"
                )));
            }
            return Ok(None);
        };
        let factory = self.factory.as_ref().ok_or_else(|| {
            InferenceError::InvalidArgument(format!(
                "decoder layer {li} is streamed but the model cannot rebuild it"
            ))
        })?;
        let layer = factory.build(&*weights, li)?;
        Ok(Some(HeldLayer {
            layer,
            _weights: weights,
        }))
    }
    pub fn source(&self) -> &Arc<dyn WeightSource> {
        &self.source
    }

    /// blake3 of the config and samples of the embeddings, LM head and final norm, taken at load
    /// ([`crate::digest::weights_digest`]); snapshots use it to recognise the model.
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
            states: self.layers.iter().map(LayerSlot::new_state).collect(),
            len: 0,
            outputs: None,
            token_guess: None,
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
        let began = std::time::Instant::now();
        let result = self.forward_inner(session, tokens, mode, trace);
        match result {
            Ok(l) => {
                session.len = start + tokens.len();
                // A decode step that could have guessed: the yardstick of the guess's cost.
                if tokens.len() == 1
                    && mode != LogitsMode::None
                    && self.source.wants_prefetch()
                    && next_token_prefetch_enabled()
                {
                    self.guess_cost
                        .record_token(began.elapsed(), self.guesser().routed_layers());
                }
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
        let _forward_span = span(Phase::Forward);
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
        let embed_span = span(Phase::Embed);
        let mut emb = vec![0f32; n * hd];
        let ev = self.embed_tokens.view();
        for (t, row) in tokens.iter().zip(emb.chunks_mut(hd)) {
            ev.decode_row(*t as usize, row);
        }
        drop(embed_span);
        // The layer a guess of this token predicted, if the guess held: no early prediction.
        let guessed_layer = settle_token_guess(
            &self.token_agreement,
            session.token_guess.take(),
            session.len,
            tokens,
        );
        let mut token_guess = None;
        if let Some(tr) = trace.as_deref_mut() {
            *tr = ForwardTrace::default();
            tr.hidden_states.push(emb.clone());
        }
        let mut streams = self.residual.init(emb);
        let recording = self.recording_routing();
        // A streamed next layer taken early (its weights had landed) for the prediction.
        let mut next_held: Option<HeldLayer<'_>> = None;
        for (li, slot) in self.layers.iter().enumerate() {
            let held;
            let layer = match slot {
                LayerSlot::Resident(l) => l,
                LayerSlot::Streamed(_) => {
                    held = match next_held.take() {
                        Some(h) => h,
                        // Waiting: `hold_layer` gives the layer or an error, never `None`.
                        None => self.hold_layer(li, true)?.ok_or_else(|| {
                            InferenceError::InvalidArgument(format!(
                                "decoder layer {li}'s streamed weights are missing"
                            ))
                        })?,
                    };
                    &held.layer
                }
            };
            let state = &mut *session.states[li];
            let res_span = span(Phase::Residual);
            let input = self.residual.block_input(li, 0, &streams);
            drop(res_span);
            if let Some(tr) = trace.as_deref_mut() {
                tr.attn_inputs.push(input.to_vec());
            }
            let x = timed(Phase::Norm, || layer.input_layernorm.apply(&input));
            drop(input);
            let y = timed(Phase::Mixer, || layer.mixer.forward(&x, n, state))?;
            timed(Phase::Residual, || {
                self.residual.block_output(li, 0, &mut streams, &y)
            });

            let next = match self.layers.get(li + 1) {
                _ if !self.next_layer_prefetch() => None,
                Some(LayerSlot::Resident(l)) => Some(l),
                // Predict with a streamed layer only if its weights are already here: waiting
                // for them would hold up this layer's experts.
                Some(LayerSlot::Streamed(_)) => {
                    if next_held.is_none() {
                        next_held = self.hold_layer(li + 1, false)?;
                    }
                    next_held.as_ref().map(|h| &h.layer)
                }
                None => None,
            };
            if let Some(next) = next.filter(|l| Some(l.index) != guessed_layer) {
                let _predict_span = span(Phase::Predict);
                let xn = next
                    .post_attention_layernorm
                    .apply(&self.residual.block_input(li + 1, 1, &streams));
                if let Some(experts) = next.ffn.predict_experts(&xn, n) {
                    self.source.prefetch(next.index, &experts);
                }
            }

            let res_span = span(Phase::Residual);
            let input = self.residual.block_input(li, 1, &streams);
            drop(res_span);
            if let Some(tr) = trace.as_deref_mut() {
                tr.mlp_inputs.push(input.to_vec());
            }
            let x = timed(Phase::Norm, || layer.post_attention_layernorm.apply(&input));
            drop(input);
            let mut routing = Vec::new();
            // While this layer waits for its experts, the next layer's attention weights are
            // loaded into the caches: that attention runs after the last expert lands, with
            // the drive idle unless a guess keeps it busy.
            // Its router's too, and the router after it (that layer's prediction runs first).
            let resident = |i: usize| match self.layers.get(i) {
                Some(LayerSlot::Resident(l)) => Some(l),
                Some(LayerSlot::Streamed(_)) if i == li + 1 => next_held.as_ref().map(|h| &h.layer),
                _ => None,
            };
            let mut warm: Vec<&Linear> = Vec::new();
            if self.source.wants_prefetch() && warm_while_waiting() {
                if let Some(next) = resident(li + 1) {
                    warm.extend(next.mixer.matrices());
                    warm.extend(next.ffn.router_gate());
                }
                warm.extend(resident(li + 2).and_then(|l| l.ffn.router_gate()));
            }
            let mut warmer = CacheWarmer::capped(
                warm.into_iter().flat_map(Linear::weight_slices),
                warm_budget(),
            );
            let mut warm_step = || warmer.step(WARM_STEP_BYTES);
            // The next layer's experts predicted again from this layer's partial output while
            // it waits for its reads (`lookahead`): only where the next layer routes experts
            // from the drives and its weights are here.
            let lookahead_next = resident(li + 1).filter(|_| {
                self.source.wants_prefetch()
                    && self.next_layer_prefetch()
                    && lookahead_enabled()
                    && n <= LOOKAHEAD_MAX_POSITIONS
            });
            // The last layer guesses the next token instead (`boundary`): decode only.
            let guess_here = li + 1 == self.layers.len()
                && n == 1
                && mode != LogitsMode::None
                && self.source.wants_prefetch()
                && self.next_layer_prefetch()
                && lookahead_enabled()
                && next_token_prefetch_enabled();
            let (states_to_here, states_after) = session.states.split_at_mut(li + 1);
            let mut next_state = states_after.first_mut();
            let residual = &*self.residual;
            let streams_now = &streams;
            let mut lookahead = |partial: &[f32]| {
                if guess_here {
                    let guessed = self.guesser().guess_next_token(
                        li,
                        streams_now,
                        partial,
                        states_to_here,
                    )?;
                    return Ok(guessed.and_then(|(g, experts)| {
                        token_guess = Some(g);
                        experts.map(|e| (g.layer, e))
                    }));
                }
                match (lookahead_next, next_state.as_deref_mut()) {
                    (Some(next), Some(state)) => predict_from_partial(
                        residual,
                        li,
                        next,
                        streams_now,
                        partial,
                        n,
                        &mut **state,
                    ),
                    _ => Ok(None),
                }
            };
            let mut ctx = FfnContext {
                source: &*self.source,
                layer: layer.index,
                routing: if trace.is_some() || recording {
                    Some(&mut routing)
                } else {
                    None
                },
                idle: &mut warm_step,
                speculate: if lookahead_next.is_some() || guess_here {
                    Some(&mut lookahead)
                } else {
                    None
                },
            };
            let y = timed(Phase::Ffn, || layer.ffn.forward(&x, n, &mut ctx))?;
            timed(Phase::Residual, || {
                self.residual.block_output(li, 1, &mut streams, &y)
            });
            if recording && !routing.is_empty() {
                if let Some(r) = self
                    .routing
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .as_mut()
                {
                    r.add(layer.index, &routing);
                }
            }
            if let Some(tr) = trace.as_deref_mut() {
                tr.hidden_states
                    .push(self.residual.layer_state(&streams).to_vec());
                if !routing.is_empty() {
                    tr.routing.push((layer.index, routing));
                }
            }
        }
        session.token_guess = token_guess;
        let h = self.residual.output(&streams);
        if let Some(tr) = trace {
            tr.final_mixed = h.to_vec();
            tr.residual_blocks = streams[..streams.len().saturating_sub(1)].to_vec();
        }
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
        let x = timed(Phase::Norm, || self.norm.apply(hs));
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        Ok(Logits {
            rows,
            vocab,
            data: timed(Phase::Head, || head.forward(&x, rows)),
        })
    }
}
