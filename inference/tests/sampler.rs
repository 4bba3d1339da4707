//! Sampler behaviour: determinism with a seed, greedy, top-k / top-p sets, stop tokens.
#![allow(clippy::unwrap_used)]

use deltafin_inference::{Sampler, SamplerConfig};

fn cfg(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature,
        top_k,
        top_p,
        seed,
    }
}

#[test]
fn same_seed_same_tokens_different_seed_differs() {
    let logits: Vec<f32> = (0..50).map(|i| ((i * 37 % 17) as f32) * 0.1).collect();
    let draw = |seed| {
        let mut s = Sampler::new(cfg(1.0, 0, 1.0, seed)).unwrap();
        (0..200)
            .map(|_| s.sample(&logits).unwrap())
            .collect::<Vec<u32>>()
    };
    assert_eq!(draw(5), draw(5));
    assert_ne!(draw(5), draw(6));
}

#[test]
fn greedy_is_argmax() {
    let logits = [0.1f32, 2.0, f32::NAN, 1.9, 2.0];
    let mut s = Sampler::new(SamplerConfig::greedy()).unwrap();
    assert_eq!(s.sample(&logits).unwrap(), 1);
    // top_k = 1 is greedy whatever the temperature.
    let mut s = Sampler::new(cfg(5.0, 1, 1.0, 3)).unwrap();
    for _ in 0..20 {
        assert_eq!(s.sample(&logits).unwrap(), 1);
    }
}

#[test]
fn top_k_keeps_the_k_most_likely() {
    let logits = [1.0f32, 5.0, 3.0, 4.0, 2.0];
    let s = Sampler::new(cfg(1.0, 3, 1.0, 0)).unwrap();
    let d = s.distribution(&logits).unwrap();
    let ids: Vec<u32> = d.iter().map(|x| x.0).collect();
    assert_eq!(ids, vec![1, 3, 2]);
    let total: f32 = d.iter().map(|x| x.1).sum();
    assert!((total - 1.0).abs() < 1e-6);
    // probabilities are the softmax of the survivors
    let z: f32 = [5.0f32, 4.0, 3.0].iter().map(|v| v.exp()).sum();
    assert!((d[0].1 - 5f32.exp() / z).abs() < 1e-6);
    let mut s = Sampler::new(cfg(1.0, 3, 1.0, 9)).unwrap();
    for _ in 0..500 {
        assert!([1, 3, 2].contains(&s.sample(&logits).unwrap()));
    }
}

#[test]
fn top_p_keeps_the_smallest_nucleus() {
    // probabilities 0.5, 0.25, 0.15, 0.1 (as logits ln p)
    let p = [0.1f32, 0.5, 0.15, 0.25];
    let logits: Vec<f32> = p.iter().map(|x| x.ln()).collect();
    let nucleus = |top_p| {
        let s = Sampler::new(cfg(1.0, 0, top_p, 0)).unwrap();
        s.distribution(&logits)
            .unwrap()
            .iter()
            .map(|x| x.0)
            .collect::<Vec<u32>>()
    };
    assert_eq!(nucleus(0.5), vec![1]);
    assert_eq!(nucleus(0.6), vec![1, 3]);
    assert_eq!(nucleus(0.75), vec![1, 3]);
    assert_eq!(nucleus(0.8), vec![1, 3, 2]);
    assert_eq!(nucleus(1.0), vec![1, 3, 2, 0]);
    let s = Sampler::new(cfg(1.0, 0, 0.8, 0)).unwrap();
    let d = s.distribution(&logits).unwrap();
    assert!((d[0].1 - 0.5 / 0.9).abs() < 1e-5, "renormalised: {d:?}");
    // Sampling frequencies follow the renormalised nucleus.
    let mut s = Sampler::new(cfg(1.0, 0, 0.8, 11)).unwrap();
    let mut counts = [0usize; 4];
    for _ in 0..20000 {
        counts[s.sample(&logits).unwrap() as usize] += 1;
    }
    assert_eq!(counts[0], 0);
    assert!(
        (counts[1] as f64 / 20000.0 - 0.5 / 0.9).abs() < 0.02,
        "{counts:?}"
    );
}

#[test]
fn temperature_sharpens() {
    let logits = [0.0f32, 1.0];
    let p_hot = Sampler::new(cfg(2.0, 0, 1.0, 0))
        .unwrap()
        .distribution(&logits)
        .unwrap()[0]
        .1;
    let p_cold = Sampler::new(cfg(0.25, 0, 1.0, 0))
        .unwrap()
        .distribution(&logits)
        .unwrap()[0]
        .1;
    assert!(p_cold > p_hot && p_cold > 0.98);
}

#[test]
fn invalid_settings_are_errors() {
    assert!(Sampler::new(cfg(-1.0, 0, 1.0, 0)).is_err());
    assert!(Sampler::new(cfg(f32::NAN, 0, 1.0, 0)).is_err());
    assert!(Sampler::new(cfg(1.0, 0, 0.0, 0)).is_err());
    assert!(Sampler::new(cfg(1.0, 0, 1.5, 0)).is_err());
    assert!(Sampler::new(SamplerConfig::greedy())
        .unwrap()
        .sample(&[])
        .is_err());
}
