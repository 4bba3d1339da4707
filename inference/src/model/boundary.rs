//! Predicting the next token's first routed layer while the last layer waits for its experts.
//!
//! Between one token's last routed layer and the next token's first, the drives have nothing
//! to read: the head, the sampler, the embedding, the first layers' attention (and the dense
//! feed-forward layers before the first routed one) all run before the first router can say
//! which experts the next token needs. On the medium synthetic model that is ~0.6-1 ms a token
//! of an idle drive at a 40% memory cap (`benches/results/cap_session35_spr.txt`).
//!
//! While the last layer waits for its last experts the compute threads are idle, as in
//! [`crate::model::lookahead`]. They guess the next token: the head's top token on the last
//! layer's output so far (the cached and landed experts and the shared experts). Then they run
//! the first layers on that token, with each touched cache of positions rolled back afterwards,
//! and route the first routed layer. A model with recurrent (KDA) layers among those makes no
//! guess unless asked to ([`next_token_guess_through_recurrent`]); then each recurrent state is
//! replaced by a copy for the run. Where the guess holds, that routing is exactly the one the next
//! forward computes, so its reads start a whole head and prefix earlier. The next forward then
//! makes no early prediction of that layer. Where the guess is wrong, the next forward's early
//! prediction replaces it and cancels its reads not yet started.
//!
//! A wrong guess costs drive time (its started reads finish), so guesses are acted on only
//! while they keep agreeing with the token that follows often enough ([`TokenAgreement`]); the
//! guess is made (on idle threads) either way, so the record stays current. How often a guess
//! holds depends on how far the head's top logit stands above the second: on the medium
//! synthetic model (random weights, greedy), guesses whose margin was under 0.06 logit standard
//! deviations held 53% of the time, those over 0.13 held 89-100%
//! (`benches/results/next_token_guess_session36.txt`). So agreement is measured, and gated,
//! per margin band, as the prefetch gate does per rank.

use std::sync::Mutex;

use crate::error::Result;
use crate::ffn::feed_forward::FfnContext;
use crate::linear::owned::Linear;
use crate::mixer::MixerState;
use crate::model::decoder::{DecoderLayer, LayerSlot};
use crate::model::guess_cost::GuessCost;
use crate::model::residual::ResidualMixer;
use crate::ops::RmsNorm;
use crate::spans::{quiet, span, Phase};
use crate::weights::WeightSource;

/// Guesses are acted on while the moving average of their agreement with the next token is at
/// least this. A wrong one's started reads (up to a few experts) cost about twice what a right
/// one saves (the drive's idle time at the boundary), so below ~0.7 guessing does not pay.
pub const MIN_TOKEN_AGREEMENT: f64 = 0.75;
/// Guesses compared before a band's agreement may close.
const AGREEMENT_WARMUP: u64 = 8;
/// Upper ends of the margin bands (top logit minus the second, in standard deviations of the
/// logits); the last band is open-ended.
const MARGIN_BANDS: [f32; 4] = [0.05, 0.1, 0.2, 0.4];

/// Whether the last layer guesses the next token's first routed experts (on unless
/// `DELTAFIN_NEXT_TOKEN_PREFETCH=0`, for measuring it).
pub fn next_token_prefetch_enabled() -> bool {
    next_token_prefetch_setting() != Some(false)
}

/// Whether guesses also run through recurrent (KDA) layers, on copies of their states: only
/// when asked for (`DELTAFIN_NEXT_TOKEN_PREFETCH` set to anything but `0`, e.g. `1`). On a
/// Kimi K3-shaped synthetic at a memory cap it made decode 2-4% slower: the guesses agreed
/// 41-65% of the time, the copies and the KDA layers' work lengthen the wait's compute, and
/// the wrong guesses' reads cost drive time
/// (`benches/results/next_token_guess_kda_session37.txt`).
pub fn next_token_guess_through_recurrent() -> bool {
    next_token_prefetch_setting() == Some(true)
}

/// `DELTAFIN_NEXT_TOKEN_PREFETCH`: unset `None`, `0` off, anything else on.
fn next_token_prefetch_setting() -> Option<bool> {
    static SET: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    *SET.get_or_init(|| {
        std::env::var("DELTAFIN_NEXT_TOKEN_PREFETCH")
            .ok()
            .map(|v| v != "0")
    })
}

/// A guess of the token a session's next forward starts with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenGuess {
    /// The position the guessed token would take.
    pub position: usize,
    pub token: u32,
    /// The decoder layer whose experts were predicted from it.
    pub layer: usize,
    /// Whether the prediction was passed to the weight source (reads may be queued).
    pub acted: bool,
    /// The guess's margin band (see [`TokenAgreement`]).
    pub band: usize,
}

/// How often guesses matched the token that followed, per margin band: moving averages (per
/// model), each band gated on its own.
#[derive(Debug)]
pub struct TokenAgreement {
    /// Per band: (moving average, guesses compared); then all bands together.
    inner: Mutex<[(f64, u64); MARGIN_BANDS.len() + 2]>,
}

impl Default for TokenAgreement {
    fn default() -> Self {
        TokenAgreement {
            inner: Mutex::new([(1.0, 0); MARGIN_BANDS.len() + 2]),
        }
    }
}

impl TokenAgreement {
    const ALL: usize = MARGIN_BANDS.len() + 1;

    fn record(&self, band: usize, agreed: bool) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        for i in [band.min(Self::ALL - 1), Self::ALL] {
            g[i].0 = 0.9 * g[i].0 + if agreed { 0.1 } else { 0.0 };
            g[i].1 += 1;
        }
    }

    /// Whether guesses in margin band `band` are right often enough to act on.
    pub fn open(&self, band: usize) -> bool {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let (ema, n) = g[band.min(Self::ALL - 1)];
        n < AGREEMENT_WARMUP || ema >= MIN_TOKEN_AGREEMENT
    }

    /// The moving average and the number of guesses compared, over all bands.
    pub fn figures(&self) -> (f64, u64) {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())[Self::ALL]
    }
}

/// The margin band of `logits`' top value `top`: how far it stands above the second, in
/// standard deviations of the logits.
fn margin_band(logits: &[f32], top: usize) -> usize {
    let n = logits.len().max(1) as f64;
    let mean = logits.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
    let var = logits
        .iter()
        .map(|&x| (f64::from(x) - mean).powi(2))
        .sum::<f64>()
        / n;
    let second = logits
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != top)
        .map(|(_, &x)| x)
        .fold(f32::NEG_INFINITY, f32::max);
    let margin = f64::from(logits[top] - second) / var.sqrt().max(f64::MIN_POSITIVE);
    MARGIN_BANDS
        .iter()
        .position(|&b| margin < f64::from(b))
        .unwrap_or(MARGIN_BANDS.len())
}

/// At the start of a forward of `tokens` at position `start`: compare the session's `guess`
/// with the token that came, record the agreement, and return the layer whose early prediction
/// the forward must skip (the guess held, its prediction was acted on, and the forward is that
/// one token: a longer one's other positions need the early prediction).
pub(crate) fn settle_token_guess(
    agreement: &TokenAgreement,
    guess: Option<TokenGuess>,
    start: usize,
    tokens: &[u32],
) -> Option<usize> {
    let g = guess?;
    if g.position != start {
        return None;
    }
    let agreed = tokens.first() == Some(&g.token);
    // Only a decode step is the token the guess stands for (a longer forward may be the next
    // turn's prompt).
    if tokens.len() == 1 {
        agreement.record(g.band, agreed);
    }
    (agreed && g.acted && tokens.len() == 1).then_some(g.layer)
}

/// What a next-token guess needs of the model (borrowed from it).
pub(crate) struct NextTokenGuesser<'a> {
    pub layers: &'a [LayerSlot],
    /// `[vocab, hidden]`
    pub embed_tokens: &'a Linear,
    pub norm: &'a RmsNorm,
    /// `[vocab, hidden]` (the embeddings when tied).
    pub head: &'a Linear,
    pub residual: &'a dyn ResidualMixer,
    pub source: &'a dyn WeightSource,
    pub agreement: &'a TokenAgreement,
    pub cost: &'a GuessCost,
    /// Guess through recurrent layers too ([`next_token_guess_through_recurrent`]); otherwise
    /// a model whose layers up to the first routed one include one makes no guess.
    pub through_recurrent: bool,
}

impl NextTokenGuesser<'_> {
    /// The first decoder layer that routes experts, if it and every layer before it are built
    /// (not streamed): the layer a next-token guess predicts. `None` also when the last layer
    /// is that layer (nothing to wait in before it).
    pub(crate) fn first_routed_layer(&self) -> Option<usize> {
        let m = self.layers.iter().position(routes_experts)?;
        let all_built = self.layers[..=m]
            .iter()
            .all(|l| matches!(l, LayerSlot::Resident(_)));
        (all_built && m + 1 < self.layers.len()).then_some(m)
    }

    /// Decoder layers that route experts ([`routes_experts`]).
    pub(crate) fn routed_layers(&self) -> usize {
        self.layers.iter().filter(|l| routes_experts(l)).count()
    }

    /// Guess the token after the current forward's last position from the last layer's
    /// partial feed-forward output `partial` `[1, hidden]` (`streams`: the streams before it,
    /// `li`: the last layer), run the layers up to the first routed one (`states`: their
    /// states, each left as it was) on it, and route that layer. Returns the guess and,
    /// when guesses are accurate enough to act on, the predicted experts (likeliest first).
    pub(crate) fn guess_next_token(
        &self,
        li: usize,
        streams: &[Vec<f32>],
        partial: &[f32],
        states: &mut [Box<dyn MixerState>],
    ) -> Result<Option<(TokenGuess, Option<Vec<usize>>)>> {
        let Some(m) = self.first_routed_layer().filter(|&m| m < li) else {
            return Ok(None);
        };
        let hd = self.embed_tokens.cols();
        if partial.len() != hd || states.len() <= m {
            return Ok(None);
        }
        let layers: Vec<_> = self.layers[..=m]
            .iter()
            .filter_map(|l| match l {
                LayerSlot::Resident(l) => Some(l),
                LayerSlot::Streamed(_) => None,
            })
            .collect();
        let recurrent = layers.iter().any(|l| l.mixer.rollback_window().is_some());
        if layers.len() != m + 1 || (recurrent && !self.through_recurrent) {
            return Ok(None);
        }
        if !self.cost.worth_it() {
            return Ok(None);
        }
        let _span = span(Phase::Lookahead);
        let began = std::time::Instant::now();
        // The head's top token on the output so far.
        let mut out = streams.to_vec();
        self.residual.block_output(li, 1, &mut out, partial);
        let x = self.norm.apply(&self.residual.output(&out));
        let logits = quiet(|| self.head.forward(&x, 1));
        let Some(token) = argmax(&logits) else {
            return Ok(None);
        };
        let position = states[0].len();
        let band = margin_band(&logits, token);
        let act = self.agreement.open(band);
        let guess = TokenGuess {
            position,
            token: token as u32,
            layer: self.layers[m].index(),
            acted: act,
            band,
        };
        if !act {
            return Ok(Some((guess, None)));
        }
        // A recurrent state (a layer with a rollback window) keeps a checkpoint it can
        // return to; a forward past the current position would move it, and a truncate back
        // would restore the values but no longer the earlier positions (a failed forward, a
        // drafter or a snapshot's prefix could not roll back over this token). Such layers
        // run the guess on a copy of their state ([`MixerState::scratch_copy`]); without one,
        // no guess.
        let mut copies: Vec<(usize, Box<dyn MixerState>)> = Vec::new();
        for (k, l) in layers.iter().enumerate() {
            if l.mixer.rollback_window().is_some() {
                match states[k].scratch_copy() {
                    Some(c) => copies.push((k, c)),
                    None => return Ok(None),
                }
            }
        }
        // The copies stand in for their states during the forward; every other touched state
        // (a KV cache) goes back to its length, whatever the forward did.
        let lens: Vec<usize> = states[..=m].iter().map(|s| s.len()).collect();
        for (k, c) in copies.iter_mut() {
            std::mem::swap(&mut states[*k], c);
        }
        let predicted = quiet(|| self.run_prefix(token, &layers, &mut states[..=m]));
        for (k, c) in copies.iter_mut() {
            std::mem::swap(&mut states[*k], c);
        }
        for (s, &len) in states[..=m].iter_mut().zip(&lens) {
            if s.len() != len {
                s.truncate(len)?;
            }
        }
        self.cost.record_guess(began.elapsed());
        Ok(predicted?.map(|e| (guess, Some(e))))
    }

    /// `token` through `layers` (the first routed one last) at their states' next position;
    /// the last one's router's choice, likeliest first.
    fn run_prefix(
        &self,
        token: usize,
        layers: &[&DecoderLayer],
        states: &mut [Box<dyn MixerState>],
    ) -> Result<Option<Vec<usize>>> {
        let mut emb = vec![0f32; self.embed_tokens.cols()];
        self.embed_tokens.view().decode_row(token, &mut emb);
        let mut streams = self.residual.init(emb);
        let Some((last, before)) = layers.split_last() else {
            return Ok(None);
        };
        for (k, layer) in before.iter().enumerate() {
            self.prefix_mixer(layer, k, &mut streams, &mut *states[k])?;
            let x = layer
                .post_attention_layernorm
                .apply(&self.residual.block_input(k, 1, &streams));
            let mut no_idle = || false;
            let mut ctx = FfnContext {
                source: self.source,
                layer: layer.index,
                routing: None,
                idle: &mut no_idle,
                speculate: None,
            };
            let y = layer.ffn.forward(&x, 1, &mut ctx)?;
            self.residual.block_output(k, 1, &mut streams, &y);
        }
        let k = before.len();
        self.prefix_mixer(last, k, &mut streams, &mut *states[k])?;
        let xn = last
            .post_attention_layernorm
            .apply(&self.residual.block_input(k, 1, &streams));
        Ok(last.ffn.predict_experts(&xn, 1))
    }

    /// Layer `k`'s token mixer on the streams, one position.
    fn prefix_mixer(
        &self,
        layer: &DecoderLayer,
        k: usize,
        streams: &mut Vec<Vec<f32>>,
        state: &mut dyn MixerState,
    ) -> Result<()> {
        let x = layer
            .input_layernorm
            .apply(&self.residual.block_input(k, 0, streams));
        let y = layer.mixer.forward(&x, 1, state)?;
        self.residual.block_output(k, 0, streams, &y);
        Ok(())
    }
}

/// Whether a layer routes experts. A streamed layer counts as one: it is not built here to
/// ask, and a guess cannot run through it anyway.
fn routes_experts(l: &LayerSlot) -> bool {
    match l {
        LayerSlot::Resident(l) => l.ffn.router_gate().is_some(),
        LayerSlot::Streamed(_) => true,
    }
}

/// Index of the largest value (the first of equals); `None` when empty or all NaN.
fn argmax(v: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in v.iter().enumerate() {
        if best.is_none_or(|(_, b)| x > b) && !x.is_nan() {
            best = Some((i, x));
        }
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agreement_closes_per_band_below_the_threshold_and_reopens() {
        let a = TokenAgreement::default();
        for _ in 0..AGREEMENT_WARMUP {
            assert!(a.open(0));
            a.record(0, false);
            a.record(3, true);
        }
        assert!(!a.open(0), "{:?}", a.figures());
        assert!(a.open(3), "another band is gated on its own");
        assert_eq!(a.figures().1, 2 * AGREEMENT_WARMUP);
        let mut steps = 0;
        while !a.open(0) {
            a.record(0, true);
            steps += 1;
        }
        assert!(steps < 30, "reopened after {steps}");
    }

    #[test]
    fn a_guess_skips_the_early_prediction_only_when_it_held_was_acted_on_and_is_one_token() {
        let a = TokenAgreement::default();
        let g = TokenGuess {
            position: 10,
            token: 42,
            layer: 1,
            acted: true,
            band: 2,
        };
        assert_eq!(settle_token_guess(&a, Some(g), 10, &[42]), Some(1));
        assert_eq!(settle_token_guess(&a, Some(g), 10, &[43]), None);
        assert_eq!(a.figures().1, 2);
        // Another position (the session was rolled back or moved on): not compared.
        assert_eq!(settle_token_guess(&a, Some(g), 11, &[42]), None);
        assert_eq!(a.figures().1, 2);
        // A longer forward's other positions need the early prediction; not compared (it may
        // be a prompt).
        assert_eq!(settle_token_guess(&a, Some(g), 10, &[42, 7]), None);
        assert_eq!(a.figures().1, 2);
        let not_acted = TokenGuess { acted: false, ..g };
        assert_eq!(settle_token_guess(&a, Some(not_acted), 10, &[42]), None);
        assert_eq!(settle_token_guess(&a, None, 10, &[42]), None);
    }

    /// The guess runs the first layers one position past the session and rolls them back:
    /// afterwards every state has its length (a recurrent one also its values) and can still
    /// roll back over the token just decoded, on every synthetic architecture (recurrent KDA
    /// states, when asked for, through copies: a forward on the state itself would move its
    /// checkpoint).
    #[test]
    fn a_guess_leaves_every_state_as_it_was_and_able_to_roll_back() {
        use crate::synth::presets::{apply_overrides, preset_config, SYNTH_ARCHS};
        use crate::synth::{write_synth, SynthFormat};
        for arch in SYNTH_ARCHS {
            let dir = tempfile::tempdir().unwrap();
            let mut cfg = preset_config(arch, "tiny").unwrap();
            apply_overrides(&mut cfg, &["num_hidden_layers=4".to_string()]).unwrap();
            let opts = deltafin_storage::checkpoint_writer::WriteOptions {
                seed: 3,
                shard_bytes: 1 << 30,
                force: false,
            };
            write_synth(
                dir.path(),
                &cfg,
                SynthFormat::Bf16,
                &opts,
                &deltafin_storage::layout::NoProgress,
            )
            .unwrap();
            let source = crate::DirSource::open(dir.path()).unwrap();
            let model = crate::Model::load(std::sync::Arc::new(source)).unwrap();
            let mut session = model.new_session();
            model.forward_last(&mut session, &[5, 9, 2, 7]).unwrap();
            model.forward_last(&mut session, &[11]).unwrap();
            let len = session.len();
            assert!(session.can_truncate(len - 1), "{arch}");
            let mut g = model.guesser();
            let hd = g.embed_tokens.cols();
            let streams = g
                .residual
                .init((0..hd).map(|i| (i % 7) as f32 * 0.1).collect());
            let partial = vec![0.05f32; hd];
            let last = model.layers().len() - 1;
            let first_routed = g.first_routed_layer().unwrap();
            let recurrent = g.layers[..=first_routed].iter().any(|l| match l {
                LayerSlot::Resident(l) => l.mixer.rollback_window().is_some(),
                LayerSlot::Streamed(_) => false,
            });
            // Every state's saved form: a recurrent state must come back bit for bit.
            let fixed = |states: &[Box<dyn MixerState>]| -> Vec<Vec<Vec<f32>>> {
                states
                    .iter()
                    .map(|s| s.export_fixed().iter().map(|a| a.to_vec()).collect())
                    .collect()
            };
            let fixed_before = fixed(&session.states);
            // By default (Kimi's first layers are KDA) no guess through recurrent layers; when
            // asked for, through copies of their states. Every other architecture guesses and
            // acts on it (the gate's warm-up) either way.
            for through in [false, true] {
                g.through_recurrent = through;
                let made = g
                    .guess_next_token(last, &streams, &partial, &mut session.states)
                    .unwrap();
                if recurrent && !through {
                    assert!(made.is_none(), "{arch}: a guess through recurrent layers");
                } else {
                    let (guess, experts) = made.unwrap_or_else(|| panic!("{arch}: no guess"));
                    assert_eq!((guess.position, guess.layer), (len, first_routed), "{arch}");
                    assert!(experts.is_some_and(|e| !e.is_empty()), "{arch}");
                }
                assert!(
                    fixed_before == fixed(&session.states),
                    "{arch}: a recurrent state changed"
                );
                assert!(
                    session.states.iter().all(|s| s.len() == len),
                    "{arch}: a state's length moved"
                );
                assert!(
                    session.can_truncate(len - 1),
                    "{arch}: cannot roll back over the token just decoded"
                );
            }
        }
    }

    #[test]
    fn margin_bands_measure_the_top_logits_lead_in_standard_deviations() {
        // Logits with standard deviation 1 (±1 alternating) and a top value nudged up.
        let mut l: Vec<f32> = (0..1000)
            .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
            .collect();
        l[10] = 1.03;
        assert_eq!(margin_band(&l, 10), 0);
        l[10] = 1.15;
        assert_eq!(margin_band(&l, 10), 2);
        l[10] = 3.0;
        assert_eq!(margin_band(&l, 10), MARGIN_BANDS.len());
    }

    #[test]
    fn argmax_takes_the_first_of_equals_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), Some(1));
        assert_eq!(argmax(&[f32::NAN, -1.0]), Some(1));
        assert_eq!(argmax(&[]), None);
    }
}
