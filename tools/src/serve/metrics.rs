//! Generation metrics for `GET /metrics`, in the Prometheus text format: requests by outcome,
//! tokens, time to first token, decode speed, conversation-state reuse, and the layout's bytes
//! read and expert-cache hit rate.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use deltafin_inference::layout_source::LayoutSource;

use crate::conversation::cache::Reuse;
use crate::conversation::Reply;

/// Counters shared by the request threads and the generator.
#[derive(Default)]
pub(crate) struct Metrics {
    /// Requests waiting in the queue.
    pub queued: AtomicUsize,
    /// Requests turned away because the queue was full.
    pub rejected: AtomicU64,
    /// Requests refused as invalid (4xx) or failed (5xx).
    pub client_errors: AtomicU64,
    pub server_errors: AtomicU64,
    /// Conversation states kept in memory for reuse (set by the generator).
    pub kept_states: AtomicUsize,
    totals: Mutex<Totals>,
}

#[derive(Default)]
struct Totals {
    requests: u64,
    cancelled: u64,
    prompt_tokens: u64,
    reused_tokens: u64,
    reused_from_disk: u64,
    completion_tokens: u64,
    ttft_sum_s: f64,
    ttft_count: u64,
    /// Decode time (total minus time to first token) and the tokens after the first.
    decode_s: f64,
    decode_tokens: u64,
    last_ttft_s: f64,
    last_decode_tokens_per_s: f64,
    /// Wall time of finished generations.
    total_s: f64,
}

impl Metrics {
    /// Count one finished generation.
    pub(crate) fn record(&self, r: &Reply) {
        let Ok(mut t) = self.totals.lock() else {
            return;
        };
        t.requests += 1;
        t.total_s += r.total.as_secs_f64();
        t.cancelled += u64::from(r.finish_reason == "cancelled");
        t.prompt_tokens += r.prompt_tokens as u64;
        t.reused_tokens += r.reused_tokens as u64;
        t.reused_from_disk += u64::from(r.reuse == Reuse::Disk);
        t.completion_tokens += r.completion_tokens as u64;
        if let Some(ttft) = r.ttft {
            let ttft = ttft.as_secs_f64();
            t.ttft_sum_s += ttft;
            t.ttft_count += 1;
            t.last_ttft_s = ttft;
            let decode = (r.total.as_secs_f64() - ttft).max(0.0);
            let n = r.completion_tokens.saturating_sub(1) as u64;
            if n > 0 && decode > 0.0 {
                t.decode_s += decode;
                t.decode_tokens += n;
                t.last_decode_tokens_per_s = n as f64 / decode;
            }
        }
    }

    /// Mean wall time of a generation so far (None before the first).
    pub(crate) fn mean_generation_s(&self) -> Option<f64> {
        let t = self.totals.lock().ok()?;
        (t.requests > 0).then(|| t.total_s / t.requests as f64)
    }

    /// The Prometheus text exposition.
    pub(crate) fn render(&self, layout: Option<&LayoutSource>) -> String {
        let mut o = String::new();
        let mut put = |name: &str, kind: &str, help: &str, value: f64| {
            let _ = writeln!(o, "# HELP deltafin_{name} {help}");
            let _ = writeln!(o, "# TYPE deltafin_{name} {kind}");
            let _ = writeln!(o, "deltafin_{name} {value}");
        };
        put(
            "requests_queued",
            "gauge",
            "Requests waiting for the generator.",
            self.queued.load(Ordering::Relaxed) as f64,
        );
        put(
            "requests_rejected_total",
            "counter",
            "Requests refused with 429 (queue full).",
            self.rejected.load(Ordering::Relaxed) as f64,
        );
        put(
            "requests_invalid_total",
            "counter",
            "Requests refused as invalid (4xx).",
            self.client_errors.load(Ordering::Relaxed) as f64,
        );
        put(
            "requests_failed_total",
            "counter",
            "Requests that failed in the server (5xx).",
            self.server_errors.load(Ordering::Relaxed) as f64,
        );
        if let Ok(t) = self.totals.lock() {
            put(
                "generations_total",
                "counter",
                "Generations finished (cancelled included).",
                t.requests as f64,
            );
            put(
                "generations_cancelled_total",
                "counter",
                "Generations stopped because the client went away.",
                t.cancelled as f64,
            );
            put(
                "prompt_tokens_total",
                "counter",
                "Prompt tokens of finished generations.",
                t.prompt_tokens as f64,
            );
            put(
                "prompt_tokens_reused_total",
                "counter",
                "Prompt tokens a kept conversation state already held (not prefilled).",
                t.reused_tokens as f64,
            );
            put(
                "states_reused_from_disk_total",
                "counter",
                "Generations that resumed a snapshot from --snapshot-dir.",
                t.reused_from_disk as f64,
            );
            put(
                "completion_tokens_total",
                "counter",
                "Generated tokens.",
                t.completion_tokens as f64,
            );
            put(
                "time_to_first_token_seconds_sum",
                "counter",
                "Sum of times to first token.",
                t.ttft_sum_s,
            );
            put(
                "time_to_first_token_seconds_count",
                "counter",
                "Generations with a first token.",
                t.ttft_count as f64,
            );
            put(
                "time_to_first_token_seconds_last",
                "gauge",
                "Time to first token of the last generation.",
                t.last_ttft_s,
            );
            put(
                "decode_tokens_per_second",
                "gauge",
                "Decode speed over all generations (tokens after the first / time after it).",
                if t.decode_s > 0.0 {
                    t.decode_tokens as f64 / t.decode_s
                } else {
                    0.0
                },
            );
            put(
                "decode_tokens_per_second_last",
                "gauge",
                "Decode speed of the last generation.",
                t.last_decode_tokens_per_s,
            );
        }
        put(
            "conversation_states_kept",
            "gauge",
            "Conversation states kept in memory for reuse.",
            self.kept_states.load(Ordering::Relaxed) as f64,
        );
        if let Some(src) = layout {
            let s = src.stats();
            put(
                "bytes_read_total",
                "counter",
                "Bytes read from the drives (resident weights and experts).",
                s.bytes_read as f64,
            );
            put(
                "expert_bytes_read_total",
                "counter",
                "Expert bytes read from the drives.",
                s.fetch.read_bytes as f64,
            );
            put(
                "expert_requests_total",
                "counter",
                "Experts the forward pass asked for.",
                s.fetch.requests as f64,
            );
            put(
                "expert_cache_hits_total",
                "counter",
                "Expert requests served by the cache.",
                s.fetch.cache_hits as f64,
            );
            put(
                "expert_cache_hit_rate",
                "gauge",
                "Expert cache hits / requests since start.",
                s.fetch.hit_rate().unwrap_or(0.0),
            );
            put(
                "replica_recoveries_total",
                "counter",
                "Reads served by another copy after a failure or hash mismatch.",
                s.replica_recoveries as f64,
            );
        }
        o
    }
}
