//! What `deltafin generate` prints after the text: a one-line summary, or one JSON object with
//! every measurement.

use deltafin_inference::run::{Measured, ModelPath};
use deltafin_inference::StopReason;

use crate::generate::loaded::Loaded;
use crate::util::{drive_stats_json, human, machine};

/// Facts about the source for the JSON report.
fn source_json(l: &Loaded) -> serde_json::Value {
    let mut v = serde_json::Map::new();
    match &l.opened.path {
        ModelPath::Directory(d) => {
            v.insert("model".into(), d.display().to_string().into());
            v.insert("source".into(), "directory".into());
        }
        ModelPath::Layout(m) => {
            v.insert("model".into(), m.display().to_string().into());
            v.insert("source".into(), "layout".into());
        }
    }
    if let Some(src) = &l.opened.layout {
        let s = src.stats();
        v.insert(
            "mode".into(),
            serde_json::to_value(src.mode()).unwrap_or_default(),
        );
        v.insert("drives".into(), src.drive_count().into());
        v.insert("bytes_read".into(), s.bytes_read.into());
        v.insert("resident_bytes".into(), s.resident_bytes.into());
        let rounded = |r: &[f64]| {
            r.iter()
                .map(|p| (p * 1000.0).round() / 1000.0)
                .collect::<Vec<f64>>()
        };
        v.insert(
            "prefetch_rank_precision".into(),
            rounded(&s.prefetch_rank_precision).into(),
        );
        v.insert(
            "prefetch_rank_precision_early".into(),
            rounded(&s.prefetch_rank_precision_early).into(),
        );
        v.insert("expert_bytes".into(), s.fetch.read_bytes.into());
        v.insert("experts_fetched".into(), s.fetch.reads.into());
        v.insert(
            "resident_load_s".into(),
            s.resident_load_time.as_secs_f64().into(),
        );
        v.insert("drive_stats".into(), drive_stats_json(&s.drives));
        v.insert("hash_check".into(), src.hash_check().to_string().into());
        v.insert("replica_recoveries".into(), s.replica_recoveries.into());
        v.insert(
            "repairs".into(),
            s.repairs
                .iter()
                .filter(|r| r.error.is_none())
                .count()
                .into(),
        );
        v.insert(
            "repairs_failed".into(),
            s.repairs
                .iter()
                .filter(|r| r.error.is_some())
                .count()
                .into(),
        );
    } else {
        v.insert("bytes_read".into(), serde_json::Value::Null);
    }
    if let Some((p, _)) = &l.tokenizer {
        v.insert("tokenizer".into(), p.display().to_string().into());
    }
    v.into()
}

fn stop_json(stop: StopReason) -> serde_json::Value {
    match stop {
        StopReason::MaxTokens => serde_json::json!("max_tokens"),
        StopReason::StopToken(id) => serde_json::json!({"stop_token": id}),
        StopReason::Callback => serde_json::json!("callback"),
    }
}

pub(crate) fn summary(m: &Measured, loaded: &Loaded, prompt_len: usize) -> String {
    let n = m.output.tokens.len();
    let rate = m.tokens_per_s();
    let mut s = format!(
        "{n} tokens from a {prompt_len}-token prompt; time to first token {}; {rate:.2} \
         tokens/s ({:.1} tokens/min); total {:.3} s; load {:.3} s",
        m.ttft
            .map(|t| format!("{:.3} s", t.as_secs_f64()))
            .unwrap_or_else(|| "n/a".into()),
        rate * 60.0,
        m.total.as_secs_f64(),
        loaded.opened.load_time.as_secs_f64(),
    );
    if let Some(src) = &loaded.opened.layout {
        let f = m.all_fetch();
        let d = &m.decode_fetch;
        s.push_str(&format!(
            "; read {} of experts ({} records) from {} drive(s); {} per decoded token; \
             {} per prompt token; expert cache hit rate {}; prefetch recall {} precision \
             {}; I/O stall {:.3} s; peak RSS {}",
            human(f.read_bytes),
            f.reads,
            src.drive_count(),
            human(d.read_bytes / m.decode_steps.max(1) as u64),
            human(m.prefill_fetch.read_bytes / prompt_len.max(1) as u64),
            pct(f.hit_rate()),
            pct(f.prefetch_recall()),
            pct(f.prefetch_precision()),
            f.stall.as_secs_f64(),
            m.peak_rss.map(human).unwrap_or_else(|| "n/a".into()),
        ));
        let streamed = loaded.opened.model.streamed_layers();
        if !streamed.is_empty() {
            let d = &m.decode_stream;
            s.push_str(&format!(
                "; {} streamed layers: {} per decoded token, {} of layer reads landed before \
                 use, {:.3} s waited",
                streamed.len(),
                human(d.bytes_read / m.decode_steps.max(1) as u64),
                pct((d.takes > 0).then(|| d.ready_takes as f64 / d.takes as f64)),
                (m.prefill_stream.wait + d.wait).as_secs_f64(),
            ));
        }
        if let Some(b) = &loaded.budget {
            s.push_str(&format!(
                " (budget {}, expert buffers {}, {} of them allocated before the prompt in \
                 {:.2} s)",
                human(b.ram_budget),
                human(b.expert_memory),
                human(b.expert_memory_preallocated),
                b.expert_memory_preallocate_ms as f64 / 1e3
            ));
        }
    }
    s
}

pub(crate) fn to_json(m: &Measured, loaded: &Loaded, prompt: &[u32]) -> serde_json::Value {
    let n = m.output.tokens.len();
    let rate = m.tokens_per_s();
    let f = m.all_fetch();
    let (p, d) = (&m.prefill_fetch, &m.decode_fetch);
    let stall = f.stall.as_secs_f64();
    let mut v = serde_json::json!({
        "tokens": n,
        "token_ids": m.output.tokens,
        "prompt_tokens": prompt.len(),
        "prompt_ids": prompt,
        "stop": stop_json(m.output.stop),
        "ttft_s": m.ttft.map(|t| t.as_secs_f64()),
        "tokens_per_s": rate,
        "tokens_per_min": rate * 60.0,
        "decode_s_per_token": (m.decode_steps > 0).then(|| m.decode_time.as_secs_f64() / m.decode_steps as f64),
        "total_s": m.total.as_secs_f64(),
        "load_s": loaded.opened.load_time.as_secs_f64(),
        "compute_s": (m.total.as_secs_f64() - stall).max(0.0),
        "io_stall_s": stall,
        "prefill_io_stall_s": p.stall.as_secs_f64(),
        "decode_io_stall_s": d.stall.as_secs_f64(),
        "peak_rss_bytes": m.peak_rss,
        "next_layer_prefetch": loaded.opened.model.next_layer_prefetch(),
        "machine": machine(),
        "kernels": deltafin_inference::KernelConfig::default().label(),
    });
    if let (Some(obj), serde_json::Value::Object(src)) = (v.as_object_mut(), source_json(loaded)) {
        obj.extend(src);
    }
    if let Some(src) = &loaded.opened.layout {
        let man = src.manifest();
        v["layout"] = man.name.clone().into();
        v["bytes_read"] = f.read_bytes.into();
        v["prefill_bytes_read"] = p.read_bytes.into();
        v["decode_bytes_read"] = d.read_bytes.into();
        v["bytes_read_per_token"] = (d.read_bytes as f64 / m.decode_steps.max(1) as f64).into();
        // What the drives transferred while decoding: the drives' time, where
        // `bytes_read_per_token` counts the records that landed in the cache (a prefetch
        // cancelled after some of its pieces were read is in the first, not the second).
        let drive_bytes: u64 = m.decode_drives.iter().map(|s| s.bytes_read).sum();
        v["decode_drive_bytes_read"] = drive_bytes.into();
        v["drive_bytes_read_per_token"] =
            (drive_bytes as f64 / m.decode_steps.max(1) as f64).into();
        v["bytes_read_per_prompt_token"] =
            (p.read_bytes as f64 / prompt.len().max(1) as f64).into();
        v["expert_cache_hit_rate"] = f.hit_rate().into();
        v["decode_expert_cache_hit_rate"] = d.hit_rate().into();
        v["prefetch_recall"] = f.prefetch_recall().into();
        v["prefetch_precision"] = f.prefetch_precision().into();
        v["prefetch_gated"] = f.prefetch_gated.into();
        v["decode_prefetch_recall"] = d.prefetch_recall().into();
        v["decode_prefetch_precision"] = d.prefetch_precision().into();
        v["fetch"] = serde_json::json!({
            "requests": f.requests, "cache_hits": f.cache_hits, "prefetch_hits": f.prefetch_hits,
            "reads": f.reads, "prefetch_reads": f.prefetch_reads,
            "prefetch_cancelled": f.prefetch_cancelled, "evictions": f.evictions,
            "repredictions": f.repredictions,
            "expert_memory_peak_bytes": f.peak_bytes,
        });
        let ((agreement, guesses), cost) = loaded.opened.model.token_guess_figures();
        v["next_token_guess"] = serde_json::json!({
            "compared": guesses,
            "agreement_ema": if guesses > 0 { Some(agreement) } else { None },
            "guess_ms_ema": (cost.guesses > 0).then_some(cost.guess_s * 1e3),
            "routed_layer_ms_ema": (cost.tokens > 0).then_some(cost.layer_s * 1e3),
            "skipped_for_cost": cost.skipped,
        });
        v["cache_policy"] = loaded.policy.to_string().into();
        v["residency"] = serde_json::to_value(&loaded.opened.residency).unwrap_or_default();
        let stream = |s: &deltafin_inference::StreamStats, steps: usize| {
            serde_json::json!({
                "layers_read": s.takes,
                "layers_ready": s.ready_takes,
                "bytes_read": s.bytes_read,
                "bytes_read_per_forward": s.bytes_read as f64 / steps.max(1) as f64,
                "wait_s": s.wait.as_secs_f64(),
                "buffer_bytes_peak": s.peak_buffer_bytes,
            })
        };
        v["streamed_layers"] = serde_json::json!({
            "layers": loaded.opened.model.streamed_layers(),
            "prefill": stream(&m.prefill_stream, 1),
            "decode": stream(&m.decode_stream, m.decode_steps),
        });
        v["budget"] = serde_json::to_value(&loaded.budget).unwrap_or_default();
        v["ram_budget_bytes"] = loaded.budget.as_ref().map(|b| b.ram_budget).into();
        v["expert_bytes_total"] = man.expert_bytes().into();
        v["drive_stats"] = drive_stats_json(&m.drives);
    }
    v
}

fn pct(x: Option<f64>) -> String {
    x.map(|x| format!("{:.1}%", 100.0 * x))
        .unwrap_or_else(|| "n/a".into())
}

/// Warnings after a run over a layout: copies read around or repaired. Never silent: a user
/// learns a drive served bad bytes even when the output was right.
pub(crate) fn integrity_warnings(loaded: &Loaded) -> Vec<String> {
    let Some(src) = &loaded.opened.layout else {
        return Vec::new();
    };
    let s = src.stats();
    let mut out: Vec<String> = s.repairs.iter().map(|r| format!("warning: {r}")).collect();
    let repaired = s.repairs.len() as u64;
    if s.replica_recoveries > 0 {
        out.push(format!(
            "warning: {} read(s) failed or did not match their hash and were served by another \
             copy ({repaired} range(s) rewritten); run `deltafin verify` on the layout",
            s.replica_recoveries
        ));
    }
    out
}
