//! `deltafin template` prints exactly the reference renderings (nothing added), from a template
//! file or a model directory; a template error is a message and exit 1.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/chat_templates")
}

fn deltafin(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn prints_exactly_the_rendering() {
    let refs: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir().join("references.json")).unwrap()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    for name in ["kimi_k3", "qwen3", "deepseek_v3_1"] {
        let case = &refs[name]["system_multi_turn"];
        let inputs = tmp.path().join(format!("{name}.json"));
        std::fs::write(&inputs, serde_json::to_vec(&case["inputs"]).unwrap()).unwrap();
        let tpl = dir().join(format!("{name}.jinja"));
        let out = deltafin(&[
            "template",
            "--template",
            tpl.to_str().unwrap(),
            "--inputs",
            inputs.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8(out.stdout).unwrap(),
            case["rendered"].as_str().unwrap()
        );
    }
    // From a model directory: chat_template.jinja, with bos/eos from tokenizer_config.json.
    let model = tmp.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(
        dir().join("deepseek_v3_1.jinja"),
        model.join("chat_template.jinja"),
    )
    .unwrap();
    let case = &refs["deepseek_v3_1"]["single_user"];
    let bos = case["inputs"]["bos_token"].as_str().unwrap();
    std::fs::write(
        model.join("tokenizer_config.json"),
        serde_json::json!({"bos_token": {"content": bos}, "eos_token": "[EOS]"}).to_string(),
    )
    .unwrap();
    let mut inputs = case["inputs"].clone();
    inputs.as_object_mut().unwrap().remove("bos_token");
    let path = tmp.path().join("in.json");
    std::fs::write(&path, serde_json::to_vec(&inputs).unwrap()).unwrap();
    let out = deltafin(&[
        "template",
        "--model",
        model.to_str().unwrap(),
        "--inputs",
        path.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        case["rendered"].as_str().unwrap()
    );
}

#[test]
fn a_template_error_is_a_message_and_exit_1() {
    let tmp = tempfile::tempdir().unwrap();
    let tpl = tmp.path().join("t.jinja");
    let inputs = tmp.path().join("in.json");
    std::fs::write(
        &inputs,
        r#"{"messages": [{"role": "user", "content": "x"}]}"#,
    )
    .unwrap();
    for (src, needle) in [
        (
            "{{ raise_exception('Only user and assistant roles') }}",
            "Only user and assistant roles",
        ),
        (
            "{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}",
            "nosuchfilter",
        ),
        ("{% if %}", "t.jinja"),
    ] {
        std::fs::write(&tpl, src).unwrap();
        let out = deltafin(&[
            "template",
            "--template",
            tpl.to_str().unwrap(),
            "--inputs",
            inputs.to_str().unwrap(),
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(out.stdout.is_empty());
        assert!(err.contains(needle), "{needle}: {err}");
    }
}
