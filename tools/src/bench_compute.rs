//! `deltafin bench compute MODEL`: prefill and decode speed of one loaded model, measured the
//! way llama.cpp's `llama-bench` measures them, so the two can stand side by side: the model
//! is opened once, one untimed warm-up generation runs first (it maps the weights and fills the
//! caches, as llama-bench's warm-up does), then each run starts a fresh session and times
//! prefill (`--prompt` tokens to the first token's logits) and decode (`--decode` tokens after
//! a one-token prompt). Reports every run and the medians.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use deltafin_inference::generate::DEFAULT_PREFILL_CHUNK;
use deltafin_inference::{generate, spans, GenerateConfig, KernelConfig};
use deltafin_storage::engine::HashCheck;
use serde_json::json;

use crate::bench_generate::{median, synthetic_prompt};
use crate::generate::args::SourceArgs;
use crate::generate::loaded::load;
use crate::util::{machine, parse_size};

#[derive(clap::Args, Debug)]
pub struct BenchComputeArgs {
    /// A model directory (config.json + safetensors) or a layout.
    pub model: PathBuf,
    /// Prompt tokens of the prefill runs (synthetic ids).
    #[arg(long, default_value_t = 512)]
    pub prompt: usize,
    /// Tokens generated in the decode runs, after a one-token prompt.
    #[arg(long, default_value_t = 128)]
    pub decode: usize,
    /// Timed runs of each; medians are reported.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    #[arg(long, value_parser = parse_size)]
    pub ram_budget: Option<u64>,
    #[arg(long, default_value_t = DEFAULT_PREFILL_CHUNK)]
    pub prefill_chunk: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Time the forward pass's phases (built-in span timer) and print where a prefill and a
    /// decoded token spend their time.
    #[arg(long)]
    pub profile: bool,
}

/// Span totals summed over runs.
#[derive(Default)]
struct PhaseSums(Vec<spans::PhaseTime>);

impl PhaseSums {
    /// Add what the timer has gathered since its last reset, then reset it.
    fn take(&mut self) {
        for p in spans::report() {
            match self.0.iter_mut().find(|q| q.phase == p.phase) {
                Some(q) => {
                    q.calls += p.calls;
                    q.total_s += p.total_s;
                    q.self_s += p.self_s;
                }
                None => self.0.push(p),
            }
        }
        spans::reset();
    }

    /// Per unit (a prefill, a decoded token), in milliseconds.
    fn json(&self, units: f64) -> serde_json::Value {
        self.0
            .iter()
            .map(|p| {
                json!({"phase": p.phase, "parent": p.parent, "calls": p.calls as f64 / units,
                       "total_ms": 1e3 * p.total_s / units, "self_ms": 1e3 * p.self_s / units})
            })
            .collect()
    }

    fn print(&self, what: &str, units: f64) {
        let forward = self
            .0
            .iter()
            .find(|p| p.phase == "forward")
            .map_or(0.0, |p| p.total_s);
        eprintln!(
            "{what}: {:.3} ms in the forward pass",
            1e3 * forward / units
        );
        eprintln!(
            "  {:24} {:>10} {:>10} {:>7}",
            "phase", "self ms", "total ms", "self %"
        );
        for p in &self.0 {
            eprintln!(
                "  {:24} {:10.3} {:10.3} {:6.1}%",
                p.phase,
                1e3 * p.self_s / units,
                1e3 * p.total_s / units,
                100.0 * p.self_s / forward.max(1e-12)
            );
        }
    }
}

pub fn run(a: &BenchComputeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.prompt > 0 && a.decode > 0,
        "--prompt and --decode must be at least 1"
    );
    let source = SourceArgs {
        model: a.model.clone(),
        threads_per_drive: 4,
        hash_check: HashCheck::All,
        ram_budget: a.ram_budget,
        cache_policy: Default::default(),
        no_prefetch: false,
        pace_drives: None,
        stream_layers: Default::default(),
        prefill_chunk: a.prefill_chunk,
        tokenizer: None,
        quiet: true,
    };
    let mut loaded = load(&source, &|_, _| Ok(a.prompt.max(a.decode + 1)))?;
    loaded.apply_budget(&source, a.prompt.max(a.decode + 1))?;
    let model = loaded.model();
    let vocab = model.vocab_size();
    let prompt = synthetic_prompt(a.prompt, vocab, 1);
    let one = synthetic_prompt(1, vocab, 2);
    let config = |n: usize| {
        let mut c = GenerateConfig::for_model(model, n);
        c.stop_tokens.clear();
        c.prefill_chunk = a.prefill_chunk;
        c
    };
    // Returns the times at which each token came.
    let timed = |ids: &[u32], n: usize| -> anyhow::Result<(Instant, Vec<Instant>)> {
        let mut times = Vec::with_capacity(n);
        let start = Instant::now();
        generate(
            model,
            &mut model.new_session(),
            ids,
            &config(n),
            &mut |_| {
                times.push(Instant::now());
                true
            },
        )
        .context("generating")?;
        Ok((start, times))
    };
    // Warm-up: one prefill and a few decode steps, untimed.
    timed(&prompt, 4)?;
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    let (mut prefill_spans, mut decode_spans) = (PhaseSums::default(), PhaseSums::default());
    spans::set_enabled(a.profile);
    spans::reset();
    for _ in 0..a.runs.max(1) {
        let (start, times) = timed(&prompt, 1)?;
        prefill_spans.take();
        let ttft = times.first().map(|t| t.duration_since(start).as_secs_f64());
        prefill.push(ttft.map(|s| a.prompt as f64 / s).unwrap_or(f64::NAN));
        // The one-token prompt's forward is timed with the decode steps' (it is one).
        let (_, times) = timed(&one, a.decode + 1)?;
        decode_spans.take();
        let rate = match (times.first(), times.last()) {
            (Some(f), Some(l)) if times.len() > 1 => {
                (times.len() - 1) as f64 / l.duration_since(*f).as_secs_f64()
            }
            _ => f64::NAN,
        };
        decode.push(rate);
    }
    spans::set_enabled(false);
    let isa = KernelConfig::default().label();
    let (pm, dm) = (median(prefill.clone()), median(decode.clone()));
    let runs = a.runs.max(1) as f64;
    // Decode runs: `decode + 1` one-position forwards each (the prompt's, then every
    // generated token's but the last).
    let decode_units = runs * (a.decode + 1) as f64;
    if a.profile {
        prefill_spans.print(&format!("prefill of {} tokens", a.prompt), runs);
        decode_spans.print("decode, per token", decode_units);
    }
    let profile = a.profile.then(|| {
        json!({"prefill_per_run": prefill_spans.json(runs),
               "decode_per_token": decode_spans.json(decode_units)})
    });
    if a.json {
        println!(
            "{}",
            json!({
                "bench": "compute",
                "model": a.model.display().to_string(),
                "kernels": isa,
                "threads": rayon::current_num_threads(),
                "prompt_tokens": a.prompt,
                "decode_tokens": a.decode,
                "prefill_tokens_per_s": prefill,
                "decode_tokens_per_s": decode,
                "prefill_tokens_per_s_median": pm,
                "decode_tokens_per_s_median": dm,
                "machine": machine(),
                "profile": profile,
            })
        );
    } else {
        println!(
            "prefill {} tokens: {:.1} tokens/s; decode {} tokens: {:.2} tokens/s (medians of {}, kernels {isa})",
            a.prompt,
            pm.unwrap_or(f64::NAN),
            a.decode,
            dm.unwrap_or(f64::NAN),
            a.runs.max(1)
        );
    }
    Ok(())
}
