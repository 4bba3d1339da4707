//! [`ExpertFormat`]: the packed formats routed experts can be stored in, named and configured
//! as released checkpoints are (compressed-tensors INT4 / MXFP4, and Q8).

use deltafin_formats::quantize::{
    quantize_int4, quantize_mxfp4, quantize_q8, QuantError, FP8_BLOCK, GROUP,
};
use deltafin_formats::Dtype;
use deltafin_storage::layout::PartSpec;
use serde_json::{json, Value};

/// What `layout --quantize-experts` (and `synth --format`) store routed experts as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertFormat {
    /// compressed-tensors `pack-quantized` INT4, group 32, symmetric (Kimi K2-Thinking).
    Int4,
    /// compressed-tensors `mxfp4-pack-quantized` (Kimi K3).
    Mxfp4,
    /// int8 per 32-value group with an F16 scale (`weight_packed` I8, `weight_scale` F16).
    Q8,
}

impl std::str::FromStr for ExpertFormat {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "int4" => Ok(ExpertFormat::Int4),
            "mxfp4" => Ok(ExpertFormat::Mxfp4),
            "q8" => Ok(ExpertFormat::Q8),
            o => Err(format!("unknown expert format `{o}` (int4, mxfp4, q8)")),
        }
    }
}

impl std::fmt::Display for ExpertFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ExpertFormat::Int4 => "int4",
            ExpertFormat::Mxfp4 => "mxfp4",
            ExpertFormat::Q8 => "q8",
        })
    }
}

/// Modules that stay unquantized when only routed experts are packed (the shipped INT4/MXFP4
/// checkpoints' `ignore` list, plus the Qwen3-MoE router, an `nn.Linear` there).
pub fn expert_only_ignore() -> Value {
    json!([
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*mlp\\.gate$"
    ])
}

/// Whether `name` is a non-expert projection `--quantize-dense` packs: a `.weight` of a
/// linear module other than a router (`mlp.gate`, K3's `gate` with its bias), `lm_head` and
/// the embeddings, and other than the small per-head tensors of KDA (`A_log`, `dt_bias`,
/// convolutions are not `.weight`s of linear modules and are 1-D or 3-D anyway).
pub fn is_dense_projection(name: &str) -> bool {
    let Some(prefix) = name.strip_suffix(".weight") else {
        return false;
    };
    let module = prefix.rsplit('.').next().unwrap_or("");
    !(module == "gate"
        || module == "lm_head"
        || module.contains("embed")
        || module.contains("norm")
        || prefix.contains("conv"))
}

/// Which resident (non-expert) weights are packed, and in which format: every projection
/// ([`is_dense_projection`]; `--quantize-dense`), `lm_head` (`--quantize-head`) and the token
/// embeddings (`--quantize-embeddings`), each chosen on its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DenseFormats {
    pub projections: Option<ExpertFormat>,
    pub head: Option<ExpertFormat>,
    pub embeddings: Option<ExpertFormat>,
}

impl DenseFormats {
    /// Every non-expert projection in `f`; head and embeddings as they are.
    pub fn projections(f: ExpertFormat) -> DenseFormats {
        DenseFormats {
            projections: Some(f),
            ..DenseFormats::default()
        }
    }

    pub fn any(&self) -> bool {
        self.projections.is_some() || self.head.is_some() || self.embeddings.is_some()
    }

    /// The format the resident weight `name` (`[rows, cols]`) is packed in, if any. One-row
    /// matrices (K3's attention-residual queries, read as vectors) and columns the format
    /// cannot group stay as they are.
    pub fn format_for(&self, name: &str, rows: u64, cols: u64) -> Option<ExpertFormat> {
        let prefix = name.strip_suffix(".weight")?;
        let module = prefix.rsplit('.').next().unwrap_or("");
        let f = if module == "lm_head" {
            self.head
        } else if module == "embed_tokens" {
            self.embeddings
        } else if is_dense_projection(name) {
            self.projections
        } else {
            None
        }?;
        (rows > 1 && f.fits(cols)).then_some(f)
    }
}

impl std::fmt::Display for DenseFormats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        for (what, v) in [
            ("dense", self.projections),
            ("head", self.head),
            ("embeddings", self.embeddings),
        ] {
            if let Some(v) = v {
                parts.push(format!("{what}-{v}"));
            }
        }
        f.write_str(&parts.join("+"))
    }
}

impl ExpertFormat {
    /// Whether a `[rows, cols]` matrix can be stored in this format.
    pub fn fits(self, cols: u64) -> bool {
        cols > 0 && cols.is_multiple_of(GROUP as u64)
    }

    /// The tensors `{prefix}.weight` `[rows, cols]` becomes, in the shipped naming.
    pub fn parts(self, prefix: &str, rows: u64, cols: u64) -> Vec<PartSpec> {
        let groups = cols.div_ceil(GROUP as u64);
        let (packed, scale) = match self {
            ExpertFormat::Int4 => (
                PartSpec::new(
                    format!("{prefix}.weight_packed"),
                    Dtype::I32,
                    &[rows, cols / 8],
                ),
                PartSpec::new(
                    format!("{prefix}.weight_scale"),
                    Dtype::Bf16,
                    &[rows, groups],
                ),
            ),
            ExpertFormat::Mxfp4 => (
                PartSpec::new(
                    format!("{prefix}.weight_packed"),
                    Dtype::U8,
                    &[rows, cols / 2],
                ),
                PartSpec::new(format!("{prefix}.weight_scale"), Dtype::U8, &[rows, groups]),
            ),
            ExpertFormat::Q8 => (
                PartSpec::new(format!("{prefix}.weight_packed"), Dtype::I8, &[rows, cols]),
                PartSpec::new(
                    format!("{prefix}.weight_scale"),
                    Dtype::F16,
                    &[rows, groups],
                ),
            ),
        };
        let mut v = vec![packed, scale];
        if self == ExpertFormat::Int4 {
            v.push(PartSpec::new(
                format!("{prefix}.weight_shape"),
                Dtype::I32,
                &[2],
            ));
        }
        v
    }

    /// Quantize `w` `[rows, cols]`: the bytes of each of [`Self::parts`], in that order.
    /// `cols` must satisfy [`Self::fits`].
    pub fn encode(self, w: &[f32], rows: usize, cols: usize) -> (Vec<Vec<u8>>, QuantError) {
        let q = match self {
            ExpertFormat::Int4 => quantize_int4(w, rows, cols, GROUP),
            ExpertFormat::Mxfp4 => quantize_mxfp4(w, rows, cols, GROUP),
            ExpertFormat::Q8 => quantize_q8(w, rows, cols, GROUP),
        };
        let mut v = vec![q.data, q.scale];
        if self == ExpertFormat::Int4 {
            let shape: Vec<u8> = [rows as i32, cols as i32]
                .iter()
                .flat_map(|d| d.to_le_bytes())
                .collect();
            v.push(shape);
        }
        (v, q.error)
    }

    /// The `quantization_config` a checkpoint with routed experts in this format carries
    /// (INT4 and MXFP4 exactly as compressed-tensors writes them; Q8 in the same shape under
    /// `quant_method: deltafin`, which `deltafin-inference` reads the group size from).
    pub fn quantization_config(self) -> Value {
        self.config_with_ignore(expert_only_ignore())
    }

    /// The `quantization_config` of a checkpoint whose routed experts are in this format and
    /// the resident weights `dense` names packed too (routers ignored; `lm_head` unless packed);
    /// a second config group targets the non-expert projections when their format differs.
    pub fn quantization_config_with_dense(self, dense: DenseFormats) -> Value {
        let mut ignore = vec![json!("re:.*mlp\\.gate$"), json!("re:.*\\.gate$")];
        if dense.head.is_none() {
            ignore.insert(0, json!("lm_head"));
        }
        let mut q = self.config_with_ignore(Value::Array(ignore));
        if let Some(d) = dense.projections.filter(|&d| d != self) {
            let d = d.config_with_ignore(json!([]));
            if let (Some(groups), Some(g)) = (
                q.get_mut("config_groups").and_then(Value::as_object_mut),
                d.get("config_groups")
                    .and_then(|g| g.get("group_0"))
                    .cloned(),
            ) {
                let mut g = g;
                g["targets"] = json!([
                    "re:.*self_attn.*",
                    "re:.*shared_experts.*",
                    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"
                ]);
                groups.insert("group_1".into(), g);
            }
        }
        q
    }

    fn config_with_ignore(self, ignore: Value) -> Value {
        match self {
            ExpertFormat::Int4 => json!({
                "config_groups": {"group_0": {
                    "input_activations": null, "output_activations": null, "targets": ["Linear"],
                    "weights": {"actorder": null, "block_structure": null, "dynamic": false,
                        "group_size": GROUP, "num_bits": 4, "observer": "minmax",
                        "observer_kwargs": {}, "strategy": "group", "symmetric": true,
                        "type": "int"}}},
                "format": "pack-quantized",
                "ignore": ignore,
                "kv_cache_scheme": null,
                "quant_method": "compressed-tensors",
                "quantization_status": "compressed"
            }),
            ExpertFormat::Mxfp4 => json!({
                "config_groups": {"group_0": {
                    "format": "mxfp4-pack-quantized",
                    "input_activations": null, "output_activations": null, "targets": ["Linear"],
                    "weights": {"actorder": null, "block_structure": null, "dynamic": false,
                        "group_size": GROUP, "num_bits": 4, "observer": "minmax",
                        "observer_kwargs": {}, "scale_dtype": "torch.uint8",
                        "strategy": "group", "symmetric": true, "type": "float",
                        "zp_dtype": null}}},
                "format": "mxfp4-pack-quantized",
                "global_compression_ratio": null,
                "ignore": ignore,
                "kv_cache_scheme": null,
                "quant_method": "compressed-tensors",
                "quantization_status": "compressed"
            }),
            ExpertFormat::Q8 => json!({
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"dynamic": false, "group_size": GROUP, "num_bits": 8,
                        "strategy": "group", "symmetric": true, "type": "int",
                        "scale_dtype": "torch.float16"}}},
                "format": "q8-group",
                "ignore": ignore,
                "quant_method": "deltafin",
                "quantization_status": "compressed"
            }),
        }
    }
}

/// The `quantization_config` of a DeepSeek-V3 block-FP8 checkpoint.
pub fn fp8_quantization_config() -> Value {
    json!({
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": FP8_BLOCK
    })
}
