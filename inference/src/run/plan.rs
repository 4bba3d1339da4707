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

use serde::Serialize;

use crate::error::{InferenceError, Result};
use crate::quantize::DenseFormats;
use crate::run::hit_rate::{hit_rate, simulated_hit_rate, RoutingAssumed};
pub use crate::run::model_bytes::{formats_of, model_bytes, ModelBytes};
use crate::run::residency::{choose_residency, RamRequest, Residency};

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
    use crate::quantize::ExpertFormat;
    use crate::synth::presets::{preset_config, SYNTH_ARCHS};
    use crate::synth::{write_synth, SynthFormat};
    use crate::weights::WeightSource;
    use deltafin_storage::checkpoint_writer::WriteOptions;
    use deltafin_storage::layout::NoProgress;
    use serde_json::Value;

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
