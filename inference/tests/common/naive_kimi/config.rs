//! The naive Kimi reference's reading of config.json.
#![allow(dead_code, clippy::unwrap_used, clippy::needless_range_loop)]

use serde_json::Value;

use super::weights::*;

// ---------------------------------------------------------------------------------------------
// Config

#[derive(Clone, Copy, Debug)]
pub(crate) enum Act {
    /// `silu(g) * u`
    Silu,
    /// `[β·tanh(g/β)·σ(g)] · [β_lin·tanh(u/β_lin)]` (up not clipped when β_lin is None).
    Situ { beta: f64, lin: Option<f64> },
}

impl Act {
    pub(crate) fn apply(self, g: f32, u: f32) -> f32 {
        let (g, u) = (g as f64, u as f64);
        match self {
            Act::Silu => (silu(g) * u) as f32,
            Act::Situ { beta, lin } => {
                let gate = beta * (g / beta).tanh() * sigmoid(g);
                let up = match lin {
                    Some(bl) => bl * (u / bl).tanh(),
                    None => u,
                };
                (gate * up) as f32
            }
        }
    }
}

pub(crate) struct Cfg {
    /// Loaded from a `kimi_k3` wrapper.
    pub(crate) k3: bool,
    pub(crate) hidden: usize,
    pub(crate) layers: usize,
    pub(crate) vocab: usize,
    pub(crate) eps: f64,
    pub(crate) act: Act,
    // KDA
    pub(crate) kda_heads: usize,
    pub(crate) kda_dim: usize,
    pub(crate) conv_k: usize,
    pub(crate) lower_bound: Option<f64>,
    pub(crate) full_rank_gate: bool,
    // MLA
    pub(crate) heads: usize,
    pub(crate) nope: usize,
    pub(crate) rope: usize,
    pub(crate) vdim: usize,
    pub(crate) kv_lora: usize,
    pub(crate) q_lora: Option<usize>,
    pub(crate) mla_gate: bool,
    // MoE
    pub(crate) first_dense: usize,
    pub(crate) experts: usize,
    pub(crate) top_k: usize,
    pub(crate) n_group: usize,
    pub(crate) topk_group: usize,
    pub(crate) renorm: bool,
    pub(crate) scaling: f64,
    pub(crate) softmax_router: bool,
    pub(crate) latent: Option<usize>,
    pub(crate) latent_norm: bool,
    // Attention Residuals
    pub(crate) attn_res: Option<usize>,
    /// Per layer: true = KDA, false = MLA.
    pub(crate) is_kda: Vec<bool>,
}

pub(crate) fn num(c: &Value, k: &str) -> f64 {
    c[k].as_f64().unwrap_or_else(|| panic!("config field {k}"))
}
pub(crate) fn us(c: &Value, k: &str) -> usize {
    c[k].as_u64().unwrap_or_else(|| panic!("config field {k}")) as usize
}
pub(crate) fn opt_us(c: &Value, k: &str) -> Option<usize> {
    c[k].as_u64().map(|v| v as usize)
}
pub(crate) fn flag(c: &Value, k: &str) -> bool {
    c[k].as_bool().unwrap_or(false)
}

impl Cfg {
    pub(crate) fn parse(top: &Value) -> Cfg {
        let mt = top["model_type"].as_str().unwrap_or("");
        let (c, k3) = if top["text_config"].is_object() {
            (&top["text_config"], true)
        } else {
            (top, mt == "kimi_k3")
        };
        assert!(
            mt == "kimi_linear" || mt == "kimi_k3",
            "naive_kimi: model_type {mt:?} is not kimi_linear/kimi_k3"
        );
        let layers = us(c, "num_hidden_layers");
        let la = &c["linear_attn_config"];
        let list = |k: &str| -> Vec<usize> {
            la[k]
                .as_array()
                .map(|a| a.iter().map(|v| v.as_u64().unwrap() as usize - 1).collect())
                .unwrap_or_default()
        };
        let (kda, full) = (list("kda_layers"), list("full_attn_layers"));
        let is_kda: Vec<bool> = (0..layers)
            .map(|l| {
                let (a, b) = (kda.contains(&l), full.contains(&l));
                assert!(!(a && b), "layer {l} listed as both KDA and full attention");
                // Without a linear_attn_config every layer is MLA.
                assert!(
                    a || b || la.is_null(),
                    "layer {l} in neither kda_layers nor full_attn_layers"
                );
                a
            })
            .collect();
        let act = match c["hidden_act"].as_str().unwrap_or("silu") {
            "silu" | "swish" => Act::Silu,
            "situ" => {
                let beta = c["activation_situ_beta"].as_f64().unwrap_or(0.0);
                Act::Situ {
                    beta: if beta == 0.0 { 1.0 } else { beta },
                    lin: c["activation_situ_linear_beta"].as_f64(),
                }
            }
            other => panic!("hidden_act {other}"),
        };
        let router = c["moe_router_activation_func"]
            .as_str()
            .unwrap_or("sigmoid");
        assert!(
            router == "sigmoid" || router == "softmax",
            "router {router}"
        );
        Cfg {
            k3,
            hidden: us(c, "hidden_size"),
            layers,
            vocab: us(c, "vocab_size"),
            eps: num(c, "rms_norm_eps"),
            act,
            kda_heads: opt_us(la, "num_heads").unwrap_or(0),
            kda_dim: opt_us(la, "head_dim").unwrap_or(0),
            conv_k: opt_us(la, "short_conv_kernel_size").unwrap_or(0),
            lower_bound: la["gate_lower_bound"].as_f64(),
            full_rank_gate: flag(la, "use_full_rank_gate"),
            heads: us(c, "num_attention_heads"),
            nope: us(c, "qk_nope_head_dim"),
            rope: us(c, "qk_rope_head_dim"),
            vdim: us(c, "v_head_dim"),
            kv_lora: us(c, "kv_lora_rank"),
            q_lora: opt_us(c, "q_lora_rank"),
            mla_gate: flag(c, "mla_use_output_gate"),
            first_dense: opt_us(c, "first_k_dense_replace").unwrap_or(0),
            experts: opt_us(c, "num_experts").unwrap_or(0),
            top_k: opt_us(c, "num_experts_per_token").unwrap_or(0),
            n_group: opt_us(c, "num_expert_group").unwrap_or(1),
            topk_group: opt_us(c, "topk_group").unwrap_or(1),
            renorm: flag(c, "moe_renormalize"),
            scaling: c["routed_scaling_factor"].as_f64().unwrap_or(1.0),
            softmax_router: router == "softmax",
            latent: opt_us(c, "routed_expert_hidden_size"),
            latent_norm: flag(c, "latent_moe_use_norm"),
            attn_res: opt_us(c, "attn_res_block_size"),
            is_kda,
        }
    }
}
