//! Issue 13's "silently wrong" cases through the command line, on the DeepSeek-V3 fixture:
//! corrupted expert records and edited manifests give the clean model's tokens (served from a
//! good copy) or a clear error naming what is at fault - never different tokens with exit 0.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::layout::{write_layout, LayoutOptions, NoProgress};
use deltafin_storage::manifest::{Manifest, RecordId, DATA_FILE, MANIFEST_FILE};
use deltafin_storage::safetensors;
use deltafin_storage::stripe::Mode;
use serde_json::{json, Value};

const FIXTURE: &str = "deepseek_v3_a";

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/fixtures")
        .join(FIXTURE)
}

fn deltafin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args(args)
        .output()
        .unwrap()
}

/// The reference prompt, greedy ids, and the experts the first prompt position routes to in
/// the first two MoE layers: (layer, expert).
fn reference() -> (String, Vec<u32>, Vec<(u32, u32)>) {
    let bytes = std::fs::read(fixture().join("reference.safetensors")).unwrap();
    let h = safetensors::parse_bytes(&bytes).unwrap();
    let i64s = |name: &str| -> Vec<i64> {
        let t = h.get(name).unwrap();
        bytes[t.offset as usize..(t.offset + t.len) as usize]
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let prompt = i64s("prompt_ids")
        .iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let greedy = i64s("greedy_ids").iter().map(|&x| x as u32).collect();
    let layers = i64s("moe_layer_ids");
    let topk = i64s("prompt_router_topk");
    let k = h.get("prompt_router_topk").unwrap().shape[2] as usize;
    let n = h.get("prompt_router_topk").unwrap().shape[1] as usize;
    let used = (0..2)
        .map(|row| (layers[row] as u32, topk[row * n * k] as u32))
        .collect();
    (prompt, greedy, used)
}

fn lay_out(mode: Mode, drives: usize) -> (Vec<tempfile::TempDir>, Vec<PathBuf>) {
    let ckpt = Checkpoint::open(&fixture()).unwrap();
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

/// Flip bytes across expert (layer, expert)'s record on drive `drive` (replicate) or wherever
/// its bytes live (stripe).
fn corrupt_expert(dirs: &[PathBuf], layer: u32, expert: u32, drive: usize) {
    let m = Manifest::load(&dirs[0]).unwrap();
    let r = m
        .records
        .iter()
        .find(|r| r.id == RecordId::Expert { layer, expert })
        .unwrap();
    let p = m.placement();
    for logical in (r.offset..r.offset + r.len).step_by(2048) {
        let (d, off) = match m.mode {
            Mode::Replicate => (drive, logical),
            Mode::Stripe => {
                let (d, base) = p.unit_location(logical / p.unit);
                (d, base + logical % p.unit)
            }
        };
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dirs[d].join(DATA_FILE))
            .unwrap();
        let mut b = [0u8; 16];
        f.read_exact_at(&mut b, off).unwrap();
        b.iter_mut().for_each(|x| *x ^= 0x33);
        f.write_all_at(&b, off).unwrap();
    }
}

/// `generate` with the default options; (success, stdout tokens or JSON, stderr).
fn generate(model: &Path, prompt: &str) -> (bool, Value, String) {
    let out = deltafin(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        prompt,
        "-n",
        "20",
        "--json",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let json = stdout
        .trim_end()
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or(Value::Null);
    (out.status.success(), json, stderr)
}

fn ids(v: &Value) -> Vec<u32> {
    v["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn corrupted_expert_records_on_a_stripe_are_an_error_not_tokens() {
    let (prompt, _, used) = reference();
    let (_tmp, dirs) = lay_out(Mode::Stripe, 2);
    for &(l, e) in &used {
        corrupt_expert(&dirs, l, e, 0);
    }
    let (ok, _, err) = generate(&dirs[0], &prompt);
    assert!(!ok, "generate succeeded over corrupt experts: {err}");
    let (l, e) = used[0];
    assert!(err.contains("xxh3-128 mismatch: layer"), "{err}");
    assert!(
        err.contains(&format!("layer {l} expert {e}")) || err.contains("expert"),
        "{err}"
    );
    assert!(err.contains("data.bin") && err.contains("offset"), "{err}");
    assert!(err.contains("fails its unit hash"), "{err}");
}

#[test]
fn a_corrupted_mirror_copy_gives_the_clean_tokens_every_run_and_is_repaired() {
    let (prompt, greedy, used) = reference();
    let (_tmp, dirs) = lay_out(Mode::Replicate, 2);
    for &(l, e) in &used {
        corrupt_expert(&dirs, l, e, 0);
    }
    let mut repaired = 0;
    for run in 0..12 {
        let (ok, v, err) = generate(&dirs[run % 2], &prompt);
        assert!(ok, "run {run}: {err}");
        assert_eq!(
            ids(&v),
            greedy,
            "run {run}: tokens differ from the clean model"
        );
        let n = v["repairs"].as_u64().unwrap();
        if n > 0 {
            assert!(
                err.contains("warning") && err.contains("rewritten from drive"),
                "{err}"
            );
            assert!(v["replica_recoveries"].as_u64().unwrap() > 0);
        }
        repaired += n;
        let verify = deltafin(&["verify", dirs[1].to_str().unwrap()]);
        if verify.status.success() {
            break;
        }
    }
    assert!(repaired > 0, "the corrupt copy was never read in 12 runs");
    // Whatever generate did not reach, verify --repair does; then a strict verify passes.
    let r = deltafin(&["verify", "--repair", dirs[0].to_str().unwrap()]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stdout));
    let v = deltafin(&["verify", dirs[1].to_str().unwrap()]);
    assert!(v.status.success(), "{}", String::from_utf8_lossy(&v.stdout));
}

/// The manifest edits, made by hand on drive 1's copy (no hash recomputed).
type Edit = fn(&mut Value);

fn manifest_edits() -> Vec<(&'static str, Edit)> {
    vec![
        ("config.routed_scaling_factor", |v| {
            v["config"]["routed_scaling_factor"] = json!(1.0)
        }),
        ("config.num_experts_per_tok", |v| {
            v["config"]["num_experts_per_tok"] = json!(2)
        }),
        ("config.eos_token_id", |v| {
            v["config"]["eos_token_id"] = json!(7)
        }),
        ("expert_templates[0].tensors[0].dtype", |v| {
            v["expert_templates"][0]["tensors"][0]["dtype"] = json!("F16")
        }),
        ("records[", |v| {
            let recs = v["records"].as_array_mut().unwrap();
            let n = recs.len();
            let a = recs[n - 1]["id"].clone();
            recs[n - 1]["id"] = recs[n - 2]["id"].clone();
            recs[n - 2]["id"] = a;
        }),
    ]
}

#[test]
fn edited_manifests_are_refused_or_read_around_never_used() {
    let (prompt, greedy, _) = reference();
    for mode in [Mode::Stripe, Mode::Replicate] {
        let (_tmp, dirs) = lay_out(mode, 2);
        let m1 = dirs[1].join(MANIFEST_FILE);
        let clean: Value = serde_json::from_slice(&std::fs::read(&m1).unwrap()).unwrap();
        for (field, edit) in manifest_edits() {
            let mut v = clean.clone();
            edit(&mut v);
            std::fs::write(&m1, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
            // Through the edited drive: an error naming the file and the field.
            let (ok, _, err) = generate(&dirs[1], &prompt);
            assert!(!ok, "{mode} {field}: generated through an edited manifest");
            assert!(
                err.contains(&m1.display().to_string()) && err.contains(field),
                "{err}"
            );
            // Through the good drive: a stripe cannot read without drive 1; a mirror gives the
            // clean tokens and says drive 1 was not used.
            let (ok, out, err) = generate(&dirs[0], &prompt);
            match mode {
                Mode::Stripe => assert!(!ok && err.contains("drive 1"), "{mode} {field}: {err}"),
                Mode::Replicate => {
                    assert!(ok, "{mode} {field}: {err}");
                    assert_eq!(ids(&out), greedy, "{mode} {field}");
                    assert!(err.contains("warning") && err.contains(field), "{err}");
                }
            }
            // verify through the good drive fails, naming drive 1.
            let verify = deltafin(&["verify", dirs[0].to_str().unwrap()]);
            assert!(!verify.status.success(), "{mode} {field}: verify passed");
        }
        std::fs::write(&m1, serde_json::to_vec_pretty(&clean).unwrap()).unwrap();
        let (ok, out, err) = generate(&dirs[1], &prompt);
        assert!(ok, "{err}");
        assert_eq!(ids(&out), greedy);
    }
}
