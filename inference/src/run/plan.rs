//! `deltafin plan`: from a model's config alone (or a layout's), a RAM size and the drives'
//! read rates, the RAM plan and the predicted decode time per token and time to first token,
//! with the cost model spelled out.
//!
//! The model (every term is in the report):
//! - **Bytes by kind** from the config's tensor list (`synth::tensors`, the same names and
//!   shapes a checkpoint of that config holds), routed experts in the config's packed format,
//!   the rest BF16 unless `dense` packs it (as `layout --quantize-dense` would).
//! - **RAM**: a reserve for the OS outside the process; the rest is what `generate
//!   --ram-budget` gets, split exactly as the runtime splits it ([`choose_residency`]): the
//!   process itself, embeddings, head and small tensors, the per-sequence state for the
//!   context, scratch, every layer's matrices held (1 byte read saved per token per byte) once
//!   the expert buffers have a floor of two layers' experts, else the fewest whole layers
//!   streamed (read every forward, two layers' buffers), and the expert cache with the rest.
//! - **Hit rate** ([`super::hit_rate`]): the cache holds the experts most likely to be chosen
//!   over all MoE layers; routing assumed uniform and independent between tokens (a floor:
//!   real routing is skewed), or as recorded by `generate --save-routing`; steady state, or
//!   `tokens` decoded after a `warm_prompt` prompt from a cold cache (`hit_rate` overrides).
//! - **Decode**: I/O time = (missed expert bytes + streamed non-expert bytes) per token over
//!   the drives' summed rate times their efficiency (striped reads measured 0.96 of the sum on
//!   4 emulated drives); compute time = the bytes every token touches over this machine's
//!   measured matrix-vector rate for their format; the critical path = non-expert compute plus,
//!   per layer, its missed experts' reads or its experts' compute, whichever is longer (a
//!   layer's misses are read once its router has run); time per token = the larger of the
//!   reads and the critical path.
//! - **TTFT**: one chunk of the prompt reads every expert some position routes to once per
//!   layer (`E (1 - (1 - k/E)^P)` expected) and the non-expert weights once; compute is the
//!   prompt's multiply-adds, by format, over the measured 32-input matrix-product rates.

use std::collections::BTreeMap;

use deltafin_storage::naming::TensorRole;
use serde::Serialize;
use serde_json::Value;

use crate::config::ModelConfig;
use crate::error::{InferenceError, Result};
use crate::family::expert_naming;
use crate::quantize::{DenseFormats, ExpertFormat};
use crate::run::hit_rate::{hit_rate, simulated_hit_rate, RoutingAssumed};
use crate::run::residency::{choose_residency, RamRequest, Residency};
use crate::streamed_layer::{layer_of, LayerWeightBytes, StreamableLayers, MIN_STREAMED_RECORD};

/// The process before its weights (binary, runtime, tokenizer), as measured on a layout's
/// `generate` (VmRSS before the resident set is read: 40-90 MiB here).
pub const RUNTIME_BASE_BYTES: u64 = 96 << 20;

/// How a plan is asked for.
#[derive(Clone, Debug)]
pub struct PlanInput {
    pub ram_bytes: u64,
    /// Read rate of each drive, bytes/s.
    pub drive_bw: Vec<f64>,
    /// Context the per-sequence state is reserved for.
    pub context: usize,
    /// Prompt length for the time to first token.
    pub prompt: usize,
    /// Non-expert weights packed as `layout --quantize-dense/-head/-embeddings` would.
    pub dense: DenseFormats,
    /// Fraction of the drives' summed rate striped reads reach.
    pub io_efficiency: f64,
    /// Expert cache hit rate to assume instead of the uniform-routing one.
    pub hit_rate: Option<f64>,
    /// Tokens of the generation the prediction averages over, from a cold cache (`None`: the
    /// steady state of a long one).
    pub tokens: Option<usize>,
    /// Prompt positions prefilled before those tokens (they warm the cache).
    pub warm_prompt: usize,
    /// Each routed expert's probability of being chosen, per decoder layer, as recorded by
    /// `generate --save-routing` (`None`: uniform routing).
    pub routing: Option<BTreeMap<usize, Vec<f64>>>,
    /// The expert cache's policy (as `generate --cache-policy`).
    pub cache_policy: deltafin_storage::store::CachePolicy,
}

/// This machine's compute rates, measured ([`super::calibrate::calibrate`]).
#[derive(Clone, Debug, Serialize)]
pub struct ComputeRates {
    /// Matrix-vector products streaming weights from DRAM, bytes/s, per format name.
    pub matvec_bytes_per_s: BTreeMap<String, f64>,
    /// Matrix products of 32 inputs (prefill), multiply-adds/s, per format name.
    pub matmul_macs_per_s: BTreeMap<String, f64>,
    pub kernels: String,
    pub threads: usize,
}

/// What the model holds, from its config.
#[derive(Clone, Debug, Serialize)]
pub struct ModelBytes {
    pub model_type: String,
    pub layers: usize,
    pub moe_layers: usize,
    pub experts_per_layer: usize,
    pub experts_per_token: usize,
    /// One routed expert (all its matrices), per MoE layer.
    pub expert_bytes: u64,
    pub expert_format: String,
    /// Every routed expert of every layer.
    pub experts_total: u64,
    /// Per-layer non-expert weights (attention, norms, routers, shared experts, dense MLPs,
    /// latent projections), all layers.
    pub layer_resident: u64,
    pub head: u64,
    pub embeddings: u64,
    /// Bytes read per token by format name (non-expert weights and the token's experts; the
    /// embeddings' one row left out).
    pub touched_per_token_by_format: BTreeMap<String, u64>,
    /// Multiply-adds per token (the same weights), total and by format name.
    pub macs_per_token: u64,
    pub macs_per_token_by_format: BTreeMap<String, u64>,
    /// Per-sequence state: bytes per position and fixed.
    pub state_per_position: u64,
    pub state_fixed: u64,
    /// What each decoder layer could stream, as a layout of this config would name it (the
    /// runtime streams whole layers' matrices: [`crate::streamed_layer`]).
    pub streamable: StreamableLayers,
    #[serde(skip)]
    pub config: ModelConfig,
}

/// The plan and its prediction.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub model: ModelBytes,
    pub ram_bytes: u64,
    pub reserve_bytes: u64,
    /// What `generate --ram-budget` gets for this plan: the RAM less the reserve.
    pub ram_budget_bytes: u64,
    pub state_bytes: u64,
    pub scratch_bytes: u64,
    /// Non-expert weights held in RAM, and read from the drives every token.
    pub resident_bytes: u64,
    pub streamed_nonexpert_bytes_per_token: u64,
    pub embeddings_resident: bool,
    pub expert_cache_bytes: u64,
    pub cached_experts_per_layer: f64,
    pub hit_rate: f64,
    pub hit_rate_assumed: String,
    /// The RAM split as `generate --ram-budget` makes it.
    pub residency: Residency,
    pub drive_bw: Vec<f64>,
    pub io_efficiency: f64,
    pub expert_bytes_per_token: u64,
    pub read_bytes_per_token: u64,
    pub decode_io_s: f64,
    pub decode_compute_s: f64,
    /// Reads of missed experts alone.
    pub decode_expert_io_s: f64,
    /// Non-expert compute, then each layer's expert reads or expert compute, whichever is
    /// longer: what a token waits for when the drives are not the limit.
    pub decode_critical_path_s: f64,
    pub decode_s_per_token: f64,
    pub tokens_per_s: f64,
    pub prompt: usize,
    pub prefill_read_bytes: u64,
    pub prefill_io_s: f64,
    pub prefill_compute_s: f64,
    pub ttft_s: f64,
    pub rates: ComputeRates,
}

/// The packed format a config's routed experts are stored in (`None`: as the dtype says).
fn expert_format_of(config: &Value) -> Option<ExpertFormat> {
    let text = config.get("text_config").unwrap_or(config);
    let q = text.get("quantization_config")?;
    let format = q.get("format").and_then(Value::as_str).unwrap_or("");
    match format {
        "pack-quantized" => Some(ExpertFormat::Int4),
        "mxfp4-pack-quantized" => Some(ExpertFormat::Mxfp4),
        "q8-group" => Some(ExpertFormat::Q8),
        _ => None,
    }
}

fn is_fp8(config: &Value) -> bool {
    let text = config.get("text_config").unwrap_or(config);
    text.get("quantization_config")
        .and_then(|q| q.get("quant_method"))
        .and_then(Value::as_str)
        == Some("fp8")
}

/// Bytes of a `[rows, cols]` weight in `f`.
fn packed_bytes(f: ExpertFormat, rows: u64, cols: u64) -> u64 {
    f.parts("w", rows, cols).iter().map(|p| p.len).sum()
}

/// What a config's model holds and reads per token.
pub fn model_bytes(config: &Value, dense: DenseFormats) -> Result<ModelBytes> {
    let cfg = ModelConfig::from_json(config)?;
    let naming = expert_naming(config)?;
    let tensors = crate::synth::tensors::tensors_for(config)?;
    let experts_format = expert_format_of(config);
    let fp8 = is_fp8(config);
    let layers = cfg.num_hidden_layers();
    let top_k = cfg.experts_per_token();
    let mut per_expert: BTreeMap<(u32, u32), u64> = BTreeMap::new();
    let mut expert_tensor_format = String::from("bf16");
    let (mut layer_resident, mut head, mut embeddings) = (0u64, 0u64, 0u64);
    let mut touched: BTreeMap<String, u64> = BTreeMap::new();
    let mut macs_by: BTreeMap<String, u64> = BTreeMap::new();
    let mut expert_macs_by_layer: BTreeMap<u32, u64> = BTreeMap::new();
    let mut streamable: BTreeMap<usize, LayerWeightBytes> = BTreeMap::new();
    for t in &tensors {
        let name = t.spec.name.as_str();
        let shape = &t.spec.shape;
        let elems: u64 = shape.iter().product();
        let (rows, cols) = match shape[..] {
            [r, c] => (r, c),
            _ => (0, 0),
        };
        let fp8_proj = fp8 && name.ends_with("_proj.weight") && rows > 0;
        match naming.role(name) {
            TensorRole::Expert { layer, expert, .. } => {
                let (bytes, fmt) = match (experts_format, fp8_proj) {
                    (Some(f), _) if rows > 0 && f.fits(cols) => {
                        (packed_bytes(f, rows, cols), f.to_string())
                    }
                    (_, true) => (
                        elems + rows.div_ceil(128) * cols.div_ceil(128) * 4,
                        "fp8".into(),
                    ),
                    _ => (t.spec.byte_len(), "bf16".into()),
                };
                expert_tensor_format = fmt;
                *per_expert.entry((layer, expert)).or_default() += bytes;
                if expert == 0 {
                    *expert_macs_by_layer.entry(layer).or_default() += elems;
                }
            }
            TensorRole::FusedExperts { .. } | TensorRole::Skipped => {}
            TensorRole::Resident => {
                let packed = if rows > 0 {
                    dense.format_for(name, rows, cols)
                } else {
                    None
                };
                let (bytes, fmt) = match packed {
                    Some(f) => (packed_bytes(f, rows, cols), f.to_string()),
                    None if fp8_proj => (
                        elems + rows.div_ceil(128) * cols.div_ceil(128) * 4,
                        "fp8".into(),
                    ),
                    None => (t.spec.byte_len(), t.spec.dtype.to_string().to_lowercase()),
                };
                let module = name
                    .trim_end_matches(".weight")
                    .rsplit('.')
                    .next()
                    .unwrap_or("");
                if module == "embed_tokens" {
                    embeddings += bytes;
                    continue;
                }
                if module == "lm_head" {
                    head += bytes;
                } else {
                    layer_resident += bytes;
                }
                // The layout's record for this tensor: streamable as `streamable_layers` says.
                if let Some(l) = layer_of(name, &naming.layers_prefix)
                    .filter(|_| rows > 1 && bytes >= MIN_STREAMED_RECORD)
                {
                    let e = streamable.entry(l).or_insert(LayerWeightBytes {
                        layer: l,
                        bytes: 0,
                        buffer_bytes: 0,
                        records: Vec::new(),
                    });
                    e.bytes += bytes;
                    e.buffer_bytes += bytes.div_ceil(4096) * 4096;
                }
                if rows > 0 {
                    *macs_by.entry(fmt.clone()).or_default() += elems;
                }
                *touched.entry(fmt).or_default() += bytes;
            }
        }
    }
    // A tied head is the embedding matrix read whole every token.
    if head == 0 {
        head = embeddings;
        *touched.entry("bf16".into()).or_default() += embeddings;
    }
    let moe_layers: Vec<u32> = {
        let mut v: Vec<u32> = per_expert.keys().map(|&(l, _)| l).collect();
        v.dedup();
        v
    };
    let experts_per_layer = per_expert
        .keys()
        .filter(|(l, _)| Some(l) == moe_layers.first())
        .count();
    let expert_bytes = per_expert.values().copied().max().unwrap_or(0);
    let experts_total: u64 = per_expert.values().sum();
    *touched.entry(expert_tensor_format.clone()).or_default() +=
        expert_bytes * top_k as u64 * moe_layers.len() as u64;
    *macs_by.entry(expert_tensor_format.clone()).or_default() +=
        expert_macs_by_layer.values().sum::<u64>() * top_k as u64;
    let (state_per_position, state_fixed) = state_bytes(&cfg);
    Ok(ModelBytes {
        model_type: cfg.model_type().to_string(),
        layers,
        moe_layers: moe_layers.len(),
        experts_per_layer,
        experts_per_token: top_k,
        expert_bytes,
        expert_format: expert_tensor_format,
        experts_total,
        layer_resident,
        head,
        embeddings,
        touched_per_token_by_format: touched,
        macs_per_token: macs_by.values().sum(),
        macs_per_token_by_format: macs_by,
        state_per_position,
        state_fixed,
        streamable: StreamableLayers {
            layers: streamable.into_values().collect(),
            resident_bytes: layer_resident + head + embeddings,
        },
        config: cfg,
    })
}

/// Per-sequence state of a config's model: bytes per position and fixed, as the mixers hold
/// it (MLA: latent + rope key per position; GQA: keys and values; KDA: the recurrent state
/// and the convolution tails, twice for rollback). Checked against the loaded models' own
/// figures in the tests.
pub(crate) fn state_bytes(cfg: &ModelConfig) -> (u64, u64) {
    const F: u64 = 4;
    match cfg {
        ModelConfig::DeepseekV3(c) => (
            c.num_hidden_layers as u64 * (c.kv_lora_rank + c.qk_rope_head_dim) as u64 * F,
            0,
        ),
        ModelConfig::Qwen3Moe(c) => (
            c.num_hidden_layers as u64 * 2 * (c.num_key_value_heads * c.head_dim) as u64 * F,
            0,
        ),
        ModelConfig::Kimi(c) => {
            let mut per_pos = 0u64;
            let mut fixed = 0u64;
            for l in 0..c.num_hidden_layers {
                if c.kda_layers.contains(&l) {
                    let ch = (c.kda_num_heads * c.kda_head_dim) as u64;
                    let s = ch * c.kda_head_dim as u64;
                    let tail = 3 * ch * c.short_conv_kernel_size.saturating_sub(1) as u64;
                    fixed += (2 * s + 2 * tail) * F;
                } else {
                    per_pos += (c.kv_lora_rank + c.qk_rope_head_dim) as u64 * F;
                }
            }
            (per_pos, fixed)
        }
    }
}

/// The formats a model's touched weights are in (what [`super::calibrate::calibrate`] needs to
/// measure).
pub fn formats_of(model: &ModelBytes) -> Vec<String> {
    model.touched_per_token_by_format.keys().cloned().collect()
}

/// The plan for `model` under `input`, on `rates`.
pub fn plan(model: ModelBytes, input: &PlanInput, rates: ComputeRates) -> Result<Plan> {
    if input.drive_bw.is_empty() || input.drive_bw.iter().any(|b| !b.is_finite() || *b <= 0.0) {
        return Err(InferenceError::InvalidArgument(
            "give every drive's read rate (--drive-bw), at least one".into(),
        ));
    }
    let ram = input.ram_bytes;
    // The OS and allocator slack outside the process's budget.
    let reserve = (1u64 << 30).max(ram / 25);
    // The runtime's own split of the rest (`generate --ram-budget`): the same function, on the
    // config's tensor list instead of a layout's records.
    let residency = choose_residency(
        &model.streamable,
        &model.config,
        (model.state_per_position, model.state_fixed),
        model.expert_bytes.div_ceil(4096) * 4096,
        RUNTIME_BASE_BYTES,
        &RamRequest {
            ram_budget: ram.saturating_sub(reserve),
            max_positions: input.context,
            chunk: crate::generate::DEFAULT_PREFILL_CHUNK,
        },
    )?;
    let state = residency.kv_reserve;
    let scratch = residency.scratch_reserve + residency.base_rss + residency.stream_buffers;
    let resident = residency.fixed_resident + residency.layer_resident;
    let streamed = residency.streamed_bytes_per_forward;
    let embeddings_resident = true;
    let cache = residency.expert_memory;
    let moe_layers = model.moe_layers.max(1) as f64;
    let cached_per_layer = if model.expert_bytes == 0 {
        0.0
    } else {
        (cache as f64 / moe_layers / model.expert_bytes as f64).min(model.experts_per_layer as f64)
    };
    let e = model.experts_per_layer.max(1) as f64;
    let k = model.experts_per_token as f64;
    let routing = RoutingAssumed::new(
        model.moe_layers,
        model.experts_per_layer,
        model.experts_per_token,
        input.routing.as_ref(),
    );
    let slots = if model.expert_bytes == 0 {
        0.0
    } else {
        cache as f64 / model.expert_bytes as f64
    };
    let window = input.tokens.map(|t| (t, input.warm_prompt));
    let (hit, assumed) = match input.hit_rate {
        Some(h) => (h.clamp(0.0, 1.0), "given".to_string()),
        None => {
            let how = if routing.recorded_layers > 0 {
                format!(
                    "recorded routing ({} of {} MoE layers; the rest uniform)",
                    routing.recorded_layers, model.moe_layers
                )
            } else {
                "uniform, independent routing".to_string()
            };
            match window {
                None => (
                    hit_rate(&routing, slots, None),
                    format!("{how}; the {slots:.0} most chosen experts cached; steady state"),
                ),
                Some((t, p)) => (
                    simulated_hit_rate(&routing, slots, (t, p), input.cache_policy),
                    format!(
                        "{how}; {t} tokens after a {p}-position prompt from a cold cache of \
                         {slots:.0} experts, the runtime's {} cache simulated",
                        input.cache_policy
                    ),
                ),
            }
        }
    };
    let expert_per_token =
        model.expert_bytes * model.experts_per_token as u64 * model.moe_layers as u64;
    let expert_read = ((1.0 - hit) * expert_per_token as f64) as u64;
    let read = expert_read + streamed;
    let bw: f64 = input.drive_bw.iter().sum::<f64>() * input.io_efficiency;
    let io_s = read as f64 / bw;
    let rate_of = |fmt: &str| {
        rates
            .matvec_bytes_per_s
            .get(fmt)
            .or_else(|| rates.matvec_bytes_per_s.get("bf16"))
            .copied()
            .unwrap_or(10e9)
    };
    let compute_s: f64 = model
        .touched_per_token_by_format
        .iter()
        .map(|(fmt, bytes)| *bytes as f64 / rate_of(fmt))
        .sum();
    // The critical path: a layer's missed experts are read once its router has chosen them,
    // so their reads overlap that layer's other experts' compute, not the attention and
    // other non-expert work (the next layer's prediction is gated off unless accurate);
    // streamed non-expert weights are read a layer ahead and overlap everything.
    let expert_compute = (expert_per_token as f64 / rate_of(&model.expert_format)).min(compute_s);
    let expert_io_s = expert_read as f64 / bw;
    let critical_s = (compute_s - expert_compute) + expert_io_s.max(expert_compute);
    let decode_s = io_s.max(critical_s);
    // Prefill: one chunk of the prompt.
    let p = input.prompt.max(1) as f64;
    let touched_experts = e * (1.0 - (1.0 - k / e).powf(p));
    let missed = touched_experts * (1.0 - hit);
    // Streamed layers are read once per prefill chunk.
    let chunks =
        (input.prompt.max(1) as u64).div_ceil(crate::generate::DEFAULT_PREFILL_CHUNK as u64);
    let prefill_read =
        (missed * moe_layers * model.expert_bytes as f64) as u64 + streamed.saturating_mul(chunks);
    let prefill_io = prefill_read as f64 / bw;
    let mut prefill_compute = 0.0;
    for (fmt, macs) in &model.macs_per_token_by_format {
        let rate = rates
            .matmul_macs_per_s
            .get(fmt)
            .or_else(|| rates.matmul_macs_per_s.get("bf16"))
            .copied()
            .unwrap_or(50e9);
        prefill_compute += p * *macs as f64 / rate;
    }
    let ttft = prefill_io.max(prefill_compute);
    Ok(Plan {
        ram_bytes: ram,
        reserve_bytes: reserve,
        ram_budget_bytes: ram.saturating_sub(reserve),
        state_bytes: state,
        scratch_bytes: scratch,
        resident_bytes: resident,
        streamed_nonexpert_bytes_per_token: streamed,
        embeddings_resident,
        expert_cache_bytes: cache,
        cached_experts_per_layer: cached_per_layer,
        hit_rate: hit,
        hit_rate_assumed: assumed,
        residency,
        drive_bw: input.drive_bw.clone(),
        io_efficiency: input.io_efficiency,
        expert_bytes_per_token: expert_per_token,
        read_bytes_per_token: read,
        decode_io_s: io_s,
        decode_compute_s: compute_s,
        decode_expert_io_s: expert_io_s,
        decode_critical_path_s: critical_s,
        decode_s_per_token: decode_s,
        tokens_per_s: 1.0 / decode_s.max(1e-12),
        prompt: input.prompt,
        prefill_read_bytes: prefill_read,
        prefill_io_s: prefill_io,
        prefill_compute_s: prefill_compute,
        ttft_s: ttft,
        model,
        rates,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::synth::presets::{preset_config, SYNTH_ARCHS};
    use crate::synth::{write_synth, SynthFormat};
    use crate::weights::WeightSource;
    use deltafin_storage::checkpoint_writer::WriteOptions;
    use deltafin_storage::layout::NoProgress;

    /// The plan's byte counts are the checkpoint's, and its state sizes the loaded model's.
    #[test]
    fn bytes_and_state_match_real_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        for arch in SYNTH_ARCHS {
            for format in [SynthFormat::Bf16, SynthFormat::Experts(ExpertFormat::Mxfp4)] {
                let d = dir.path().join(format!("{arch}-{format}"));
                let cfg = preset_config(arch, "tiny").unwrap();
                let opts = WriteOptions {
                    seed: 1,
                    shard_bytes: 1 << 30,
                    force: false,
                };
                let s = write_synth(&d, &cfg, format, &opts, &NoProgress).unwrap();
                let src = crate::DirSource::open(&d).unwrap();
                let written: Value = src.config().clone();
                let m = model_bytes(&written, DenseFormats::default()).unwrap();
                assert_eq!(m.experts_total, s.expert_bytes, "{arch} {format}");
                let model = crate::Model::load(std::sync::Arc::new(src)).unwrap();
                assert_eq!(
                    m.state_per_position,
                    model.state_bytes_per_position(),
                    "{arch}"
                );
                assert_eq!(m.state_fixed, model.fixed_state_bytes(), "{arch}");
                let all = m.experts_total + m.layer_resident + m.head + m.embeddings;
                assert!(
                    all <= s.bytes && all * 10 >= s.bytes * 9,
                    "{arch} {format}: {all} of {}",
                    s.bytes
                );
            }
        }
    }

    #[test]
    fn ram_goes_to_the_spine_first_then_the_cache() {
        let cfg = preset_config("kimi_k3", "k3-width").unwrap();
        let m = model_bytes(&cfg, DenseFormats::default()).unwrap();
        let rates = ComputeRates {
            matvec_bytes_per_s: [("bf16".to_string(), 20e9)].into(),
            matmul_macs_per_s: [("bf16".to_string(), 50e9)].into(),
            kernels: "test".into(),
            threads: 1,
        };
        let input = |ram: u64| PlanInput {
            ram_bytes: ram,
            drive_bw: vec![1e9, 1e9],
            context: 4096,
            prompt: 512,
            dense: DenseFormats::default(),
            io_efficiency: 1.0,
            hit_rate: None,
            tokens: None,
            warm_prompt: 0,
            routing: None,
            cache_policy: Default::default(),
        };
        // 8 GiB (7 for the process) holds less than the 5.5 GiB of non-expert weights plus the
        // state, scratch and expert floor: layers are
        // streamed, the experts get little more than their floor.
        let small = plan(m.clone(), &input(8 << 30), rates.clone()).unwrap();
        assert!(small.streamed_nonexpert_bytes_per_token > 0);
        let r = &small.residency;
        assert!(!r.streamed_layers.is_empty() && r.expert_memory >= r.expert_floor);
        assert!(small.hit_rate < 0.2, "{}", small.hit_rate);
        // Too little RAM even streaming every layer: an error that says how much is needed.
        let e = plan(m.clone(), &input(4 << 30), rates.clone()).unwrap_err();
        assert!(e.to_string().contains("give at least"), "{e}");
        let big = plan(m.clone(), &input(64 << 30), rates.clone()).unwrap();
        assert_eq!(big.streamed_nonexpert_bytes_per_token, 0);
        assert!(big.hit_rate > 0.99, "{}", big.hit_rate);
        assert!(big.decode_s_per_token < small.decode_s_per_token);
        // A short run from a cold cache misses each cached expert once: 32 tokens of top-8
        // over 64 experts touch 63.1 of them per layer in 256 lookups.
        let mut cold = input(64 << 30);
        cold.tokens = Some(32);
        let c = plan(m.clone(), &cold, rates.clone()).unwrap();
        // (Simulated: within a few hundredths of the expectation.)
        let expected = 1.0 - 64.0 * (1.0 - (56.0f64 / 64.0).powi(32)) / 256.0;
        assert!(
            (c.hit_rate - expected).abs() < 0.03,
            "{} vs {expected}",
            c.hit_rate
        );
        // Twice the drives, half the read time.
        let mut two = input(8 << 30);
        two.drive_bw = vec![1e9; 4];
        let p2 = plan(m, &two, rates).unwrap();
        assert!((p2.decode_io_s * 2.0 - small.decode_io_s).abs() < 1e-9);
    }
}
