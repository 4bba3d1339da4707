//! A built-in span timer: wall time of the forward pass's phases, measured on the thread that
//! runs the pass (its parallel kernels run inside the phase that starts them), so that a
//! profile of one decode token or one prefill chunk needs no `perf`. Off unless
//! [`set_enabled`]; then each phase costs one `Instant::now()` at each end. Phases nest
//! ([`Phase::parent`]): a report gives each phase's own time (its total less its children's).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// A phase of the forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The whole forward call.
    Forward,
    Embed,
    /// RMS norms before the mixer and the feed-forward, and the final one.
    Norm,
    /// The token mixer (attention or KDA), everything in it.
    Mixer,
    /// The mixer's input projections (q, kv, gates).
    MixerIn,
    /// Attention over the cache or the recurrent update.
    MixerCore,
    /// The mixer's output projection (and output gate).
    MixerOut,
    /// Applying the next layer's router to predict its experts (prefetch).
    Predict,
    /// The feed-forward, everything in it.
    Ffn,
    /// While the layer waits for its last experts: the next layer's mixer and router on the
    /// output so far, to predict that layer's experts ([`crate::model::lookahead`]).
    Lookahead,
    Router,
    /// Kimi K3's latent down / up projections around the routed experts.
    Latent,
    /// Every routed expert's gate and up (with the shared expert's when it rides along).
    ExpertsGateUp,
    ExpertsAct,
    ExpertsDown,
    /// Routing weights applied and slots summed.
    ExpertsCombine,
    /// A shared expert computed on its own.
    Shared,
    /// A dense MLP layer.
    Dense,
    /// Residual mixing (plain adds or K3's attention residuals).
    Residual,
    /// The final norm's output through the head.
    Head,
}

impl Phase {
    pub const ALL: [Phase; 20] = [
        Phase::Forward,
        Phase::Embed,
        Phase::Norm,
        Phase::Mixer,
        Phase::MixerIn,
        Phase::MixerCore,
        Phase::MixerOut,
        Phase::Predict,
        Phase::Ffn,
        Phase::Lookahead,
        Phase::Router,
        Phase::Latent,
        Phase::ExpertsGateUp,
        Phase::ExpertsAct,
        Phase::ExpertsDown,
        Phase::ExpertsCombine,
        Phase::Shared,
        Phase::Dense,
        Phase::Residual,
        Phase::Head,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Embed => "embed",
            Phase::Norm => "norm",
            Phase::Mixer => "mixer",
            Phase::MixerIn => "mixer.in_proj",
            Phase::MixerCore => "mixer.core",
            Phase::MixerOut => "mixer.out_proj",
            Phase::Predict => "predict_next_experts",
            Phase::Ffn => "ffn",
            Phase::Lookahead => "ffn.lookahead",
            Phase::Router => "ffn.router",
            Phase::Latent => "ffn.latent_proj",
            Phase::ExpertsGateUp => "ffn.experts_gate_up",
            Phase::ExpertsAct => "ffn.experts_act",
            Phase::ExpertsDown => "ffn.experts_down",
            Phase::ExpertsCombine => "ffn.experts_combine",
            Phase::Shared => "ffn.shared",
            Phase::Dense => "ffn.dense",
            Phase::Residual => "residual",
            Phase::Head => "head",
        }
    }

    /// The phase this one runs inside.
    pub fn parent(self) -> Option<Phase> {
        match self {
            Phase::Forward => None,
            Phase::MixerIn | Phase::MixerCore | Phase::MixerOut => Some(Phase::Mixer),
            Phase::Router
            | Phase::Latent
            | Phase::ExpertsGateUp
            | Phase::ExpertsAct
            | Phase::ExpertsDown
            | Phase::ExpertsCombine
            | Phase::Shared
            | Phase::Dense
            | Phase::Lookahead => Some(Phase::Ffn),
            _ => Some(Phase::Forward),
        }
    }

    fn index(self) -> usize {
        Phase::ALL.iter().position(|&p| p == self).unwrap_or(0)
    }
}

const N: usize = Phase::ALL.len();
static ENABLED: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];
static CALLS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];

/// Turn the timer on or off (process-wide).
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Zero every phase's totals.
pub fn reset() {
    for i in 0..N {
        NANOS[i].store(0, Ordering::Relaxed);
        CALLS[i].store(0, Ordering::Relaxed);
    }
}

/// Times its phase until dropped (nothing when the timer is off).
#[must_use = "the span ends when the guard is dropped"]
#[derive(Debug)]
pub struct Span {
    phase: Phase,
    start: Option<Instant>,
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some(s) = self.start {
            let i = self.phase.index();
            let ns = u64::try_from(s.elapsed().as_nanos()).unwrap_or(u64::MAX);
            NANOS[i].fetch_add(ns, Ordering::Relaxed);
            CALLS[i].fetch_add(1, Ordering::Relaxed);
            deltafin_storage::timeline::record(self.phase.name(), s, Instant::now(), 0, 0);
        }
    }
}

thread_local! {
    /// Inside [`quiet`] on this thread: spans started here time nothing.
    static QUIET: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Start timing `phase`.
pub fn span(phase: Phase) -> Span {
    Span {
        phase,
        start: (enabled() && QUIET.with(|q| q.get() == 0)).then(Instant::now),
    }
}

/// Run `f` with the spans it starts on this thread not timed: work that runs inside one
/// phase but would otherwise count in another's (the lookahead's mixer in the mixer's).
pub fn quiet<T>(f: impl FnOnce() -> T) -> T {
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            QUIET.with(|q| q.set(q.get().saturating_sub(1)));
        }
    }
    QUIET.with(|q| q.set(q.get() + 1));
    let _leave = Leave;
    f()
}

/// Run `f` inside a span of `phase`.
pub fn timed<T>(phase: Phase, f: impl FnOnce() -> T) -> T {
    let _s = span(phase);
    f()
}

/// One phase's totals since the last [`reset`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PhaseTime {
    pub phase: &'static str,
    pub parent: Option<&'static str>,
    pub calls: u64,
    /// Wall time inside the phase, its children included.
    pub total_s: f64,
    /// Less its children's.
    pub self_s: f64,
}

/// Every phase that ran since the last [`reset`], in [`Phase::ALL`] order.
pub fn report() -> Vec<PhaseTime> {
    let total = |p: Phase| NANOS[p.index()].load(Ordering::Relaxed) as f64 * 1e-9;
    Phase::ALL
        .iter()
        .filter(|p| CALLS[p.index()].load(Ordering::Relaxed) > 0)
        .map(|&p| {
            let children: f64 = Phase::ALL
                .iter()
                .filter(|c| c.parent() == Some(p))
                .map(|&c| total(c))
                .sum();
            PhaseTime {
                phase: p.name(),
                parent: p.parent().map(Phase::name),
                calls: CALLS[p.index()].load(Ordering::Relaxed),
                total_s: total(p),
                self_s: (total(p) - children).max(0.0),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_spans_report_self_time() {
        // The only test touching the process-wide timer.
        set_enabled(true);
        reset();
        {
            let _f = span(Phase::Ffn);
            std::thread::sleep(std::time::Duration::from_millis(20));
            let _r = span(Phase::Router);
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        set_enabled(false);
        let _ignored = span(Phase::Head);
        let r = report();
        let ffn = r.iter().find(|p| p.phase == "ffn").expect("ffn ran");
        let router = r
            .iter()
            .find(|p| p.phase == "ffn.router")
            .expect("router ran");
        assert_eq!((ffn.calls, router.calls), (1, 1));
        assert!(ffn.total_s >= 0.030 && router.total_s >= 0.010);
        assert!((ffn.self_s - (ffn.total_s - router.total_s)).abs() < 1e-9);
        assert!(ffn.self_s >= 0.020);
        assert!(r.iter().all(|p| p.phase != "head"), "off: not timed");
        reset();
    }
}
