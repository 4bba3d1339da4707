//! Validates the plain Kimi Linear / Kimi K3 reference (tests/common/naive_kimi.rs) against the
//! transformers-based fixtures (kimi_linear_a, kimi_k3_a, kimi_k3_mxfp4), and smoke-tests it on
//! harder synthetic configurations written by tests/common/synth_kimi.rs.
#![allow(clippy::unwrap_used, clippy::needless_range_loop)]

mod common;
#[path = "common/naive_kimi/mod.rs"]
mod naive_kimi;
#[path = "common/synth_kimi.rs"]
mod synth_kimi;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use common::{argmax, fixture_dir, max_abs, max_abs_diff, Reference};
use naive_kimi::{naive_kimi_forward, naive_kimi_weight, NaiveKimiOut};
use serde_json::Value;
use synth_kimi::{harder_k3_config, harder_kimi_linear_config, synth_kimi, write_kimi_model_with};

/// Collects every comparison, prints it, and fails at the end with the list of failures.
struct Checker {
    name: String,
    failures: Vec<String>,
}

impl Checker {
    fn new(name: &str) -> Checker {
        Checker {
            name: name.into(),
            failures: Vec::new(),
        }
    }

    /// `max|ours - ref| <= rel * (1 + max|ref|)`.
    fn close(&mut self, what: &str, ours: &[f32], reference: &[f32], rel: f32) -> f32 {
        if ours.len() != reference.len() {
            self.fail(format!(
                "{what}: length {} vs reference {}",
                ours.len(),
                reference.len()
            ));
            return f32::INFINITY;
        }
        let err = max_abs_diff(ours, reference);
        let tol = rel * (1.0 + max_abs(reference));
        let ok = err <= tol;
        println!(
            "{}: {what}: max err {err:.3e}, tol {tol:.3e} (max|ref| {:.3}) {}",
            self.name,
            max_abs(reference),
            if ok { "ok" } else { "FAIL" }
        );
        if !ok {
            self.fail(format!("{what}: max err {err:.3e} > tol {tol:.3e}"));
        }
        err
    }

    fn check(&mut self, what: &str, ok: bool, detail: String) {
        println!("{}: {what}: {}", self.name, if ok { "ok" } else { "FAIL" });
        if !ok {
            self.fail(format!("{what}: {detail}"));
        }
    }

    fn fail(&mut self, msg: String) {
        self.failures.push(msg);
    }

    fn finish(self) {
        assert!(
            self.failures.is_empty(),
            "{}: {} failed check(s):\n{}",
            self.name,
            self.failures.len(),
            self.failures.join("\n")
        );
    }
}

fn ids(r: &Reference, name: &str) -> Vec<u32> {
    r.i64(name).iter().map(|&t| t as u32).collect()
}

fn usizes(r: &Reference, name: &str) -> Vec<usize> {
    r.i64(name).iter().map(|&t| t as usize).collect()
}

/// Tolerance of the prompt/step logits and taps: Kimi Linear 1e-3, K3 3e-4 (relative to
/// 1 + max|ref|).
fn prompt_rel(name: &str) -> f32 {
    if name.starts_with("kimi_linear") {
        1e-3
    } else {
        3e-4
    }
}

fn check_prompt(name: &str) {
    let dir = fixture_dir(name);
    let r = Reference::open(&dir.join("reference.safetensors"));
    let rel = prompt_rel(name);
    let mut ck = Checker::new(name);
    let prompt = ids(&r, "prompt_ids");
    let n = prompt.len();
    let t0 = std::time::Instant::now();
    let out = naive_kimi_forward(&dir, &prompt);
    println!("{name}: {n}-token forward took {:?}", t0.elapsed());
    let (vocab, hidden) = (out.vocab, out.hidden);
    println!(
        "{name}: min_greedy_margin {:?}, min_route_margin {:?}",
        r.f32("min_greedy_margin"),
        r.f32("min_route_margin")
    );

    // Structure.
    ck.check(
        "kda_layer_ids",
        out.kda_layers == usizes(&r, "kda_layer_ids"),
        format!("{:?} vs {:?}", out.kda_layers, r.i64("kda_layer_ids")),
    );
    ck.check(
        "mla_layer_ids",
        out.mla_layers == usizes(&r, "mla_layer_ids"),
        format!("{:?} vs {:?}", out.mla_layers, r.i64("mla_layer_ids")),
    );
    let moe: Vec<usize> = out.router_topk.iter().map(|m| m.layer).collect();
    ck.check(
        "moe_layer_ids",
        moe == usizes(&r, "moe_layer_ids"),
        format!("{moe:?} vs {:?}", r.i64("moe_layer_ids")),
    );
    ck.close(
        "attn_softmax_scale",
        &[out.attn_softmax_scale],
        &r.f32("attn_softmax_scale"),
        1e-6,
    );

    // Residual stream / AttnRes taps, layer by layer (where a port diverges).
    let hs = r.f32("prompt_hidden_states");
    let per = n * hidden;
    for (i, ours) in out.hidden_states.iter().enumerate() {
        ck.close(
            &format!("prompt_hidden_states[{i}]"),
            ours,
            &hs[i * per..(i + 1) * per],
            rel,
        );
    }
    if r.has("prompt_attn_inputs") {
        let ai = r.f32("prompt_attn_inputs");
        let mi = r.f32("prompt_mlp_inputs");
        for l in 0..out.attn_inputs.len() {
            ck.close(
                &format!("prompt_attn_inputs[{l}]"),
                &out.attn_inputs[l],
                &ai[l * per..(l + 1) * per],
                rel,
            );
            ck.close(
                &format!("prompt_mlp_inputs[{l}]"),
                &out.mlp_inputs[l],
                &mi[l * per..(l + 1) * per],
                rel,
            );
        }
        let blocks = r.f32("prompt_attn_res_blocks");
        let ours: Vec<f32> = out.attn_res_blocks.iter().flatten().cloned().collect();
        ck.close("prompt_attn_res_blocks", &ours, &blocks, rel);
        ck.close(
            "prompt_final_mixed",
            &out.final_mixed,
            &r.f32("prompt_final_mixed"),
            rel,
        );
    }

    // KDA taps.
    ck.close("kda0_g", &out.kda0_g, &r.f32("kda0_g"), rel);
    ck.close("kda0_beta", &out.kda0_beta, &r.f32("kda0_beta"), rel);
    ck.close(
        "kda0_core_out",
        &out.kda0_core_out,
        &r.f32("kda0_core_out"),
        rel,
    );
    let st = r.f32("kda_recurrent_state");
    let cs = r.f32("kda_conv_state");
    let (sper, cper) = (
        st.len() / out.kda_states.len().max(1),
        cs.len() / out.kda_conv_states.len().max(1),
    );
    for (i, (s, c)) in out.kda_states.iter().zip(&out.kda_conv_states).enumerate() {
        ck.close(
            &format!("kda_recurrent_state[{i}]"),
            s,
            &st[i * sper..(i + 1) * sper],
            rel,
        );
        ck.close(
            &format!("kda_conv_state[{i}]"),
            c,
            &cs[i * cper..(i + 1) * cper],
            rel,
        );
    }

    // Routing: sets at every prompt position, weights matched by expert.
    let top_k = r.shape("router_topk")[1];
    let rt = usizes(&r, "router_topk");
    let rw = r.f32("router_topk_weights");
    let prt = usizes(&r, "prompt_router_topk");
    let prw = r.f32("prompt_router_topk_weights");
    let mut worst_w = 0f32;
    for (mi, route) in out.router_topk.iter().enumerate() {
        let want: BTreeSet<usize> = rt[mi * top_k..(mi + 1) * top_k].iter().cloned().collect();
        let got: BTreeSet<usize> = route.ids[n - 1].iter().cloned().collect();
        ck.check(
            &format!("router_topk layer {} (last position)", route.layer),
            want == got,
            format!("ours {:?} vs reference {want:?}", route.ids[n - 1]),
        );
        for (j, &e) in rt[mi * top_k..(mi + 1) * top_k].iter().enumerate() {
            if let Some(p) = route.ids[n - 1].iter().position(|&x| x == e) {
                worst_w = worst_w.max((route.weights[n - 1][p] - rw[mi * top_k + j]).abs());
            }
        }
        let mut bad = Vec::new();
        for t in 0..n {
            let base = (mi * n + t) * top_k;
            let want: BTreeSet<usize> = prt[base..base + top_k].iter().cloned().collect();
            let got: BTreeSet<usize> = route.ids[t].iter().cloned().collect();
            if want != got {
                bad.push(format!("t={t}: ours {:?} ref {want:?}", route.ids[t]));
            }
            for (j, &e) in prt[base..base + top_k].iter().enumerate() {
                if let Some(p) = route.ids[t].iter().position(|&x| x == e) {
                    worst_w = worst_w.max((route.weights[t][p] - prw[base + j]).abs());
                }
            }
        }
        ck.check(
            &format!("prompt_router_topk layer {} (all positions)", route.layer),
            bad.is_empty(),
            bad.join("; "),
        );
    }
    let wmax = max_abs(&prw);
    println!("{name}: router weights max err {worst_w:.3e} (max|ref| {wmax:.3})");
    ck.check(
        "router weights",
        worst_w <= rel * (1.0 + wmax),
        format!("max err {worst_w:.3e}"),
    );

    // Dequantization example (MXFP4 fixture).
    if r.has("dequant_example") {
        let tensor = r
            .metadata("dequant_example_tensor")
            .map(str::to_string)
            .or_else(|| {
                // the fixture keeps it inside the `oracle` metadata JSON
                let o: Value = serde_json::from_str(r.metadata("oracle")?).ok()?;
                o["dequant_example_tensor"].as_str().map(str::to_string)
            });
        let tensor = tensor.expect("dequant_example_tensor in the metadata");
        let prefix = tensor.strip_suffix(".weight").unwrap();
        let (w, rows, cols) = naive_kimi_weight(&dir, prefix);
        ck.check(
            "dequant_example shape",
            vec![rows, cols] == r.shape("dequant_example"),
            format!("{rows}x{cols} vs {:?}", r.shape("dequant_example")),
        );
        ck.close("dequant_example", &w, &r.f32("dequant_example"), 0.0);
    }

    // Logits last: everything above says where a difference comes from.
    let want = r.f32("prompt_logits");
    ck.close("prompt_logits", &out.logits, &want, rel);
    for t in 0..n {
        let a = argmax(&out.logits[t * vocab..(t + 1) * vocab]);
        let b = argmax(&want[t * vocab..(t + 1) * vocab]);
        if a != b {
            ck.fail(format!("prompt row {t}: argmax {a} vs reference {b}"));
        }
    }
    ck.finish();
}

fn check_long_prompt(name: &str) {
    let dir = fixture_dir(name);
    let r = Reference::open(&dir.join("reference.safetensors"));
    let mut ck = Checker::new(name);
    let tokens = ids(&r, "long_prompt_ids");
    let t0 = std::time::Instant::now();
    let out = naive_kimi_forward(&dir, &tokens);
    println!(
        "{name}: {}-token forward took {:?}",
        tokens.len(),
        t0.elapsed()
    );
    ck.close(
        "long_prompt_logits",
        &out.logits,
        &r.f32("long_prompt_logits"),
        1e-3,
    );
    ck.finish();
}

/// Greedy decoding by repeated uncached forwards.
fn check_greedy(name: &str) {
    let dir = fixture_dir(name);
    let r = Reference::open(&dir.join("reference.safetensors"));
    let rel = prompt_rel(name);
    let mut ck = Checker::new(name);
    let mut tokens = ids(&r, "prompt_ids");
    let want = ids(&r, "greedy_ids");
    let step_logits = r.f32("greedy_step_logits");
    let mut got = Vec::new();
    let mut worst = 0f32;
    let mut tol = 0f32;
    for i in 0..want.len() {
        let out = naive_kimi_forward(&dir, &tokens);
        let v = out.vocab;
        let last = &out.logits[(tokens.len() - 1) * v..tokens.len() * v];
        let reference = &step_logits[i * v..(i + 1) * v];
        worst = worst.max(max_abs_diff(last, reference));
        tol = tol.max(rel * (1.0 + max_abs(reference)));
        let next = argmax(last) as u32;
        got.push(next);
        tokens.push(next);
    }
    println!("{name}: greedy ids ours {got:?}");
    println!("{name}: greedy ids ref  {want:?}");
    ck.check("greedy_ids", got == want, format!("{got:?} vs {want:?}"));
    println!("{name}: greedy step logits max err {worst:.3e}, tol {tol:.3e}");
    ck.check(
        "greedy_step_logits",
        worst <= tol,
        format!("max err {worst:.3e} > {tol:.3e}"),
    );
    ck.finish();
}

#[test]
fn kimi_linear_a_prompt() {
    check_prompt("kimi_linear_a");
}

#[test]
fn kimi_linear_a_long_prompt() {
    check_long_prompt("kimi_linear_a");
}

#[test]
fn kimi_linear_a_greedy() {
    check_greedy("kimi_linear_a");
}

#[test]
fn kimi_k3_a_prompt() {
    check_prompt("kimi_k3_a");
}

#[test]
fn kimi_k3_a_long_prompt() {
    check_long_prompt("kimi_k3_a");
}

#[test]
fn kimi_k3_a_greedy() {
    check_greedy("kimi_k3_a");
}

#[test]
fn kimi_k3_mxfp4_prompt() {
    check_prompt("kimi_k3_mxfp4");
}

#[test]
fn kimi_k3_mxfp4_long_prompt() {
    check_long_prompt("kimi_k3_mxfp4");
}

#[test]
fn kimi_k3_mxfp4_greedy() {
    check_greedy("kimi_k3_mxfp4");
}

// ---------------------------------------------------------------------------------------------
// Synthetic models

fn fixture_config(name: &str) -> Value {
    serde_json::from_slice(&std::fs::read(fixture_dir(name).join("config.json")).unwrap()).unwrap()
}

/// name -> (dtype, shape) of every tensor of a safetensors file.
fn layout_of(path: &Path) -> BTreeMap<String, (String, Vec<u64>)> {
    deltafin_storage::safetensors::read_header(path)
        .unwrap()
        .tensors
        .into_iter()
        .map(|t| (t.name, (t.dtype.as_str().to_string(), t.shape)))
        .collect()
}

/// synth_kimi writes exactly the fixtures' tensor names, dtypes and shapes for their configs.
#[test]
fn synth_kimi_matches_fixture_layouts() {
    for (name, mxfp4) in [
        ("kimi_linear_a", false),
        ("kimi_k3_a", false),
        ("kimi_k3_mxfp4", true),
    ] {
        let cfg = fixture_config(name);
        let tmp = tempfile::tempdir().unwrap();
        write_kimi_model_with(tmp.path(), &cfg, 3, mxfp4);
        let ours = layout_of(&tmp.path().join("model.safetensors"));
        let want = layout_of(&fixture_dir(name).join("model.safetensors"));
        let only_ours: Vec<_> = ours.keys().filter(|k| !want.contains_key(*k)).collect();
        let only_want: Vec<_> = want.keys().filter(|k| !ours.contains_key(*k)).collect();
        assert!(
            only_ours.is_empty() && only_want.is_empty(),
            "{name}: only in synth {only_ours:?}; only in fixture {only_want:?}"
        );
        for (k, v) in &want {
            assert_eq!(&ours[k], v, "{name}: {k}");
        }
        println!("{name}: {} tensors, layout identical", want.len());
        // and the naive forward runs on it
        let out = naive_kimi_forward(tmp.path(), &[5, 9, 200, 3, 77, 1, 400, 12]);
        assert!(out.logits.iter().all(|v| v.is_finite()), "{name}");
    }
}

fn smoke(what: &str, cfg: &Value, mxfp4: bool) -> NaiveKimiOut {
    let tmp = tempfile::tempdir().unwrap();
    write_kimi_model_with(tmp.path(), cfg, 11, mxfp4);
    let tokens: Vec<u32> = (0..24u32).map(|i| (i * 37 + 5) % 512).collect();
    let out = naive_kimi_forward(tmp.path(), &tokens);
    let (n, v) = (out.n, out.vocab);
    assert_eq!(out.logits.len(), n * v);
    assert!(
        out.logits.iter().all(|x| x.is_finite()),
        "{what}: non-finite logits"
    );
    // causality: a forward over a prefix reproduces the first rows
    let m = 9;
    let pre = naive_kimi_forward(tmp.path(), &tokens[..m]);
    let err = max_abs_diff(&pre.logits, &out.logits[..m * v]);
    assert!(
        err <= 1e-5 * (1.0 + max_abs(&pre.logits)),
        "{what}: prefix differs by {err}"
    );
    // non-degenerate decisions
    let mut min_gap = f32::INFINITY;
    for t in 0..n {
        let row = &out.logits[t * v..(t + 1) * v];
        let mut s = row.to_vec();
        s.sort_by(|a, b| b.partial_cmp(a).unwrap());
        min_gap = min_gap.min(s[0] - s[1]);
    }
    let distinct: Vec<usize> = out
        .router_topk
        .iter()
        .map(|r| r.ids.iter().flatten().collect::<BTreeSet<_>>().len())
        .collect();
    let g_range = (
        out.kda0_g.iter().cloned().fold(f32::INFINITY, f32::min),
        out.kda0_g.iter().cloned().fold(f32::NEG_INFINITY, f32::max),
    );
    println!(
        "{what}: max|logits| {:.3}, min top1-top2 gap {min_gap:.4}, layers kda {:?} mla {:?}, \
         distinct experts per MoE layer {distinct:?}, kda0 g in [{:.3}, {:.3}], \
         attn-res blocks {}, prefix err {err:.2e}",
        max_abs(&out.logits),
        out.kda_layers,
        out.mla_layers,
        g_range.0,
        g_range.1,
        out.attn_res_blocks.len()
    );
    assert!(max_abs(&out.logits) < 100.0, "{what}: logits blow up");
    assert!(
        distinct.iter().all(|&d| d > 4),
        "{what}: routing degenerate"
    );
    out
}

#[test]
fn synthetic_harder_k3() {
    let cfg = harder_k3_config();
    let out = smoke("harder K3 (BF16 experts)", &cfg, false);
    assert_eq!(out.mla_layers, vec![0, 3]);
    assert_eq!(out.kda_layers, vec![1, 2, 4, 5]);
    // boundaries at layers 0, 2, 4
    assert_eq!(out.attn_res_blocks.len(), 3);
    assert_eq!(out.router_topk.len(), 4);
    assert_eq!(out.kda_states[0].len(), 3 * 16 * 16);
    assert_eq!(out.kda_conv_states[0].len(), 3 * 48 * 3);
    // A_log is stored padded to head_dim with zeros after the 3 head values
    let s = synth_kimi(&cfg, 11, false);
    let a = s
        .tensors
        .iter()
        .find(|t| t.name == "language_model.model.layers.1.self_attn.A_log")
        .unwrap();
    assert_eq!(a.shape, vec![16]);
    smoke("harder K3 (MXFP4 experts)", &cfg, true);
}

#[test]
fn synthetic_harder_kimi_linear() {
    let cfg = harder_kimi_linear_config();
    let out = smoke("harder Kimi Linear", &cfg, false);
    assert_eq!(out.mla_layers, vec![0, 3]);
    assert_eq!(out.kda_layers, vec![1, 2, 4]);
    assert!(out.attn_res_blocks.is_empty());
    assert_eq!(out.kda_states[0].len(), 5 * 8 * 8);
}
