//! Generation over a layout (1-4 drives, stripe and replicate) with the expert cache under
//! various budgets and next-layer prefetch on or off gives exactly the greedy tokens of
//! in-memory generation from the checkpoint directory; the budget is never exceeded; chunked
//! prefill reads each expert at most once per layer per chunk.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use deltafin_inference::{
    generate, CachePolicy, DirSource, GenerateConfig, LayoutSource, LayoutSourceOptions, Model,
};
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::engine::HashCheck;
use deltafin_storage::layout::{write_layout, LayoutOptions, NoProgress};
use deltafin_storage::manifest::RecordId;
use deltafin_storage::stripe::{align_up, Mode};

const NEW_TOKENS: usize = 12;

fn synth_model(dir: &Path, arch: &str) {
    // More layers than the preset so prefetch and the cache see several MoE layers.
    common::synth_preset(dir, arch, 7, &["num_hidden_layers=5"]);
}

fn prompt() -> Vec<u32> {
    (0..23u32).map(|i| (i * 37 + 5) % 500).collect()
}

fn config(model: &Model) -> GenerateConfig {
    let mut c = GenerateConfig::for_model(model, NEW_TOKENS);
    c.stop_tokens.clear();
    c.prefill_chunk = 8; // three chunks for the 23-token prompt
    c
}

fn reference(dir: &Path) -> Vec<u32> {
    let model = Model::load(Arc::new(DirSource::open(dir).unwrap())).unwrap();
    let out = generate(
        &model,
        &mut model.new_session(),
        &prompt(),
        &config(&model),
        &mut |_| true,
    )
    .unwrap();
    assert_eq!(out.tokens.len(), NEW_TOKENS);
    out.tokens
}

fn lay_out(ckpt: &Path, mode: Mode, drives: usize) -> (Vec<tempfile::TempDir>, PathBuf) {
    let ckpt = Checkpoint::open(ckpt).unwrap();
    let tmp: Vec<_> = (0..drives).map(|_| tempfile::tempdir().unwrap()).collect();
    let opts = LayoutOptions {
        name: "m".into(),
        drives: tmp.iter().map(|t| t.path().to_path_buf()).collect(),
        mode,
        stripe_unit: 8192,
        force: false,
        naming: deltafin_inference::family::expert_naming(&ckpt.config).unwrap(),
        transform: None,
        keep_free: 0,
    };
    let m = write_layout(&ckpt, &opts, &NoProgress).unwrap();
    let first = m.drives[0].path.clone();
    (tmp, first)
}

struct Run {
    tokens: Vec<u32>,
    stats: deltafin_inference::StoreStats,
}

fn run(layout: &Path, cap: u64, policy: CachePolicy, prefetch: bool) -> Run {
    let opts = LayoutSourceOptions {
        threads_per_drive: 2,
        buffer_cap_bytes: cap,
        cache_policy: policy,
        hash_check: HashCheck::All,
        ..LayoutSourceOptions::default()
    };
    let src = Arc::new(LayoutSource::open(layout, &opts).unwrap());
    let model = Model::load(src.clone()).unwrap();
    model.set_next_layer_prefetch(prefetch);
    let out = generate(
        &model,
        &mut model.new_session(),
        &prompt(),
        &config(&model),
        &mut |_| true,
    )
    .unwrap();
    Run {
        tokens: out.tokens,
        stats: src.stats(),
    }
}

fn expert_sizes(layout: &Path) -> (u64, u64, usize) {
    let src = LayoutSource::open(layout, &LayoutSourceOptions::default()).unwrap();
    let sizes: Vec<u64> = src
        .manifest()
        .records
        .iter()
        .filter(|r| matches!(r.id, RecordId::Expert { .. }))
        .map(|r| align_up(r.len))
        .collect();
    (
        *sizes.iter().max().unwrap(),
        sizes.iter().sum(),
        sizes.len(),
    )
}

fn check_arch(arch: &str) {
    let ckpt = tempfile::tempdir().unwrap();
    synth_model(ckpt.path(), arch);
    let want = reference(ckpt.path());
    for mode in [Mode::Stripe, Mode::Replicate] {
        for drives in 1..=4 {
            let (_tmp, layout) = lay_out(ckpt.path(), mode, drives);
            let (biggest, all, count) = expert_sizes(&layout);
            // One expert at a time, a quarter of the experts, everything.
            for (cap, policy, prefetch) in [
                (biggest, CachePolicy::Lru, false),
                (all / 4, CachePolicy::Lfu, true),
                (all / 4, CachePolicy::Lru, true),
                (all + biggest, CachePolicy::Lfu, true),
            ] {
                let what =
                    format!("{arch} {mode} x{drives} cap {cap} {policy} prefetch {prefetch}");
                let r = run(&layout, cap, policy, prefetch);
                assert_eq!(
                    r.tokens, want,
                    "{what}: tokens differ from in-memory generation"
                );
                let f = &r.stats.fetch;
                assert!(
                    f.peak_bytes <= cap,
                    "{what}: expert memory {} over cap",
                    f.peak_bytes
                );
                assert!(f.reads > 0 && f.requests > 0, "{what}");
                if cap > all {
                    // Everything fits: each expert is read at most once.
                    assert!(
                        f.reads <= count as u64,
                        "{what}: {} reads of {count} experts",
                        f.reads
                    );
                    assert_eq!(f.evictions, 0, "{what}");
                }
                if prefetch {
                    assert!(f.predicted > 0, "{what}: no predictions");
                } else {
                    assert_eq!(f.prefetch_reads, 0, "{what}");
                }
            }
        }
    }
}

#[test]
fn deepseek_v3_layouts_generate_like_memory() {
    check_arch("deepseek_v3");
}

#[test]
fn qwen3_moe_layouts_generate_like_memory() {
    check_arch("qwen3_moe");
}

/// With no cache to speak of (one expert of room) and no prefetch, a prefill chunk reads each
/// routed expert at most once per layer: reads == distinct (layer, expert) pairs per chunk.
#[test]
fn prefill_chunk_reads_each_expert_once_per_layer() {
    let ckpt = tempfile::tempdir().unwrap();
    synth_model(ckpt.path(), "deepseek_v3");
    let (_tmp, layout) = lay_out(ckpt.path(), Mode::Stripe, 2);
    let (biggest, _, _) = expert_sizes(&layout);
    let opts = LayoutSourceOptions {
        threads_per_drive: 2,
        buffer_cap_bytes: biggest,
        cache_policy: CachePolicy::Lru,
        ..LayoutSourceOptions::default()
    };
    let src = Arc::new(LayoutSource::open(&layout, &opts).unwrap());
    let model = Model::load(src.clone()).unwrap();
    model.set_next_layer_prefetch(false);
    let p = prompt();
    let mut session = model.new_session();
    let mut trace = deltafin_inference::ForwardTrace::default();
    model
        .forward_with(
            &mut session,
            &p,
            deltafin_inference::LogitsMode::None,
            Some(&mut trace),
        )
        .unwrap();
    let distinct: usize = trace
        .routing
        .iter()
        .map(|(_, routes)| {
            let mut e: Vec<usize> = routes.iter().flat_map(|r| r.experts.clone()).collect();
            e.sort_unstable();
            e.dedup();
            e.len()
        })
        .sum();
    let positions: usize = trace
        .routing
        .iter()
        .map(|(_, r)| r.iter().map(|x| x.experts.len()).sum::<usize>())
        .sum();
    let f = src.stats().fetch;
    assert_eq!(
        f.reads as usize, distinct,
        "one read per distinct (layer, expert)"
    );
    assert!(distinct < positions, "shared experts exist in this prompt");
}
