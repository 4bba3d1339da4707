//! Speculative decoding is lossless: greedy output with every drafter equals plain `generate`
//! (fixtures, synthetic models over layouts), the session afterwards continues identically, and
//! with temperature > 0 the acceptance rule reproduces the target distribution (chi-square).
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::fixture_dir;
use deltafin_inference::speculative::{
    accept_or_resample, speculative_generate, Drafter, ModelDrafter, NgramDrafter, ReplayDrafter,
    SpecConfig, SpecStats,
};
use deltafin_inference::{
    generate, DirSource, GenerateConfig, LayoutSource, LayoutSourceOptions, Model, Rng, Sampler,
    SamplerConfig, StopReason,
};
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::layout::{write_layout, LayoutOptions, NoProgress};
use deltafin_storage::stripe::Mode;

fn load(name: &str) -> Model {
    Model::load(Arc::new(DirSource::open(&fixture_dir(name)).unwrap())).unwrap()
}

/// A prompt with repeats (so prompt lookup finds matches).
fn prompt() -> Vec<u32> {
    let a: Vec<u32> = (0..7u32).map(|i| (i * 53 + 9) % 500).collect();
    let mut p = a.clone();
    p.extend_from_slice(&[77, 78]);
    p.extend_from_slice(&a);
    p.extend_from_slice(&a[..3]);
    p
}

fn spec(max_k: usize, adaptive: bool) -> SpecConfig {
    SpecConfig {
        max_k,
        adaptive,
        bytes_read: None,
    }
}

fn plain(model: &Model, p: &[u32], config: &GenerateConfig) -> (Vec<u32>, StopReason, Vec<f32>) {
    let mut s = model.new_session();
    let out = generate(model, &mut s, p, config, &mut |_| true).unwrap();
    let next = model.forward_last(&mut s, &[1]).unwrap();
    (out.tokens, out.stop, next)
}

fn run_spec(
    model: &Model,
    p: &[u32],
    config: &GenerateConfig,
    sc: &SpecConfig,
    d: &mut dyn Drafter,
) -> (Vec<u32>, StopReason, Vec<f32>, SpecStats) {
    let mut s = model.new_session();
    let mut streamed = Vec::new();
    let (out, stats) = speculative_generate(model, &mut s, &[], p, config, sc, d, &mut |t| {
        streamed.push(t);
        true
    })
    .unwrap();
    assert_eq!(
        streamed, out.tokens,
        "every token is streamed once, in order"
    );
    let next = model.forward_last(&mut s, &[1]).unwrap();
    (out.tokens, out.stop, next, stats)
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-4)
}

/// Every drafter and k setting gives plain greedy's tokens and leaves an equivalent session.
fn check_greedy(model: &Model, other: Option<Arc<Model>>, what: &str) {
    let p = prompt();
    let mut config = GenerateConfig::for_model(model, 28);
    config.stop_tokens.clear();
    let (want, want_stop, want_next) = plain(model, &p, &config);
    let vocab = model.vocab_size();
    let mut drafters: Vec<(String, Box<dyn Drafter>, SpecConfig)> = vec![
        (
            "ngram adaptive".into(),
            Box::new(NgramDrafter::default()),
            spec(6, true),
        ),
        (
            "ngram k4".into(),
            Box::new(NgramDrafter::default()),
            spec(4, false),
        ),
    ];
    for c in [0.0, 0.5, 1.0] {
        for k in [1usize, 3, 8] {
            drafters.push((
                format!("replay {c} k{k}"),
                Box::new(ReplayDrafter::new(p.len(), want.clone(), c, vocab, 7).unwrap()),
                spec(k, false),
            ));
        }
        drafters.push((
            format!("replay {c} adaptive"),
            Box::new(ReplayDrafter::new(p.len(), want.clone(), c, vocab, 7).unwrap()),
            spec(8, true),
        ));
    }
    if let Some(o) = other {
        let g = SamplerConfig::greedy();
        drafters.push((
            "model k3".into(),
            Box::new(ModelDrafter::new(o.clone(), vocab, &g).unwrap()),
            spec(3, false),
        ));
        drafters.push((
            "model adaptive".into(),
            Box::new(ModelDrafter::new(o, vocab, &g).unwrap()),
            spec(5, true),
        ));
    }
    for (name, mut d, sc) in drafters {
        let (got, stop, next, stats) = run_spec(model, &p, &config, &sc, &mut *d);
        assert_eq!(got, want, "{what}: {name}");
        assert_eq!(stop, want_stop, "{what}: {name}");
        assert!(
            close(&next, &want_next),
            "{what}: {name}: session differs after"
        );
        assert!(stats.accepted_tokens <= stats.draft_tokens);
        if name.starts_with("replay 0 k") {
            assert_eq!(stats.acceptance_rate(), 1.0, "{what}: {name} {stats:?}");
            assert!(stats.verify_passes > 0);
        }
        if name.starts_with("replay 1 k") {
            assert_eq!(stats.accepted_tokens, 0, "{what}: {name} {stats:?}");
            assert!(stats.draft_tokens > 0);
        }
    }
}

#[test]
fn greedy_is_identical_on_fixtures() {
    let qwen = Arc::new(load("qwen3_moe_a"));
    let ds = Arc::new(load("deepseek_v3_a"));
    check_greedy(&qwen, Some(ds.clone()), "qwen3_moe_a");
    check_greedy(&ds, Some(qwen.clone()), "deepseek_v3_a");
    // The target as its own drafter accepts everything.
    let mut config = GenerateConfig::for_model(&qwen, 16);
    config.stop_tokens.clear();
    let mut d = ModelDrafter::new(qwen.clone(), 512, &SamplerConfig::greedy()).unwrap();
    let (_, _, _, stats) = run_spec(&qwen, &prompt(), &config, &spec(4, false), &mut d);
    assert_eq!(stats.acceptance_rate(), 1.0, "{stats:?}");
    for name in ["deepseek_v3_fp8", "deepseek_v3_int4", "deepseek_v3_mxfp4"] {
        check_greedy(&load(name), None, name);
    }
}

#[test]
fn ngram_proposes_what_followed_the_latest_match() {
    let mut d = NgramDrafter::default();
    let ctx = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 3];
    // Longest suffix with an earlier match: [2, 3] (latest at 6) -> 7, 8, 2, 3.
    assert_eq!(d.draft(&ctx, 3).unwrap().tokens, vec![7, 8, 2]);
    assert_eq!(d.draft(&ctx, 10).unwrap().tokens, vec![7, 8, 2, 3]);
    assert_eq!(d.draft(&[1, 2, 3], 4).unwrap().tokens, Vec::<u32>::new());
    assert_eq!(d.draft(&[5], 4).unwrap().tokens, Vec::<u32>::new());
    // [4, 1] has no earlier match; [1] does.
    assert_eq!(d.draft(&[1, 6, 4, 1], 2).unwrap().tokens, vec![6, 4]);
}

#[test]
fn stop_tokens_and_small_budgets_match() {
    let model = load("qwen3_moe_a");
    let p = prompt();
    let mut config = GenerateConfig::for_model(&model, 20);
    config.stop_tokens.clear();
    let (all, _, _) = plain(&model, &p, &config);
    // A stop token in the middle of an accepted draft.
    config.stop_tokens = vec![all[9]];
    let first = all.iter().position(|&t| t == all[9]).unwrap();
    for budget in [0usize, 1, 2, 3, 20] {
        config.max_new_tokens = budget;
        let (want, want_stop, want_next) = plain(&model, &p, &config);
        assert_eq!(want.len(), budget.min(first));
        let mut d = ReplayDrafter::new(p.len(), all.clone(), 0.0, 512, 1).unwrap();
        let (got, stop, next, _) = run_spec(&model, &p, &config, &spec(8, false), &mut d);
        assert_eq!((got, stop), (want, want_stop), "budget {budget}");
        assert!(close(&next, &want_next), "budget {budget}");
    }
    // The callback stops it early, as with generate.
    config.max_new_tokens = 20;
    config.stop_tokens.clear();
    let mut d = ReplayDrafter::new(p.len(), all.clone(), 0.0, 512, 1).unwrap();
    let mut s = model.new_session();
    let mut n = 0;
    let (out, _) = speculative_generate(
        &model,
        &mut s,
        &[],
        &p,
        &config,
        &spec(8, false),
        &mut d,
        &mut |_| {
            n += 1;
            n < 5
        },
    )
    .unwrap();
    assert_eq!(out.tokens, all[..5].to_vec());
    assert_eq!(out.stop, StopReason::Callback);
    assert_eq!(s.len(), p.len() + 4);
}

#[test]
fn bad_drafts_and_inputs_are_errors() {
    let model = load("qwen3_moe_a");
    let config = GenerateConfig::for_model(&model, 8);
    // A drafter proposing an id past the vocabulary.
    let mut d = ReplayDrafter::new(0, vec![600; 64], 0.0, 1000, 1).unwrap();
    let mut s = model.new_session();
    let r = speculative_generate(
        &model,
        &mut s,
        &[],
        &[1, 2],
        &config,
        &spec(3, false),
        &mut d,
        &mut |_| true,
    );
    assert!(r.is_err());
    let r = speculative_generate(
        &model,
        &mut s,
        &[],
        &[],
        &config,
        &spec(3, false),
        &mut NgramDrafter::default(),
        &mut |_| true,
    );
    assert!(r.is_err());
    assert!(ReplayDrafter::new(1, vec![], 1.5, 512, 0).is_err());
    let big = Arc::new(load("deepseek_v3_a"));
    assert!(ModelDrafter::new(big, 100, &SamplerConfig::greedy()).is_err());
}

fn synth_layout(arch: &str, seed: u64) -> (tempfile::TempDir, Model) {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ckpt");
    common::synth_preset(&ck, arch, seed, &[]);
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ck.join("config.json")).unwrap()).unwrap();
    let drives: Vec<_> = (0..2).map(|i| tmp.path().join(format!("d{i}"))).collect();
    for d in &drives {
        std::fs::create_dir_all(d).unwrap();
    }
    let opts = LayoutOptions {
        name: "m".into(),
        drives,
        mode: Mode::Stripe,
        stripe_unit: 8192,
        force: false,
        naming: deltafin_inference::family::expert_naming(&cfg).unwrap(),
        transform: None,
        keep_free: 0,
    };
    let m = write_layout(&Checkpoint::open(&ck).unwrap(), &opts, &NoProgress).unwrap();
    let src = LayoutSource::open(
        &m.drives[0]
            .path
            .join(deltafin_storage::manifest::MANIFEST_FILE),
        &LayoutSourceOptions::default(),
    )
    .unwrap();
    let model = Model::load(Arc::new(src)).unwrap();
    (tmp, model)
}

#[test]
fn greedy_is_identical_on_synthetic_layouts() {
    for arch in ["qwen3_moe", "deepseek_v3"] {
        let (_t, model) = synth_layout(arch, 3);
        check_greedy(&model, None, arch);
    }
}

/// Chi-square statistic of `counts` against probabilities `expected` (cells with an expected
/// count below 5 pooled) and its degrees of freedom.
fn chi_square(counts: &[(u32, u64)], expected: &[(u32, f64)], n: u64) -> (f64, usize) {
    let mut stat = 0.0;
    let mut cells = 0usize;
    let (mut pool_obs, mut pool_exp) = (0f64, 0f64);
    let count_of = |t: u32| counts.iter().find(|c| c.0 == t).map_or(0, |c| c.1) as f64;
    for &(t, p) in expected {
        let e = p * n as f64;
        let o = count_of(t);
        if e < 5.0 {
            pool_obs += o;
            pool_exp += e;
        } else {
            stat += (o - e) * (o - e) / e;
            cells += 1;
        }
    }
    // Observations outside the expected support.
    let outside: f64 = counts
        .iter()
        .filter(|c| !expected.iter().any(|e| e.0 == c.0))
        .map(|c| c.1 as f64)
        .sum();
    pool_obs += outside;
    if pool_exp > 0.0 || pool_obs > 0.0 {
        let e = pool_exp.max(1e-9);
        stat += (pool_obs - e) * (pool_obs - e) / e;
        cells += 1;
    }
    (stat, cells.saturating_sub(1).max(1))
}

/// Upper 1 - 2.3e-4 quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty).
fn chi_crit(df: usize) -> f64 {
    let k = df as f64;
    let z = 3.5;
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

fn tally(counts: &mut Vec<(u32, u64)>, t: u32) {
    match counts.iter_mut().find(|c| c.0 == t) {
        Some(c) => c.1 += 1,
        None => counts.push((t, 1)),
    }
}

#[test]
fn acceptance_rule_reproduces_the_target_distribution() {
    let mut rng = Rng::new(11);
    let p: Vec<(u32, f32)> = vec![(0, 0.4), (1, 0.25), (2, 0.2), (3, 0.1), (4, 0.05)];
    let qs: Vec<Option<Vec<(u32, f32)>>> = vec![
        Some(vec![(0, 0.1), (1, 0.1), (2, 0.1), (5, 0.7)]), // q has mass outside p
        Some(vec![(4, 0.5), (3, 0.3), (0, 0.2)]),
        Some(p.clone()),
        None, // deterministic drafter: d fixed, q one-hot
    ];
    let n = 100_000u64;
    let expected: Vec<(u32, f64)> = p.iter().map(|&(t, x)| (t, x as f64)).collect();
    for (qi, q) in qs.iter().enumerate() {
        let mut counts = Vec::new();
        let mut wrong = Vec::new(); // "always accept" baseline: must fail the test
        for _ in 0..n {
            let d = match q {
                Some(q) => {
                    let u = rng.next_f64();
                    let mut cum = 0.0;
                    let mut pick = q[q.len() - 1].0;
                    for &(t, x) in q {
                        cum += x as f64;
                        if u < cum {
                            pick = t;
                            break;
                        }
                    }
                    pick
                }
                None => 3,
            };
            let t = accept_or_resample(&p, q.as_deref(), d, &mut rng).unwrap_or(d);
            tally(&mut counts, t);
            tally(&mut wrong, d);
        }
        let (stat, df) = chi_square(&counts, &expected, n);
        assert!(stat < chi_crit(df), "q{qi}: chi2 {stat:.1} df {df}");
        if qi != 2 {
            let (bad, df) = chi_square(&wrong, &expected, n);
            assert!(
                bad > chi_crit(df),
                "q{qi}: the baseline should fail ({bad:.1})"
            );
        }
    }
}

/// Exact distribution of the second generated token under the target's sampler.
fn second_token_distribution(model: &Model, p: &[u32], sc: &SamplerConfig) -> Vec<(u32, f64)> {
    let sampler = Sampler::new(sc.clone()).unwrap();
    let mut s = model.new_session();
    let l1 = model.forward_last(&mut s, p).unwrap();
    let mut out: Vec<(u32, f64)> = Vec::new();
    for (t1, p1) in sampler.distribution(&l1).unwrap() {
        let mut s2 = model.new_session();
        let mut q = p.to_vec();
        q.push(t1);
        let l2 = model.forward_last(&mut s2, &q).unwrap();
        for (t2, p2) in sampler.distribution(&l2).unwrap() {
            let w = p1 as f64 * p2 as f64;
            match out.iter_mut().find(|o| o.0 == t2) {
                Some(o) => o.1 += w,
                None => out.push((t2, w)),
            }
        }
    }
    out
}

#[test]
fn sampling_with_a_draft_model_keeps_the_target_distribution() {
    let target = load("qwen3_moe_a");
    // The draft: the target itself, sampled hotter and wider (q != p, overlapping supports).
    let draft = Arc::new(load("qwen3_moe_a"));
    let p = vec![3u32, 141, 59, 26];
    let base = SamplerConfig {
        temperature: 1.0,
        top_k: 6,
        top_p: 1.0,
        seed: 0,
    };
    let hot = SamplerConfig {
        temperature: 2.0,
        top_k: 10,
        top_p: 1.0,
        seed: 0,
    };
    let want = second_token_distribution(&target, &p, &base);
    let n = 1500u64;
    let mut counts = Vec::new();
    let mut drafted = 0;
    let mut accepted = 0;
    for seed in 0..n {
        let sc = SamplerConfig {
            seed: seed * 7919 + 1,
            ..base.clone()
        };
        let mut config = GenerateConfig::for_model(&target, 3);
        config.stop_tokens.clear();
        config.sampler = sc.clone();
        let dc = SamplerConfig {
            seed: sc.seed,
            ..hot.clone()
        };
        let mut d = ModelDrafter::new(draft.clone(), 512, &dc).unwrap();
        let mut s = target.new_session();
        let (out, st) = speculative_generate(
            &target,
            &mut s,
            &[],
            &p,
            &config,
            &spec(1, false),
            &mut d,
            &mut |_| true,
        )
        .unwrap();
        drafted += st.draft_tokens;
        accepted += st.accepted_tokens;
        tally(&mut counts, out.tokens[1]);
    }
    assert_eq!(drafted, n, "one verified draft per run");
    assert!(accepted > 0 && accepted < n, "accepted {accepted} of {n}");
    let (stat, df) = chi_square(&counts, &want, n);
    assert!(stat < chi_crit(df), "chi2 {stat:.1} df {df}");
}
