//! `deltafin plan`: the RAM plan and predicted speed of a model on a machine, from its
//! config alone (or a layout's), the RAM size and the drives' read rates; the cost model is
//! `deltafin_inference::run::plan`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use deltafin_inference::model::RoutingCounts;
use deltafin_inference::quantize::{DenseFormats, ExpertFormat};
use deltafin_inference::run::calibrate::calibrate;
use deltafin_inference::run::plan::{formats_of, model_bytes, plan, PlanInput};
use deltafin_storage::manifest::Manifest;

use crate::util::{human, machine, parse_size};

#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// A folder holding the model's config.json (no weights needed), a checkpoint, or a
    /// layout (its manifest.json or folder).
    #[arg(long)]
    pub model: PathBuf,
    /// RAM of the machine (e.g. 64G; binary units).
    #[arg(long, value_parser = parse_size)]
    pub ram: u64,
    /// Read rate of one drive, bytes/s in decimal units as drives are rated (7G = 7e9;
    /// 3500M; 2GiB for binary): one per drive, 1-4 (measure yours with `deltafin bench io`).
    #[arg(long = "drive-bw", value_parser = parse_rate, required = true)]
    pub drive_bw: Vec<f64>,
    /// Context to reserve the per-sequence state for.
    #[arg(long, default_value_t = 4096)]
    pub context: usize,
    /// Prompt length for the time to first token.
    #[arg(long, default_value_t = 512)]
    pub prompt: usize,
    /// Assume the non-expert projections packed (layout --quantize-dense): int4, mxfp4, q8.
    #[arg(long, value_name = "FORMAT")]
    pub quantize_dense: Option<ExpertFormat>,
    /// Assume lm_head packed (layout --quantize-head).
    #[arg(long, value_name = "FORMAT")]
    pub quantize_head: Option<ExpertFormat>,
    /// Assume the embeddings packed (layout --quantize-embeddings).
    #[arg(long, value_name = "FORMAT")]
    pub quantize_embeddings: Option<ExpertFormat>,
    /// Fraction of the drives' summed rate reads reach (measured 0.96 striped over 4
    /// emulated drives, benches/results/io_scaling.json).
    #[arg(long, default_value_t = 0.96)]
    pub io_efficiency: f64,
    /// Expert cache hit rate to assume (default: uniform independent routing, a floor).
    #[arg(long)]
    pub hit_rate: Option<f64>,
    /// Predict the average over this many decoded tokens from a cold expert cache (after a
    /// --warm-prompt prompt) instead of the steady state.
    #[arg(long)]
    pub tokens: Option<usize>,
    /// With --tokens: the prompt positions prefilled before them, which warm the cache.
    #[arg(long, default_value_t = 0, requires = "tokens")]
    pub warm_prompt: usize,
    /// Expert choices recorded by `generate --save-routing FILE` on this model: the hit rate
    /// from how often each expert is chosen instead of uniform routing.
    #[arg(long, value_name = "FILE")]
    pub routing: Option<PathBuf>,
    /// The expert cache policy the runtime will use (generate --cache-policy).
    #[arg(long, default_value = "lfu")]
    pub cache_policy: deltafin_storage::store::CachePolicy,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// A rate in bytes/s: decimal units (k, M, G, T), `KiB`/`MiB`/`GiB` binary, `/s` optional.
pub fn parse_rate(s: &str) -> Result<f64, String> {
    let t = s.trim().trim_end_matches("/s");
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("`{s}` is not a rate"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1048576.0,
        "gib" => 1073741824.0,
        other => return Err(format!("unknown rate unit `{other}` in `{s}`")),
    };
    let v = n * mult;
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("`{s}`: a rate above 0"));
    }
    Ok(v)
}

/// The config.json of a model folder, a checkpoint or a layout.
fn load_config(path: &Path) -> anyhow::Result<serde_json::Value> {
    let manifest = if path.is_dir() {
        path.join("manifest.json")
    } else {
        path.to_path_buf()
    };
    if manifest.file_name().is_some_and(|n| n == "manifest.json") && manifest.is_file() {
        let m =
            Manifest::load(&manifest).with_context(|| format!("reading {}", manifest.display()))?;
        return Ok(m.config);
    }
    let cfg = path.join("config.json");
    let text = std::fs::read(&cfg).with_context(|| format!("reading {}", cfg.display()))?;
    serde_json::from_slice(&text).with_context(|| format!("parsing {}", cfg.display()))
}

pub fn run(a: &PlanArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=4).contains(&a.drive_bw.len()),
        "--drive-bw: one per drive, 1-4 drives"
    );
    anyhow::ensure!(
        a.io_efficiency > 0.0 && a.io_efficiency <= 1.0,
        "--io-efficiency: a fraction in (0, 1]"
    );
    let config = load_config(&a.model)?;
    let dense = DenseFormats {
        projections: a.quantize_dense,
        head: a.quantize_head,
        embeddings: a.quantize_embeddings,
    };
    let model = model_bytes(&config, dense)
        .with_context(|| format!("the config of {}", a.model.display()))?;
    if !a.json {
        eprintln!("measuring this machine's kernels (about two seconds)...");
    }
    let routing = match &a.routing {
        Some(f) => Some(
            RoutingCounts::load(
                f,
                &model.model_type,
                model.layers,
                model.experts_per_layer,
                model.experts_per_token,
            )?
            .probabilities(model.experts_per_layer),
        ),
        None => None,
    };
    let rates = calibrate(&formats_of(&model));
    let input = PlanInput {
        ram_bytes: a.ram,
        drive_bw: a.drive_bw.clone(),
        context: a.context,
        prompt: a.prompt,
        dense,
        io_efficiency: a.io_efficiency,
        hit_rate: a.hit_rate,
        tokens: a.tokens,
        warm_prompt: a.warm_prompt,
        routing,
        cache_policy: a.cache_policy,
    };
    let p = plan(model, &input, rates)?;
    if a.json {
        let mut v = serde_json::to_value(&p)?;
        v["machine"] = machine();
        println!("{v}");
        return Ok(());
    }
    let m = &p.model;
    let gb = |b: f64| format!("{:.2} GB/s", b / 1e9);
    println!(
        "{} ({} layers, {} with {} routed experts, top {}; experts {})",
        m.model_type,
        m.layers,
        m.moe_layers,
        m.experts_per_layer,
        m.experts_per_token,
        m.expert_format
    );
    println!("bytes:");
    println!(
        "  routed experts        {:>10}  ({} per expert)",
        human(m.experts_total),
        human(m.expert_bytes)
    );
    println!(
        "  per-layer non-expert  {:>10}  (attention, norms, routers, shared/dense MLPs)",
        human(m.layer_resident)
    );
    println!("  lm_head               {:>10}", human(m.head));
    println!("  embeddings            {:>10}", human(m.embeddings));
    println!(
        "  state                 {:>10}  ({} per position + {} fixed; context {})",
        human(p.state_bytes),
        human(m.state_per_position),
        human(m.state_fixed),
        a.context
    );
    println!("RAM plan ({}):", human(p.ram_bytes));
    println!(
        "  reserve (OS, runtime) {:>10}  (the rest is `generate --ram-budget {}`)",
        human(p.reserve_bytes),
        p.ram_budget_bytes
    );
    println!(
        "  state + scratch       {:>10}",
        human(p.state_bytes + p.scratch_bytes)
    );
    let r = &p.residency;
    println!(
        "  non-expert resident   {:>10}  (embeddings, head, small tensors {}; {} of {} layers' \
         matrices)",
        human(p.resident_bytes),
        human(r.fixed_resident),
        m.streamable.layers.len() - r.streamed_layers.len(),
        m.streamable.layers.len()
    );
    println!(
        "  non-expert streamed   {:>10}  per token: layers {:?} (read every forward; buffers {})",
        human(p.streamed_nonexpert_bytes_per_token),
        r.streamed_layers,
        human(r.stream_buffers)
    );
    println!(
        "  expert cache          {:>10}  ({:.1} experts per MoE layer; hit rate {:.1}%: {})",
        human(p.expert_cache_bytes),
        p.cached_experts_per_layer,
        100.0 * p.hit_rate,
        p.hit_rate_assumed
    );
    println!("decode, per token:");
    println!(
        "  expert bytes          {:>10}  ({} experts x {} MoE layers)",
        human(p.expert_bytes_per_token),
        m.experts_per_token,
        m.moe_layers
    );
    println!(
        "  read from drives      {:>10}  at {} ({} drive(s) x efficiency {:.2}) = {:.3} s",
        human(p.read_bytes_per_token),
        gb(p.drive_bw.iter().sum::<f64>() * p.io_efficiency),
        p.drive_bw.len(),
        p.io_efficiency,
        p.decode_io_s
    );
    let touched: Vec<String> = m
        .touched_per_token_by_format
        .iter()
        .map(|(f, b)| {
            format!(
                "{} {f} at {}",
                human(*b),
                gb(p.rates.matvec_bytes_per_s.get(f).copied().unwrap_or(0.0))
            )
        })
        .collect();
    println!(
        "  compute               {:>10.3} s  ({}; measured here, {} kernels, {} threads)",
        p.decode_compute_s,
        touched.join(", "),
        p.rates.kernels,
        p.rates.threads
    );
    println!(
        "  critical path         {:>10.3} s  (non-expert compute, then per layer its missed \
         experts' reads ({:.3} s in all) or their compute, whichever is longer)",
        p.decode_critical_path_s, p.decode_expert_io_s
    );
    println!(
        "  => {:.3} s per token ({:.2} tokens/s): the larger of the reads and the critical path",
        p.decode_s_per_token, p.tokens_per_s
    );
    println!("time to first token, {}-token prompt:", p.prompt);
    let macs: Vec<String> = m
        .macs_per_token_by_format
        .iter()
        .map(|(f, n)| {
            format!(
                "{:.2e} {f} at {:.0} G/s",
                *n as f64,
                p.rates.matmul_macs_per_s.get(f).copied().unwrap_or(0.0) / 1e9
            )
        })
        .collect();
    println!(
        "  reads {} = {:.2} s; compute {:.2} s ({} multiply-adds per token x {} tokens)",
        human(p.prefill_read_bytes),
        p.prefill_io_s,
        p.prefill_compute_s,
        macs.join(", "),
        p.prompt
    );
    println!("  => {:.2} s", p.ttft_s);

    Ok(())
}
