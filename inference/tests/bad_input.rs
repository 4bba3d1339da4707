//! Bad input is a clear typed error naming what is wrong, never a panic.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::sync::Arc;

use common::fixture_dir;
use common::synth::synth_model;
use deltafin_formats::Dtype;
use deltafin_inference::weights::{ExpertCallback, TensorRef, WeightSource};
use deltafin_inference::{ConfigError, DirSource, InferenceError, Model};
use serde_json::Value;

fn fixture_config(name: &str) -> Value {
    serde_json::from_slice(&std::fs::read(fixture_dir(name).join("config.json")).unwrap()).unwrap()
}

fn load(dir: &Path) -> Result<Model, InferenceError> {
    Model::load(Arc::new(DirSource::open(dir)?))
}

/// Copy a fixture's weights next to a modified config.
fn with_config(name: &str, config: &Value) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture_dir(name).join("model.safetensors"),
        tmp.path().join("model.safetensors"),
    )
    .unwrap();
    std::fs::write(
        tmp.path().join("config.json"),
        serde_json::to_vec(config).unwrap(),
    )
    .unwrap();
    tmp
}

#[test]
fn missing_required_config_field_is_named() {
    for (fixture, field) in [
        ("deepseek_v3_a", "hidden_size"),
        ("deepseek_v3_a", "kv_lora_rank"),
        ("deepseek_v3_a", "n_routed_experts"),
        ("qwen3_moe_a", "num_hidden_layers"),
        ("qwen3_moe_a", "num_experts"),
        ("qwen3_moe_a", "vocab_size"),
    ] {
        let mut cfg = fixture_config(fixture);
        cfg.as_object_mut().unwrap().remove(field);
        let tmp = with_config(fixture, &cfg);
        match load(tmp.path()) {
            Err(InferenceError::Config(ConfigError::MissingField { field: f, .. })) => {
                assert_eq!(f, field)
            }
            other => panic!("{fixture} without {field}: {other:?}"),
        }
        let msg = load(tmp.path()).unwrap_err().to_string();
        assert!(msg.contains(field), "{msg}");
    }
}

#[test]
fn ill_typed_or_inconsistent_config_is_named() {
    let mut cfg = fixture_config("qwen3_moe_a");
    cfg["num_key_value_heads"] = serde_json::json!(3);
    match load(with_config("qwen3_moe_a", &cfg).path()) {
        Err(InferenceError::Config(ConfigError::InvalidField { field, .. })) => {
            assert_eq!(field, "num_key_value_heads")
        }
        other => panic!("{other:?}"),
    }
    let mut cfg = fixture_config("deepseek_v3_a");
    cfg["hidden_size"] = serde_json::json!("sixty-four");
    match load(with_config("deepseek_v3_a", &cfg).path()) {
        Err(InferenceError::Config(ConfigError::InvalidField { field, .. })) => {
            assert_eq!(field, "hidden_size")
        }
        other => panic!("{other:?}"),
    }
    let mut cfg = fixture_config("deepseek_v3_a");
    cfg["rope_scaling"] = serde_json::json!({"type": "dynamic", "factor": 2.0});
    assert!(matches!(
        load(with_config("deepseek_v3_a", &cfg).path()),
        Err(InferenceError::Config(ConfigError::Unsupported { .. }))
    ));
}

#[test]
fn config_disagreeing_with_weights_names_the_tensor() {
    // hidden_size 64 in the weights, 32 in the config.
    let mut cfg = fixture_config("qwen3_moe_a");
    cfg["intermediate_size"] = serde_json::json!(128);
    cfg["moe_intermediate_size"] = serde_json::json!(48);
    match load(with_config("qwen3_moe_a", &cfg).path()).map(|m| {
        // Resident weights load; the expert shapes are only seen when experts are used.
        let mut s = m.new_session();
        m.forward(&mut s, &[1, 2, 3]).map(|_| ())
    }) {
        Ok(Err(InferenceError::TensorShape {
            name,
            expected,
            got,
        })) => {
            assert!(name.contains("mlp.experts."), "{name}");
            assert_eq!(expected[0], 48);
            assert_eq!(got[0], 32);
        }
        other => panic!("{other:?}"),
    }
}

fn synth_dir(mutate: impl FnOnce(&mut common::synth::Synth)) -> tempfile::TempDir {
    let cfg = fixture_config("deepseek_v3_a");
    let mut s = synth_model(&cfg, 9, false);
    mutate(&mut s);
    let tmp = tempfile::tempdir().unwrap();
    s.write(tmp.path(), &cfg);
    tmp
}

#[test]
fn wrong_tensor_shape_is_named() {
    let tmp = synth_dir(|s| {
        s.remove("model.layers.2.self_attn.kv_b_proj.weight");
        s.matrix("model.layers.2.self_attn.kv_b_proj.weight", 128, 31);
    });
    match load(tmp.path()) {
        Err(InferenceError::TensorShape {
            name,
            expected,
            got,
        }) => {
            assert_eq!(name, "model.layers.2.self_attn.kv_b_proj.weight");
            assert_eq!(expected, vec![128, 32]);
            assert_eq!(got, vec![128, 31]);
        }
        other => panic!("{other:?}"),
    }
    let tmp = synth_dir(|s| {
        s.remove("model.norm.weight");
        s.norm("model.norm.weight", 63);
    });
    assert!(
        matches!(load(tmp.path()), Err(InferenceError::TensorShape { name, .. }) if name == "model.norm.weight")
    );
}

#[test]
fn wrong_dtype_and_missing_tensor_are_named() {
    let tmp = synth_dir(|s| {
        s.remove("model.layers.1.mlp.gate.weight");
        s.tensors.push(common::synth::Tensor {
            name: "model.layers.1.mlp.gate.weight".into(),
            dtype: Dtype::I32,
            shape: vec![16, 64],
            bytes: vec![0; 16 * 64 * 4],
        });
    });
    match load(tmp.path()) {
        Err(InferenceError::TensorDtype { name, got, .. }) => {
            assert_eq!(name, "model.layers.1.mlp.gate.weight");
            assert_eq!(got, "I32");
        }
        other => panic!("{other:?}"),
    }
    let tmp = synth_dir(|s| s.remove("model.layers.3.self_attn.q_a_layernorm.weight"));
    assert!(matches!(
        load(tmp.path()),
        Err(InferenceError::MissingTensor { name }) if name == "model.layers.3.self_attn.q_a_layernorm.weight"
    ));
    // A routed expert that is missing surfaces when it is needed, naming layer and expert.
    let tmp = synth_dir(|s| {
        for e in 0..16 {
            s.remove(&format!("model.layers.2.mlp.experts.{e}.up_proj.weight"));
        }
    });
    let m = load(tmp.path()).unwrap();
    let mut sess = m.new_session();
    match m.forward(&mut sess, &[3, 4, 5]) {
        Err(InferenceError::MissingExpert { layer, reason, .. }) => {
            assert_eq!(layer, 2);
            assert!(reason.contains("up_proj"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        sess.len(),
        0,
        "a failed forward leaves the session untouched"
    );
}

#[test]
fn token_past_vocabulary_is_an_error_and_leaves_session_intact() {
    let m = load(&fixture_dir("deepseek_v3_a")).unwrap();
    let mut s = m.new_session();
    m.forward(&mut s, &[1, 2]).unwrap();
    match m.forward(&mut s, &[3, 512, 4]) {
        Err(InferenceError::TokenOutOfRange {
            token: 512,
            index: 1,
            vocab_size: 512,
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        m.forward(&mut s, &[u32::MAX]),
        Err(InferenceError::TokenOutOfRange { .. })
    ));
    assert!(matches!(
        m.forward(&mut s, &[]),
        Err(InferenceError::EmptyInput)
    ));
    assert_eq!(s.len(), 2);
    // The session still works and matches a fresh one.
    let a = m.forward_last(&mut s, &[3]).unwrap();
    let b = m.forward_last(&mut m.new_session(), &[1, 2, 3]).unwrap();
    assert_eq!(a, b);
    // Sessions are tied to their model.
    let other = load(&fixture_dir("deepseek_v3_a")).unwrap();
    assert!(matches!(
        other.forward(&mut s, &[1]),
        Err(InferenceError::StateMismatch(_))
    ));
    assert!(matches!(
        s.truncate(10),
        Err(InferenceError::Truncate {
            len: 3,
            requested: 10
        })
    ));
}

/// A source that fails to deliver experts: the error comes back unchanged and the session rolls
/// back; a source that silently skips an expert is caught.
struct Flaky {
    inner: DirSource,
    skip: bool,
}

impl WeightSource for Flaky {
    fn config(&self) -> &Value {
        self.inner.config()
    }
    fn tensor(&self, name: &str) -> deltafin_inference::Result<TensorRef<'_>> {
        self.inner.tensor(name)
    }
    fn with_experts(
        &self,
        layer: usize,
        experts: &[usize],
        on_ready: &mut ExpertCallback<'_>,
    ) -> deltafin_inference::Result<()> {
        if self.skip {
            return self.inner.with_experts(layer, &experts[1..], on_ready);
        }
        if layer == 3 {
            return Err(InferenceError::Unsupported("drive 2 is unplugged".into()));
        }
        self.inner.with_experts(layer, experts, on_ready)
    }
}

#[test]
fn source_failures_propagate() {
    for skip in [false, true] {
        let src = Flaky {
            inner: DirSource::open(&fixture_dir("deepseek_v3_a")).unwrap(),
            skip,
        };
        let m = Model::load(Arc::new(src)).unwrap();
        let mut s = m.new_session();
        let err = m.forward(&mut s, &[5, 6]).unwrap_err();
        if skip {
            assert!(
                matches!(err, InferenceError::MissingExpert { layer: 1, .. }),
                "{err:?}"
            );
        } else {
            assert!(err.to_string().contains("unplugged"), "{err}");
        }
        assert_eq!(s.len(), 0);
    }
}

#[test]
fn bad_model_directory() {
    let tmp = tempfile::tempdir().unwrap();
    assert!(matches!(load(tmp.path()), Err(InferenceError::Storage(_))));
    std::fs::write(
        tmp.path().join("config.json"),
        b"{\"model_type\": \"llama\"}",
    )
    .unwrap();
    assert!(load(tmp.path()).is_err());
}
