//! One generation with its measurements: time to first token, decode rate, and what a layout
//! read in the prefill and decode phases.

use std::time::{Duration, Instant};

use deltafin_storage::engine::DriveStats;
use deltafin_storage::store::{FetchStats, StreamStats};

use crate::generate::GenerateOutput;
use crate::layout_source::LayoutSource;
use crate::run::memory::peak_rss_bytes;

/// One generation with its measurements.
#[derive(Debug, Clone)]
pub struct Measured {
    pub output: GenerateOutput,
    pub ttft: Option<Duration>,
    pub total: Duration,
    /// Decode steps after the first token and their wall time.
    pub decode_steps: usize,
    pub decode_time: Duration,
    /// What the layout read before the first token (prefill) and after it (decode).
    pub prefill_fetch: FetchStats,
    pub decode_fetch: FetchStats,
    /// Streamed layers' weights read before the first token and after it.
    pub prefill_stream: StreamStats,
    pub decode_stream: StreamStats,
    /// Per-drive counters over the whole generation.
    pub drives: Vec<DriveStats>,
    /// Per-drive counters after the first token: every byte the drives transferred while
    /// decoding, including the read part of prefetches cancelled before they landed (which
    /// `decode_fetch`, counting the records that landed in the cache, leaves out).
    pub decode_drives: Vec<DriveStats>,
    pub peak_rss: Option<u64>,
}

/// The generation itself, supplied by the caller (plain, speculative, from a snapshot): it
/// calls the token callback for every token and returns the output, or the caller's error.
pub type GenStep<'a, E> =
    dyn FnMut(&mut dyn FnMut(u32) -> bool) -> std::result::Result<GenerateOutput, E> + 'a;

/// Run `gen`, passing every token to `on_token`, measuring time and (with a layout) reads.
pub fn measure_generation<E>(
    layout: Option<&LayoutSource>,
    on_token: &mut dyn FnMut(u32) -> bool,
    gen: &mut GenStep<'_, E>,
) -> std::result::Result<Measured, E> {
    let stats = || layout.map(|s| s.stats()).unwrap_or_default();
    let s0 = stats();
    let mut s1 = None;
    let mut times: Vec<Instant> = Vec::new();
    let start = Instant::now();
    let output = gen(&mut |id| {
        times.push(Instant::now());
        if s1.is_none() {
            s1 = Some(stats());
        }
        on_token(id)
    })?;
    let total = start.elapsed();
    let s2 = stats();
    let s1 = s1.unwrap_or_else(|| s2.clone());
    let (f1, st1) = (&s1.fetch, s1.stream);
    let (decode_steps, decode_time) = match (times.first(), times.last()) {
        (Some(a), Some(b)) if times.len() > 1 => (times.len() - 1, b.duration_since(*a)),
        _ => (0, Duration::ZERO),
    };
    Ok(Measured {
        ttft: times.first().map(|t| t.duration_since(start)),
        total,
        decode_steps,
        decode_time,
        prefill_fetch: f1 - &s0.fetch,
        decode_fetch: &s2.fetch - f1,
        prefill_stream: st1.since(&s0.stream),
        decode_stream: s2.stream.since(&st1),
        drives: (&s2 - &s0).drives,
        decode_drives: (&s2 - &s1).drives,
        peak_rss: peak_rss_bytes(),
        output,
    })
}

impl Measured {
    /// Decode tokens per second (after the first token), or tokens over the whole run when
    /// there was only one.
    pub fn tokens_per_s(&self) -> f64 {
        let n = self.output.tokens.len();
        if self.decode_steps > 0 && self.decode_time > Duration::ZERO {
            self.decode_steps as f64 / self.decode_time.as_secs_f64()
        } else if self.total > Duration::ZERO {
            n as f64 / self.total.as_secs_f64()
        } else {
            0.0
        }
    }

    /// Prefill and decode reads together.
    pub fn all_fetch(&self) -> FetchStats {
        &self.prefill_fetch + &self.decode_fetch
    }
}
