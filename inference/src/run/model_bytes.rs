//! What a model holds, by kind and format, from its config alone: the byte and
//! multiply-add counts `deltafin plan` predicts from (see [`super::plan`]).

use std::collections::BTreeMap;

use deltafin_storage::naming::TensorRole;
use serde::Serialize;
use serde_json::Value;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::family::expert_naming;
use crate::quantize::{DenseFormats, ExpertFormat};
use crate::streamed_layer::{layer_of, LayerWeightBytes, StreamableLayers, MIN_STREAMED_RECORD};

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
