//! End-to-end checks against references computed by Hugging Face transformers (f32) on the
//! fixtures in testdata/fixtures: prompt logits, cached greedy decoding, routing, hidden states.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use common::{argmax, assert_close, fixture_dir, max_abs_diff, Reference};
use deltafin_inference::kernels::{Isa, KernelConfig};
use deltafin_inference::{DirSource, ForwardTrace, LogitsMode, Model};

struct Report {
    prompt_err: f32,
    step_err: f32,
}

fn check_fixture(name: &str) -> Report {
    check_fixture_on(name, KernelConfig::default())
}

fn check_fixture_on(name: &str, kernels: KernelConfig) -> Report {
    let dir = fixture_dir(name);
    let src = Arc::new(DirSource::open(&dir).unwrap());
    let model = Model::load_with(src, kernels).unwrap();
    let r = Reference::open(&dir.join("reference.safetensors"));
    let vocab = model.vocab_size();
    let hidden = model.hidden_size();
    let prompt: Vec<u32> = r.i64("prompt_ids").iter().map(|&t| t as u32).collect();
    let n = prompt.len();

    // One uncached forward over the prompt, with a trace.
    let mut session = model.new_session();
    let mut trace = ForwardTrace::default();
    let logits = model
        .forward_with(&mut session, &prompt, LogitsMode::All, Some(&mut trace))
        .unwrap();
    assert_eq!((logits.rows, logits.vocab), (n, vocab));

    // Hidden states first: they say where a port diverges.
    let hs = r.f32("prompt_hidden_states");
    assert_eq!(trace.hidden_states.len(), model.layers().len() + 1);
    for (i, ours) in trace.hidden_states.iter().enumerate() {
        let reference = &hs[i * n * hidden..(i + 1) * n * hidden];
        assert_close(&format!("{name}: hidden state {i}"), ours, reference);
    }

    let want = r.f32("prompt_logits");
    let prompt_err = assert_close(&format!("{name}: prompt logits"), &logits.data, &want);
    for t in 0..n {
        assert_close(
            &format!("{name}: prompt row {t}"),
            logits.row(t).unwrap(),
            &want[t * vocab..(t + 1) * vocab],
        );
    }

    // Routing: every prompt position, compared as sets; weights by expert.
    let layer_ids = r.i64("moe_layer_ids");
    let topk = r.i64("prompt_router_topk");
    let topw = r.f32("prompt_router_topk_weights");
    let k = r.shape("prompt_router_topk")[2];
    assert_eq!(trace.routing.len(), layer_ids.len());
    for (row, (layer, routes)) in trace.routing.iter().enumerate() {
        assert_eq!(*layer as i64, layer_ids[row]);
        for (t, route) in routes.iter().enumerate() {
            let base = (row * n + t) * k;
            let want: BTreeSet<usize> = topk[base..base + k].iter().map(|&e| e as usize).collect();
            let got: BTreeSet<usize> = route.experts.iter().copied().collect();
            assert_eq!(got, want, "{name}: layer {layer} position {t} routing");
            for (slot, &e) in topk[base..base + k].iter().enumerate() {
                let i = route.experts.iter().position(|&x| x == e as usize).unwrap();
                let (ours, theirs) = (route.weights[i], topw[base + slot]);
                assert!(
                    (ours - theirs).abs() < 1e-4 * (1.0 + theirs.abs()),
                    "{name}: weight {ours} vs {theirs}"
                );
            }
        }
        // The last-position table agrees with the per-position one.
        let last: BTreeSet<i64> = r.i64("router_topk")[row * k..(row + 1) * k]
            .iter()
            .copied()
            .collect();
        let ours: BTreeSet<i64> = routes[n - 1].experts.iter().map(|&e| e as i64).collect();
        assert_eq!(ours, last);
    }

    // Greedy decoding with the cache, one position per step.
    let greedy = r.i64("greedy_ids");
    let step_logits = r.f32("greedy_step_logits");
    let mut session = model.new_session();
    let mut last = model.forward_last(&mut session, &prompt).unwrap();
    let mut step_err = 0f32;
    for (i, &want_id) in greedy.iter().enumerate() {
        let reference = &step_logits[i * vocab..(i + 1) * vocab];
        step_err = step_err.max(assert_close(
            &format!("{name}: greedy step {i}"),
            &last,
            reference,
        ));
        let id = argmax(&last);
        assert_eq!(id as i64, want_id, "{name}: greedy step {i}");
        last = model.forward_last(&mut session, &[id as u32]).unwrap();
    }
    assert_eq!(session.len(), n + greedy.len());
    eprintln!(
        "{name}: prompt logits max err {prompt_err:e}, greedy step logits max err {step_err:e}"
    );
    let _ = max_abs_diff;
    Report {
        prompt_err,
        step_err,
    }
}

#[test]
fn deepseek_v3_a_matches_transformers() {
    let r = check_fixture("deepseek_v3_a");
    assert!(r.prompt_err < 1e-3 && r.step_err < 1e-3);
}

#[test]
fn qwen3_moe_a_matches_transformers() {
    let r = check_fixture("qwen3_moe_a");
    assert!(r.prompt_err < 1e-3 && r.step_err < 1e-3);
}

/// Every instruction set this machine runs, in one process: each model carries the kernels it
/// was loaded with (they used to be latched from the environment once per process).
#[test]
fn every_instruction_set_matches_in_one_process() {
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
            continue; // not on this machine
        }
        for name in [
            "deepseek_v3_a",
            "qwen3_moe_a",
            "deepseek_v3_fp8",
            "deepseek_v3_int4",
            "deepseek_v3_mxfp4",
        ] {
            let r = check_fixture_on(name, k);
            eprintln!(
                "{isa:?} {name}: prompt {:.2e} step {:.2e}",
                r.prompt_err, r.step_err
            );
        }
        done.push(isa);
    }
    assert!(done.contains(&Isa::Scalar) && done.len() >= 2, "{done:?}");
}

#[test]
fn rope_and_softmax_scale_match_reference() {
    use deltafin_inference::arch::{deepseek_rope_and_scale, qwen_rope_and_scale};
    use deltafin_inference::ModelConfig;
    for name in ["deepseek_v3_a", "qwen3_moe_a"] {
        let dir = fixture_dir(name);
        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        let (rope, scale) = match ModelConfig::from_json(&cfg).unwrap() {
            ModelConfig::DeepseekV3(c) => deepseek_rope_and_scale(&c).unwrap(),
            ModelConfig::Qwen3Moe(c) => qwen_rope_and_scale(&c).unwrap(),
            ModelConfig::Kimi(_) => unreachable!("{name} is not a Kimi fixture"),
        };
        let r = Reference::open(&dir.join("reference.safetensors"));
        let inv = r.f32("rope_inv_freq");
        assert_eq!(rope.inv_freq().len(), inv.len());
        for (a, b) in rope.inv_freq().iter().zip(&inv) {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1e-6),
                "{name}: inv_freq {a} vs {b}"
            );
        }
        assert!((rope.attention_factor() - r.f32("rope_attention_factor")[0]).abs() < 1e-6);
        assert!((scale - r.f32("attn_softmax_scale")[0]).abs() < 1e-6 * scale);
    }
}

/// Packed expert formats: the engine dequantizes as compressed-tensors / DeepSeek FP8 do.
#[test]
fn packed_fixtures_match_transformers() {
    for name in ["deepseek_v3_fp8", "deepseek_v3_int4", "deepseek_v3_mxfp4"] {
        let r = check_fixture(name);
        assert!(r.prompt_err < 1e-3 && r.step_err < 1e-3);
    }
}

/// The dequantized example weights agree bit for bit with our row decoders.
#[test]
fn packed_dequant_examples() {
    use deltafin_inference::linear::QuantHints;
    use deltafin_inference::weights::WeightSource;
    for name in ["deepseek_v3_fp8", "deepseek_v3_int4", "deepseek_v3_mxfp4"] {
        let dir = fixture_dir(name);
        let src = DirSource::open(&dir).unwrap();
        let r = Reference::open(&dir.join("reference.safetensors"));
        let oracle: serde_json::Value =
            serde_json::from_str(r.metadata("oracle").unwrap()).unwrap();
        let tensor = oracle["dequant_example_tensor"]
            .as_str()
            .unwrap()
            .to_string();
        let want = r.f32("dequant_example");
        let shape = r.shape("dequant_example");
        let hints = QuantHints::from_config(src.config().get("quantization_config"));
        let got = deltafin_inference::linear::dequantize(&src, &tensor, shape[0], shape[1], &hints)
            .unwrap();
        assert_eq!(got, want, "{name}: {tensor}");
        if r.has("dequant_example_dense_gate") {
            for (t, ref_name) in [
                (
                    "model.layers.0.mlp.gate_proj.weight",
                    "dequant_example_dense_gate",
                ),
                (
                    "model.layers.0.mlp.down_proj.weight",
                    "dequant_example_dense_down",
                ),
            ] {
                let s = r.shape(ref_name);
                let got =
                    deltafin_inference::linear::dequantize(&src, t, s[0], s[1], &hints).unwrap();
                assert_eq!(got, r.f32(ref_name), "{name}: {t}");
            }
        }
    }
}

/// The generate loop reproduces the greedy reference, streams every token, and stops on a stop
/// token or when the callback says so; seeded sampling is reproducible.
#[test]
fn generate_loop_streams_and_stops() {
    use deltafin_inference::{generate, GenerateConfig, SamplerConfig, StopReason};
    let dir = fixture_dir("qwen3_moe_a");
    let model = Model::load(Arc::new(DirSource::open(&dir).unwrap())).unwrap();
    let r = Reference::open(&dir.join("reference.safetensors"));
    let prompt: Vec<u32> = r.i64("prompt_ids").iter().map(|&t| t as u32).collect();
    let greedy: Vec<u32> = r.i64("greedy_ids").iter().map(|&t| t as u32).collect();

    let mut cfg = GenerateConfig::for_model(&model, greedy.len());
    cfg.stop_tokens.clear();
    let mut streamed = Vec::new();
    let mut s = model.new_session();
    let out = generate(&model, &mut s, &prompt, &cfg, &mut |t| {
        streamed.push(t);
        true
    })
    .unwrap();
    assert_eq!(out.tokens, greedy);
    assert_eq!(streamed, greedy);
    assert_eq!(out.stop, StopReason::MaxTokens);
    assert_eq!(s.len(), prompt.len() + greedy.len() - 1);

    // Stop on the 5th greedy token.
    cfg.stop_tokens = vec![greedy[4]];
    let first = greedy.iter().position(|&t| t == greedy[4]).unwrap();
    let out = generate(&model, &mut model.new_session(), &prompt, &cfg, &mut |_| {
        true
    })
    .unwrap();
    assert_eq!(out.stop, StopReason::StopToken(greedy[4]));
    assert_eq!(out.tokens, greedy[..first].to_vec());

    // The callback can stop generation.
    cfg.stop_tokens.clear();
    let out = generate(&model, &mut model.new_session(), &prompt, &cfg, &mut |_| {
        false
    })
    .unwrap();
    assert_eq!((out.tokens.len(), out.stop), (1, StopReason::Callback));

    // Seeded sampling is reproducible.
    cfg.sampler = SamplerConfig {
        temperature: 1.0,
        top_k: 50,
        top_p: 0.9,
        seed: 77,
    };
    let a = generate(&model, &mut model.new_session(), &prompt, &cfg, &mut |_| {
        true
    })
    .unwrap();
    let b = generate(&model, &mut model.new_session(), &prompt, &cfg, &mut |_| {
        true
    })
    .unwrap();
    assert_eq!(a, b);
}
