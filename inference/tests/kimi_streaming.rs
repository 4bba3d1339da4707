//! Kimi K3 (synthetic, `synth --arch kimi_k3 --preset tiny`, BF16 and MXFP4 experts) streamed
//! from layouts equals in-RAM generation on 1-4 drives in both modes under small expert
//! budgets; speculative decoding (KDA state rolled back on rejection) and session snapshots
//! (the KDA state saved and restored) give the same greedy ids.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use deltafin_inference::quantize::ExpertFormat;
use deltafin_inference::snapshot;
use deltafin_inference::speculative::{speculative_generate, ReplayDrafter, SpecConfig};
use deltafin_inference::synth::presets::preset_config;
use deltafin_inference::synth::{write_synth, SynthFormat};
use deltafin_inference::{
    generate, DirSource, GenerateConfig, LayoutSource, LayoutSourceOptions, Model,
};
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::checkpoint_writer::WriteOptions;
use deltafin_storage::engine::HashCheck;
use deltafin_storage::layout::{write_layout, LayoutOptions, NoProgress};
use deltafin_storage::stripe::Mode;

const NEW: usize = 24;

fn prompt() -> Vec<u32> {
    (0..19u32).map(|i| (i * 37 + 5) % 500 + 2).collect()
}

fn synth_k3(dir: &Path, format: SynthFormat) {
    let mut cfg = preset_config("kimi_k3", "tiny").unwrap();
    // Six layers: KDA, KDA, KDA, MLA, KDA, KDA; Attention Residual blocks of 2.
    cfg["text_config"]["num_hidden_layers"] = 6.into();
    cfg["text_config"]["linear_attn_config"]["kda_layers"] = serde_json::json!([1, 2, 3, 5, 6]);
    cfg["text_config"]["linear_attn_config"]["full_attn_layers"] = serde_json::json!([4]);
    cfg["text_config"]["attn_res_block_size"] = 2.into();
    let opts = WriteOptions {
        seed: 5,
        shard_bytes: 1 << 30,
        force: false,
    };
    write_synth(dir, &cfg, format, &opts, &NoProgress).unwrap();
}

fn config(model: &Model) -> GenerateConfig {
    let mut c = GenerateConfig::for_model(model, NEW);
    c.stop_tokens.clear();
    c.prefill_chunk = 8; // three chunks for the 19-token prompt
    c
}

fn greedy(model: &Model) -> Vec<u32> {
    generate(
        model,
        &mut model.new_session(),
        &prompt(),
        &config(model),
        &mut |_| true,
    )
    .unwrap()
    .tokens
}

fn lay_out(ckpt: &Path, mode: Mode, drives: usize) -> (Vec<tempfile::TempDir>, PathBuf) {
    let ck = Checkpoint::open(ckpt).unwrap();
    let tmp: Vec<_> = (0..drives).map(|_| tempfile::tempdir().unwrap()).collect();
    let opts = LayoutOptions {
        name: "m".into(),
        drives: tmp.iter().map(|t| t.path().to_path_buf()).collect(),
        mode,
        stripe_unit: 8192,
        force: false,
        naming: deltafin_inference::family::expert_naming(&ck.config).unwrap(),
        transform: None,
        keep_free: 0,
    };
    let m = write_layout(&ck, &opts, &NoProgress).unwrap();
    (tmp, m.drives[0].path.clone())
}

fn open(layout: &Path, cap: u64) -> (Arc<LayoutSource>, Model) {
    let opts = LayoutSourceOptions {
        threads_per_drive: 2,
        buffer_cap_bytes: cap,
        hash_check: HashCheck::All,
        ..LayoutSourceOptions::default()
    };
    let src = Arc::new(LayoutSource::open(layout, &opts).unwrap());
    let model = Model::load(src.clone()).unwrap();
    (src, model)
}

#[test]
fn k3_streams_from_layouts_like_in_ram() {
    for format in [SynthFormat::Bf16, SynthFormat::Experts(ExpertFormat::Mxfp4)] {
        let ckpt = tempfile::tempdir().unwrap();
        synth_k3(ckpt.path(), format);
        let dir = Model::load(Arc::new(DirSource::open(ckpt.path()).unwrap())).unwrap();
        let want = greedy(&dir);
        for mode in [Mode::Stripe, Mode::Replicate] {
            for drives in 1..=4 {
                let (_tmp, layout) = lay_out(ckpt.path(), mode, drives);
                let probe = LayoutSource::open(&layout, &LayoutSourceOptions::default()).unwrap();
                let biggest = probe.largest_expert_record();
                let all = probe.manifest().expert_bytes();
                drop(probe);
                // The experts are about 3x the budget.
                let cap = (all / 3).max(biggest);
                let (src, model) = open(&layout, cap);
                let got = greedy(&model);
                assert_eq!(
                    got, want,
                    "{format} {mode} x{drives}: tokens differ from in-RAM"
                );
                let f = src.stats().fetch;
                assert!(
                    f.peak_bytes <= cap,
                    "{format} {mode} x{drives}: peak over budget"
                );
                assert!(f.reads > 0, "experts were streamed");
            }
        }
    }
}

#[test]
fn k3_speculative_decoding_keeps_greedy_ids() {
    let ckpt = tempfile::tempdir().unwrap();
    synth_k3(ckpt.path(), SynthFormat::Bf16);
    let (_tmp, layout) = lay_out(ckpt.path(), Mode::Stripe, 2);
    let (_src, model) = open(&layout, 64 << 20);
    let want = greedy(&model);
    // Drafts right, half wrong, all wrong: every rejection rolls the KDA states back. A k
    // beyond the KDA rollback window is drafted as the window allows.
    for (corruption, max_k) in [(0.0, 4), (0.5, 4), (1.0, 4), (0.5, 40)] {
        let mut d = ReplayDrafter::new(
            prompt().len(),
            want.clone(),
            corruption,
            model.vocab_size(),
            3,
        )
        .unwrap();
        let spec = SpecConfig {
            max_k,
            adaptive: false,
            bytes_read: None,
        };
        let mut s = model.new_session();
        let (out, stats) = speculative_generate(
            &model,
            &mut s,
            &[],
            &prompt(),
            &config(&model),
            &spec,
            &mut d,
            &mut |_| true,
        )
        .unwrap();
        assert_eq!(out.tokens, want, "corruption {corruption}");
        assert!(stats.verify_passes > 0);
        if corruption == 1.0 {
            assert_eq!(stats.accepted_tokens, 0);
        }
        // The session holds the prompt and the fed tokens, and continues correctly after the
        // rollbacks.
        let held = s.len();
        assert_eq!(
            held,
            prompt().len() + want.len() - 1,
            "corruption {corruption}"
        );
        let next = model.forward_last(&mut s, &[7]).unwrap();
        let mut fresh = model.new_session();
        let mut all = prompt();
        all.extend(&want);
        all.truncate(held);
        all.push(7);
        let direct = model.forward_last(&mut fresh, &all).unwrap();
        let err = common::max_abs_diff(&next, &direct);
        assert!(
            err < 1e-4,
            "corruption {corruption}: after speculation: {err}"
        );
    }
}

#[test]
fn k3_snapshots_save_and_restore_the_kda_state() {
    let ckpt = tempfile::tempdir().unwrap();
    synth_k3(ckpt.path(), SynthFormat::Bf16);
    let model = Model::load(Arc::new(DirSource::open(ckpt.path()).unwrap())).unwrap();
    let hash = snapshot::model_hash(&model, b"");
    let cfg = config(&model);
    // A conversation's first turn, saved.
    let mut s = model.new_session();
    let first = generate(&model, &mut s, &prompt(), &cfg, &mut |_| true).unwrap();
    let mut history = prompt();
    history.extend(&first.tokens);
    history.truncate(s.len());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.bin");
    snapshot::save(&path, &model, &hash, &s, &history).unwrap();
    // The next turn extends the history: the prefix is reused, the output is the same as
    // prefilling everything.
    let mut turn2 = history.clone();
    turn2.extend([11, 12, 13]);
    let (mut restored, hist) = snapshot::load(&path, &model, &hash).unwrap();
    let reused = snapshot::reuse_prefix(&mut restored, &hist, &turn2).unwrap();
    assert_eq!(reused, history.len());
    let a = generate(&model, &mut restored, &turn2[reused..], &cfg, &mut |_| true).unwrap();
    let b = generate(&model, &mut model.new_session(), &turn2, &cfg, &mut |_| {
        true
    })
    .unwrap();
    assert_eq!(a.tokens, b.tokens);
    // A prompt that leaves the history part-way: the recurrent state there is unknown, so the
    // session starts over (and still gives the right tokens).
    let mut other = history[..10].to_vec();
    other.push(99);
    let (mut restored, hist) = snapshot::load(&path, &model, &hash).unwrap();
    let reused = snapshot::reuse_prefix(&mut restored, &hist, &other).unwrap();
    assert_eq!(reused, 0);
    let a = generate(&model, &mut restored, &other, &cfg, &mut |_| true).unwrap();
    let b = generate(&model, &mut model.new_session(), &other, &cfg, &mut |_| {
        true
    })
    .unwrap();
    assert_eq!(a.tokens, b.tokens);
}
