//! Edited or corrupted manifest copies are never used: a copy that does not match its content
//! hash is refused naming the file and, compared with a good copy, the field; copies that
//! disagree (even when each is self-consistent) are refused naming the drive and the field; a
//! replicated layout opened through a good copy reads around a drive with a bad copy.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};

use common::*;
use deltafin_storage::layout::{open_layout, open_layout_degraded, write_layout, NoProgress};
use deltafin_storage::manifest::{Manifest, MANIFEST_FILE, UNIT_HASHES_FILE};
use deltafin_storage::stripe::Mode;
use deltafin_storage::verify::verify_layout;
use deltafin_storage::StorageError;
use serde_json::{json, Value};

fn read_json(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

fn write_json(p: &Path, v: &Value) {
    std::fs::write(p, serde_json::to_vec_pretty(v).unwrap()).unwrap();
}

/// The edits a careless or hostile user makes to one drive's manifest: (what, edit).
#[allow(clippy::type_complexity)]
fn edits() -> Vec<(&'static str, Box<dyn Fn(&mut Value)>)> {
    vec![
        (
            "config.n_routed_experts",
            Box::new(|v: &mut Value| v["config"]["n_routed_experts"] = json!(8)),
        ),
        (
            "config.eos_token_id",
            Box::new(|v: &mut Value| v["config"]["eos_token_id"] = json!(3)),
        ),
        (
            "expert_templates[0].tensors[0].dtype",
            Box::new(|v: &mut Value| {
                v["expert_templates"][0]["tensors"][0]["dtype"] = json!("F16")
            }),
        ),
        (
            "records[3].id",
            Box::new(|v: &mut Value| {
                let a = v["records"][3]["id"].clone();
                v["records"][3]["id"] = v["records"][4]["id"].clone();
                v["records"][4]["id"] = a;
            }),
        ),
        (
            "records[5].hash",
            Box::new(|v: &mut Value| v["records"][5]["hash"] = json!("00".repeat(32))),
        ),
    ]
}

fn layout(root: &Path, mode: Mode, n: usize) -> Vec<PathBuf> {
    let ckpt = write_model(&root.join("model"), MODEL_A, 3);
    let ds = drives(root, n);
    write_layout(&ckpt, &opts(ds.clone(), mode, 8192), &NoProgress).unwrap();
    ds
}

#[test]
fn an_edited_copy_is_refused_naming_the_file_and_the_field() {
    for mode in [Mode::Stripe, Mode::Replicate] {
        let tmp = tempfile::tempdir().unwrap();
        let ds = layout(tmp.path(), mode, 3);
        let m1 = ds[1].join("m").join(MANIFEST_FILE);
        let clean = read_json(&m1);
        for (field, edit) in edits() {
            let mut v = clean.clone();
            edit(&mut v);
            write_json(&m1, &v);
            // Through the edited copy: refused, naming the file and what was changed.
            let e = open_layout(&ds[1].join("m")).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, StorageError::ManifestTampered { .. }), "{msg}");
            assert!(msg.contains(&m1.display().to_string()), "{msg}");
            assert!(msg.contains(field), "{field}: {msg}");
            // Through a good copy: a stripe needs drive 1 (error naming it); a mirror reads
            // around it.
            match mode {
                Mode::Stripe => {
                    let e = open_layout(&ds[0].join("m")).unwrap_err().to_string();
                    assert!(e.contains("drive 1") && e.contains(field), "{field}: {e}");
                }
                Mode::Replicate => {
                    let (_, _, bad) = open_layout_degraded(&ds[0].join("m")).unwrap();
                    assert_eq!(bad.len(), 1, "{field}");
                    assert_eq!(bad[0].0, 1);
                    assert!(bad[0].1.to_string().contains(field), "{}", bad[0].1);
                }
            }
            // verify, pointed at any drive, fails naming drive 1.
            let e = verify_layout(&ds[2].join("m"), 1, 16 << 20, &NoProgress)
                .map(|(_, _, r)| r.mismatches.len())
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("drive 1") || e.contains(&m1.display().to_string()),
                "{e}"
            );
        }
        write_json(&m1, &clean);
        open_layout(&ds[1].join("m")).unwrap();
    }
}

/// An edit re-sealed with a matching content hash still disagrees with the other copies.
#[test]
fn a_self_consistent_edit_disagrees_with_the_other_copies() {
    for mode in [Mode::Stripe, Mode::Replicate] {
        let tmp = tempfile::tempdir().unwrap();
        let ds = layout(tmp.path(), mode, 2);
        let m1 = ds[1].join("m").join(MANIFEST_FILE);
        let mut v = read_json(&m1);
        v["config"]["n_routed_experts"] = json!(8);
        let resealed = serde_json::from_value::<Manifest>(v).unwrap();
        resealed.store(&ds[1].join("m")).unwrap();
        Manifest::load(&m1).unwrap(); // self-consistent
        for from in [0, 1] {
            let e = open_layout_degraded(&ds[from].join("m")).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, StorageError::ManifestDisagrees { .. }), "{msg}");
            assert!(msg.contains("config.n_routed_experts"), "{msg}");
            assert!(msg.contains('8') && msg.contains("16"), "{msg}");
        }
    }
}

/// `verify` checks every drive's files whichever drive it is pointed at.
#[test]
fn verify_checks_every_drives_unit_hashes() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = layout(tmp.path(), Mode::Replicate, 2);
    let (_, _, r) = verify_layout(&ds[0].join("m"), 1, 16 << 20, &NoProgress).unwrap();
    assert!(r.mismatches.is_empty());
    let u1 = ds[1].join("m").join(UNIT_HASHES_FILE);
    std::fs::remove_file(&u1).unwrap();
    let e = verify_layout(&ds[0].join("m"), 1, 16 << 20, &NoProgress)
        .map(|(_, _, r)| {
            r.mismatches
                .iter()
                .map(|m| m.to_string())
                .collect::<Vec<_>>()
        })
        .map_err(|e| e.to_string());
    let text = format!("{e:?}");
    assert!(text.contains(&u1.display().to_string()), "{text}");
    assert!(!matches!(e, Ok(ref v) if v.is_empty()), "{text}");
}
