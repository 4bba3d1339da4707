//! `deltafin synth`: synthetic checkpoints in exactly the Hugging Face on-disk format
//! (config.json + BF16 safetensors, sharded with an index when large, HF tensor names), with
//! random weights from a seed, scaled so activations stay finite; optionally with the weights a
//! released quantized checkpoint packs stored in that format (RTN from the same BF16 values).
//!
//! [`presets`] gives the config, [`tensors`] the tensor list of each architecture ([`kimi`] for
//! Kimi Linear and Kimi K3, built from the pieces in [`planned`]); this file replaces the
//! packed weights and hands everything to the storage crate's checkpoint writer.

pub mod kimi;
pub mod planned;
pub mod presets;
pub mod tensors;

use std::path::Path;

use deltafin_formats::quantize::{quantize_fp8_block, FP8_BLOCK};
use deltafin_formats::Dtype;
use deltafin_storage::checkpoint_writer::{
    drawn_values, write_checkpoint, Fill, PlannedTensor, WriteOptions,
};
use deltafin_storage::layout::Progress;
use deltafin_storage::naming::TensorRole;
use deltafin_storage::safetensors::TensorSpec;
use serde_json::Value;

use crate::error::Result;
use crate::family::expert_naming;
pub use crate::quantize::expert_format::is_dense_projection;
use crate::quantize::expert_format::{fp8_quantization_config, DenseFormats, ExpertFormat};

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
    /// Routed experts in `experts` and the resident weights `dense` names packed too (every
    /// other projection: attention, shared experts, dense MLPs, latent projections; `lm_head`;
    /// the embeddings); routers and norms stay BF16 (`synth --format F --quantize-dense D
    /// [--quantize-head H] [--quantize-embeddings E]`; llama.cpp's Q8_0 / Q4_K_M quantize
    /// these too).
    Packed {
        experts: ExpertFormat,
        dense: DenseFormats,
    },
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
            SynthFormat::Packed { experts, dense } => write!(f, "{experts}+{dense}"),
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
            SynthFormat::Packed { experts, dense } => experts.quantization_config_with_dense(dense),
        };
        // Kimi K3 keeps the text model's quantization_config in text_config.
        let target = if cfg.get("model_type").and_then(Value::as_str) == Some("kimi_k3") {
            cfg.get_mut("text_config")
        } else {
            Some(&mut cfg)
        };
        if let Some(o) = target.and_then(Value::as_object_mut) {
            o.insert("quantization_config".into(), q);
        }
        cfg
    }

    /// Whether the linear weight `name` `[rows, cols]` is stored quantized.
    fn quantizes(self, name: &str, rows: u64, cols: u64, is_expert: &dyn Fn(&str) -> bool) -> bool {
        let Some(prefix) = name.strip_suffix(".weight") else {
            return false;
        };
        let module = prefix.rsplit('.').next().unwrap_or("");
        match self {
            SynthFormat::Bf16 => false,
            SynthFormat::Fp8 => module.contains("_proj"),
            SynthFormat::Experts(_) | SynthFormat::Packed { .. } => {
                self.packed_format(name, rows, cols, is_expert).is_some()
            }
        }
    }

    /// The packed format the 2-D weight `name` `[rows, cols]` is stored in (`None`: kept as
    /// it is).
    fn packed_format(
        self,
        name: &str,
        rows: u64,
        cols: u64,
        is_expert: &dyn Fn(&str) -> bool,
    ) -> Option<ExpertFormat> {
        match self {
            SynthFormat::Experts(e) => (is_expert(name) && e.fits(cols)).then_some(e),
            SynthFormat::Packed { experts, dense } => {
                if is_expert(name) {
                    experts.fits(cols).then_some(experts)
                } else {
                    dense.format_for(name, rows, cols)
                }
            }
            SynthFormat::Bf16 | SynthFormat::Fp8 => None,
        }
    }
}

/// What `synth` wrote.
#[derive(Debug, Clone)]
pub struct SynthSummary {
    pub bytes: u64,
    pub tensors: usize,
    pub shards: usize,
    /// Bytes of routed-expert tensors.
    pub expert_bytes: u64,
}

/// Replace every weight `format` stores quantized by its packed parts (`Init::Packed`);
/// returns the new list and the replaced sources with their packed format.
fn quantized_tensors(
    tensors: Vec<PlannedTensor>,
    format: SynthFormat,
    is_expert: &dyn Fn(&str) -> bool,
) -> (
    Vec<PlannedTensor>,
    Vec<(PlannedTensor, Option<ExpertFormat>)>,
) {
    let mut out = Vec::with_capacity(tensors.len());
    let mut sources = Vec::new();
    let mut formats = Vec::new();
    for t in tensors {
        let (rows, cols) = match t.spec.shape[..] {
            [r, c] => (r, c),
            _ => (0, 0),
        };
        if !matches!(t.fill, Fill::Linear { .. } | Fill::Uniform(_))
            || !format.quantizes(&t.spec.name, rows, cols, is_expert)
        {
            out.push(t);
            continue;
        }
        let prefix = t.spec.name.trim_end_matches(".weight").to_string();
        let packed = format.packed_format(&t.spec.name, rows, cols, is_expert);
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
            SynthFormat::Experts(_) | SynthFormat::Packed { .. } => packed
                .map(|e| e.parts(&prefix, rows, cols))
                .unwrap_or_default()
                .into_iter()
                .map(|p| TensorSpec::new(p.name, p.dtype, &p.shape))
                .collect(),
            SynthFormat::Bf16 => Vec::new(),
        };
        let src = sources.len();
        formats.push(packed);
        for (part, spec) in parts.into_iter().enumerate() {
            out.push(PlannedTensor {
                spec,
                fill: Fill::Computed { group: src, part },
            });
        }
        sources.push(t);
    }
    (out, sources.into_iter().zip(formats).collect())
}

/// The quantized parts of `t`, in the order [`quantized_tensors`] lists them.
fn quantize_source(
    t: &PlannedTensor,
    packed: Option<ExpertFormat>,
    format: SynthFormat,
    seed: u64,
) -> Vec<Vec<u8>> {
    let (rows, cols) = match t.spec.shape[..] {
        [r, c] => (r as usize, c as usize),
        _ => (0, 0),
    };
    let w = drawn_values(&t.spec, t.fill, seed);
    match format {
        SynthFormat::Fp8 => {
            let q = quantize_fp8_block(&w, rows, cols, FP8_BLOCK);
            vec![q.data, q.scale]
        }
        SynthFormat::Experts(_) | SynthFormat::Packed { .. } => packed
            .map(|e| e.encode(&w, rows, cols).0)
            .unwrap_or_default(),
        SynthFormat::Bf16 => Vec::new(),
    }
}

/// Write a synthetic checkpoint for `config` into `dir` in `format`: the values a BF16 synth of
/// this seed draws, with the weights `format` covers quantized (RTN) and config.json carrying
/// its `quantization_config`. `dir` must not hold a config.json unless `force`; shards at
/// `shard_bytes`.
pub fn write_synth(
    dir: &Path,
    config: &Value,
    format: SynthFormat,
    opts: &WriteOptions,
    progress: &dyn Progress,
) -> Result<SynthSummary> {
    // The same validation a model load runs, before any tensor is planned: sizes within the
    // limits, every key legal.
    crate::config::ModelConfig::from_json(config)?;
    let naming = expert_naming(config)?;
    let is_expert = |name: &str| {
        matches!(
            naming.role(name),
            TensorRole::Expert { .. } | TensorRole::FusedExperts { .. }
        )
    };
    let config = &format.apply_to_config(config);
    let (tensors, sources) = quantized_tensors(tensors::tensors_for(config)?, format, &is_expert);
    let expert_bytes = tensors
        .iter()
        .filter(|t| is_expert(&t.spec.name))
        .map(|t| t.spec.byte_len())
        .sum();
    let seed = opts.seed;
    let compute = |group: usize| -> deltafin_storage::Result<Vec<Vec<u8>>> {
        Ok(sources
            .get(group)
            .map(|(s, packed)| quantize_source(s, *packed, format, seed))
            .unwrap_or_default())
    };
    let s = write_checkpoint(dir, config, tensors, opts, &compute, progress)?;
    Ok(SynthSummary {
        bytes: s.bytes,
        tensors: s.tensors,
        shards: s.shards,
        expert_bytes,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::synth::presets::{apply_overrides, preset_config, SYNTH_ARCHS};
    use deltafin_storage::checkpoint::Checkpoint;
    use deltafin_storage::expert_parts::expert_sources;
    use deltafin_storage::layout::NoProgress;

    fn opts(seed: u64) -> WriteOptions {
        WriteOptions {
            seed,
            shard_bytes: 256 << 10,
            force: false,
        }
    }

    #[test]
    fn presets_produce_openable_checkpoints() {
        for arch in SYNTH_ARCHS {
            let dir = tempfile::tempdir().unwrap();
            let cfg = preset_config(arch, "tiny").unwrap();
            let s =
                write_synth(dir.path(), &cfg, SynthFormat::Bf16, &opts(7), &NoProgress).unwrap();
            assert!(s.shards > 1, "256 KiB shards should split a tiny model");
            let ck = Checkpoint::open(dir.path()).unwrap();
            assert_eq!(ck.tensors.len(), s.tensors);
            let experts = expert_sources(&ck, &expert_naming(&cfg).unwrap()).unwrap();
            let parsed = crate::config::ModelConfig::from_json(&cfg).unwrap();
            let moe_layers = (0..parsed.num_hidden_layers())
                .filter(|&l| parsed.is_moe_layer(l))
                .count();
            assert!(moe_layers > 0, "{arch}");
            assert_eq!(experts.len(), moe_layers * 16, "{arch}");
            // Values are finite and bounded.
            let prefix = crate::family::text_prefix(&cfg);
            let w = ck
                .bytes(&format!("{prefix}model.layers.1.self_attn.o_proj.weight"))
                .unwrap();
            for c in w.chunks_exact(2) {
                let x = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
                assert!(x.is_finite() && x.abs() < 1.0);
            }
            // Same seed, same bytes.
            let dir2 = tempfile::tempdir().unwrap();
            write_synth(dir2.path(), &cfg, SynthFormat::Bf16, &opts(7), &NoProgress).unwrap();
            let ck2 = Checkpoint::open(dir2.path()).unwrap();
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
        let t = tensors::tensors_for(&cfg).unwrap();
        assert!(t
            .iter()
            .any(|t| t.spec.name == "model.layers.0.self_attn.q_proj.weight"));
        assert!(!t.iter().any(|t| t.spec.name.contains("experts.8.")));
        assert!(apply_overrides(&mut cfg, &["nokey".into()]).is_err());
        // K3: the text model's keys go to text_config; dotted keys reach nested objects.
        let mut k3 = preset_config("kimi_k3", "tiny").unwrap();
        apply_overrides(
            &mut k3,
            &[
                "num_experts=24".into(),
                "linear_attn_config.num_heads=2".into(),
                "text_config.num_hidden_layers=3".into(),
            ],
        )
        .unwrap();
        let text = &k3["text_config"];
        assert_eq!(text["num_experts"], 24);
        assert_eq!(text["linear_attn_config"]["num_heads"], 2);
        assert_eq!(text["num_hidden_layers"], 3);
        assert!(k3.get("num_experts").is_none());
        assert!(apply_overrides(&mut k3, &["num_experts.x=1".into()]).is_err());
    }
}
