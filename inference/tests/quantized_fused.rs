//! `layout --quantize-experts` on a Qwen3-MoE checkpoint whose routed experts are stored fused
//! (transformers-5 `mlp.experts.gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`): every
//! expert's slices are quantized (not copied), the records shrink by the format's ratio, and the
//! model served from the layout stays close to the unquantized one.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::synth::synth_model;
use common::{max_abs, max_abs_diff};
use deltafin_inference::quantize::{ExpertFormat, QuantizeExperts};
use deltafin_inference::{DirSource, LayoutSource, LayoutSourceOptions, Model};
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::layout::{write_layout, ExpertTransform, LayoutOptions, NoProgress};
use deltafin_storage::manifest::RecordId;
use deltafin_storage::stripe::Mode;
use serde_json::json;

const PROMPT: [u32; 12] = [5, 17, 3, 88, 42, 9, 61, 0, 33, 71, 2, 54];

#[test]
fn fused_qwen_experts_are_quantized_at_layout() {
    let config = json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 96, "hidden_size": 64, "intermediate_size": 80, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": true,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": null, "max_position_embeddings": 128,
        "tie_word_embeddings": false, "attention_bias": false, "hidden_act": "silu",
        "eos_token_id": 1, "bos_token_id": 0
    });
    let ckpt_dir = tempfile::tempdir().unwrap();
    synth_model(&config, 21, true).write(ckpt_dir.path(), &config);
    let plain = Model::load(Arc::new(DirSource::open(ckpt_dir.path()).unwrap())).unwrap();
    let want = plain
        .forward(&mut plain.new_session(), &PROMPT)
        .unwrap()
        .data;
    let ckpt = Checkpoint::open(ckpt_dir.path()).unwrap();

    for (format, max_rel) in [(ExpertFormat::Q8, 0.02), (ExpertFormat::Int4, 0.3)] {
        let drive = tempfile::tempdir().unwrap();
        let quant = Arc::new(QuantizeExperts::new(
            format,
            deltafin_inference::family::expert_naming(&ckpt.config).unwrap(),
        ));
        let opts = LayoutOptions {
            name: "q".into(),
            drives: vec![drive.path().to_path_buf()],
            mode: Mode::Stripe,
            stripe_unit: 8192,
            force: false,
            naming: deltafin_inference::family::expert_naming(&ckpt.config).unwrap(),
            transform: Some(quant.clone() as Arc<dyn ExpertTransform>),
            keep_free: 0,
        };
        let manifest = write_layout(&ckpt, &opts, &NoProgress).unwrap();

        // Both fused matrices of every expert were quantized and reported.
        let errs = quant.errors();
        assert_eq!(errs.len(), 3 * 8 * 2, "{format:?}: {errs:?}");
        assert!(errs.iter().any(|e| e.tensor.ends_with("gate_up_proj[7]")));
        let record = manifest
            .records
            .iter()
            .find(|r| matches!(r.id, RecordId::Expert { .. }))
            .unwrap();
        let bf16_bytes = (2 * 32 * 64 + 64 * 32) * 2;
        let ratio = bf16_bytes as f64 / record.len as f64;
        let want_ratio = if format == ExpertFormat::Q8 { 1.7 } else { 2.8 };
        assert!(ratio > want_ratio, "{format:?}: record ratio {ratio}");

        let opts = LayoutSourceOptions {
            threads_per_drive: 2,
            ..LayoutSourceOptions::default()
        };
        let src = LayoutSource::open(&manifest.drives[0].path, &opts).unwrap();
        let model = Model::load(Arc::new(src)).unwrap();
        let got = model
            .forward(&mut model.new_session(), &PROMPT)
            .unwrap()
            .data;
        let rel = max_abs_diff(&got, &want) / max_abs(&want);
        eprintln!("{format:?}: record {ratio:.2}x smaller, logits rel err {rel:.4}");
        assert!(rel < max_rel, "{format:?}: logits rel err {rel}");
        assert!(
            rel > 0.0,
            "{format:?}: identical logits, nothing was quantized"
        );
    }
}
