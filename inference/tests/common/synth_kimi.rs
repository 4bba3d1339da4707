//! Random Kimi Linear / Kimi K3 checkpoints written as the real ones are (config.json +
//! model.safetensors; names, dtypes and shapes of testdata/fixtures/README.md), for any config:
//! top-level `kimi_linear`, or the `kimi_k3` wrapper with the text model in `text_config` and
//! every tensor under `language_model.`.
//!
//! Values are scaled like the fixtures' (unit-RMS activations through every sublayer, router and
//! lm_head logits spread by a few units so routing and greedy decisions are not degenerate).
#![allow(dead_code, clippy::unwrap_used, clippy::needless_range_loop)]

use std::path::Path;

use crate::common::synth::{Synth, Tensor};
use deltafin_inference::Rng;
use deltafin_storage::safetensors::Dtype;
use serde_json::{json, Value};

struct Gen {
    rng: Rng,
    s: Synth,
    prefix: String,
}

impl Gen {
    fn uniform(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f32> {
        (0..n)
            .map(|_| (lo + (hi - lo) * self.rng.next_f64()) as f32)
            .collect()
    }

    fn push(&mut self, name: &str, shape: &[usize], v: &[f32], dtype: Dtype) {
        let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        let full = format!("{}{}", self.prefix, name);
        self.s.push_f32_as(&full, &shape, v, dtype);
    }

    /// Uniform values with standard deviation `gain / sqrt(cols)`.
    fn values(&mut self, rows: usize, cols: usize, gain: f64) -> Vec<f32> {
        let a = gain * 3f64.sqrt() / (cols as f64).sqrt();
        self.uniform(rows * cols, -a, a)
    }

    /// A BF16 `[rows, cols]` linear weight `{name}.weight`.
    fn lin(&mut self, name: &str, rows: usize, cols: usize, gain: f64) {
        let v = self.values(rows, cols, gain);
        self.push(&format!("{name}.weight"), &[rows, cols], &v, Dtype::Bf16);
    }

    /// A routed expert's linear, BF16 or MXFP4 (`weight_packed` + `weight_scale`).
    fn expert_lin(&mut self, name: &str, rows: usize, cols: usize, gain: f64, mxfp4: bool) {
        let v = self.values(rows, cols, gain);
        if !mxfp4 {
            self.push(&format!("{name}.weight"), &[rows, cols], &v, Dtype::Bf16);
            return;
        }
        let (packed, scale) = encode_mxfp4(&v, rows, cols);
        let groups = cols / 32;
        let full = format!("{}{}", self.prefix, name);
        self.s.tensors.push(Tensor {
            name: format!("{full}.weight_packed"),
            dtype: Dtype::U8,
            shape: vec![rows as u64, cols as u64 / 2],
            bytes: packed,
        });
        self.s.tensors.push(Tensor {
            name: format!("{full}.weight_scale"),
            dtype: Dtype::U8,
            shape: vec![rows as u64, groups as u64],
            bytes: scale,
        });
    }

    /// An RMSNorm weight around 1.
    fn norm(&mut self, name: &str, dim: usize, dtype: Dtype) {
        let v = self.uniform(dim, 0.5, 1.5);
        self.push(name, &[dim], &v, dtype);
    }
}

/// E2M1 magnitudes by 3-bit index.
const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Round-to-nearest MXFP4: per row and group of 32, the E8M0 scale is the smallest power of two
/// with `amax / scale <= 6`; each value is the nearest signed E2M1 value times the scale.
/// Returns (`weight_packed` [rows, cols/2], `weight_scale` [rows, cols/32]).
pub fn encode_mxfp4(v: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    assert_eq!(
        cols % 32,
        0,
        "MXFP4 needs the input dimension to be a multiple of 32"
    );
    let groups = cols / 32;
    let mut packed = vec![0u8; rows * cols / 2];
    let mut scale = vec![0u8; rows * groups];
    for r in 0..rows {
        for g in 0..groups {
            let grp = &v[r * cols + g * 32..r * cols + (g + 1) * 32];
            let amax = grp.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
            let e = if amax == 0.0 {
                127
            } else {
                ((amax / 6.0).log2().ceil() as i32 + 127).clamp(0, 254)
            };
            scale[r * groups + g] = e as u8;
            let s = 2f64.powi(e - 127);
            for (i, &x) in grp.iter().enumerate() {
                let y = (x as f64 / s).abs();
                let mut best = 0usize;
                for m in 1..8 {
                    if (E2M1[m] as f64 - y).abs() < (E2M1[best] as f64 - y).abs() {
                        best = m;
                    }
                }
                let nib = best as u8 | if x < 0.0 && best != 0 { 8 } else { 0 };
                let c = g * 32 + i;
                let b = &mut packed[r * cols / 2 + c / 2];
                if c % 2 == 0 {
                    *b |= nib;
                } else {
                    *b |= nib << 4;
                }
            }
        }
    }
    (packed, scale)
}

fn us(c: &Value, k: &str) -> usize {
    c[k].as_u64().unwrap_or_else(|| panic!("config field {k}")) as usize
}
fn opt_us(c: &Value, k: &str) -> Option<usize> {
    c[k].as_u64().map(|v| v as usize)
}
fn flag(c: &Value, k: &str) -> bool {
    c[k].as_bool().unwrap_or(false)
}

/// Every tensor a Kimi Linear / K3 config needs, with random values. `mxfp4` stores the routed
/// experts (`block_sparse_moe.experts.E.w1/w2/w3`) as MXFP4 `weight_packed` + `weight_scale`
/// (no `weight_shape`), as the K3 release does.
pub fn synth_kimi(config: &Value, seed: u64, mxfp4: bool) -> Synth {
    let k3 = config["model_type"].as_str() == Some("kimi_k3");
    let c = if k3 { &config["text_config"] } else { config };
    assert!(
        k3 || config["model_type"].as_str() == Some("kimi_linear"),
        "synth_kimi: model_type must be kimi_linear or kimi_k3"
    );
    let mut g = Gen {
        rng: Rng::new(seed ^ 0x4b49_4d49),
        s: Synth::new(seed),
        prefix: if k3 {
            "language_model.".into()
        } else {
            String::new()
        },
    };
    // K3 stores conv weights and the KDA o_norm in F32 (Kimi Linear: BF16).
    let k3_f32 = if k3 { Dtype::F32 } else { Dtype::Bf16 };
    let (v, h, layers) = (
        us(c, "vocab_size"),
        us(c, "hidden_size"),
        us(c, "num_hidden_layers"),
    );
    let situ = c["hidden_act"].as_str() == Some("situ");
    // gate/up and down gains of every gated MLP (SiTU clips at β, so it gets a larger input)
    let (gu_gain, down_gain) = if situ { (2.0, 0.35) } else { (0.65, 0.65) };
    let la = &c["linear_attn_config"];
    let list = |k: &str| -> Vec<usize> {
        la[k]
            .as_array()
            .map(|a| a.iter().map(|x| x.as_u64().unwrap() as usize - 1).collect())
            .unwrap_or_default()
    };
    let kda_layers = list("kda_layers");
    let attn_res = opt_us(c, "attn_res_block_size").is_some();
    let first_dense = opt_us(c, "first_k_dense_replace").unwrap_or(0);

    let embed = g.uniform(v * h, -(3f64.sqrt()), 3f64.sqrt());
    g.push("model.embed_tokens.weight", &[v, h], &embed, Dtype::Bf16);
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        g.norm(&format!("{p}.input_layernorm.weight"), h, Dtype::Bf16);
        g.norm(
            &format!("{p}.post_attention_layernorm.weight"),
            h,
            Dtype::Bf16,
        );
        if attn_res {
            for which in ["self_attention_res", "mlp_res"] {
                g.norm(&format!("{p}.{which}_norm.weight"), h, Dtype::Bf16);
                g.lin(&format!("{p}.{which}_proj"), 1, h, 0.7);
            }
        }
        let a = format!("{p}.self_attn");
        if kda_layers.contains(&l) {
            let (hh, d, k) = (
                us(la, "num_heads"),
                us(la, "head_dim"),
                us(la, "short_conv_kernel_size"),
            );
            let hd = hh * d;
            for x in ["q", "k", "v"] {
                g.lin(&format!("{a}.{x}_proj"), hd, h, 0.65);
                let w = g.uniform(hd * k, -0.87, 0.87);
                g.push(
                    &format!("{a}.{x}_conv1d.weight"),
                    &[hd, 1, k],
                    &w,
                    k3_f32.clone(),
                );
            }
            g.lin(&format!("{a}.f_a_proj"), d, h, 0.65);
            g.lin(&format!("{a}.f_b_proj"), hd, d, 1.2);
            let lower_bound = !la["gate_lower_bound"].is_null();
            // A_log per head: softplus gate as transformers initialises it (log U(1, 16)), the
            // safe gate's rate around 1. dt_bias = inverse softplus of dt (softplus gate: dt in
            // [1e-3, 0.1], log-uniform), or U(-3, 0) for the safe gate.
            let a_log: Vec<f32> = if lower_bound {
                g.uniform(hh, -0.5, 0.5)
            } else {
                g.uniform(hh, 1.0, 16.0).iter().map(|x| x.ln()).collect()
            };
            let dt_bias: Vec<f32> = if lower_bound {
                g.uniform(hd, -3.0, 0.0)
            } else {
                g.uniform(hd, (1e-3f64).ln(), (0.1f64).ln())
                    .iter()
                    .map(|x| (x.exp() as f64).exp_m1().ln() as f32)
                    .collect()
            };
            if k3 {
                // the release: F32 [head_dim] = the num_heads values, then zeros
                let mut padded = a_log.clone();
                padded.resize(hh.max(d), 0.0);
                g.push(&format!("{a}.A_log"), &[hh.max(d)], &padded, Dtype::F32);
            } else {
                g.push(&format!("{a}.A_log"), &[1, 1, hh, 1], &a_log, Dtype::F32);
            }
            g.push(&format!("{a}.dt_bias"), &[hd], &dt_bias, Dtype::F32);
            g.lin(&format!("{a}.b_proj"), hh, h, 0.65);
            if flag(la, "use_full_rank_gate") {
                g.lin(&format!("{a}.g_proj"), hd, h, 1.5);
            } else {
                g.lin(&format!("{a}.g_a_proj"), d, h, 0.65);
                g.lin(&format!("{a}.g_b_proj"), hd, d, 1.2);
            }
            g.norm(&format!("{a}.o_norm.weight"), d, k3_f32.clone());
            g.lin(&format!("{a}.o_proj"), h, hd, 0.65);
        } else {
            let (hn, nope, rd, vd, kl) = (
                us(c, "num_attention_heads"),
                us(c, "qk_nope_head_dim"),
                us(c, "qk_rope_head_dim"),
                us(c, "v_head_dim"),
                us(c, "kv_lora_rank"),
            );
            match opt_us(c, "q_lora_rank") {
                Some(r) => {
                    g.lin(&format!("{a}.q_a_proj"), r, h, 0.65);
                    g.norm(&format!("{a}.q_a_layernorm.weight"), r, Dtype::Bf16);
                    g.lin(&format!("{a}.q_b_proj"), hn * (nope + rd), r, 0.65);
                }
                None => g.lin(&format!("{a}.q_proj"), hn * (nope + rd), h, 0.65),
            }
            g.lin(&format!("{a}.kv_a_proj_with_mqa"), kl + rd, h, 0.65);
            g.norm(&format!("{a}.kv_a_layernorm.weight"), kl, Dtype::Bf16);
            g.lin(&format!("{a}.kv_b_proj"), hn * (nope + vd), kl, 0.65);
            if flag(c, "mla_use_output_gate") {
                g.lin(&format!("{a}.g_proj"), hn * vd, h, 1.5);
            }
            g.lin(&format!("{a}.o_proj"), h, hn * vd, 0.65);
        }
        if l < first_dense {
            let m = format!("{p}.mlp");
            let it = us(c, "intermediate_size");
            g.lin(&format!("{m}.gate_proj"), it, h, gu_gain);
            g.lin(&format!("{m}.up_proj"), it, h, gu_gain);
            g.lin(&format!("{m}.down_proj"), h, it, down_gain);
        } else {
            let m = format!("{p}.block_sparse_moe");
            let (e, it) = (us(c, "num_experts"), us(c, "moe_intermediate_size"));
            g.lin(&format!("{m}.gate"), e, h, 2.5);
            let bias = g.uniform(e, -0.18, 0.18);
            g.push(
                &format!("{m}.gate.e_score_correction_bias"),
                &[e],
                &bias,
                Dtype::F32,
            );
            let width = match opt_us(c, "routed_expert_hidden_size") {
                Some(r) => {
                    g.lin(&format!("{m}.routed_expert_down_proj"), r, h, 1.0);
                    g.lin(&format!("{m}.routed_expert_up_proj"), h, r, 1.0);
                    if flag(c, "latent_moe_use_norm") {
                        g.norm(&format!("{m}.routed_expert_norm.weight"), r, Dtype::Bf16);
                    }
                    r
                }
                None => h,
            };
            for x in 0..e {
                let ex = format!("{m}.experts.{x}");
                g.expert_lin(&format!("{ex}.w1"), it, width, gu_gain, mxfp4);
                g.expert_lin(&format!("{ex}.w3"), it, width, gu_gain, mxfp4);
                g.expert_lin(&format!("{ex}.w2"), width, it, down_gain, mxfp4);
            }
            let shared = opt_us(c, "num_shared_experts").unwrap_or(0);
            if shared > 0 {
                let sw = it * shared;
                let sp = format!("{m}.shared_experts");
                g.lin(&format!("{sp}.gate_proj"), sw, h, gu_gain);
                g.lin(&format!("{sp}.up_proj"), sw, h, gu_gain);
                g.lin(&format!("{sp}.down_proj"), h, sw, down_gain);
            }
        }
    }
    g.norm("model.norm.weight", h, Dtype::Bf16);
    if attn_res {
        g.norm("model.output_attn_res_norm.weight", h, Dtype::Bf16);
        g.lin("model.output_attn_res_proj", 1, h, 0.7);
    }
    if !flag(c, "tie_word_embeddings") {
        g.lin("lm_head", v, h, 2.8);
    }
    g.s
}

/// Write config.json + model.safetensors for `config` into `dir` (BF16 routed experts).
pub fn write_kimi_model(dir: &Path, config: &Value, seed: u64) {
    synth_kimi(config, seed, false).write(dir, config);
}

/// As [`write_kimi_model`], with the routed experts as MXFP4 when `mxfp4`.
pub fn write_kimi_model_with(dir: &Path, config: &Value, seed: u64, mxfp4: bool) {
    synth_kimi(config, seed, mxfp4).write(dir, config);
}

/// A fixture's config.json.
pub fn fixture_json(name: &str) -> Value {
    serde_json::from_slice(
        &std::fs::read(crate::common::fixture_dir(name).join("config.json")).unwrap(),
    )
    .unwrap()
}

/// A K3 configuration harder than the fixtures: MLA first, KDA last, H·D != hidden, conv kernel
/// 3, q_lora_rank null, attn_res_block_size 2, two dense layers, grouped routing (4 groups,
/// keep 2), routed_scaling_factor 1.5, an unclipped SiTU up branch.
pub fn harder_k3_config() -> Value {
    let mut c = fixture_json("kimi_k3_a");
    let t = &mut c["text_config"];
    t["num_hidden_layers"] = json!(6);
    t["linear_attn_config"]["full_attn_layers"] = json!([1, 4]);
    t["linear_attn_config"]["kda_layers"] = json!([2, 3, 5, 6]);
    t["linear_attn_config"]["num_heads"] = json!(3);
    t["linear_attn_config"]["head_dim"] = json!(16);
    t["linear_attn_config"]["short_conv_kernel_size"] = json!(3);
    t["q_lora_rank"] = Value::Null;
    t["attn_res_block_size"] = json!(2);
    t["first_k_dense_replace"] = json!(2);
    t["num_expert_group"] = json!(4);
    t["topk_group"] = json!(2);
    t["routed_scaling_factor"] = json!(1.5);
    t["activation_situ_linear_beta"] = Value::Null;
    c
}

/// A Kimi Linear configuration harder than its fixture: MLA first, q_lora, H·D != hidden, conv
/// kernel 3, two dense layers, grouped routing, no renormalisation.
pub fn harder_kimi_linear_config() -> Value {
    let mut c = fixture_json("kimi_linear_a");
    c["num_hidden_layers"] = json!(5);
    c["linear_attn_config"]["full_attn_layers"] = json!([1, 4]);
    c["linear_attn_config"]["kda_layers"] = json!([2, 3, 5]);
    c["linear_attn_config"]["num_heads"] = json!(5);
    c["linear_attn_config"]["head_dim"] = json!(8);
    c["linear_attn_config"]["short_conv_kernel_size"] = json!(3);
    c["q_lora_rank"] = json!(24);
    c["first_k_dense_replace"] = json!(2);
    c["num_expert_group"] = json!(4);
    c["topk_group"] = json!(2);
    c["moe_renormalize"] = json!(false);
    c
}
