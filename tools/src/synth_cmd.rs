//! `deltafin synth`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use deltafin_inference::quantize::{DenseFormats, ExpertFormat};
use deltafin_inference::synth::presets::{apply_overrides, preset_config};
use deltafin_inference::synth::{write_synth, SynthFormat};
use deltafin_storage::checkpoint_writer::WriteOptions;

use crate::progress::Bar;
use crate::util::{human, parse_size};

#[derive(clap::Args, Debug)]
pub struct SynthArgs {
    /// Output directory (created).
    #[arg(long, short)]
    pub out: PathBuf,
    /// Architecture: deepseek_v3 or qwen3_moe.
    #[arg(long, default_value = "deepseek_v3")]
    pub arch: String,
    /// Size preset: tiny (tests), small, medium (~2 GB), large (~12 GB), xl (~40 GB); k3-width
    /// (kimi_k3 only: K3's real widths with 4 layers, 64 experts, a 32K vocabulary; ~9 GB
    /// with --format mxfp4).
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Override any config.json field: --set n_routed_experts=128 --set q_lora_rank=null
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Weight format, as shipped checkpoints store it: bf16; fp8 (DeepSeek-V3 block FP8, every
    /// projection); int4 / mxfp4 (compressed-tensors, routed experts); q8 (routed experts).
    /// Values are the bf16 synth of the same seed, quantized round-to-nearest.
    #[arg(long, default_value = "bf16", value_name = "FORMAT")]
    pub format: SynthFormat,
    /// Also store every non-expert projection (attention, shared experts, dense MLPs, latent
    /// projections) packed: int4, mxfp4 or q8. Routers, norms, embeddings and lm_head stay
    /// BF16. Needs --format int4|mxfp4|q8 (the routed experts' format).
    #[arg(long, value_name = "FORMAT")]
    pub quantize_dense: Option<ExpertFormat>,
    /// Also store lm_head packed (int4, mxfp4 or q8); needs --format int4|mxfp4|q8.
    #[arg(long, value_name = "FORMAT")]
    pub quantize_head: Option<ExpertFormat>,
    /// Also store the token embeddings packed (int4, mxfp4 or q8); needs --format
    /// int4|mxfp4|q8.
    #[arg(long, value_name = "FORMAT")]
    pub quantize_embeddings: Option<ExpertFormat>,
    /// Shard size (files are split like Hugging Face checkpoints, with an index).
    #[arg(long, default_value = "2GiB", value_parser = parse_size)]
    pub shard_size: u64,
    /// Replace an existing checkpoint in --out.
    #[arg(long)]
    pub force: bool,
    #[arg(long, short)]
    pub quiet: bool,
}

pub fn run(a: &SynthArgs) -> anyhow::Result<()> {
    let mut cfg = preset_config(&a.arch, &a.preset)?;
    apply_overrides(&mut cfg, &a.sets)?;
    let t = Instant::now();
    let opts = WriteOptions {
        seed: a.seed,
        shard_bytes: a.shard_size,
        force: a.force,
    };
    let dense = DenseFormats {
        projections: a.quantize_dense,
        head: a.quantize_head,
        embeddings: a.quantize_embeddings,
    };
    let format = match (a.format, dense.any()) {
        (f, false) => f,
        (SynthFormat::Experts(experts), true) => SynthFormat::Packed { experts, dense },
        (f, true) => anyhow::bail!(
            "--quantize-dense/--quantize-head/--quantize-embeddings need --format int4|mxfp4|q8, not {f}"
        ),
    };
    let s = write_synth(&a.out, &cfg, format, &opts, &Bar::new(a.quiet))
        .with_context(|| format!("writing {}", a.out.display()))?;
    let secs = t.elapsed().as_secs_f64();
    if !a.quiet {
        eprintln!(
            "wrote {} ({} tensors, {} shard(s), routed experts {}) to {} in {:.1}s ({}/s)",
            human(s.bytes),
            s.tensors,
            s.shards,
            human(s.expert_bytes),
            a.out.display(),
            secs,
            human((s.bytes as f64 / secs.max(1e-9)) as u64)
        );
    }
    Ok(())
}
