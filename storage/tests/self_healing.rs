//! Real corruption on disk (bytes changed in a drive's data file): a mirror serves the clean
//! bytes from a good copy and rewrites the bad one in place, so a strict verify passes again;
//! a stripe fails with an error naming the drive, file, offset and stripe unit.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::*;
use deltafin_storage::backend::PosixBackend;
use deltafin_storage::engine::{HashCheck, REPAIR_LOG_FILE};
use deltafin_storage::layout::{open_layout, write_layout, NoProgress};
use deltafin_storage::manifest::{Manifest, RecordId, DATA_FILE};
use deltafin_storage::stripe::Mode;
use deltafin_storage::verify::verify_layout;
use deltafin_storage::StorageError;

/// Flip `n` bytes near the start of expert record `record` (in its first piece, which a lone
/// read of an idle mirror sends to drive 0) on drive `drive`.
fn corrupt(
    m: &Manifest,
    dirs: &[PathBuf],
    record: usize,
    drive: Option<usize>,
    n: u64,
) -> (usize, u64) {
    let r = &m.records[record];
    let logical = r.offset + 100;
    let p = m.placement();
    let (d, off) = match m.mode {
        Mode::Replicate => (drive.unwrap_or(0), logical),
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
    let mut b = vec![0u8; n as usize];
    f.read_exact_at(&mut b, off).unwrap();
    for x in &mut b {
        *x ^= 0x5a;
    }
    f.write_all_at(&b, off).unwrap();
    f.sync_all().unwrap();
    (d, off)
}

fn expert_records(m: &Manifest) -> Vec<usize> {
    (0..m.records.len())
        .filter(|&i| matches!(m.records[i].id, RecordId::Expert { .. }))
        .collect()
}

fn strict_verify(dir: &Path) -> usize {
    let (_, _, r) = verify_layout(dir, 2, 16 << 20, &NoProgress).unwrap();
    r.mismatches.len()
}

#[test]
fn a_mirror_serves_the_good_copy_and_repairs_the_bad_one() {
    for n in [2, 3] {
        let tmp = tempfile::tempdir().unwrap();
        let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 5);
        let ds = drives(tmp.path(), n);
        write_layout(&ckpt, &opts(ds.clone(), Mode::Replicate, 8192), &NoProgress).unwrap();
        let (m, dirs) = open_layout(&ds[0].join("m")).unwrap();
        let experts = expert_records(&m);
        // Three records corrupt on drive 0 (a lone read goes to the least-loaded drive, the
        // first when all are idle, so each is served from the bad copy first).
        let bad = [experts[3], experts[11], experts[20]];
        for (k, &r) in bad.iter().enumerate() {
            corrupt(&m, &dirs, r, Some(0), [1, 64, 3000][k]);
        }
        // Each corruption fails its stripe unit and its record.
        assert_eq!(strict_verify(&ds[0].join("m")), 6);
        // Which drive serves a piece is the scheduler's choice (idle workers steal from each
        // other), and a drive that served a bad copy is rested for a while: read each bad
        // record with fresh engines until the bad copy has been read once. It must then come
        // back clean, and be repaired.
        let mut repairs = Vec::new();
        for &r in &bad {
            for attempt in 0.. {
                assert!(attempt < 200, "the bad copy of record {r} was never read");
                let engine = engine_with(&ds, Arc::new(PosixBackend::default()), HashCheck::All);
                let loaded = engine.read_record(r, None).unwrap();
                assert!(loaded.verified);
                if engine.replica_recoveries() > 0 {
                    repairs.extend(engine.repairs());
                    break;
                }
            }
        }
        let engine = engine_with(&ds, Arc::new(PosixBackend::default()), HashCheck::All);
        check_all_records(&ckpt, &engine);
        assert!(!repairs.is_empty());
        assert!(
            repairs.iter().all(|r| r.error.is_none() && r.drive == 0),
            "{repairs:#?}"
        );
        for &r in &bad {
            let id = m.records[r].id.to_string();
            assert!(
                repairs.iter().any(|x| x.what == id),
                "{id} not repaired: {repairs:#?}"
            );
        }
        drop(engine);
        // The bad copies were rewritten in place: a strict verify passes again, the repairs
        // are logged on the repaired drive, and reading again repairs nothing.
        assert_eq!(strict_verify(&ds[0].join("m")), 0, "{n} drives");
        let log = std::fs::read_to_string(ds[0].join("m").join(REPAIR_LOG_FILE)).unwrap();
        assert!(log.contains("rewritten from drive"), "{log}");
        assert!(log.contains(&m.records[bad[0]].id.to_string()), "{log}");
        let engine = engine_with(&ds, Arc::new(PosixBackend::default()), HashCheck::All);
        check_all_records(&ckpt, &engine);
        assert!(engine.repairs().is_empty());
        assert_eq!(engine.replica_recoveries(), 0);
    }
}

#[test]
fn a_stripe_names_the_corrupt_unit() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 5);
    let ds = drives(tmp.path(), 3);
    write_layout(&ckpt, &opts(ds.clone(), Mode::Stripe, 8192), &NoProgress).unwrap();
    let (m, dirs) = open_layout(&ds[0].join("m")).unwrap();
    let experts = expert_records(&m);
    let r = experts[7];
    let (d, off) = corrupt(&m, &dirs, r, None, 16);
    let engine = engine_with(&ds, Arc::new(PosixBackend::default()), HashCheck::All);
    let e = engine.read_record(r, None).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, StorageError::HashMismatch { .. }), "{msg}");
    assert!(msg.contains(&m.records[r].id.to_string()), "{msg}");
    assert!(msg.contains(&format!("drive {d}")), "{msg}");
    assert!(
        msg.contains(&dirs[d].join(DATA_FILE).display().to_string()),
        "{msg}"
    );
    assert!(msg.contains("fails its unit hash"), "{msg}");
    let unit_off = off - off % m.stripe_unit;
    assert!(msg.contains(&format!("offset {unit_off}")), "{msg}");
    assert!(
        engine.repairs().is_empty(),
        "a stripe has nothing to repair from"
    );
}
