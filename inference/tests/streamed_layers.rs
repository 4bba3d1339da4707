//! Streamed non-expert weights: a layout opened with some or all decoder layers streamed (their
//! matrices read from the drives for every forward, one layer ahead, into reused buffers)
//! generates exactly the greedy tokens of the same model held in memory, on every architecture,
//! with plain, speculative and snapshot-resumed generation; the streamed layers' bytes are not
//! held between forwards.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use deltafin_inference::speculative::{speculative_generate, NgramDrafter, SpecConfig};
use deltafin_inference::synth::presets::SYNTH_ARCHS;
use deltafin_inference::weights::WeightSource;
use deltafin_inference::{
    generate, DirSource, GenerateConfig, LayoutSource, LayoutSourceOptions, Model,
};
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::engine::HashCheck;
use deltafin_storage::layout::{write_layout, LayoutOptions, NoProgress};
use deltafin_storage::stripe::Mode;

const NEW_TOKENS: usize = 10;

fn prompt() -> Vec<u32> {
    let a: Vec<u32> = (0..9u32).map(|i| (i * 41 + 3) % 500).collect();
    let mut p = a.clone();
    p.extend_from_slice(&a[..5]);
    p
}

fn config(model: &Model) -> GenerateConfig {
    let mut c = GenerateConfig::for_model(model, NEW_TOKENS);
    c.stop_tokens.clear();
    c.prefill_chunk = 6;
    c
}

fn lay_out(ckpt: &Path, drives: usize) -> (Vec<tempfile::TempDir>, PathBuf) {
    let ckpt = Checkpoint::open(ckpt).unwrap();
    let tmp: Vec<_> = (0..drives).map(|_| tempfile::tempdir().unwrap()).collect();
    let opts = LayoutOptions {
        name: "s".into(),
        drives: tmp.iter().map(|t| t.path().to_path_buf()).collect(),
        mode: Mode::Stripe,
        stripe_unit: 8192,
        force: false,
        naming: deltafin_inference::family::expert_naming(&ckpt.config).unwrap(),
        transform: None,
        keep_free: 0,
    };
    let m = write_layout(&ckpt, &opts, &NoProgress).unwrap();
    (tmp, m.drives[0].path.clone())
}

/// The layout with `pick` choosing the streamed layers among those that can stream.
fn open(layout: &Path, pick: &dyn Fn(&[usize]) -> Vec<usize>) -> (Model, Arc<LayoutSource>) {
    let opts = LayoutSourceOptions {
        threads_per_drive: 2,
        buffer_cap_bytes: 64 << 20,
        hash_check: HashCheck::All,
        // The tiny presets' matrices are a few KiB.
        min_streamed_record: 0,
        ..LayoutSourceOptions::default()
    };
    let src = LayoutSource::open_streaming(
        layout,
        &opts,
        &mut |_, s| Ok(pick(&s.layers.iter().map(|l| l.layer).collect::<Vec<_>>())),
        &mut |_| {},
    )
    .unwrap();
    Model::load_owned(src).unwrap()
}

#[test]
fn streamed_layers_give_the_in_memory_tokens() {
    for arch in SYNTH_ARCHS {
        let ckpt = tempfile::tempdir().unwrap();
        common::synth_preset(ckpt.path(), arch, 11, &["num_hidden_layers=4"]);
        let reference = Model::load(Arc::new(DirSource::open(ckpt.path()).unwrap())).unwrap();
        let want = generate(
            &reference,
            &mut reference.new_session(),
            &prompt(),
            &config(&reference),
            &mut |_| true,
        )
        .unwrap()
        .tokens;
        let (_drives, layout) = lay_out(ckpt.path(), 2);
        let all: &dyn Fn(&[usize]) -> Vec<usize> = &|ls| ls.to_vec();
        let odd: &dyn Fn(&[usize]) -> Vec<usize> =
            &|ls| ls.iter().copied().filter(|l| l % 2 == 1).collect();
        for (what, pick) in [("all layers", all), ("odd layers", odd)] {
            let (model, src) = open(&layout, pick);
            let streamed = model.streamed_layers();
            assert_eq!(streamed, pick(&[0, 1, 2, 3]), "{arch} {what}");
            assert_eq!(src.streamed_layers(), streamed);
            // Nothing of a streamed layer's matrices is held by the model or the source.
            for &l in &streamed {
                let w = src.streamable().layer(l).unwrap();
                assert!(w.bytes > 0, "{arch} layer {l} streams nothing");
            }

            let before = src.stream_stats();
            let out = generate(
                &model,
                &mut model.new_session(),
                &prompt(),
                &config(&model),
                &mut |_| true,
            )
            .unwrap();
            assert_eq!(out.tokens, want, "{arch} {what}: tokens differ");
            let after = src.stream_stats();
            // Every forward (3 prefill chunks, 9 decode steps) read every streamed layer.
            let forwards = 3 + (NEW_TOKENS as u64 - 1);
            assert_eq!(
                after.takes - before.takes,
                forwards * streamed.len() as u64,
                "{arch} {what}"
            );
            let per_pass: u64 = streamed
                .iter()
                .map(|&l| src.streamable().layer(l).unwrap().bytes)
                .sum();
            assert_eq!(
                after.bytes_read - before.bytes_read,
                forwards * per_pass,
                "{arch} {what}"
            );
            // Buffers are reused: never more than two layers' worth (each record's buffer is
            // its length rounded up to 4 KiB).
            let aligned = |l: usize| -> u64 {
                src.streamable()
                    .layer(l)
                    .unwrap()
                    .records
                    .iter()
                    .map(|&r| src.manifest().records[r].len.div_ceil(4096) * 4096)
                    .sum()
            };
            let biggest = streamed.iter().map(|&l| aligned(l)).max().unwrap();
            assert!(
                after.peak_buffer_bytes <= 2 * biggest,
                "{arch} {what}: stream buffers peaked at {} for layers of {biggest}",
                after.peak_buffer_bytes
            );

            // Speculative decoding verifies several positions per forward: same tokens.
            let mut drafter = NgramDrafter::default();
            let mut s = model.new_session();
            let (spec_out, _) = speculative_generate(
                &model,
                &mut s,
                &[],
                &prompt(),
                &config(&model),
                &SpecConfig {
                    max_k: 3,
                    adaptive: false,
                    bytes_read: None,
                },
                &mut drafter,
                &mut |_| true,
            )
            .unwrap();
            assert_eq!(
                spec_out.tokens, want,
                "{arch} {what}: speculative tokens differ"
            );

            // A snapshot of the prompt's session resumes to the same tokens.
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("s.snap");
            let hash = deltafin_inference::snapshot::model_hash(&model, b"");
            let mut s = model.new_session();
            let p = prompt();
            model.forward_last(&mut s, &p).unwrap();
            deltafin_inference::snapshot::save(&path, &model, &hash, &s, &p).unwrap();
            let (mut resumed, history) =
                deltafin_inference::snapshot::load(&path, &model, &hash).unwrap();
            assert_eq!(history, p);
            let b = model.forward_last(&mut resumed, &[want[0]]).unwrap();
            let mut again = model.new_session();
            model.forward_last(&mut again, &p).unwrap();
            let c = model.forward_last(&mut again, &[want[0]]).unwrap();
            assert_eq!(b, c, "{arch} {what}: resumed snapshot differs");
            println!(
                "{arch} {what}: streamed {streamed:?}, {} bytes read per forward, tokens equal",
                per_pass
            );
        }
    }
}
