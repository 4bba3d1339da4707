//! Random small models written as real checkpoints (config.json + BF16 safetensors).
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use deltafin_inference::{ModelConfig, Rng};
use deltafin_storage::safetensors::{write_header, Dtype, TensorSpec};
use serde_json::Value;

pub struct Tensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub bytes: Vec<u8>,
}

pub struct Synth {
    rng: Rng,
    pub tensors: Vec<Tensor>,
}

impl Synth {
    pub fn new(seed: u64) -> Synth {
        Synth {
            rng: Rng::new(seed),
            tensors: Vec::new(),
        }
    }

    fn uniform(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n)
            .map(|_| lo + (hi - lo) * self.rng.next_f64() as f32)
            .collect()
    }

    pub fn push_f32_as(&mut self, name: &str, shape: &[u64], values: &[f32], dtype: Dtype) {
        let bytes = match dtype {
            Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Dtype::Bf16 => values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
                .collect(),
            _ => panic!("unsupported"),
        };
        self.tensors.push(Tensor {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            bytes,
        });
    }

    /// A `[rows, cols]` BF16 matrix scaled for unit-variance outputs.
    pub fn matrix(&mut self, name: &str, rows: usize, cols: usize) {
        let s = 1.7 / (cols as f32).sqrt();
        let v = self.uniform(rows * cols, -s, s);
        self.push_f32_as(name, &[rows as u64, cols as u64], &v, Dtype::Bf16);
    }

    pub fn norm(&mut self, name: &str, dim: usize) {
        let v = self.uniform(dim, 0.8, 1.2);
        self.push_f32_as(name, &[dim as u64], &v, Dtype::Bf16);
    }

    pub fn vector(&mut self, name: &str, dim: usize, scale: f32, dtype: Dtype) {
        let v = self.uniform(dim, -scale, scale);
        self.push_f32_as(name, &[dim as u64], &v, dtype);
    }

    pub fn embedding(&mut self, name: &str, rows: usize, cols: usize) {
        let v = self.uniform(rows * cols, -1.0, 1.0);
        self.push_f32_as(name, &[rows as u64, cols as u64], &v, Dtype::Bf16);
    }

    pub fn remove(&mut self, name: &str) {
        self.tensors.retain(|t| t.name != name);
    }

    pub fn write(&self, dir: &Path, config: &Value) {
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_vec_pretty(config).unwrap(),
        )
        .unwrap();
        let specs: Vec<TensorSpec> = self
            .tensors
            .iter()
            .map(|t| TensorSpec::new(t.name.clone(), t.dtype.clone(), &t.shape))
            .collect();
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        let mut f = std::fs::File::create(dir.join("model.safetensors")).unwrap();
        write_header(&mut f, &specs, &meta).unwrap();
        for t in &self.tensors {
            f.write_all(&t.bytes).unwrap();
        }
    }
}

fn u(c: &Value, k: &str) -> usize {
    c[k].as_u64().unwrap_or_else(|| panic!("config field {k}")) as usize
}

/// Every tensor a config needs, with random values. `fused` stores Qwen experts in the
/// transformers-5 fused layout.
pub fn synth_model(config: &Value, seed: u64, fused: bool) -> Synth {
    let mut s = Synth::new(seed);
    let parsed = ModelConfig::from_json(config).unwrap();
    let (v, h) = (u(config, "vocab_size"), u(config, "hidden_size"));
    s.embedding("model.embed_tokens.weight", v, h);
    let bias = config["attention_bias"].as_bool().unwrap_or(false);
    for l in 0..u(config, "num_hidden_layers") {
        let p = format!("model.layers.{l}");
        s.norm(&format!("{p}.input_layernorm.weight"), h);
        s.norm(&format!("{p}.post_attention_layernorm.weight"), h);
        let a = format!("{p}.self_attn");
        let lin = |s: &mut Synth, name: &str, rows: usize, cols: usize, with_bias: bool| {
            s.matrix(&format!("{a}.{name}.weight"), rows, cols);
            if with_bias {
                s.vector(&format!("{a}.{name}.bias"), rows, 0.3, Dtype::Bf16);
            }
        };
        match &parsed {
            ModelConfig::DeepseekV3(c) => {
                let (hn, nope, rd, vd, kl) = (
                    c.num_attention_heads,
                    c.qk_nope_head_dim,
                    c.qk_rope_head_dim,
                    c.v_head_dim,
                    c.kv_lora_rank,
                );
                match c.q_lora_rank {
                    Some(r) => {
                        lin(&mut s, "q_a_proj", r, h, bias);
                        s.norm(&format!("{a}.q_a_layernorm.weight"), r);
                        lin(&mut s, "q_b_proj", hn * (nope + rd), r, false);
                    }
                    None => lin(&mut s, "q_proj", hn * (nope + rd), h, false),
                }
                lin(&mut s, "kv_a_proj_with_mqa", kl + rd, h, bias);
                s.norm(&format!("{a}.kv_a_layernorm.weight"), kl);
                lin(&mut s, "kv_b_proj", hn * (nope + vd), kl, false);
                lin(&mut s, "o_proj", h, hn * vd, bias);
                let m = format!("{p}.mlp");
                if c.is_moe_layer(l) {
                    let (e, it) = (c.n_routed_experts, c.moe_intermediate_size);
                    s.matrix(&format!("{m}.gate.weight"), e, h);
                    s.vector(
                        &format!("{m}.gate.e_score_correction_bias"),
                        e,
                        0.3,
                        Dtype::F32,
                    );
                    for x in 0..e {
                        s.matrix(&format!("{m}.experts.{x}.gate_proj.weight"), it, h);
                        s.matrix(&format!("{m}.experts.{x}.up_proj.weight"), it, h);
                        s.matrix(&format!("{m}.experts.{x}.down_proj.weight"), h, it);
                    }
                    if c.n_shared_experts > 0 {
                        let w = it * c.n_shared_experts;
                        s.matrix(&format!("{m}.shared_experts.gate_proj.weight"), w, h);
                        s.matrix(&format!("{m}.shared_experts.up_proj.weight"), w, h);
                        s.matrix(&format!("{m}.shared_experts.down_proj.weight"), h, w);
                    }
                } else {
                    let it = c.intermediate_size;
                    s.matrix(&format!("{m}.gate_proj.weight"), it, h);
                    s.matrix(&format!("{m}.up_proj.weight"), it, h);
                    s.matrix(&format!("{m}.down_proj.weight"), h, it);
                }
            }
            ModelConfig::Qwen3Moe(c) => {
                let (hn, kv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
                lin(&mut s, "q_proj", hn * d, h, bias);
                lin(&mut s, "k_proj", kv * d, h, bias);
                lin(&mut s, "v_proj", kv * d, h, bias);
                lin(&mut s, "o_proj", h, hn * d, bias);
                s.norm(&format!("{a}.q_norm.weight"), d);
                s.norm(&format!("{a}.k_norm.weight"), d);
                let m = format!("{p}.mlp");
                if c.is_moe_layer(l) {
                    let (e, it) = (c.num_experts, c.moe_intermediate_size);
                    s.matrix(&format!("{m}.gate.weight"), e, h);
                    if fused {
                        let sc = 1.7 / (h as f32).sqrt();
                        let gu = s.uniform(e * 2 * it * h, -sc, sc);
                        s.push_f32_as(
                            &format!("{m}.experts.gate_up_proj"),
                            &[e as u64, 2 * it as u64, h as u64],
                            &gu,
                            Dtype::Bf16,
                        );
                        let sc = 1.7 / (it as f32).sqrt();
                        let dn = s.uniform(e * h * it, -sc, sc);
                        s.push_f32_as(
                            &format!("{m}.experts.down_proj"),
                            &[e as u64, h as u64, it as u64],
                            &dn,
                            Dtype::Bf16,
                        );
                    } else {
                        for x in 0..e {
                            s.matrix(&format!("{m}.experts.{x}.gate_proj.weight"), it, h);
                            s.matrix(&format!("{m}.experts.{x}.up_proj.weight"), it, h);
                            s.matrix(&format!("{m}.experts.{x}.down_proj.weight"), h, it);
                        }
                    }
                } else {
                    let it = c.intermediate_size;
                    s.matrix(&format!("{m}.gate_proj.weight"), it, h);
                    s.matrix(&format!("{m}.up_proj.weight"), it, h);
                    s.matrix(&format!("{m}.down_proj.weight"), h, it);
                }
            }
            ModelConfig::Kimi(_) => panic!("Kimi test checkpoints come from common::synth_kimi"),
        }
    }
    s.norm("model.norm.weight", h);
    if !config["tie_word_embeddings"].as_bool().unwrap_or(false) {
        s.matrix("lm_head.weight", v, h);
    }
    s
}
