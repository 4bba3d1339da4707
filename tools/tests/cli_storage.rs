//! The storage subcommands end to end through the built binary: synth, layout (flags and
//! --spec), verify (clean, then a flipped byte), bench io, and refusals.

use std::path::Path;
use std::process::{Command, Output};

fn deltafin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args(args)
        .output()
        .expect("run deltafin")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn p(path: &Path) -> &str {
    path.to_str().expect("utf-8 temp path")
}

#[test]
fn synth_layout_verify_bench_and_refusals() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("model");
    let o = deltafin(&[
        "synth",
        "--out",
        p(&model),
        "--arch",
        "qwen3_moe",
        "--preset",
        "tiny",
        "-q",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let d: Vec<_> = (0..3)
        .map(|i| tmp.path().join(format!("drive{i}")))
        .collect();
    for x in &d {
        std::fs::create_dir_all(x).expect("mkdir");
    }
    let o = deltafin(&[
        "layout",
        "--model",
        p(&model),
        "--drive",
        p(&d[0]),
        "--drive",
        p(&d[1]),
        "--drive",
        p(&d[2]),
        "--mode",
        "stripe",
        "--stripe-unit",
        "8K",
        "--name",
        "m",
        "-q",
    ]);
    assert!(o.status.success(), "{}", text(&o));

    // A second layout of the same name is refused without --force, and says so.
    let o = deltafin(&[
        "layout",
        "--model",
        p(&model),
        "--drive",
        p(&d[0]),
        "--name",
        "m",
        "-q",
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--force"), "{}", text(&o));

    // The same layout from a spec file, under another name.
    let spec = tmp.path().join("spec.json");
    let spec_text = serde_json::json!({"name": "s", "mode": "replicate", "stripe_unit": "16K", "drives": [p(&d[0]), p(&d[1])]});
    std::fs::write(&spec, spec_text.to_string()).expect("write spec");
    let o = deltafin(&["layout", "--model", p(&model), "--spec", p(&spec), "-q"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(d[1].join("s/manifest.json").exists());

    let o = deltafin(&["verify", p(&d[2].join("m")), "-q"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("OK: every hash matches"), "{}", text(&o));

    let o = deltafin(&[
        "bench",
        "io",
        p(&d[0].join("m")),
        "--seconds",
        "0.3",
        "--rounds",
        "1",
        "--no-fio",
        "--json",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let last = String::from_utf8_lossy(&o.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .to_string();
    let v: serde_json::Value =
        serde_json::from_str(&last).expect("bench io --json prints one JSON object");
    assert!(
        v["gb_per_s"].as_f64().unwrap_or(0.0) > 0.0 && v["drives"] == 3,
        "{v}"
    );

    // Flip one byte on drive 1: verify fails and names drive, file, offset and the record.
    let data = d[1].join("m/data.bin");
    let mut bytes = std::fs::read(&data).expect("read data");
    bytes[20_000] ^= 1;
    std::fs::write(&data, &bytes).expect("write data");
    let o = deltafin(&["verify", p(&d[0].join("m")), "-q"]);
    assert!(!o.status.success(), "verify must fail on a flipped byte");
    let t = text(&o);
    assert!(
        t.contains("MISMATCH drive 1")
            && t.contains("drive1/m/data.bin")
            && t.contains("offset 16384"),
        "{t}"
    );
    assert!(
        t.contains("layer") || t.contains("model."),
        "names the tensor or expert: {t}"
    );

    // A missing drive is named.
    std::fs::remove_dir_all(&d[2]).expect("rm drive");
    let o = deltafin(&["verify", p(&d[0].join("m")), "-q"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("drive 2"), "{}", text(&o));
}
