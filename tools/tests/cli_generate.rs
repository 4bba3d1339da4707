//! `deltafin generate` / `deltafin logits` on the reference fixtures, from the model directory
//! and from layouts, against the transformers references.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::layout::{write_layout, LayoutOptions, NoProgress};
use deltafin_storage::safetensors::{self, Dtype};
use deltafin_storage::stripe::Mode;

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

/// A reference tensor as f32 or i64 values.
struct Reference {
    bytes: Vec<u8>,
    header: safetensors::Header,
}

impl Reference {
    fn open(path: &Path) -> Reference {
        let bytes = std::fs::read(path).unwrap();
        let header = safetensors::parse_bytes(&bytes).unwrap();
        Reference { bytes, header }
    }
    fn raw(&self, name: &str) -> (&safetensors::TensorInfo, &[u8]) {
        let t = self.header.get(name).unwrap();
        (
            t,
            &self.bytes[t.offset as usize..(t.offset + t.len) as usize],
        )
    }
    fn f32(&self, name: &str) -> Vec<f32> {
        let (t, b) = self.raw(name);
        assert_eq!(t.dtype, Dtype::F32);
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
    fn i64(&self, name: &str) -> Vec<i64> {
        let (t, b) = self.raw(name);
        assert_eq!(t.dtype, Dtype::I64);
        b.chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
}

fn reference(name: &str) -> (Reference, String, Vec<u32>) {
    let r = Reference::open(&fixture(name).join("reference.safetensors"));
    let prompt = r.i64("prompt_ids");
    let ids = prompt
        .iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let greedy = r.i64("greedy_ids").iter().map(|&x| x as u32).collect();
    (r, ids, greedy)
}

/// Run `generate --json` and return the final JSON object (stdout's last line).
fn generate_json(model: &Path, prompt_ids: &str, extra: &[&str]) -> serde_json::Value {
    let model = model.to_str().unwrap();
    let mut args = vec![
        "generate",
        "--model",
        model,
        "--prompt-ids",
        prompt_ids,
        "-n",
        "20",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = deltafin(&args);
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout {stdout}\nstderr {stderr}");
    assert!(stderr.contains("tokens/s"), "{stderr}");
    let last = stdout.trim_end().lines().last().unwrap();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {last}"))
}

fn tokens(v: &serde_json::Value) -> Vec<u32> {
    assert_eq!(
        v["tokens"].as_u64(),
        v["token_ids"].as_array().map(|a| a.len() as u64)
    );
    v["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

fn check_logits_file(path: &Path, r: &Reference, rows: usize) -> f32 {
    let got = Reference::open(path);
    let (info, _) = got.raw("logits");
    let want = r.f32("prompt_logits");
    let vocab = want.len() / rows;
    assert_eq!(info.shape, vec![rows as u64, vocab as u64]);
    let ours = got.f32("logits");
    let err = ours
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let tol = 1e-3 * (1.0 + want.iter().map(|x| x.abs()).fold(0f32, f32::max));
    assert!(err <= tol, "logits max err {err} > {tol}");
    err
}

fn lay_out(name: &str, mode: Mode, drives: usize) -> (Vec<tempfile::TempDir>, Vec<PathBuf>) {
    let ckpt = Checkpoint::open(&fixture(name)).unwrap();
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
    let dirs = m.drives.iter().map(|d| d.path.clone()).collect();
    (tmp, dirs)
}

#[test]
fn generate_from_directory_matches_greedy_reference() {
    let (_, ids, greedy) = reference("deepseek_v3_a");
    let v = generate_json(&fixture("deepseek_v3_a"), &ids, &[]);
    assert_eq!(tokens(&v), greedy);
    assert_eq!(v["prompt_tokens"], 12);
    assert_eq!(v["source"], "directory");
    assert_eq!(v["stop"], "max_tokens");
    for k in ["ttft_s", "tokens_per_s", "tokens_per_min"] {
        assert!(v[k].as_f64().unwrap() > 0.0, "{k}: {v}");
    }
    assert!(v.get("bytes_read").is_some());
}

#[test]
fn logits_from_directory_match_reference() {
    let (r, ids, _) = reference("deepseek_v3_a");
    let tmp = tempfile::tempdir().unwrap();
    let out_path = tmp.path().join("l.safetensors");
    let dir = fixture("deepseek_v3_a");
    let out = deltafin(&[
        "logits",
        "--model",
        dir.to_str().unwrap(),
        "--ids",
        &ids,
        "--out",
        out_path.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = check_logits_file(&out_path, &r, 12);
    eprintln!("deepseek_v3_a logits via CLI: max err {err:e}");
}

#[test]
fn generate_and_logits_from_layouts() {
    for (name, mode, drives) in [
        ("qwen3_moe_a", Mode::Stripe, 3),
        ("deepseek_v3_int4", Mode::Replicate, 2),
    ] {
        let (r, ids, greedy) = reference(name);
        let (_tmp, dirs) = lay_out(name, mode, drives);
        let v = generate_json(dirs.last().unwrap(), &ids, &["--hash-check", "all"]);
        assert_eq!(tokens(&v), greedy, "{name}");
        assert_eq!(v["source"], "layout");
        assert_eq!(v["drives"], drives);
        assert_eq!(v["mode"], serde_json::to_value(mode).unwrap());
        assert!(v["bytes_read"].as_u64().unwrap() > 0);
        assert_eq!(v["drive_stats"].as_array().unwrap().len(), drives);

        let out_path = dirs[0].join("logits.safetensors");
        let manifest = dirs[0].join("manifest.json");
        let out = deltafin(&[
            "logits",
            "--model",
            manifest.to_str().unwrap(),
            "--ids",
            &ids,
            "--out",
            out_path.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let err = check_logits_file(&out_path, &r, 12);
        eprintln!("{name} {mode:?}x{drives} logits via CLI: max err {err:e}");
    }
}

/// A replicated layout with one drive gone still generates the reference tokens from the other
/// copy, warns about the missing drive, and reads nothing from it; a striped one refuses.
#[test]
fn replicated_layout_runs_with_a_drive_missing() {
    let name = "deepseek_v3_int4";
    let (_, ids, greedy) = reference(name);
    let (_tmp, dirs) = lay_out(name, Mode::Replicate, 2);
    std::fs::remove_file(dirs[1].join("data.bin")).unwrap();
    let out = deltafin(&[
        "generate",
        "--model",
        dirs[0].to_str().unwrap(),
        "--prompt-ids",
        &ids,
        "-n",
        "20",
        "--json",
        "--hash-check",
        "all",
    ]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("warning: drive 1") && stderr.contains("data.bin"),
        "{stderr}"
    );
    let v: serde_json::Value =
        serde_json::from_str(stdout.trim_end().lines().last().unwrap()).unwrap();
    assert_eq!(tokens(&v), greedy);
    assert_eq!(v["drive_stats"][1]["bytes_read"], 0);

    let (_tmp, dirs) = lay_out("qwen3_moe_a", Mode::Stripe, 2);
    std::fs::remove_file(dirs[1].join("data.bin")).unwrap();
    let out = deltafin(&[
        "generate",
        "--model",
        dirs[0].to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "-n",
        "2",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("drive 1") && stderr.contains("data.bin"),
        "{stderr}"
    );
}

/// A word-level tokenizer.json: token `wI` is id I.
fn write_tokenizer(path: &Path, vocab: usize) {
    let words: serde_json::Map<String, serde_json::Value> = (0..vocab)
        .map(|i| (format!("w{i}"), serde_json::Value::from(i)))
        .collect();
    let t = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": words, "unk_token": "w0"},
    });
    std::fs::write(path, serde_json::to_vec(&t).unwrap()).unwrap();
}

#[test]
fn prompt_text_through_a_tokenizer() {
    let (_, ids, greedy) = reference("deepseek_v3_a");
    let prompt: String = ids
        .split(',')
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    let want_text = greedy
        .iter()
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ");

    // Without a tokenizer, text prompts are refused with a pointer to --prompt-ids.
    let dir = fixture("deepseek_v3_a");
    let out = deltafin(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        &prompt,
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--prompt-ids"), "{stderr}");

    // A copy of the model directory with a tokenizer.json.
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(dir.join(f), tmp.path().join(f)).unwrap();
    }
    write_tokenizer(&tmp.path().join("tokenizer.json"), 512);
    let model = tmp.path().to_str().unwrap();
    let out = deltafin(&[
        "generate", "--model", model, "--prompt", &prompt, "-n", "20", "--json",
    ]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines = stdout.trim_end().lines();
    let v: serde_json::Value = serde_json::from_str(lines.next_back().unwrap()).unwrap();
    assert_eq!(tokens(&v), greedy);
    assert_eq!(v["text"], want_text.as_str());
    // The streamed text is the same text.
    assert_eq!(lines.collect::<Vec<_>>().join("\n").trim(), want_text);

    // A layout finds the tokenizer through the source checkpoint recorded in its manifest.
    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    let drive = tempfile::tempdir().unwrap();
    let opts = LayoutOptions {
        name: "m".into(),
        drives: vec![drive.path().to_path_buf()],
        mode: Mode::Stripe,
        stripe_unit: 8192,
        force: false,
        naming: deltafin_inference::family::expert_naming(&ckpt.config).unwrap(),
        transform: None,
        keep_free: 0,
    };
    write_layout(&ckpt, &opts, &NoProgress).unwrap();
    let layout = drive.path().join("m");
    let out = deltafin(&[
        "generate",
        "--model",
        layout.to_str().unwrap(),
        "--prompt",
        &prompt,
        "-n",
        "20",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(stdout.trim_end().lines().last().unwrap()).unwrap();
    assert_eq!(tokens(&v), greedy);
    assert_eq!(v["text"], want_text.as_str());
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dir = fixture("qwen3_moe_a");
    let model = dir.to_str().unwrap();
    let out = deltafin(&["generate", "--model", model, "--prompt-ids", "5,512"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("token id 512") && stderr.contains("vocab"),
        "{stderr}"
    );

    let tmp = tempfile::tempdir().unwrap();
    let out = deltafin(&[
        "logits",
        "--model",
        tmp.path().to_str().unwrap(),
        "--ids",
        "1",
        "--out",
        tmp.path().join("x").to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("config.json"), "{stderr}");

    let out = deltafin(&[
        "generate",
        "--model",
        model,
        "--prompt-ids",
        "1",
        "--hash-check",
        "sometimes",
    ]);
    assert!(!out.status.success());
}
