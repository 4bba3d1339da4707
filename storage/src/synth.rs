//! `deltafin synth`: synthetic checkpoints in exactly the Hugging Face on-disk format
//! (config.json + bf16 safetensors, sharded with an index when large, HF tensor names), with
//! random weights from a seed, scaled so activations stay finite.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::Path;

use serde_json::{json, Value};

use crate::error::{Result, StorageError};
use crate::formats::{
    float_bytes_to_f32, fp8_quantization_config, quantize_fp8_block, ExpertFormat, FP8_BLOCK,
};
use crate::layout::Progress;
use crate::safetensors::{write_header, Dtype, TensorSpec};

/// Architectures `synth` can write.
pub const SYNTH_ARCHS: &[&str] = &["deepseek_v3", "qwen3_moe"];
/// Size presets, smallest first.
pub const PRESETS: &[&str] = &["tiny", "small", "medium", "large", "xl"];

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Init {
    /// Uniform with unit-variance output for a linear layer of this fan-in.
    Linear { fan_in: u64 },
    /// Uniform in [-scale, scale].
    Uniform(f32),
    /// All ones (norm weights).
    Ones,
    /// Part `part` of the quantized form of `SynthPlan::sources[src]` (a BF16 linear weight
    /// drawn as `synth` draws it, then quantized).
    Packed { src: usize, part: usize },
}

/// The format `synth` writes weights in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SynthFormat {
    /// Everything BF16 (the default).
    #[default]
    Bf16,
    /// DeepSeek-V3 block FP8: every projection (`*_proj*.weight`) F8_E4M3 with an F32
    /// `weight_scale_inv` per 128x128 block; embeddings, lm_head, norms and routers stay BF16.
    Fp8,
    /// Routed experts packed in this format (compressed-tensors for INT4 / MXFP4); the rest
    /// BF16.
    Experts(ExpertFormat),
}

impl std::str::FromStr for SynthFormat {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "bf16" => Ok(SynthFormat::Bf16),
            "fp8" => Ok(SynthFormat::Fp8),
            o => o
                .parse()
                .map(SynthFormat::Experts)
                .map_err(|_| format!("unknown format `{o}` (bf16, fp8, int4, mxfp4, q8)")),
        }
    }
}

impl std::fmt::Display for SynthFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SynthFormat::Bf16 => f.write_str("bf16"),
            SynthFormat::Fp8 => f.write_str("fp8"),
            SynthFormat::Experts(e) => e.fmt(f),
        }
    }
}

impl SynthFormat {
    /// `config` with the `quantization_config` this format's checkpoints carry.
    pub fn apply_to_config(self, config: &Value) -> Value {
        let mut cfg = config.clone();
        let q = match self {
            SynthFormat::Bf16 => return cfg,
            SynthFormat::Fp8 => fp8_quantization_config(),
            SynthFormat::Experts(e) => e.quantization_config(),
        };
        if let Some(o) = cfg.as_object_mut() {
            o.insert("quantization_config".into(), q);
        }
        cfg
    }

    /// Whether the linear weight `name` `[_, cols]` is stored quantized.
    fn quantizes(self, name: &str, cols: u64) -> bool {
        let Some(prefix) = name.strip_suffix(".weight") else {
            return false;
        };
        let module = prefix.rsplit('.').next().unwrap_or("");
        match self {
            SynthFormat::Bf16 => false,
            SynthFormat::Fp8 => module.contains("_proj"),
            SynthFormat::Experts(e) => name.contains(".mlp.experts.") && e.fits(cols),
        }
    }
}

#[derive(Clone, Debug)]
struct SynthTensor {
    spec: TensorSpec,
    init: Init,
}

/// The config.json for an architecture and preset, before overrides.
pub fn preset_config(arch: &str, preset: &str) -> Result<Value> {
    let bad = |what: String| StorageError::InvalidArgument(what);
    // (hidden, layers, experts, top_k, moe_inter, inter, heads, vocab)
    let (h, layers, experts, topk, im, inter, heads, vocab) = match preset {
        "tiny" => (64u64, 4u64, 16u64, 4u64, 32u64, 128u64, 4u64, 512u64),
        "small" => (512, 6, 32, 4, 256, 1024, 8, 4096),
        "medium" => (1024, 8, 64, 6, 768, 2048, 8, 8192),
        "large" => (2048, 12, 64, 6, 1408, 4096, 16, 16384),
        "xl" => (4096, 16, 64, 8, 1536, 8192, 32, 32768),
        other => {
            return Err(bad(format!(
                "unknown preset `{other}`; presets: {}",
                PRESETS.join(", ")
            )))
        }
    };
    let common = json!({
        "hidden_size": h,
        "num_hidden_layers": layers,
        "num_experts_per_tok": topk,
        "moe_intermediate_size": im,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": null,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "hidden_act": "silu",
        "use_cache": true,
    });
    let mut cfg = common.as_object().cloned().unwrap_or_default();
    let extra = match arch {
        "deepseek_v3" => {
            let (ql, kvl, rope, nope, v) = if preset == "tiny" {
                (48u64, 32u64, 8u64, 16u64, 16u64)
            } else {
                (h / 2, h / 4, 32, 64, 64)
            };
            json!({
                "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3",
                "first_k_dense_replace": 1,
                "moe_layer_freq": 1,
                "n_group": 1,
                "topk_group": 1,
                "n_routed_experts": experts,
                "n_shared_experts": 1,
                "norm_topk_prob": true,
                "routed_scaling_factor": 2.5,
                "scoring_func": "sigmoid",
                "topk_method": "noaux_tc",
                "num_key_value_heads": heads,
                "num_nextn_predict_layers": 0,
                "q_lora_rank": ql,
                "kv_lora_rank": kvl,
                "qk_rope_head_dim": rope,
                "qk_nope_head_dim": nope,
                "v_head_dim": v,
            })
        }
        "qwen3_moe" => json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": experts,
            "num_key_value_heads": (heads / 2).max(1),
            "head_dim": if preset == "tiny" { 16 } else { 64 },
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": true,
            "router_aux_loss_coef": 0.001,
            "output_router_logits": false,
            "sliding_window": null,
            "use_sliding_window": false,
            "max_window_layers": layers,
        }),
        other => {
            return Err(bad(format!(
                "synth cannot write `{other}`; it writes: {}",
                SYNTH_ARCHS.join(", ")
            )))
        }
    };
    if let Some(o) = extra.as_object() {
        cfg.extend(o.clone());
    }
    Ok(Value::Object(cfg))
}

/// Apply `key=value` overrides; values parse as JSON when they can, else as strings.
pub fn apply_overrides(cfg: &mut Value, sets: &[String]) -> Result<()> {
    for s in sets {
        let (k, v) = s.split_once('=').ok_or_else(|| {
            StorageError::InvalidArgument(format!("--set {s}: expected key=value"))
        })?;
        let value = serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.to_string()));
        if let Some(o) = cfg.as_object_mut() {
            o.insert(k.trim().to_string(), value);
        }
    }
    Ok(())
}

fn field(cfg: &Value, key: &str) -> Result<u64> {
    cfg.get(key).and_then(Value::as_u64).ok_or_else(|| {
        StorageError::InvalidArgument(format!(
            "config field `{key}` must be a non-negative integer"
        ))
    })
}

fn lin(name: String, out: u64, inp: u64) -> SynthTensor {
    SynthTensor {
        spec: TensorSpec::new(name, Dtype::Bf16, &[out, inp]),
        init: Init::Linear { fan_in: inp },
    }
}

fn norm(name: String, n: u64) -> SynthTensor {
    SynthTensor {
        spec: TensorSpec::new(name, Dtype::Bf16, &[n]),
        init: Init::Ones,
    }
}

/// The checkpoint's tensors for a config, in the order real checkpoints store them.
fn tensors_for(cfg: &Value) -> Result<Vec<SynthTensor>> {
    let arch = cfg.get("model_type").and_then(Value::as_str).unwrap_or("");
    let h = field(cfg, "hidden_size")?;
    let layers = field(cfg, "num_hidden_layers")?;
    let vocab = field(cfg, "vocab_size")?;
    let heads = field(cfg, "num_attention_heads")?;
    let inter = field(cfg, "intermediate_size")?;
    let im = field(cfg, "moe_intermediate_size")?;
    let mut v = vec![SynthTensor {
        spec: TensorSpec::new("model.embed_tokens.weight", Dtype::Bf16, &[vocab, h]),
        init: Init::Uniform(1.0),
    }];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        v.push(norm(format!("{p}.input_layernorm.weight"), h));
        let moe: bool;
        let experts: u64;
        match arch {
            "deepseek_v3" | "kimi_k2" => {
                let nope = field(cfg, "qk_nope_head_dim")?;
                let rope = field(cfg, "qk_rope_head_dim")?;
                let vd = field(cfg, "v_head_dim")?;
                let kvl = field(cfg, "kv_lora_rank")?;
                let qk = nope + rope;
                match cfg.get("q_lora_rank").and_then(Value::as_u64) {
                    Some(ql) => {
                        v.push(lin(format!("{p}.self_attn.q_a_proj.weight"), ql, h));
                        v.push(norm(format!("{p}.self_attn.q_a_layernorm.weight"), ql));
                        v.push(lin(
                            format!("{p}.self_attn.q_b_proj.weight"),
                            heads * qk,
                            ql,
                        ));
                    }
                    None => v.push(lin(format!("{p}.self_attn.q_proj.weight"), heads * qk, h)),
                }
                v.push(lin(
                    format!("{p}.self_attn.kv_a_proj_with_mqa.weight"),
                    kvl + rope,
                    h,
                ));
                v.push(norm(format!("{p}.self_attn.kv_a_layernorm.weight"), kvl));
                v.push(lin(
                    format!("{p}.self_attn.kv_b_proj.weight"),
                    heads * (nope + vd),
                    kvl,
                ));
                v.push(lin(format!("{p}.self_attn.o_proj.weight"), h, heads * vd));
                let dense = cfg
                    .get("first_k_dense_replace")
                    .and_then(Value::as_u64)
                    .unwrap_or(0);
                let freq = cfg
                    .get("moe_layer_freq")
                    .and_then(Value::as_u64)
                    .unwrap_or(1)
                    .max(1);
                experts = field(cfg, "n_routed_experts")?;
                moe = experts > 0 && l >= dense && l % freq == 0;
            }
            "qwen3_moe" => {
                let kv = field(cfg, "num_key_value_heads")?;
                let hd = cfg
                    .get("head_dim")
                    .and_then(Value::as_u64)
                    .unwrap_or(h / heads.max(1));
                v.push(lin(format!("{p}.self_attn.q_proj.weight"), heads * hd, h));
                v.push(lin(format!("{p}.self_attn.k_proj.weight"), kv * hd, h));
                v.push(lin(format!("{p}.self_attn.v_proj.weight"), kv * hd, h));
                v.push(lin(format!("{p}.self_attn.o_proj.weight"), h, heads * hd));
                v.push(norm(format!("{p}.self_attn.q_norm.weight"), hd));
                v.push(norm(format!("{p}.self_attn.k_norm.weight"), hd));
                let step = cfg
                    .get("decoder_sparse_step")
                    .and_then(Value::as_u64)
                    .unwrap_or(1)
                    .max(1);
                let only: Vec<u64> = cfg
                    .get("mlp_only_layers")
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(Value::as_u64).collect())
                    .unwrap_or_default();
                experts = field(cfg, "num_experts")?;
                moe = experts > 0 && !only.contains(&l) && (l + 1) % step == 0;
            }
            other => {
                return Err(StorageError::InvalidArgument(format!(
                    "synth cannot write `{other}`; it writes: {}",
                    SYNTH_ARCHS.join(", ")
                )))
            }
        }
        v.push(norm(format!("{p}.post_attention_layernorm.weight"), h));
        if moe {
            v.push(lin(format!("{p}.mlp.gate.weight"), experts, h));
            if arch != "qwen3_moe" {
                v.push(SynthTensor {
                    spec: TensorSpec::new(
                        format!("{p}.mlp.gate.e_score_correction_bias"),
                        Dtype::F32,
                        &[experts],
                    ),
                    init: Init::Uniform(0.01),
                });
            }
            for e in 0..experts {
                v.push(lin(format!("{p}.mlp.experts.{e}.gate_proj.weight"), im, h));
                v.push(lin(format!("{p}.mlp.experts.{e}.up_proj.weight"), im, h));
                v.push(lin(format!("{p}.mlp.experts.{e}.down_proj.weight"), h, im));
            }
            let shared = cfg
                .get("n_shared_experts")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            if arch != "qwen3_moe" && shared > 0 {
                let w = im * shared;
                v.push(lin(
                    format!("{p}.mlp.shared_experts.gate_proj.weight"),
                    w,
                    h,
                ));
                v.push(lin(format!("{p}.mlp.shared_experts.up_proj.weight"), w, h));
                v.push(lin(
                    format!("{p}.mlp.shared_experts.down_proj.weight"),
                    h,
                    w,
                ));
            }
        } else {
            v.push(lin(format!("{p}.mlp.gate_proj.weight"), inter, h));
            v.push(lin(format!("{p}.mlp.up_proj.weight"), inter, h));
            v.push(lin(format!("{p}.mlp.down_proj.weight"), h, inter));
        }
    }
    v.push(norm("model.norm.weight".into(), h));
    if !cfg
        .get("tie_word_embeddings")
        .and_then(Value::as_bool)
        .unwrap_or(false)
    {
        v.push(lin("lm_head.weight".into(), vocab, h));
    }
    Ok(v)
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fill `out` with the encoded values of elements `first..` of a tensor.
fn fill(out: &mut [u8], dtype: &Dtype, init: Init, seed: u64, first: u64) {
    let scale = match init {
        Init::Linear { fan_in } => (3.0 / fan_in.max(1) as f32).sqrt(),
        Init::Uniform(s) => s,
        Init::Ones | Init::Packed { .. } => 0.0,
    };
    let value = |j: u64| -> f32 {
        if init == Init::Ones {
            return 1.0;
        }
        let r = splitmix(seed ^ (j / 4).wrapping_mul(0xD6E8_FEB8_6659_FD93));
        let u = (r >> (16 * (j % 4))) as u16;
        (u as f32 / 32768.0 - 1.0) * scale
    };
    match dtype {
        Dtype::F32 => {
            for (k, c) in out.chunks_exact_mut(4).enumerate() {
                c.copy_from_slice(&value(first + k as u64).to_le_bytes());
            }
        }
        _ => {
            for (k, c) in out.chunks_exact_mut(2).enumerate() {
                c.copy_from_slice(&half::bf16::from_f32(value(first + k as u64)).to_le_bytes());
            }
        }
    }
}

/// What `synth` wrote.
#[derive(Debug, Clone)]
pub struct SynthSummary {
    pub bytes: u64,
    pub tensors: usize,
    pub shards: usize,
    pub expert_bytes: u64,
}

/// Write a synthetic checkpoint for `config` into `dir` (created; must not hold config.json
/// unless `force`). Shards at `shard_bytes`.
pub fn write_checkpoint(
    dir: &Path,
    config: &Value,
    seed: u64,
    shard_bytes: u64,
    force: bool,
    progress: &dyn Progress,
) -> Result<SynthSummary> {
    write_checkpoint_as(
        dir,
        config,
        SynthFormat::Bf16,
        seed,
        shard_bytes,
        force,
        progress,
    )
}

/// The seed of tensor `name`'s values.
fn tensor_seed(seed: u64, name: &str) -> u64 {
    splitmix(
        seed ^ u64::from_le_bytes(
            blake3::hash(name.as_bytes()).as_bytes()[..8]
                .try_into()
                .unwrap_or([0; 8]),
        ),
    )
}

/// The values of BF16 linear weight `spec` exactly as a BF16 synth of the same seed writes them.
fn source_values(spec: &TensorSpec, init: Init, seed: u64) -> Vec<f32> {
    let mut bytes = vec![0u8; spec.byte_len() as usize];
    fill(
        &mut bytes,
        &Dtype::Bf16,
        init,
        tensor_seed(seed, &spec.name),
        0,
    );
    float_bytes_to_f32(&Dtype::Bf16, &bytes).unwrap_or_default()
}

/// Replace every weight `format` stores quantized by its packed parts (`Init::Packed`);
/// returns the new list and the replaced sources.
fn quantized_tensors(
    tensors: Vec<SynthTensor>,
    format: SynthFormat,
) -> (Vec<SynthTensor>, Vec<SynthTensor>) {
    let mut out = Vec::with_capacity(tensors.len());
    let mut sources = Vec::new();
    for t in tensors {
        let (rows, cols) = match t.spec.shape[..] {
            [r, c] => (r, c),
            _ => (0, 0),
        };
        if !matches!(t.init, Init::Linear { .. }) || !format.quantizes(&t.spec.name, cols) {
            out.push(t);
            continue;
        }
        let prefix = t.spec.name.trim_end_matches(".weight").to_string();
        let parts: Vec<TensorSpec> = match format {
            SynthFormat::Fp8 => vec![
                TensorSpec::new(format!("{prefix}.weight"), Dtype::F8E4m3, &[rows, cols]),
                TensorSpec::new(
                    format!("{prefix}.weight_scale_inv"),
                    Dtype::F32,
                    &[
                        rows.div_ceil(FP8_BLOCK[0] as u64),
                        cols.div_ceil(FP8_BLOCK[1] as u64),
                    ],
                ),
            ],
            SynthFormat::Experts(e) => e
                .parts(&prefix, rows, cols)
                .into_iter()
                .map(|p| TensorSpec::new(p.name, p.dtype, &p.shape))
                .collect(),
            SynthFormat::Bf16 => Vec::new(),
        };
        let src = sources.len();
        for (part, spec) in parts.into_iter().enumerate() {
            out.push(SynthTensor {
                spec,
                init: Init::Packed { src, part },
            });
        }
        sources.push(t);
    }
    (out, sources)
}

/// The quantized parts of `t`, in the order [`quantized_tensors`] lists them.
fn quantize_source(t: &SynthTensor, format: SynthFormat, seed: u64) -> Vec<Vec<u8>> {
    let (rows, cols) = match t.spec.shape[..] {
        [r, c] => (r as usize, c as usize),
        _ => (0, 0),
    };
    let w = source_values(&t.spec, t.init, seed);
    match format {
        SynthFormat::Fp8 => {
            let q = quantize_fp8_block(&w, rows, cols, FP8_BLOCK);
            vec![q.data, q.scale]
        }
        SynthFormat::Experts(e) => e.encode(&w, rows, cols).0,
        SynthFormat::Bf16 => Vec::new(),
    }
}

/// [`write_checkpoint`] in `format`: the same values a BF16 synth of this seed draws, with the
/// weights `format` covers quantized (RTN) and config.json carrying its `quantization_config`.
pub fn write_checkpoint_as(
    dir: &Path,
    config: &Value,
    format: SynthFormat,
    seed: u64,
    shard_bytes: u64,
    force: bool,
    progress: &dyn Progress,
) -> Result<SynthSummary> {
    crate::checkpoint::check_model_type(&dir.join("config.json"), config)?;
    let config = &format.apply_to_config(config);
    let (tensors, sources) = quantized_tensors(tensors_for(config)?, format);
    let mut cached: Option<(usize, Vec<Vec<u8>>)> = None;
    fs::create_dir_all(dir).map_err(|e| StorageError::io(dir, "create", e))?;
    let cfg_path = dir.join("config.json");
    if cfg_path.exists() && !force {
        return Err(StorageError::LayoutExists {
            path: dir.to_path_buf(),
        });
    }
    // Remove what a previous run left so a stale index cannot point at stale shards.
    for entry in fs::read_dir(dir)
        .map_err(|e| StorageError::io(dir, "read_dir", e))?
        .flatten()
    {
        let n = entry.file_name().to_string_lossy().to_string();
        if n.ends_with(".safetensors") || n == "model.safetensors.index.json" || n == "config.json"
        {
            fs::remove_file(entry.path())
                .map_err(|e| StorageError::io(&entry.path(), "remove", e))?;
        }
    }
    // Group into shards.
    let mut shards: Vec<Vec<SynthTensor>> = vec![Vec::new()];
    let mut cur = 0u64;
    for t in tensors {
        let n = t.spec.byte_len();
        if cur > 0 && cur + n > shard_bytes {
            shards.push(Vec::new());
            cur = 0;
        }
        cur += n;
        if let Some(last) = shards.last_mut() {
            last.push(t);
        }
    }
    let total: u64 = shards.iter().flatten().map(|t| t.spec.byte_len()).sum();
    let expert_bytes: u64 = shards
        .iter()
        .flatten()
        .filter(|t| t.spec.name.contains(".mlp.experts."))
        .map(|t| t.spec.byte_len())
        .sum();
    progress.start(total, "synthesizing");
    let nshards = shards.len();
    let mut weight_map = BTreeMap::new();
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let mut count = 0;
    for (si, shard) in shards.iter().enumerate() {
        let fname = if nshards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", si + 1, nshards)
        };
        let path = dir.join(&fname);
        let tmp = dir.join(format!("{fname}.partial"));
        let file = File::create(&tmp).map_err(|e| StorageError::io(&tmp, "create", e))?;
        let mut out = BufWriter::with_capacity(8 << 20, file);
        let specs: Vec<TensorSpec> = shard.iter().map(|t| t.spec.clone()).collect();
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        write_header(&mut out, &specs, &meta).map_err(|e| StorageError::io(&tmp, "write", e))?;
        let mut buf = vec![0u8; 16 << 20];
        for t in shard {
            if let Init::Packed { src, part } = t.init {
                if cached.as_ref().map(|c| c.0) != Some(src) {
                    let parts = sources
                        .get(src)
                        .map(|s| quantize_source(s, format, seed))
                        .unwrap_or_default();
                    cached = Some((src, parts));
                }
                let bytes = cached
                    .as_ref()
                    .and_then(|c| c.1.get(part))
                    .filter(|b| b.len() as u64 == t.spec.byte_len())
                    .ok_or_else(|| {
                        StorageError::InvalidArgument(format!(
                            "synth: quantized part `{}` has the wrong length",
                            t.spec.name
                        ))
                    })?;
                out.write_all(bytes)
                    .map_err(|e| StorageError::io(&tmp, "write", e))?;
                progress.advance(bytes.len() as u64);
                weight_map.insert(t.spec.name.clone(), fname.clone());
                count += 1;
                continue;
            }
            let seed = tensor_seed(seed, &t.spec.name);
            let esize = t.spec.dtype.size_bytes().unwrap_or(1);
            let len = t.spec.byte_len();
            let mut done = 0u64;
            while done < len {
                let n = (len - done).min(buf.len() as u64) as usize;
                let chunk = &mut buf[..n];
                let per = (n / threads / 64 + 1) * 64;
                std::thread::scope(|s| {
                    for (k, part) in chunk.chunks_mut(per).enumerate() {
                        let first = (done + (k * per) as u64) / esize;
                        let dtype = &t.spec.dtype;
                        let init = t.init;
                        s.spawn(move || fill(part, dtype, init, seed, first));
                    }
                });
                out.write_all(chunk)
                    .map_err(|e| StorageError::io(&tmp, "write", e))?;
                done += n as u64;
                progress.advance(n as u64);
            }
            weight_map.insert(t.spec.name.clone(), fname.clone());
            count += 1;
        }
        let file = out
            .into_inner()
            .map_err(|e| StorageError::io(&tmp, "write", e.into_error()))?;
        file.sync_all()
            .map_err(|e| StorageError::io(&tmp, "fsync", e))?;
        fs::rename(&tmp, &path).map_err(|e| StorageError::io(&path, "rename", e))?;
    }
    if nshards > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let p = dir.join("model.safetensors.index.json");
        fs::write(&p, serde_json::to_vec_pretty(&index).unwrap_or_default())
            .map_err(|e| StorageError::io(&p, "write", e))?;
    }
    // config.json last: a checkpoint without it does not open, so an interrupted synth is obvious.
    let text = serde_json::to_vec_pretty(config).unwrap_or_default();
    crate::manifest::write_atomic(&cfg_path, &text)?;
    progress.finish();
    Ok(SynthSummary {
        bytes: total,
        tensors: count,
        shards: nshards,
        expert_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_produce_openable_checkpoints() {
        for arch in SYNTH_ARCHS {
            let dir = tempfile::tempdir().unwrap();
            let cfg = preset_config(arch, "tiny").unwrap();
            let s = write_checkpoint(
                dir.path(),
                &cfg,
                7,
                256 << 10,
                false,
                &crate::layout::NoProgress,
            )
            .unwrap();
            assert!(s.shards > 1, "256 KiB shards should split a tiny model");
            let ck = crate::checkpoint::Checkpoint::open(dir.path()).unwrap();
            assert_eq!(ck.tensors.len(), s.tensors);
            let experts = ck.experts().unwrap();
            let moe_layers = if *arch == "deepseek_v3" { 3 } else { 4 };
            assert_eq!(experts.len(), moe_layers * 16);
            // Values are finite and bounded.
            let w = ck.bytes("model.layers.1.self_attn.o_proj.weight").unwrap();
            for c in w.chunks_exact(2) {
                let x = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
                assert!(x.is_finite() && x.abs() < 1.0);
            }
            // Same seed, same bytes.
            let dir2 = tempfile::tempdir().unwrap();
            write_checkpoint(
                dir2.path(),
                &cfg,
                7,
                256 << 10,
                false,
                &crate::layout::NoProgress,
            )
            .unwrap();
            let ck2 = crate::checkpoint::Checkpoint::open(dir2.path()).unwrap();
            assert_eq!(ck.bytes("lm_head.weight"), ck2.bytes("lm_head.weight"));
        }
    }

    #[test]
    fn overrides_change_shapes() {
        let mut cfg = preset_config("deepseek_v3", "tiny").unwrap();
        apply_overrides(
            &mut cfg,
            &[
                "q_lora_rank=null".into(),
                "n_routed_experts=8".into(),
                "model_type=deepseek_v3".into(),
            ],
        )
        .unwrap();
        let t = tensors_for(&cfg).unwrap();
        assert!(t
            .iter()
            .any(|t| t.spec.name == "model.layers.0.self_attn.q_proj.weight"));
        assert!(!t.iter().any(|t| t.spec.name.contains("experts.8.")));
        assert!(apply_overrides(&mut cfg, &["nokey".into()]).is_err());
    }
}
