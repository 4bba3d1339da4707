//! `verify --repair` (storage::layout_repair): a mirror with corrupted, zeroed and deleted data
//! on its drives, a deleted unit-hash file, a missing and an edited manifest copy is made whole
//! again, so a strict verify passes and every record reads back as the checkpoint; a stripe's
//! bad data is reported as unrepairable.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use common::*;
use deltafin_storage::backend::PosixBackend;
use deltafin_storage::engine::HashCheck;
use deltafin_storage::layout::{write_layout, NoProgress};
use deltafin_storage::layout_repair::repair_layout;
use deltafin_storage::manifest::{DATA_FILE, MANIFEST_FILE, UNIT_HASHES_FILE};
use deltafin_storage::stripe::Mode;
use deltafin_storage::verify::verify_layout;

fn mismatches(dir: &Path) -> Vec<String> {
    match verify_layout(dir, 2, 16 << 20, &NoProgress) {
        Ok((_, _, r)) => r.mismatches.iter().map(|m| m.to_string()).collect(),
        Err(e) => vec![e.to_string()],
    }
}

fn scribble(path: &Path, offset: u64, bytes: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, offset).unwrap();
}

#[test]
fn a_damaged_mirror_is_made_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 9);
    let ds = drives(tmp.path(), 3);
    write_layout(&ckpt, &opts(ds.clone(), Mode::Replicate, 8192), &NoProgress).unwrap();
    let m = |d: usize| ds[d].join("m");
    // Drive 1: corrupted bytes in two places, a unit zeroed; its manifest edited.
    scribble(&m(1).join(DATA_FILE), 5000, b"corrupt!");
    scribble(&m(1).join(DATA_FILE), 70_000, &[0xff; 100]);
    scribble(&m(1).join(DATA_FILE), 16384, &[0u8; 8192]);
    let mp = m(1).join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&mp).unwrap();
    std::fs::write(&mp, text.replacen("\"test_moe\"", "\"other\"", 1)).unwrap();
    // Drive 2: data and unit hashes deleted. Drive 0: one corrupt unit of its own.
    std::fs::remove_file(m(2).join(DATA_FILE)).unwrap();
    std::fs::remove_file(m(2).join(UNIT_HASHES_FILE)).unwrap();
    scribble(&m(0).join(DATA_FILE), 200_000, b"bitrot");
    assert!(!mismatches(&m(0)).is_empty());

    let r = repair_layout(&m(0), &NoProgress).unwrap();
    assert!(r.unrepairable.is_empty(), "{:#?}", r.unrepairable);
    assert_eq!(r.manifests_rewritten, vec![1]);
    assert_eq!(r.unit_files_rewritten, vec![2]);
    assert_eq!(r.data_files_fixed, vec![2]);
    let on = |d: usize| r.units_repaired.iter().filter(|u| u.0 == d).count();
    assert!(
        on(0) >= 1 && on(1) >= 3 && on(2) > 10,
        "{:?}",
        r.units_repaired
    );

    for d in 0..3 {
        assert!(
            mismatches(&m(d)).is_empty(),
            "through drive {d}: {:?}",
            mismatches(&m(d))
        );
    }
    let engine = engine_with(&ds, Arc::new(PosixBackend::default()), HashCheck::All);
    check_all_records(&ckpt, &engine);
    // A second pass finds nothing to do.
    drop(engine);
    let again = repair_layout(&m(2), &NoProgress).unwrap();
    assert!(again.units_repaired.is_empty() && again.manifests_rewritten.is_empty());
}

#[test]
fn a_stripe_repairs_its_metadata_but_reports_bad_data() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 9);
    let ds = drives(tmp.path(), 2);
    write_layout(&ckpt, &opts(ds.clone(), Mode::Stripe, 8192), &NoProgress).unwrap();
    let m = |d: usize| ds[d].join("m");
    std::fs::remove_file(m(1).join(UNIT_HASHES_FILE)).unwrap();
    std::fs::remove_file(m(1).join(MANIFEST_FILE)).unwrap();
    let r = repair_layout(&m(0), &NoProgress).unwrap();
    assert_eq!(r.manifests_rewritten, vec![1]);
    assert_eq!(r.unit_files_rewritten, vec![1]);
    assert!(r.unrepairable.is_empty());
    assert!(mismatches(&m(1)).is_empty());
    scribble(&m(1).join(DATA_FILE), 9000, b"bad");
    let r = repair_layout(&m(0), &NoProgress).unwrap();
    assert_eq!(r.unrepairable.len(), 1, "{:?}", r.unrepairable);
    let u = &r.unrepairable[0];
    assert!(
        u.contains("drive 1") && u.contains("offset 8192") && u.contains("no other copy"),
        "{u}"
    );
    let _ = ckpt;
}
