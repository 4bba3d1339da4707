//! Lay test checkpoints out over 1-4 plain directories, read everything back through the
//! engine, and check the failure paths name what is at fault.

#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::*;
use deltafin_storage::backend::{Fault, FaultyBackend, PosixBackend};
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::engine::{HashCheck, Lane};
use deltafin_storage::layout::{open_layout, write_layout, NoProgress};
use deltafin_storage::manifest::{RecordId, DATA_FILE, MANIFEST_FILE};
use deltafin_storage::stripe::Mode;
use deltafin_storage::StorageError;

#[test]
fn every_drive_count_and_mode_reads_back_byte_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 11);
    for n in 1..=4 {
        for mode in [Mode::Replicate, Mode::Stripe] {
            let root = tmp.path().join(format!("{mode}{n}"));
            let ds = drives(&root, n);
            // A small unit so records straddle units and drives.
            let m = write_layout(&ckpt, &opts(ds.clone(), mode, 8192), &NoProgress).unwrap();
            assert_eq!(m.drives.len(), n);
            for d in &ds {
                assert!(d.join("m").join(MANIFEST_FILE).exists());
            }
            let engine = engine_with(&ds, Arc::new(PosixBackend::default()), HashCheck::All);
            check_all_records(&ckpt, &engine);
            let report = deltafin_storage::verify::verify(
                &engine,
                &ds.iter().map(|d| d.join("m")).collect::<Vec<_>>(),
                &NoProgress,
            )
            .unwrap();
            assert!(report.mismatches.is_empty(), "{:?}", report.mismatches);
            assert_eq!(
                report.records_checked as usize,
                m.records.len() * if mode == Mode::Replicate { n } else { 1 }
            );
            let total: u64 = report.drives.iter().map(|d| d.bytes).sum();
            let want: u64 = m.drives.iter().map(|d| d.data_len).sum();
            assert_eq!(total, want, "verify must read every byte on every drive");
        }
    }
}

#[test]
fn qwen_layout_reads_back() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = write_model(&tmp.path().join("model"), MODEL_B, 11);
    let ds = drives(tmp.path(), 3);
    write_layout(&ckpt, &opts(ds.clone(), Mode::Stripe, 4096), &NoProgress).unwrap();
    let engine = engine_with(&ds, Arc::new(PosixBackend::default()), HashCheck::All);
    check_all_records(&ckpt, &engine);
}

#[test]
fn verify_names_a_flipped_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 11);
    let ds = drives(tmp.path(), 3);
    let m = write_layout(&ckpt, &opts(ds.clone(), Mode::Stripe, 8192), &NoProgress).unwrap();
    // Flip a byte inside some expert record on drive 1.
    let rec = m
        .records
        .iter()
        .find(|r| {
            matches!(
                r.id,
                RecordId::Expert {
                    layer: 2,
                    expert: 5
                }
            )
        })
        .unwrap();
    let p = m.placement().pieces(rec.offset, rec.len);
    let piece = p.iter().find(|p| p.drive == 1).unwrap();
    let data = ds[1].join("m").join(DATA_FILE);
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[(piece.file_offset + 10) as usize] ^= 0x40;
    std::fs::write(&data, &bytes).unwrap();

    let engine = engine_with(&ds, Arc::new(PosixBackend::default()), HashCheck::Off);
    let dirs: Vec<PathBuf> = ds.iter().map(|d| d.join("m")).collect();
    let report = deltafin_storage::verify::verify(&engine, &dirs, &NoProgress).unwrap();
    assert!(!report.mismatches.is_empty());
    let text: Vec<String> = report.mismatches.iter().map(|m| m.to_string()).collect();
    assert!(report.mismatches.iter().all(|x| x.drive == 1), "{text:?}");
    let unit_start = piece.file_offset - piece.file_offset % 8192;
    assert!(
        report.mismatches.iter().any(|x| x.offset == unit_start
            && x.what.contains("layer 2 expert 5")
            && x.file == data),
        "{text:?}"
    );
    assert!(
        text.iter()
            .any(|t| t.contains("record layer 2 expert 5 hash differs")),
        "{text:?}"
    );

    // And a demand read with hashing on reports the record.
    let engine = engine_with(&ds, Arc::new(PosixBackend::default()), HashCheck::All);
    let idx = engine.record_index(&rec.id).unwrap();
    let err = engine.read_record(idx, None).unwrap_err();
    assert!(matches!(err, StorageError::HashMismatch { .. }), "{err}");
    assert!(err.to_string().contains("layer 2 expert 5"), "{err}");
}

#[test]
fn io_errors_name_drive_file_and_offset_and_short_reads_are_retried() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 11);
    let ds = drives(tmp.path(), 2);
    let m = write_layout(&ckpt, &opts(ds.clone(), Mode::Stripe, 8192), &NoProgress).unwrap();

    let short = Arc::new(FaultyBackend::new(
        Arc::new(PosixBackend::default()),
        vec![Fault::ShortReads],
    ));
    let engine = engine_with(&ds, short.clone(), HashCheck::All);
    check_all_records(&ckpt, &engine);

    let rec = m
        .records
        .iter()
        .find(|r| {
            matches!(
                r.id,
                RecordId::Expert {
                    layer: 3,
                    expert: 0
                }
            )
        })
        .unwrap();
    let piece = m
        .placement()
        .pieces(rec.offset, rec.len)
        .into_iter()
        .find(|p| p.drive == 1)
        .unwrap();
    let eio = Arc::new(FaultyBackend::new(
        Arc::new(PosixBackend::default()),
        vec![Fault::Eio {
            path_contains: "drive1".into(),
            offset: piece.file_offset,
        }],
    ));
    let engine = engine_with(&ds, eio, HashCheck::Off);
    let err = engine
        .read_record(engine.record_index(&rec.id).unwrap(), None)
        .unwrap_err();
    match &err {
        StorageError::Read {
            drive: 1,
            path,
            offset,
            ..
        } => {
            assert!(path.ends_with("drive1/m/data.bin"), "{err}");
            assert_eq!(*offset, piece.file_offset);
        }
        other => panic!("unexpected {other}"),
    }
    // Other records still read fine.
    let ok = m
        .records
        .iter()
        .position(|r| {
            matches!(
                r.id,
                RecordId::Expert {
                    layer: 1,
                    expert: 0
                }
            )
        })
        .unwrap();
    assert!(engine.read_record(ok, None).is_ok());
}

#[test]
fn bad_inputs_name_what_is_wrong() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    let ckpt = write_model(&model, MODEL_A, 11);
    drop(ckpt);

    // Existing layout without --force; a rerun after an interrupted layout needs no force.
    let ds = drives(&tmp.path().join("d"), 2);
    let ckpt = Checkpoint::open(&model).unwrap();
    write_layout(&ckpt, &opts(ds.clone(), Mode::Stripe, 8192), &NoProgress).unwrap();
    let err = write_layout(&ckpt, &opts(ds.clone(), Mode::Stripe, 8192), &NoProgress).unwrap_err();
    assert!(matches!(err, StorageError::LayoutExists { .. }), "{err}");
    let mut forced = opts(ds.clone(), Mode::Replicate, 8192);
    forced.force = true;
    write_layout(&ckpt, &forced, &NoProgress).unwrap();
    std::fs::remove_file(ds[1].join("m").join(MANIFEST_FILE)).unwrap(); // as if interrupted
    let err = open_layout(&ds[0].join("m")).unwrap_err();
    assert!(
        matches!(err, StorageError::MissingDrive { drive: 1, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("drive1"), "{err}");
    std::fs::remove_file(ds[0].join("m").join(MANIFEST_FILE)).unwrap();
    assert!(
        open_layout(&ds[0].join("m")).is_err(),
        "no manifest: not a complete layout"
    );
    write_layout(&ckpt, &opts(ds.clone(), Mode::Stripe, 8192), &NoProgress).unwrap();

    // Missing drive directory.
    let err = write_layout(
        &ckpt,
        &opts(
            vec![ds[0].clone(), tmp.path().join("nope")],
            Mode::Stripe,
            8192,
        ),
        &NoProgress,
    )
    .unwrap_err();
    assert!(
        matches!(err, StorageError::MissingDrive { drive: 1, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("nope"));

    // A drive whose data file was truncated.
    let data = ds[1].join("m").join(DATA_FILE);
    let f = std::fs::OpenOptions::new().write(true).open(&data).unwrap();
    f.set_len(4096).unwrap();
    let err = open_layout(&ds[0].join("m")).unwrap_err();
    assert!(err.to_string().contains("drive1"), "{err}");
    drop(ckpt);

    // Truncated shard: names the file and the tensor.
    let shard = std::fs::read_dir(&model)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .max()
        .unwrap();
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let err = Checkpoint::open(&model).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(shard.file_name().unwrap().to_str().unwrap()) && msg.contains("truncated"),
        "{msg}"
    );
    assert!(msg.contains("tensor `"), "{msg}");

    // A header that lies about its length.
    let lying = tmp.path().join("lying");
    std::fs::create_dir_all(&lying).unwrap();
    std::fs::write(lying.join("config.json"), r#"{"model_type":"qwen3_moe"}"#).unwrap();
    let mut bytes = 5000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(lying.join("model.safetensors"), &bytes).unwrap();
    let msg = Checkpoint::open(&lying).unwrap_err().to_string();
    assert!(
        msg.contains("model.safetensors") && msg.contains("5000"),
        "{msg}"
    );
}

/// Experts are fetched by (layer, expert); an unknown expert is refused by name.
#[test]
fn fetch_by_layer_and_expert() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = write_model(&tmp.path().join("model"), MODEL_B, 11);
    let ds = drives(tmp.path(), 2);
    write_layout(&ckpt, &opts(ds.clone(), Mode::Stripe, 4096), &NoProgress).unwrap();
    let engine = engine_with(&ds, Arc::new(PosixBackend::default()), HashCheck::All);
    let (rx, tickets) = engine.fetch_experts(2, &[3, 9, 15], Lane::Demand).unwrap();
    assert_eq!(tickets.len(), 3);
    let mut got: Vec<RecordId> = rx
        .iter()
        .take(3)
        .map(|c| engine.record(c.tag as usize).id.clone())
        .collect();
    got.sort();
    let want: Vec<RecordId> = [3, 9, 15]
        .iter()
        .map(|&e| RecordId::Expert {
            layer: 2,
            expert: e,
        })
        .collect();
    assert_eq!(got, want);
    let err = engine.fetch_experts(2, &[3, 16], Lane::Demand).unwrap_err();
    assert!(err.to_string().contains("layer 2 expert 16"), "{err}");
}

/// Rewrite every drive's manifest through `edit` (resealed: a consistent manifest, not a
/// tampered one).
fn rewrite_manifests(ds: &[PathBuf], edit: impl Fn(&mut deltafin_storage::manifest::Manifest)) {
    for (i, d) in ds.iter().enumerate() {
        let dir = d.join("m");
        let mut m = deltafin_storage::manifest::Manifest::load(&dir).unwrap();
        assert_eq!(m.this_drive, i);
        edit(&mut m);
        m.store(&dir).unwrap();
    }
}

/// `err` is a hash mismatch whose message contains `says`.
fn assert_hash_mismatch(err: StorageError, says: &str) {
    assert!(matches!(err, StorageError::HashMismatch { .. }), "{err}");
    assert!(err.to_string().contains(says), "{err}");
}

#[test]
fn reads_check_xxh3_and_version_2_layouts_blake3() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 12);
    let ds = drives(tmp.path(), 2);
    let m = write_layout(&ckpt, &opts(ds.clone(), Mode::Stripe, 8192), &NoProgress).unwrap();
    assert!(m.records.iter().all(|r| r.xxh3.is_some()));
    let want = RecordId::Expert {
        layer: 1,
        expert: 3,
    };
    let idx = m.records.iter().position(|r| r.id == want).unwrap();
    let read = || {
        let engine = engine_with(&ds, Arc::new(PosixBackend::default()), HashCheck::All);
        engine.read_record(idx, None)
    };
    assert!(read().is_ok());

    // Reads check the record's xxh3: a consistent manifest whose xxh3 is wrong fails them
    // (the data is intact), and `verify` names the record's xxh3.
    rewrite_manifests(&ds, |m| m.records[idx].xxh3 = Some("0".repeat(32)));
    assert_hash_mismatch(read().unwrap_err(), "xxh3-128 mismatch: layer 1 expert 3");
    let engine = engine_with(&ds, Arc::new(PosixBackend::default()), HashCheck::Off);
    let dirs: Vec<PathBuf> = ds.iter().map(|d| d.join("m")).collect();
    let report = deltafin_storage::verify::verify(&engine, &dirs, &NoProgress).unwrap();
    let text: Vec<String> = report.mismatches.iter().map(|m| m.to_string()).collect();
    assert!(
        text.iter()
            .any(|t| t.contains("record layer 1 expert 3 xxh3 differs")),
        "{text:?}"
    );

    // A version 2 layout has no xxh3: its reads check blake3, and still catch a flipped byte.
    rewrite_manifests(&ds, |m| {
        m.version = 2;
        for r in &mut m.records {
            r.xxh3 = None;
        }
    });
    assert!(read().is_ok());
    let rec = &m.records[idx];
    let piece = m.placement().pieces(rec.offset, rec.len)[0];
    let data = ds[piece.drive].join("m").join(DATA_FILE);
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[(piece.file_offset + 100) as usize] ^= 0x01;
    std::fs::write(&data, &bytes).unwrap();
    assert_hash_mismatch(read().unwrap_err(), "blake3 mismatch: layer 1 expert 3");
}

/// Records are hashed piece by piece as the pieces land (`engine/piece_hash.rs`): a byte
/// flipped in the first, a middle or the last piece of a record cut into three, over three
/// drives whose pieces land in any order, still fails the record's read; intact, it reads.
#[test]
fn a_flipped_byte_in_any_piece_of_a_record_fails_its_read() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 13);
    let ds = drives(tmp.path(), 3);
    let m = write_layout(&ckpt, &opts(ds.clone(), Mode::Stripe, 4096), &NoProgress).unwrap();
    let idx = m
        .records
        .iter()
        .position(|r| matches!(r.id, RecordId::Expert { .. }) && r.len > 2 * 4096)
        .expect("an expert record of three pieces or more");
    let rec = &m.records[idx];
    let pieces = m.placement().pieces(rec.offset, rec.len);
    let read = || {
        let engine = engine_with(&ds, Arc::new(PosixBackend::default()), HashCheck::All);
        engine.read_record(idx, None)
    };
    assert!(read().is_ok());
    for which in [0, pieces.len() / 2, pieces.len() - 1] {
        let p = pieces[which];
        let data = ds[p.drive].join("m").join(DATA_FILE);
        let at = (p.file_offset + p.len / 2) as usize;
        let mut bytes = std::fs::read(&data).unwrap();
        bytes[at] ^= 0x10;
        std::fs::write(&data, &bytes).unwrap();
        assert_hash_mismatch(read().unwrap_err(), "mismatch");
        bytes[at] ^= 0x10;
        std::fs::write(&data, &bytes).unwrap();
        assert!(read().is_ok(), "piece {which} restored");
    }
}
