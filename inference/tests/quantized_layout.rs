//! `deltafin layout --quantize-experts`: fixture `deepseek_v3_a` (BF16) laid out with its
//! routed experts quantized to MXFP4 / INT4 / Q8 runs unchanged through `LayoutSource` +
//! `Model`, close to the BF16 reference, with expert records shrunk by the format's ratio.
//!
//! Measured figures are printed (one JSON line per format, `--nocapture`) and recorded in
//! benches/results/quantized_experts.json; the asserts are lower bounds with margin.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::{argmax, fixture_dir, max_abs, max_abs_diff, Reference};
use deltafin_inference::quantize::{ExpertFormat, QuantizeExperts};
use deltafin_inference::{LayoutSource, LayoutSourceOptions, Model};
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::engine::HashCheck;
use deltafin_storage::layout::{write_layout, ExpertTransform, LayoutOptions, NoProgress};
use deltafin_storage::manifest::Manifest;
use deltafin_storage::stripe::Mode;

struct Measured {
    /// max |logit - ref| over the prompt, and relative to max |ref|.
    prompt_err: f32,
    prompt_rel: f32,
    /// Same over the 20 teacher-forced greedy steps.
    step_err: f32,
    step_rel: f32,
    /// Steps (of 20) where our argmax, fed the reference prefix, is the reference token.
    forced_agree: usize,
    /// Steps (of 20) where free-running greedy decoding emits the reference token.
    free_agree: usize,
    /// Length of the common prefix of the free-running continuation and the reference.
    free_prefix: usize,
    /// Bytes of one expert record (unaligned, all layers alike here).
    expert_record_bytes: u64,
}

fn lay_out(format: Option<ExpertFormat>) -> (tempfile::TempDir, tempfile::TempDir, Manifest) {
    let ckpt = Checkpoint::open(&fixture_dir("deepseek_v3_a")).unwrap();
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let opts = LayoutOptions {
        name: "q".into(),
        drives: vec![a.path().to_path_buf(), b.path().to_path_buf()],
        mode: Mode::Stripe,
        stripe_unit: 8192,
        force: false,
        naming: deltafin_inference::family::expert_naming(&ckpt.config).unwrap(),
        transform: format.map(|f| {
            Arc::new(QuantizeExperts::new(
                f,
                deltafin_inference::family::expert_naming(&ckpt.config).unwrap(),
            )) as Arc<dyn ExpertTransform>
        }),
        keep_free: 0,
    };
    let m = write_layout(&ckpt, &opts, &NoProgress).unwrap();
    (a, b, m)
}

fn measure(format: Option<ExpertFormat>) -> Measured {
    let (_a, _b, m) = lay_out(format);
    let opts = LayoutSourceOptions {
        threads_per_drive: 2,
        hash_check: HashCheck::All,
        ..LayoutSourceOptions::default()
    };
    let src = Arc::new(LayoutSource::open(&m.drives[0].path, &opts).unwrap());
    let model = Model::load(src).unwrap();
    let r = Reference::open(&fixture_dir("deepseek_v3_a").join("reference.safetensors"));
    let vocab = model.vocab_size();
    let prompt: Vec<u32> = r.i64("prompt_ids").iter().map(|&t| t as u32).collect();
    let want = r.f32("prompt_logits");
    let logits = model.forward(&mut model.new_session(), &prompt).unwrap();
    let prompt_err = max_abs_diff(&logits.data, &want);
    let prompt_rel = prompt_err / max_abs(&want);

    let greedy = r.i64("greedy_ids");
    let step_logits = r.f32("greedy_step_logits");
    // Teacher forced: feed the reference tokens.
    let mut session = model.new_session();
    let mut last = model.forward_last(&mut session, &prompt).unwrap();
    let (mut step_err, mut step_max, mut forced_agree) = (0f32, 0f32, 0);
    for (i, &id) in greedy.iter().enumerate() {
        let reference = &step_logits[i * vocab..(i + 1) * vocab];
        step_err = step_err.max(max_abs_diff(&last, reference));
        step_max = step_max.max(max_abs(reference));
        forced_agree += usize::from(argmax(&last) as i64 == id);
        last = model.forward_last(&mut session, &[id as u32]).unwrap();
    }
    // Free running.
    let mut session = model.new_session();
    let mut last = model.forward_last(&mut session, &prompt).unwrap();
    let mut ids = Vec::new();
    for _ in 0..greedy.len() {
        let id = argmax(&last);
        ids.push(id as i64);
        last = model.forward_last(&mut session, &[id as u32]).unwrap();
    }
    let free_agree = ids.iter().zip(&greedy).filter(|(a, b)| a == b).count();
    let free_prefix = ids.iter().zip(&greedy).take_while(|(a, b)| a == b).count();
    Measured {
        prompt_err,
        prompt_rel,
        step_err,
        step_rel: step_err / step_max,
        forced_agree,
        free_agree,
        free_prefix,
        expert_record_bytes: m.expert_templates[0].len,
    }
}

fn report(name: &str, q: &Measured, bf16: &Measured) -> f64 {
    let ratio = bf16.expert_record_bytes as f64 / q.expert_record_bytes as f64;
    println!(
        "{{\"format\": \"{name}\", \"prompt_logits_max_abs_err\": {:.5}, \"prompt_logits_rel_err\": {:.5}, \
         \"step_logits_max_abs_err\": {:.5}, \"step_logits_rel_err\": {:.5}, \
         \"teacher_forced_greedy_agree\": \"{}/20\", \"free_running_greedy_agree\": \"{}/20\", \
         \"free_running_common_prefix\": {}, \"expert_record_bytes\": {}, \"bf16_expert_record_bytes\": {}, \
         \"ratio_vs_bf16\": {:.3}}}",
        q.prompt_err,
        q.prompt_rel,
        q.step_err,
        q.step_rel,
        q.forced_agree,
        q.free_agree,
        q.free_prefix,
        q.expert_record_bytes,
        bf16.expert_record_bytes,
        ratio
    );
    ratio
}

#[test]
fn quantized_expert_layouts_track_bf16() {
    let bf16 = measure(None);
    // The unquantized layout matches transformers (as tests/layout.rs checks in full).
    assert!(bf16.prompt_rel < 1e-4 && bf16.forced_agree == 20 && bf16.free_agree == 20);
    report("bf16", &bf16, &bf16);

    // (format, max relative logit error, min teacher-forced agreement, min record ratio)
    let bounds = [
        (ExpertFormat::Q8, 0.01, 20, 1.85),
        (ExpertFormat::Int4, 0.2, 17, 3.3),
        (ExpertFormat::Mxfp4, 0.15, 17, 3.7),
    ];
    for (format, max_rel, min_agree, min_ratio) in bounds {
        let q = measure(Some(format));
        let ratio = report(&format.to_string(), &q, &bf16);
        assert!(
            q.prompt_rel <= max_rel && q.step_rel <= max_rel,
            "{format}: logits rel err {} / {} > {max_rel}",
            q.prompt_rel,
            q.step_rel
        );
        assert!(
            q.forced_agree >= min_agree,
            "{format}: {} of 20 teacher-forced greedy tokens agree",
            q.forced_agree
        );
        assert!(ratio >= min_ratio, "{format}: record ratio {ratio}");
    }
}
