//! Work done while a layer waits for its experts' reads (warming the next layer's weights into
//! the caches, `inference/src/warm.rs`) runs while reads are outstanding and changes nothing:
//! the source hands over the same bytes, generation gives the same greedy tokens.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::fixture_dir;
use deltafin_inference::weights::{ExpertView, IdleCallback, WeightSource};
use deltafin_inference::{
    generate, DirSource, GenerateConfig, LayoutSource, LayoutSourceOptions, Model,
};
use deltafin_storage::backend::PosixBackend;
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::engine::HashCheck;
use deltafin_storage::expert_parts::expert_sources;
use deltafin_storage::layout::{write_layout, LayoutOptions, NoProgress};
use deltafin_storage::paced_backend::PacedBackend;
use deltafin_storage::stripe::Mode;

/// `ckpt` laid out on one fresh directory; returns the tempdir (keep it) and the layout folder.
fn lay_out(ckpt: &Path) -> (tempfile::TempDir, PathBuf) {
    let ckpt = Checkpoint::open(ckpt).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let opts = LayoutOptions {
        name: "m".into(),
        drives: vec![tmp.path().to_path_buf()],
        mode: Mode::Stripe,
        stripe_unit: 1 << 20,
        force: false,
        naming: deltafin_inference::family::expert_naming(&ckpt.config).unwrap(),
        transform: None,
        keep_free: 0,
    };
    let m = write_layout(&ckpt, &opts, &NoProgress).unwrap();
    let first = m.drives[0].path.clone();
    (tmp, first)
}

/// Reads paced to `bytes_per_s`, so the forward pass waits for them.
fn paced(bytes_per_s: f64) -> LayoutSourceOptions {
    LayoutSourceOptions {
        threads_per_drive: 2,
        hash_check: HashCheck::All,
        backend: Arc::new(
            PacedBackend::new(Arc::new(PosixBackend::default()), bytes_per_s).unwrap(),
        ),
        ..LayoutSourceOptions::default()
    }
}

/// While a layer waits for a drive, the source does the caller's idle work a step at a time
/// and still hands over every expert once, with the bytes it would have without it.
#[test]
fn idle_work_runs_while_experts_are_read_and_changes_nothing() {
    let (_tmp, layout) = lay_out(&fixture_dir("deepseek_v3_a"));
    let plain = LayoutSource::open(&layout, &LayoutSourceOptions::default()).unwrap();
    // ~2 ms per expert record of this fixture: the reads are waited for.
    let slow = LayoutSource::open(&layout, &paced(4e6)).unwrap();
    let ckpt = Checkpoint::open(&fixture_dir("deepseek_v3_a")).unwrap();
    let naming = deltafin_inference::family::expert_naming(&ckpt.config).unwrap();
    let layer = expert_sources(&ckpt, &naming).unwrap()[0].layer as usize;
    let experts: Vec<usize> = (0..4).collect();
    let bytes_of = |src: &LayoutSource, idle: &mut IdleCallback<'_>| {
        let mut got: Vec<(usize, Vec<u8>)> = Vec::new();
        src.with_expert_groups_idle(
            layer,
            &experts,
            &mut |group: &[(usize, ExpertView<'_>)]| {
                for (e, v) in group {
                    let bytes = v.parts().iter().flat_map(|p| p.tensor.bytes.to_vec());
                    got.push((*e, bytes.collect()));
                }
                Ok(())
            },
            idle,
        )
        .unwrap();
        got.sort_by_key(|g| g.0);
        got
    };
    let want = bytes_of(&plain, &mut |_| false);
    let mut steps = 0usize;
    let got = bytes_of(&slow, &mut |_| {
        steps += 1;
        std::thread::sleep(std::time::Duration::from_micros(100));
        steps < 1_000_000
    });
    assert!(steps > 0, "no idle work while waiting for a paced drive");
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), experts);
    assert_eq!(got, want);
    // Work that is done is not asked for again: once per wait at most (a fresh source, so
    // the reads are waited for again).
    let fresh = LayoutSource::open(&layout, &paced(4e6)).unwrap();
    let mut calls = 0usize;
    let _ = bytes_of(&fresh, &mut |_| {
        calls += 1;
        false
    });
    assert!(calls > 0, "the fresh source never waited");
    assert!(
        calls <= experts.len(),
        "{calls} calls after the work said it was done"
    );
}

/// Generation over a paced drive, where every layer waits, warms the next one's weights and
/// runs the next one's mixer on its partial output to predict that layer's experts
/// (`model/lookahead.rs`, rolling the mixer's state back after), and whose last layer may guess
/// the next token and run the first layers on it (`model/boundary.rs`; whether it waits, and
/// so guesses, depends on timing: `boundary.rs`'s own test calls it directly), gives the greedy tokens of
/// generation from the checkpoint in memory, on every synthetic architecture; each one's
/// layers have matrices to warm.
#[test]
fn generation_that_warms_while_waiting_keeps_its_tokens() {
    use deltafin_inference::model::decoder::LayerSlot;
    for arch in deltafin_inference::synth::presets::SYNTH_ARCHS {
        let ckpt = tempfile::tempdir().unwrap();
        common::synth_preset(ckpt.path(), arch, 7, &["num_hidden_layers=4"]);
        let prompt: Vec<u32> = (0..9u32).map(|i| (i * 37 + 5) % 500).collect();
        let run = |model: &Model, session: &mut deltafin_inference::Session| {
            let mut c = GenerateConfig::for_model(model, 6);
            c.stop_tokens.clear();
            generate(model, session, &prompt, &c, &mut |_| true)
                .unwrap()
                .tokens
        };
        let mem = Model::load(Arc::new(DirSource::open(ckpt.path()).unwrap())).unwrap();
        let want = run(&mem, &mut mem.new_session());
        let (_tmp, layout) = lay_out(ckpt.path());
        let src = Arc::new(LayoutSource::open(&layout, &paced(64e6)).unwrap());
        let model = Model::load(src.clone()).unwrap();
        assert_eq!(run(&model, &mut model.new_session()), want, "{arch}");
        // The guesses' forwards past the last position leave every state able to roll back
        // over the token just decoded, as without them (a drafter, a failed forward, a
        // snapshot's prefix need it): a recurrent state's checkpoint must not have moved.
        // Step by step, greedy, on a fresh session.
        let mut s = model.new_session();
        let mut logits = model.forward_last(&mut s, &prompt).unwrap();
        for step in 0..6 {
            let next = (0..logits.len())
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
                .unwrap() as u32;
            logits = model.forward_last(&mut s, &[next]).unwrap();
            let last = s.len() - 1;
            assert!(
                s.can_truncate(last),
                "{arch} step {step}: cannot roll back over the token just decoded"
            );
        }
        s.truncate(s.len() - 1).unwrap();
        let fetch = src.stats().fetch;
        assert!(
            fetch.stall > std::time::Duration::ZERO,
            "{arch}: the drive was never waited for"
        );
        // The next layer's mixer ran on partial outputs (its state rolled back each time).
        assert!(fetch.repredictions > 0, "{arch}: no lookahead");
        for slot in model.layers() {
            if let LayerSlot::Resident(l) = slot {
                assert!(
                    !l.mixer.matrices().is_empty(),
                    "{arch} layer {}: nothing to warm",
                    l.index
                );
            }
        }
        assert!(
            model
                .layers()
                .iter()
                .any(|s| matches!(s, LayerSlot::Resident(l) if l.ffn.router_gate().is_some())),
            "{arch}: no router to warm"
        );
    }
}

/// A 4-layer synthetic `arch` checkpoint (`seed`), a 9-token prompt (`mul`, `add` vary it),
/// a greedy config for `tokens` and what plain greedy gives from memory: the reference the
/// runs over paced drives must match.
struct Reference {
    ckpt: tempfile::TempDir,
    prompt: Vec<u32>,
    config: GenerateConfig,
    want: Vec<u32>,
}

fn reference(arch: &str, seed: u64, mul: u32, add: u32, tokens: usize) -> Reference {
    let ckpt = tempfile::tempdir().unwrap();
    common::synth_preset(ckpt.path(), arch, seed, &["num_hidden_layers=4"]);
    let prompt: Vec<u32> = (0..9u32).map(|i| (i * mul + add) % 500).collect();
    let mem = Model::load(Arc::new(DirSource::open(ckpt.path()).unwrap())).unwrap();
    let mut config = GenerateConfig::for_model(&mem, tokens);
    config.stop_tokens.clear();
    let want = greedy(&mem, &prompt, &config);
    Reference {
        ckpt,
        prompt,
        config,
        want,
    }
}

fn greedy(model: &Model, prompt: &[u32], config: &GenerateConfig) -> Vec<u32> {
    generate(model, &mut model.new_session(), prompt, config, &mut |_| {
        true
    })
    .unwrap()
    .tokens
}

/// Speculative decoding over a paced drive: its verification batches (several positions) run
/// the lookahead too, which moves the next layer's KV cache or recurrent state forward and back
/// while the verification itself later rolls the same states back to the accepted length. The
/// tokens are plain greedy's from memory on every synthetic architecture, for a drafter that
/// is always right and one that is right half the time.
#[test]
fn speculative_decoding_over_a_paced_drive_keeps_its_tokens() {
    use deltafin_inference::speculative::{speculative_generate, ReplayDrafter, SpecConfig};
    for arch in deltafin_inference::synth::presets::SYNTH_ARCHS {
        let Reference {
            ckpt,
            prompt,
            config,
            want,
        } = reference(arch, 11, 53, 9, 10);
        let (_tmp, layout) = lay_out(ckpt.path());
        let src = Arc::new(LayoutSource::open(&layout, &paced(64e6)).unwrap());
        let model = Model::load(src.clone()).unwrap();
        for (wrong, k) in [(0.0, 3usize), (0.5, 4)] {
            let mut drafter =
                ReplayDrafter::new(prompt.len(), want.clone(), wrong, model.vocab_size(), 7)
                    .unwrap();
            let sc = SpecConfig {
                max_k: k,
                adaptive: false,
                bytes_read: None,
            };
            let (out, stats) = speculative_generate(
                &model,
                &mut model.new_session(),
                &[],
                &prompt,
                &config,
                &sc,
                &mut drafter,
                &mut |_| true,
            )
            .unwrap();
            assert_eq!(out.tokens, want, "{arch}: drafter wrong {wrong}, k {k}");
            assert!(stats.verify_passes > 0, "{arch}: no verification batch");
        }
        assert!(src.stats().fetch.repredictions > 0, "{arch}: no lookahead");
    }
}

/// Every decoder layer streamed (its attention weights read for every forward) over a paced
/// drive, where layers wait for their experts with idle work offered: the tokens are plain
/// greedy's from memory. (The lookahead needs the next layer's weights at the prediction; on
/// this drive they land later, so here it does not run.)
#[test]
fn lookahead_over_streamed_layers_keeps_its_tokens() {
    for arch in deltafin_inference::synth::presets::SYNTH_ARCHS {
        let Reference {
            ckpt,
            prompt,
            config,
            want,
        } = reference(arch, 5, 29, 3, 8);
        let (_tmp, layout) = lay_out(ckpt.path());
        let opts = LayoutSourceOptions {
            min_streamed_record: 0,
            ..paced(64e6)
        };
        let src = LayoutSource::open_streaming(
            &layout,
            &opts,
            &mut |_, s| Ok(s.layers.iter().map(|l| l.layer).collect()),
            &mut |_| {},
        )
        .unwrap();
        let (model, src) = Model::load_owned(src).unwrap();
        assert_eq!(
            model.streamed_layers().len(),
            4,
            "{arch}: every layer streamed"
        );
        assert_eq!(greedy(&model, &prompt, &config), want, "{arch}");
        assert!(
            src.stats().fetch.stall > std::time::Duration::ZERO,
            "{arch}: the drive was never waited for"
        );
    }
}
