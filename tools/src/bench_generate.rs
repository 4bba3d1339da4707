//! `deltafin bench generate LAYOUT`: generation over a layout with the standard prompts ("The
//! capital of France is", "The largest planet in our solar system is" and a 512-token prompt;
//! deterministic synthetic token ids of the same lengths when there is no tokenizer) for 128
//! and 512 new tokens, each repeated with a freshly opened layout (cold expert cache); reports
//! medians of tokens/s, TTFT, bytes read per token, hit rate, prefetch recall/precision.

use std::path::PathBuf;

use anyhow::Context;
use deltafin_inference::generate::DEFAULT_PREFILL_CHUNK;
use deltafin_inference::{CachePolicy, GenerateConfig};
use deltafin_storage::engine::HashCheck;
use serde_json::json;

use deltafin_inference::generate;
use deltafin_inference::run::measure_generation;

use crate::generate::args::SourceArgs;
use crate::generate::loaded::load;
use crate::generate::report::{integrity_warnings, summary, to_json};
use crate::util::{machine, parse_size};

/// The standard text prompts.
pub const PROMPTS: [&str; 2] = [
    "The capital of France is",
    "The largest planet in our solar system is",
];

#[derive(clap::Args, Debug)]
pub struct BenchGenerateArgs {
    /// Any drive's copy of the manifest, or the layout folder holding it (or a model dir).
    pub layout: PathBuf,
    /// Generated tokens per run (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "128,512")]
    pub new_tokens: Vec<usize>,
    /// Length of the long prompt.
    #[arg(long, default_value_t = 512)]
    pub long_prompt: usize,
    /// Which prompts: short (the two text prompts), long, or all.
    #[arg(long, default_value = "all")]
    pub prompts: String,
    /// Runs per (prompt, length); medians are reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    #[arg(long, value_parser = parse_size)]
    pub ram_budget: Option<u64>,
    #[arg(long, default_value = "lfu")]
    pub cache_policy: CachePolicy,
    #[arg(long)]
    pub no_prefetch: bool,
    /// Decoder layers whose non-expert weights are streamed: auto, none, all or 1,3,5.
    #[arg(long, default_value = "auto")]
    pub stream_layers: deltafin_inference::run::StreamChoice,
    #[arg(long, default_value_t = DEFAULT_PREFILL_CHUNK)]
    pub prefill_chunk: usize,
    #[arg(long, default_value_t = 4)]
    pub threads_per_drive: usize,
    #[arg(long, default_value = "all")]
    pub hash_check: HashCheck,
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Print one JSON object (runs and medians).
    #[arg(long)]
    pub json: bool,
}

/// Deterministic synthetic prompt ids (a fixed LCG), avoiding ids 0 and 1 (BOS/EOS).
pub fn synthetic_prompt(len: usize, vocab: usize, salt: u64) -> Vec<u32> {
    let mut x = 0x2545_F491_4F6C_DD1Du64 ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..len)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (2 + (x >> 33) % (vocab.max(3) as u64 - 2)) as u32
        })
        .collect()
}

pub fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    })
}

pub fn run(a: &BenchGenerateArgs) -> anyhow::Result<()> {
    let source = SourceArgs {
        model: a.layout.clone(),
        threads_per_drive: a.threads_per_drive,
        hash_check: a.hash_check,
        ram_budget: a.ram_budget,
        cache_policy: a.cache_policy,
        no_prefetch: a.no_prefetch,
        pace_drives: None,
        stream_layers: a.stream_layers.clone(),
        prefill_chunk: a.prefill_chunk,
        tokenizer: a.tokenizer.clone(),
        quiet: true,
    };
    // Prompts: tokenized when a tokenizer is there, else synthetic ids of similar length.
    let longest = a.long_prompt.max(64) + a.new_tokens.iter().copied().max().unwrap_or(0);
    let probe = load(&source, &|_, _| Ok(longest))?;
    let vocab = probe.model().vocab_size();
    let mut prompts: Vec<(String, Vec<u32>)> = Vec::new();
    if a.prompts == "all" || a.prompts == "short" {
        for (i, p) in PROMPTS.iter().enumerate() {
            let ids = match probe.encode(p)? {
                Some(ids) => ids,
                None => synthetic_prompt(p.split_whitespace().count() + 1, vocab, i as u64),
            };
            prompts.push((p.to_string(), ids));
        }
    }
    if a.prompts == "all" || a.prompts == "long" {
        prompts.push((
            format!("synthetic {}-token prompt", a.long_prompt),
            synthetic_prompt(a.long_prompt, vocab, 99),
        ));
    }
    anyhow::ensure!(!prompts.is_empty(), "--prompts: use short, long or all");
    drop(probe);

    let mut rows = Vec::new();
    for (name, ids) in &prompts {
        for &n in &a.new_tokens {
            let mut runs = Vec::new();
            for r in 0..a.repeats.max(1) {
                // A fresh layout each run: cold expert cache, counters from zero.
                let mut loaded = load(&source, &|_, _| Ok(ids.len() + n))?;
                loaded.apply_budget(&source, ids.len() + n)?;
                let model = loaded.model();
                let mut config = GenerateConfig::for_model(model, n);
                config.stop_tokens.clear();
                config.prefill_chunk = a.prefill_chunk;
                let m = measure_generation(
                    loaded.opened.layout.as_deref(),
                    &mut |_| true,
                    &mut |on_tok| generate(model, &mut model.new_session(), ids, &config, on_tok),
                )
                .with_context(|| format!("generating from `{name}`"))?;
                let mut v = to_json(&m, &loaded, ids);
                v["prompt"] = name.clone().into();
                v["repeat"] = r.into();
                if let Some(o) = v.as_object_mut() {
                    o.remove("token_ids");
                    o.remove("prompt_ids");
                    o.remove("machine");
                }
                eprintln!("{name} n={n} #{r}: {}", summary(&m, &loaded, ids.len()));
                for w in integrity_warnings(&loaded) {
                    eprintln!("{w}");
                }
                runs.push(v);
                drop(loaded);
            }
            let med = |k: &str| median(runs.iter().filter_map(|v| v[k].as_f64()).collect());
            let row = json!({
                "prompt": name,
                "prompt_tokens": ids.len(),
                "new_tokens": n,
                "tokens_per_s_median": med("tokens_per_s"),
                "ttft_s_median": med("ttft_s"),
                "decode_s_per_token_median": med("decode_s_per_token"),
                "bytes_read_per_token_median": med("bytes_read_per_token"),
                "bytes_read_per_prompt_token_median": med("bytes_read_per_prompt_token"),
                "expert_cache_hit_rate_median": med("expert_cache_hit_rate"),
                "prefetch_recall_median": med("prefetch_recall"),
                "prefetch_precision_median": med("prefetch_precision"),
                "io_stall_s_median": med("io_stall_s"),
                "decode_io_stall_s_median": med("decode_io_stall_s"),
                "compute_s_median": med("compute_s"),
                "peak_rss_bytes_max": runs.iter().filter_map(|v| v["peak_rss_bytes"].as_u64()).max(),
                "runs": runs,
            });
            if !a.json {
                println!(
                    "{name} ({} prompt tokens), {n} new: {:.2} tokens/s, TTFT {:.3} s, {:.0} bytes/token (medians of {})",
                    ids.len(),
                    row["tokens_per_s_median"].as_f64().unwrap_or(f64::NAN),
                    row["ttft_s_median"].as_f64().unwrap_or(f64::NAN),
                    row["bytes_read_per_token_median"].as_f64().unwrap_or(f64::NAN),
                    a.repeats.max(1)
                );
            }
            rows.push(row);
        }
    }
    if a.json {
        let first = rows
            .first()
            .and_then(|r| r["runs"].get(0))
            .cloned()
            .unwrap_or_default();
        println!(
            "{}",
            json!({
                "bench": "generate",
                "layout": first["layout"],
                "model": first["model"],
                "mode": first["mode"],
                "drives": first["drives"],
                "cache_policy": a.cache_policy.to_string(),
                "next_layer_prefetch": !a.no_prefetch,
                "ram_budget_bytes": first["ram_budget_bytes"],
                "repeats": a.repeats,
                "machine": machine(),
                "rows": rows,
            })
        );
    }
    Ok(())
}
