//! Hostile or careless inputs through the command line end in a clear error naming the key,
//! file or flag - never an abort, a hang, or a device node replaced by a regular file.
#![allow(clippy::unwrap_used)]

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/fixtures")
        .join(name)
}

fn deltafin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args(args)
        .output()
        .unwrap()
}

/// A copy of fixture `name` with `edit` applied to its config.json.
fn edited(name: &str, edit: impl Fn(&mut Value)) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture(name).join(f), tmp.path().join(f)).unwrap();
    }
    let p = tmp.path().join("config.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&p, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    tmp
}

/// A clean failure: an exit code (no signal, no abort), a message containing every `needle`,
/// no panic or allocation-failure text.
fn refused(out: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "succeeded: {err}");
    assert!(out.status.signal().is_none(), "killed by a signal: {err}");
    assert!(
        !err.contains("panicked") && !err.contains("memory allocation"),
        "{err}"
    );
    for n in needles {
        assert!(err.contains(n), "`{n}` not in: {err}");
    }
}

fn generate(model: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["generate", "--model", model.to_str().unwrap()];
    if !extra.contains(&"--prompt") {
        args.extend(["--prompt-ids", "1,2,3"]);
    }
    if !extra.contains(&"-n") {
        args.extend(["-n", "4"]);
    }
    args.extend_from_slice(extra);
    deltafin(&args)
}

#[test]
fn absurd_sizes_in_a_config_are_refused_not_allocated() {
    let m = edited("deepseek_v3_a", |v| {
        v["num_hidden_layers"] = json!(1_000_000_000u64)
    });
    refused(
        &generate(m.path(), &[]),
        &["num_hidden_layers", "1000000000"],
    );
    // As a draft model too.
    let draft = ["--draft-model", m.path().to_str().unwrap()];
    refused(
        &generate(&fixture("deepseek_v3_a"), &draft),
        &["num_hidden_layers"],
    );
    // And for synth.
    let out_dir = tempfile::tempdir().unwrap();
    let out = deltafin(&[
        "synth",
        "--out",
        out_dir.path().join("m").to_str().unwrap(),
        "--preset",
        "tiny",
        "--set",
        "num_hidden_layers=1000000000",
        "-q",
    ]);
    refused(&out, &["num_hidden_layers"]);
}

#[test]
fn nonsense_config_values_are_refused_by_name() {
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "deepseek_v3_a",
            Box::new(|v| v["rope_theta"] = json!(-5)),
            "rope_theta",
        ),
        (
            "deepseek_v3_a",
            Box::new(|v| v["scoring_func"] = json!("tanh")),
            "scoring_func",
        ),
        (
            "deepseek_v3_a",
            Box::new(|v| v["topk_method"] = json!("greedy")),
            "topk_method",
        ),
        (
            "qwen3_moe_a",
            Box::new(|v| v["mlp_only_layers"] = json!([99])),
            "mlp_only_layers",
        ),
        (
            "deepseek_v3_a",
            Box::new(|v| v["n_routed_experts"] = json!(0)),
            "n_routed_experts",
        ),
    ];
    for (name, edit, key) in cases {
        let m = edited(name, edit);
        eprintln!("{name}: {key}");
        refused(&generate(m.path(), &[]), &[key]);
        // layout refuses it too, before writing anything.
        let drive = tempfile::tempdir().unwrap();
        let out = deltafin(&[
            "layout",
            "--model",
            m.path().to_str().unwrap(),
            "--drive",
            drive.path().to_str().unwrap(),
            "--name",
            "x",
            "-q",
        ]);
        refused(&out, &[key]);
        assert!(
            !drive.path().join("x").exists(),
            "{key}: layout wrote something"
        );
    }
}

#[test]
fn a_prompt_past_the_context_is_refused_up_front() {
    let m = edited("deepseek_v3_a", |v| {
        v["max_position_embeddings"] = json!(16)
    });
    refused(
        &generate(m.path(), &["-n", "20"]),
        &["max_position_embeddings", "16"],
    );
}

#[test]
fn sessions_are_regular_files_only() {
    // Loading a device is refused quickly (it used to read /dev/zero until OOM); the run goes
    // on from scratch.
    let t = Instant::now();
    let out = generate(&fixture("deepseek_v3_a"), &["--load-session", "/dev/zero"]);
    assert!(t.elapsed() < Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("/dev/zero") && err.contains("not a regular file"),
        "{err}"
    );
    // Saving onto a FIFO (or a device) is refused before anything runs, and it stays a FIFO.
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid C string path; mkfifo only creates a node.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let out = generate(
        &fixture("deepseek_v3_a"),
        &["--save-session", fifo.to_str().unwrap()],
    );
    refused(&out, &["not a regular file"]);
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    // logits --out likewise.
    let out = deltafin(&[
        "logits",
        "--model",
        fixture("deepseek_v3_a").to_str().unwrap(),
        "--ids",
        "1,2",
        "--out",
        fifo.to_str().unwrap(),
    ]);
    refused(&out, &["not a regular file"]);
}

#[test]
fn impossible_durations_are_refused() {
    for secs in ["inf", "NaN", "0", "-1", "1e30"] {
        let out = deltafin(&["bench", "io", "/nonexistent", &format!("--seconds={secs}")]);
        refused(&out, &["--seconds"]);
        let out = deltafin(&["demo", &format!("--bench-seconds={secs}")]);
        refused(&out, &["--bench-seconds"]);
    }
}

#[test]
fn the_demo_runs_on_the_tiny_preset() {
    let tmp = tempfile::tempdir().unwrap();
    let out = deltafin(&[
        "demo",
        "--preset",
        "tiny",
        "--dir",
        tmp.path().join("demo").to_str().unwrap(),
        "--bench-seconds",
        "1",
        "-n",
        "8",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("demo finished"), "{err}");
}

/// A tokenizer.json that makes the tokenizers library panic in its decoder deserializer
/// (found by fuzz/fuzz_targets/tokenizer.rs): a clean error naming the file.
#[test]
fn a_malformed_tokenizer_is_an_error_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("tokenizer.json");
    std::fs::write(
        &bad,
        r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,9:true},"model":{"type":"WordLevel","vocab":{"hello":0,"[UNK]":1},"unk_token":"[UNK]"}}"#,
    )
    .unwrap();
    let out = generate(
        &fixture("deepseek_v3_a"),
        &["--tokenizer", bad.to_str().unwrap(), "--prompt", "hello"],
    );
    refused(&out, &[bad.to_str().unwrap(), "malformed tokenizer"]);
}
