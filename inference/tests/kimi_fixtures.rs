//! Kimi Linear and Kimi K3 against their references (transformers' kimi_linear modules; K3's
//! additions composed on them following Moonshot's code): prompt and step logits, greedy ids,
//! routing sets, the 80-token prompt, and the intermediate taps (KDA gate, beta, core output and
//! states; Attention Residuals' inputs, blocks and final mix), from the model directory and from
//! a 3-drive striped layout; chunked, token-by-token and split prefill agree.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use common::{argmax, fixture_dir, max_abs, max_abs_diff, Reference};
use deltafin_inference::mixer::kda::KdaAttention;
use deltafin_inference::mixer::KdaState;
use deltafin_inference::{
    DirSource, ForwardTrace, LayoutSource, LayoutSourceOptions, LogitsMode, Model, Session,
};
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::layout::{write_layout, LayoutOptions, NoProgress};
use deltafin_storage::stripe::Mode;

const FIXTURES: [&str; 3] = ["kimi_linear_a", "kimi_k3_a", "kimi_k3_mxfp4"];

/// The logits tolerance of a fixture, relative to `1 + max|ref|`.
fn rel_tol(name: &str) -> f32 {
    if name.starts_with("kimi_linear") {
        1e-3
    } else {
        3e-4
    }
}

fn check(what: &str, ours: &[f32], reference: &[f32], rel: f32) -> f32 {
    assert_eq!(ours.len(), reference.len(), "{what}: length");
    let err = max_abs_diff(ours, reference);
    let tol = rel * (1.0 + max_abs(reference));
    assert!(err <= tol, "{what}: max abs error {err} > tolerance {tol}");
    err
}

fn ids(r: &Reference, name: &str) -> Vec<u32> {
    r.i64(name).iter().map(|&t| t as u32).collect()
}

fn load_dir(name: &str) -> Model {
    Model::load(Arc::new(DirSource::open(&fixture_dir(name)).unwrap())).unwrap()
}

/// A 3-drive striped layout of fixture `name` (tempdirs kept alive by the caller).
fn load_layout(name: &str) -> (Vec<tempfile::TempDir>, Model) {
    let ckpt = Checkpoint::open(&fixture_dir(name)).unwrap();
    let tmp: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let opts = LayoutOptions {
        name: "m".into(),
        drives: tmp.iter().map(|t| t.path().to_path_buf()).collect(),
        mode: Mode::Stripe,
        stripe_unit: 8192,
        force: false,
        naming: deltafin_inference::family::expert_naming(&ckpt.config).unwrap(),
        transform: None,
        keep_free: 0,
    };
    let m = write_layout(&ckpt, &opts, &NoProgress).unwrap();
    let src = LayoutSource::open(
        &m.drives[0].path,
        &LayoutSourceOptions {
            threads_per_drive: 2,
            buffer_cap_bytes: 64 << 20,
            ..LayoutSourceOptions::default()
        },
    )
    .unwrap();
    let (model, _) = Model::load_owned(src).unwrap();
    // The resident matrices keep the layout's buffers rather than a second copy.
    assert!(
        model.lm_head().is_some_and(|h| h.shares_bytes()),
        "{name}: lm_head copied"
    );
    (tmp, model)
}

/// Prompt logits, routing sets, greedy ids and step logits, the 80-token prompt.
fn check_outputs(name: &str, model: &Model, r: &Reference) -> (f32, f32) {
    let rel = rel_tol(name);
    let prompt = ids(r, "prompt_ids");
    let (n, vocab) = (prompt.len(), model.vocab_size());
    let mut session = model.new_session();
    let mut trace = ForwardTrace::default();
    let logits = model
        .forward_with(&mut session, &prompt, LogitsMode::All, Some(&mut trace))
        .unwrap();
    let prompt_err = check(
        &format!("{name}: prompt logits"),
        &logits.data,
        &r.f32("prompt_logits"),
        rel,
    );

    // Routing at every prompt position, as sets.
    let layer_ids = r.i64("moe_layer_ids");
    let topk = r.i64("prompt_router_topk");
    let k = r.shape("prompt_router_topk")[2];
    assert_eq!(trace.routing.len(), layer_ids.len(), "{name}");
    for (row, (layer, routes)) in trace.routing.iter().enumerate() {
        assert_eq!(*layer as i64, layer_ids[row]);
        for (t, route) in routes.iter().enumerate() {
            let base = (row * n + t) * k;
            let want: BTreeSet<usize> = topk[base..base + k].iter().map(|&e| e as usize).collect();
            let got: BTreeSet<usize> = route.experts.iter().copied().collect();
            assert_eq!(got, want, "{name}: layer {layer} position {t} routing");
        }
    }

    // Greedy decoding with the cache.
    let greedy = r.i64("greedy_ids");
    let step_logits = r.f32("greedy_step_logits");
    let mut session = model.new_session();
    let mut last = model.forward_last(&mut session, &prompt).unwrap();
    let mut step_err = 0f32;
    for (i, &want) in greedy.iter().enumerate() {
        let reference = &step_logits[i * vocab..(i + 1) * vocab];
        step_err = step_err.max(check(
            &format!("{name}: greedy step {i}"),
            &last,
            reference,
            rel,
        ));
        let id = argmax(&last);
        assert_eq!(id as i64, want, "{name}: greedy step {i}");
        last = model.forward_last(&mut session, &[id as u32]).unwrap();
    }

    // The 80-token prompt, longer than transformers' 64-token KDA chunk.
    let long = ids(r, "long_prompt_ids");
    let logits = model.forward(&mut model.new_session(), &long).unwrap();
    check(
        &format!("{name}: long prompt logits"),
        &logits.data,
        &r.f32("long_prompt_logits"),
        1e-3,
    );
    (prompt_err, step_err)
}

/// The KDA layer `layer` and its state in `session`.
fn kda_of<'m>(
    model: &'m Model,
    session: &'m Session,
    layer: usize,
) -> (&'m KdaAttention, &'m KdaState) {
    let mixer = model.layers()[layer]
        .resident()
        .unwrap()
        .mixer
        .as_any()
        .downcast_ref::<KdaAttention>()
        .unwrap();
    let state = session
        .state(layer)
        .unwrap()
        .as_any()
        .downcast_ref::<KdaState>()
        .unwrap();
    (mixer, state)
}

/// The intermediate taps of the prompt forward.
fn check_taps(name: &str, model: &Model, r: &Reference) {
    let prompt = ids(r, "prompt_ids");
    let n = prompt.len();
    let mut session = model.new_session();
    let mut trace = ForwardTrace::default();
    model
        .forward_with(&mut session, &prompt, LogitsMode::All, Some(&mut trace))
        .unwrap();
    let hidden = model.hidden_size();
    let layers = model.layers().len();
    // MXFP4 experts run with 16-bit activations on x86 (`KernelConfig::act`): the residual
    // stream then differs from the f32 reference by up to ~1.5e-4 of its size.
    let tol = if name.ends_with("mxfp4") { 3e-4 } else { 1e-4 };
    let hs = r.f32("prompt_hidden_states");
    for (i, ours) in trace.hidden_states.iter().enumerate() {
        check(
            &format!("{name}: hidden state {i}"),
            ours,
            &hs[i * n * hidden..(i + 1) * n * hidden],
            tol,
        );
    }
    if r.has("prompt_attn_inputs") {
        let (ai, mi) = (r.f32("prompt_attn_inputs"), r.f32("prompt_mlp_inputs"));
        for l in 0..layers {
            let at = l * n * hidden..(l + 1) * n * hidden;
            check(
                &format!("{name}: layer {l} attention input"),
                &trace.attn_inputs[l],
                &ai[at.clone()],
                tol,
            );
            check(
                &format!("{name}: layer {l} mlp input"),
                &trace.mlp_inputs[l],
                &mi[at],
                tol,
            );
        }
        let blocks = r.f32("prompt_attn_res_blocks");
        assert_eq!(
            trace.residual_blocks.len(),
            r.shape("prompt_attn_res_blocks")[0],
            "{name}: blocks"
        );
        for (b, ours) in trace.residual_blocks.iter().enumerate() {
            check(
                &format!("{name}: block {b}"),
                ours,
                &blocks[b * n * hidden..(b + 1) * n * hidden],
                tol,
            );
        }
        check(
            &format!("{name}: final mix"),
            &trace.final_mixed,
            &r.f32("prompt_final_mixed"),
            tol,
        );
    }
    // KDA: the first layer's gate, beta and core output; every layer's states.
    let kda_layers: Vec<usize> = r.i64("kda_layer_ids").iter().map(|&l| l as usize).collect();
    let first = kda_layers[0];
    let layer0 = model.layers()[first].resident().unwrap();
    let normed = layer0.input_layernorm.apply(&trace.attn_inputs[first]);
    let kda = layer0
        .mixer
        .as_any()
        .downcast_ref::<KdaAttention>()
        .unwrap();
    let mut fresh = layer0.mixer.new_state();
    let (_, taps) = kda.forward_taps(&normed, n, &mut *fresh).unwrap();
    check(&format!("{name}: kda0 g"), &taps.g, &r.f32("kda0_g"), tol);
    check(
        &format!("{name}: kda0 beta"),
        &taps.beta,
        &r.f32("kda0_beta"),
        tol,
    );
    check(
        &format!("{name}: kda0 core out"),
        &taps.core_out,
        &r.f32("kda0_core_out"),
        tol,
    );
    let states = r.f32("kda_recurrent_state");
    let convs = r.f32("kda_conv_state");
    let conv_shape = r.shape("kda_conv_state");
    let (c3, kk) = (conv_shape[1], conv_shape[2]);
    for (i, &l) in kda_layers.iter().enumerate() {
        let (_, st) = kda_of(model, &session, l);
        let s = st.recurrent();
        check(
            &format!("{name}: layer {l} recurrent state"),
            &s,
            &states[i * s.len()..(i + 1) * s.len()],
            tol,
        );
        // The reference keeps the last K inputs; the engine the last K - 1.
        let tail = st.conv_tail();
        let want: Vec<f32> = (0..c3)
            .flat_map(|c| convs[(i * c3 + c) * kk + 1..(i * c3 + c + 1) * kk].to_vec())
            .collect();
        check(&format!("{name}: layer {l} conv state"), tail, &want, tol);
    }
}

#[test]
fn kimi_fixtures_match_from_the_directory() {
    for name in FIXTURES {
        let r = Reference::open(&fixture_dir(name).join("reference.safetensors"));
        let model = load_dir(name);
        let (p, s) = check_outputs(name, &model, &r);
        check_taps(name, &model, &r);
        eprintln!("{name} (directory): prompt logits max err {p:.2e}, step logits max err {s:.2e}");
    }
}

#[test]
fn kimi_fixtures_match_from_a_striped_layout() {
    for name in FIXTURES {
        let r = Reference::open(&fixture_dir(name).join("reference.safetensors"));
        let (_tmp, model) = load_layout(name);
        let (p, s) = check_outputs(name, &model, &r);
        eprintln!(
            "{name} (3-drive stripe): prompt logits max err {p:.2e}, step logits max err {s:.2e}"
        );
    }
}

/// K3 with MXFP4 experts on every instruction set this machine runs, in one process.
#[test]
fn kimi_k3_mxfp4_matches_on_every_instruction_set() {
    use deltafin_inference::kernels::{Isa, KernelConfig};
    let name = "kimi_k3_mxfp4";
    let r = Reference::open(&fixture_dir(name).join("reference.safetensors"));
    let mut done = Vec::new();
    for isa in [
        Isa::Scalar,
        Isa::Avx2,
        Isa::AvxVnni,
        Isa::Avx512Bw,
        Isa::Avx512,
        Isa::Neon,
    ] {
        let k = KernelConfig::with_isa(isa);
        if k.isa != isa {
            continue;
        }
        let src = Arc::new(DirSource::open(&fixture_dir(name)).unwrap());
        let model = Model::load_with(src, k).unwrap();
        let (p, s) = check_outputs(name, &model, &r);
        eprintln!("{isa:?} {name}: prompt {p:.2e} step {s:.2e}");
        done.push(isa);
    }
    assert!(done.contains(&Isa::Scalar) && done.len() >= 2, "{done:?}");
}

/// Prefill as one chunk, token by token, and split across chunk boundaries: the same logits
/// and the same KDA states.
#[test]
fn chunked_token_by_token_and_split_prefill_agree() {
    for name in FIXTURES {
        let r = Reference::open(&fixture_dir(name).join("reference.safetensors"));
        let model = load_dir(name);
        let long = ids(&r, "long_prompt_ids");
        let n = long.len();
        let mut whole = model.new_session();
        let full = model.forward(&mut whole, &long).unwrap();
        let mut one = model.new_session();
        let mut rows = Vec::new();
        for &t in &long {
            rows.extend(model.forward(&mut one, &[t]).unwrap().data);
        }
        let mut split = model.new_session();
        let mut srows = Vec::new();
        for chunk in [&long[..37], &long[37..64], &long[64..]] {
            srows.extend(model.forward(&mut split, chunk).unwrap().data);
        }
        let e1 = check(&format!("{name}: token by token"), &rows, &full.data, 1e-4);
        let e2 = check(&format!("{name}: split prefill"), &srows, &full.data, 1e-4);
        let kda: Vec<usize> = r.i64("kda_layer_ids").iter().map(|&l| l as usize).collect();
        for &l in &kda {
            let s0 = kda_of(&model, &whole, l).1.recurrent();
            for (what, s) in [("token by token", &one), ("split", &split)] {
                let (_, st) = kda_of(&model, s, l);
                check(
                    &format!("{name}: layer {l} state, {what}"),
                    &st.recurrent(),
                    &s0,
                    1e-4,
                );
                assert_eq!(st.conv_tail(), kda_of(&model, &whole, l).1.conv_tail());
            }
        }
        eprintln!("{name}: {n} positions; token by token {e1:.1e}, split {e2:.1e}");
    }
}

/// A forward that fails part-way leaves the session (KDA states included) as it was, and a
/// rollback inside a short forward replays the recurrence exactly.
#[test]
fn kda_state_rolls_back_exactly() {
    let model = load_dir("kimi_k3_a");
    let r = Reference::open(&fixture_dir("kimi_k3_a").join("reference.safetensors"));
    let prompt = ids(&r, "prompt_ids");
    let mut s = model.new_session();
    model.forward(&mut s, &prompt[..6]).unwrap();
    // A short forward (recorded), rolled back into its middle, then continued.
    let a = model.forward(&mut s, &prompt[6..10]).unwrap();
    s.truncate(8).unwrap();
    let b = model.forward(&mut s, &prompt[8..12]).unwrap();
    let mut reference = model.new_session();
    let full = model.forward(&mut reference, &prompt).unwrap();
    check(
        "row 7 before the rollback",
        a.row(1).unwrap(),
        full.row(7).unwrap(),
        1e-5,
    );
    for t in 8..12 {
        check(
            &format!("row {t} after the rollback"),
            b.row(t - 8).unwrap(),
            full.row(t).unwrap(),
            1e-5,
        );
    }
    // A position inside a long (unrecorded) forward is not known: refused, nothing changed.
    let long = ids(&r, "long_prompt_ids");
    let mut s = model.new_session();
    model.forward(&mut s, &long).unwrap();
    let len_before = s.len();
    assert!(!s.can_truncate(5));
    let err = s.truncate(5).unwrap_err().to_string();
    assert!(err.contains("KDA") && err.contains("position 5"), "{err}");
    assert_eq!(s.len(), len_before);
    assert!(s.can_truncate(0) && s.can_truncate(len_before));
    // A bad token fails the forward; the states are as before.
    let before = kda_of(&model, &s, 0).1.recurrent();
    assert!(model.forward(&mut s, &[1, 100_000]).is_err());
    assert_eq!(s.len(), len_before);
    assert_eq!(kda_of(&model, &s, 0).1.recurrent(), before);
    let next = model.forward(&mut s, &[5]).unwrap();
    let mut t = model.new_session();
    let want = model
        .forward(&mut t, &[long.as_slice(), &[5]].concat())
        .unwrap();
    check(
        "after a failed forward",
        next.row(0).unwrap(),
        want.row(long.len()).unwrap(),
        1e-5,
    );
}
