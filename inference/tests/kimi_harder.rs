//! The engine on Kimi Linear / K3 configurations harder than the fixtures, against the plain,
//! independently written reference (tests/common/naive_kimi): MLA first and KDA last, H·D !=
//! hidden, conv kernels 2 and 3, q_lora_rank null, attention-residual blocks of 1 and 2, two
//! dense layers, grouped routing, the softplus and safe gates, low- and full-rank output gates,
//! softmax routing, no latent norm, MXFP4 experts.
#![allow(clippy::unwrap_used)]

mod common;
#[path = "common/naive_kimi/mod.rs"]
mod naive_kimi;
#[path = "common/synth_kimi.rs"]
mod synth_kimi;

use std::sync::Arc;

use common::{max_abs, max_abs_diff};
use deltafin_inference::{DirSource, Model};
use naive_kimi::naive_kimi_forward;
use serde_json::{json, Value};
use synth_kimi::{harder_k3_config, harder_kimi_linear_config, write_kimi_model_with};

/// Engine logits against the naive reference's, over a 20-token prompt, uncached and cached
/// (prefill of 7 then one token at a time).
fn compare(what: &str, cfg: &Value, mxfp4: bool) {
    let tmp = tempfile::tempdir().unwrap();
    write_kimi_model_with(tmp.path(), cfg, 11, mxfp4);
    let tokens: Vec<u32> = (0..20u32).map(|i| (i * 37 + 5) % 500).collect();
    let want = naive_kimi_forward(tmp.path(), &tokens);
    let model = Model::load(Arc::new(DirSource::open(tmp.path()).unwrap())).unwrap();
    let got = model.forward(&mut model.new_session(), &tokens).unwrap();
    let tol = 3e-4 * (1.0 + max_abs(&want.logits));
    let err = max_abs_diff(&got.data, &want.logits);
    assert!(err <= tol, "{what}: uncached max err {err} > {tol}");
    let mut s = model.new_session();
    let v = model.vocab_size();
    let mut rows = model.forward(&mut s, &tokens[..7]).unwrap().data;
    for &t in &tokens[7..] {
        rows.extend(model.forward(&mut s, &[t]).unwrap().data);
    }
    let cached = max_abs_diff(&rows, &want.logits);
    assert!(cached <= tol, "{what}: cached max err {cached} > {tol}");
    assert_eq!(rows.len(), tokens.len() * v);
    eprintln!("{what}: max err uncached {err:.2e}, cached {cached:.2e} (tolerance {tol:.2e})");
}

#[test]
fn harder_k3_matches_the_plain_reference() {
    compare("harder K3", &harder_k3_config(), false);
    compare("harder K3, MXFP4 experts", &harder_k3_config(), true);
}

#[test]
fn harder_kimi_linear_matches_the_plain_reference() {
    compare("harder Kimi Linear", &harder_kimi_linear_config(), false);
}

/// More corners: one-layer residual blocks, KDA first and last with conv kernel 2 and H·D >
/// hidden, low-rank gate with the safe gate, no latent norm, softmax routing, MLA output gate
/// off.
#[test]
fn other_k3_corners_match_the_plain_reference() {
    let mut c = harder_k3_config();
    let t = &mut c["text_config"];
    t["attn_res_block_size"] = json!(1);
    t["linear_attn_config"]["full_attn_layers"] = json!([3]);
    t["linear_attn_config"]["kda_layers"] = json!([1, 2, 4, 5, 6]);
    t["linear_attn_config"]["num_heads"] = json!(5);
    t["linear_attn_config"]["head_dim"] = json!(16);
    t["linear_attn_config"]["short_conv_kernel_size"] = json!(2);
    t["linear_attn_config"]["use_full_rank_gate"] = json!(false);
    t["latent_moe_use_norm"] = json!(false);
    t["moe_router_activation_func"] = json!("softmax");
    t["mla_use_output_gate"] = json!(false);
    t["q_lora_rank"] = json!(16);
    t["num_expert_group"] = json!(1);
    t["topk_group"] = json!(1);
    compare("K3 corners", &c, false);
}

/// A model whose files disagree with its config is refused, naming the tensor or key.
#[test]
fn malformed_kimi_checkpoints_are_refused_by_name() {
    let cfg = harder_k3_config();
    let load = |mutate: &dyn Fn(&mut common::synth::Synth), cfg: &Value| -> String {
        let tmp = tempfile::tempdir().unwrap();
        let mut s = synth_kimi::synth_kimi(cfg, 3, false);
        mutate(&mut s);
        s.write(tmp.path(), cfg);
        match DirSource::open(tmp.path()).map(Arc::new) {
            Ok(src) => Model::load(src).unwrap_err().to_string(),
            Err(e) => e.to_string(),
        }
    };
    let a_log = "language_model.model.layers.1.self_attn.A_log";
    // A_log whose padding is not zero (could be a per-channel rate, which is not run).
    let e = load(
        &|s| {
            let t = s.tensors.iter_mut().find(|t| t.name == a_log).unwrap();
            let last = t.bytes.len() - 4;
            t.bytes[last..].copy_from_slice(&0.5f32.to_le_bytes());
        },
        &cfg,
    );
    assert!(e.contains(a_log) && e.contains("padding"), "{e}");
    // A_log with fewer values than heads.
    let e = load(
        &|s| {
            let t = s.tensors.iter_mut().find(|t| t.name == a_log).unwrap();
            t.shape = vec![2];
            t.bytes.truncate(8);
        },
        &cfg,
    );
    assert!(e.contains(a_log), "{e}");
    // A conv weight of the wrong kernel size.
    let conv = "language_model.model.layers.1.self_attn.q_conv1d.weight";
    let e = load(
        &|s| {
            let t = s.tensors.iter_mut().find(|t| t.name == conv).unwrap();
            t.shape[2] = 4;
            let n = t.bytes.len() / 3 * 4;
            t.bytes.resize(n, 0);
        },
        &cfg,
    );
    assert!(e.contains(conv) && e.contains("shape"), "{e}");
    // A missing latent projection.
    let e = load(
        &|s| {
            s.tensors.retain(|t| {
                !t.name
                    .ends_with("layers.2.block_sparse_moe.routed_expert_up_proj.weight")
            })
        },
        &cfg,
    );
    assert!(e.contains("routed_expert_up_proj"), "{e}");
    // An unknown key that could change the math.
    let mut bad = cfg.clone();
    bad["text_config"]["kda_chunk_gate"] = json!(true);
    let e = load(&|_| {}, &bad);
    assert!(e.contains("text_config.kda_chunk_gate"), "{e}");
}
