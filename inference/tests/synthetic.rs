//! Other configurations of both architectures, on random small models written as real
//! checkpoints: the engine must agree with an independent naive forward pass, and the cached
//! paths (one position at a time, chunked prefill, truncate-and-redo) must agree with one
//! uncached forward over all positions.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::naive::naive_logits;
use common::synth::synth_model;
use common::{assert_close, max_abs, max_abs_diff};
use deltafin_inference::{DirSource, ForwardTrace, LogitsMode, Model};
use serde_json::{json, Value};

fn deepseek_base() -> Value {
    json!({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 96, "hidden_size": 48, "intermediate_size": 80, "moe_intermediate_size": 24,
        "num_hidden_layers": 4, "num_attention_heads": 3, "num_key_value_heads": 3,
        "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "norm_topk_prob": true, "routed_scaling_factor": 2.5, "kv_lora_rank": 24,
        "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": null,
        "max_position_embeddings": 128, "tie_word_embeddings": false, "attention_bias": false,
        "hidden_act": "silu", "eos_token_id": 1, "bos_token_id": 0,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc"
    })
}

fn qwen_base() -> Value {
    json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 96, "hidden_size": 64, "intermediate_size": 80, "moe_intermediate_size": 24,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": true,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": null, "max_position_embeddings": 128,
        "tie_word_embeddings": false, "attention_bias": false, "hidden_act": "silu",
        "eos_token_id": 1, "bos_token_id": 0
    })
}

fn with(mut base: Value, patch: Value) -> Value {
    for (k, v) in patch.as_object().unwrap() {
        base[k] = v.clone();
    }
    base
}

const PROMPT: [u32; 12] = [5, 17, 3, 88, 42, 9, 61, 0, 33, 71, 2, 54];

/// Write the model, then run every check. Returns (engine vs naive error, cache error).
fn check(name: &str, config: &Value, fused: bool, seed: u64) -> (f32, f32) {
    let tmp = tempfile::tempdir().unwrap();
    synth_model(config, seed, fused).write(tmp.path(), config);
    let model = Model::load(Arc::new(DirSource::open(tmp.path()).unwrap())).unwrap();
    let vocab = model.vocab_size();
    let n = PROMPT.len();

    // 1. One uncached forward vs the naive implementation.
    let mut s = model.new_session();
    let mut trace = ForwardTrace::default();
    let full = model
        .forward_with(&mut s, &PROMPT, LogitsMode::All, Some(&mut trace))
        .unwrap();
    let naive = naive_logits(tmp.path(), &PROMPT);
    let naive_err = assert_close(&format!("{name}: engine vs naive"), &full.data, &naive);
    // The logits are not degenerate (the comparison means something).
    assert!(max_abs(&naive) > 0.1, "{name}: logits too small");

    // 2. One position per call reproduces every row.
    let tol = 1e-4 * (1.0 + max_abs(&full.data));
    let mut s = model.new_session();
    let mut cache_err = 0f32;
    for (t, &tok) in PROMPT.iter().enumerate() {
        let row = model.forward(&mut s, &[tok]).unwrap();
        assert_eq!(row.rows, 1);
        let e = max_abs_diff(row.row(0).unwrap(), full.row(t).unwrap());
        assert!(e <= tol, "{name}: incremental position {t}: {e} > {tol}");
        cache_err = cache_err.max(e);
    }
    assert_eq!(s.len(), n);

    // 3. Chunked prefill (5 + 7) with last-only logits.
    let mut s = model.new_session();
    let a = model.forward(&mut s, &PROMPT[..5]).unwrap();
    let b = model.forward_last(&mut s, &PROMPT[5..]).unwrap();
    assert!(
        max_abs_diff(a.row(4).unwrap(), full.row(4).unwrap()) <= tol,
        "{name}: chunk 1"
    );
    assert!(
        max_abs_diff(&b, full.row(n - 1).unwrap()) <= tol,
        "{name}: chunk 2"
    );

    // 4. Truncate (speculative rollback) and redo with different tokens, then the original ones.
    let wrong: Vec<u32> = PROMPT[6..].iter().map(|t| (t + 1) % vocab as u32).collect();
    s.truncate(6).unwrap();
    assert_eq!(s.len(), 6);
    let _ = model.forward(&mut s, &wrong).unwrap();
    s.truncate(6).unwrap();
    let redo = model.forward(&mut s, &PROMPT[6..]).unwrap();
    for t in 6..n {
        let e = max_abs_diff(redo.row(t - 6).unwrap(), full.row(t).unwrap());
        assert!(e <= tol, "{name}: after truncate, position {t}: {e}");
    }
    assert!(s.truncate(n + 1).is_err());

    // 5. Routing trace: one routing per position for each MoE layer, weights finite.
    for (_, routes) in &trace.routing {
        assert_eq!(routes.len(), n);
        assert!(routes
            .iter()
            .all(|r| r.weights.iter().all(|w| w.is_finite())));
    }
    eprintln!("{name}: engine vs naive {naive_err:e}, cache {cache_err:e}");
    (naive_err, cache_err)
}

#[test]
fn deepseek_fixture_shape_on_random_weights() {
    check("deepseek base", &deepseek_base(), false, 1);
}

/// Grouped routing, several shared experts, no q_lora, YaRN, v_head_dim != qk_nope_head_dim,
/// two leading dense layers, norm_topk_prob false.
#[test]
fn deepseek_grouped_yarn_no_q_lora() {
    let cfg = with(
        deepseek_base(),
        json!({
            "q_lora_rank": null, "n_group": 4, "topk_group": 2, "n_shared_experts": 2,
            "v_head_dim": 12, "first_k_dense_replace": 2, "norm_topk_prob": false,
            "routed_scaling_factor": 1.5, "num_hidden_layers": 5,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
        }),
    );
    check("deepseek grouped/yarn/no-q_lora", &cfg, false, 2);
}

/// moe_layer_freq 2, tied embeddings, attention biases, no shared experts, transformers-5
/// rope_parameters spelling with mscale != mscale_all_dim, half-split rope.
#[test]
fn deepseek_layer_freq_tied_bias_rope_parameters() {
    let mut cfg = with(
        deepseek_base(),
        json!({
            "moe_layer_freq": 2, "first_k_dense_replace": 1, "tie_word_embeddings": true,
            "attention_bias": true, "n_shared_experts": null, "n_group": 2, "topk_group": 1,
            "num_experts_per_tok": 2, "rope_interleave": false, "qk_rope_head_dim": 12,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                                "original_max_position_embeddings": 16, "mscale": 1.0,
                                "mscale_all_dim": 0.707}
        }),
    );
    cfg.as_object_mut().unwrap().remove("rope_scaling");
    cfg.as_object_mut().unwrap().remove("rope_theta");
    check("deepseek freq2/tied/bias/rope_parameters", &cfg, false, 3);
}

#[test]
fn qwen_fixture_shape_on_random_weights() {
    check("qwen base", &qwen_base(), false, 4);
}

/// One KV head, head_dim != hidden/heads, a dense layer via mlp_only_layers, norm_topk_prob
/// false, YaRN.
#[test]
fn qwen_one_kv_head_wide_heads_dense_layer_yarn() {
    let cfg = with(
        qwen_base(),
        json!({
            "num_key_value_heads": 1, "head_dim": 24, "mlp_only_layers": [1],
            "norm_topk_prob": false,
            "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
        }),
    );
    check("qwen 1kv/head_dim 24/dense/yarn", &cfg, false, 5);
}

/// decoder_sparse_step 2, fused transformers-5 expert tensors, attention bias, tied embeddings,
/// head_dim derived from hidden/heads.
#[test]
fn qwen_sparse_step_fused_experts_tied() {
    let mut cfg = with(
        qwen_base(),
        json!({
            "num_attention_heads": 8, "num_key_value_heads": 2, "decoder_sparse_step": 2,
            "attention_bias": true, "tie_word_embeddings": true
        }),
    );
    cfg.as_object_mut().unwrap().remove("head_dim");
    check("qwen sparse-step 2/fused/tied", &cfg, true, 6);
}
