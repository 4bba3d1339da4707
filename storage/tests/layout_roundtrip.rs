//! Lay synthetic checkpoints out over 1-4 plain directories, read everything back through the
//! engine, and check the failure paths name what is at fault.

#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use deltafin_storage::backend::{Fault, FaultyBackend, PosixBackend};
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::engine::{Engine, EngineConfig, HashCheck, Lane, Target};
use deltafin_storage::layout::{open_layout, write_layout, LayoutOptions, NoProgress};
use deltafin_storage::manifest::{RecordId, DATA_FILE, MANIFEST_FILE};
use deltafin_storage::stripe::Mode;
use deltafin_storage::synth::{preset_config, write_checkpoint};
use deltafin_storage::StorageError;

fn synth(dir: &Path, arch: &str) -> Checkpoint {
    let cfg = preset_config(arch, "tiny").unwrap();
    write_checkpoint(dir, &cfg, 11, 300 << 10, false, &NoProgress).unwrap();
    Checkpoint::open(dir).unwrap()
}

fn drives(root: &Path, n: usize) -> Vec<PathBuf> {
    (0..n)
        .map(|i| {
            let d = root.join(format!("drive{i}"));
            std::fs::create_dir_all(&d).unwrap();
            d
        })
        .collect()
}

fn opts(drives: Vec<PathBuf>, mode: Mode, unit: u64) -> LayoutOptions {
    LayoutOptions {
        name: "m".into(),
        drives,
        mode,
        stripe_unit: unit,
        force: false,
        transform: None,
    }
}

/// An engine config for tests: `threads` per drive, 64 MiB of buffers, `hash`, `backend`.
fn config(
    threads: usize,
    hash: HashCheck,
    backend: Arc<dyn deltafin_storage::backend::IoBackend>,
) -> EngineConfig {
    EngineConfig {
        threads_per_drive: threads,
        buffer_cap_bytes: 64 << 20,
        queue_capacity: 1024,
        hash_check: hash,
        backend,
        ..EngineConfig::default()
    }
}

fn engine_with(
    dirs: &[PathBuf],
    backend: Arc<dyn deltafin_storage::backend::IoBackend>,
    hash: HashCheck,
) -> Engine {
    let (manifest, dirs) = open_layout(&dirs[0].join("m")).unwrap();
    Engine::open(Arc::new(manifest), &dirs, config(3, hash, backend)).unwrap()
}

/// Every expert part and resident tensor read through the engine equals the checkpoint bytes.
fn check_all_records(ckpt: &Checkpoint, engine: &Engine) {
    let m = engine.manifest().clone();
    let experts = ckpt.experts().unwrap();
    let all: Vec<usize> = (0..m.records.len()).collect();
    let (rx, _tickets) = engine.fetch(&all, Lane::Demand).unwrap();
    let mut seen = 0;
    for c in rx.iter().take(all.len()) {
        let loaded = c.result.unwrap();
        let Target::Record(i) = loaded.target else {
            panic!()
        };
        let rec = &m.records[i];
        assert_eq!(loaded.buf.len() as u64, rec.len);
        match &rec.id {
            RecordId::Resident { group } => {
                assert_eq!(&loaded.buf[..], ckpt.bytes(group).unwrap(), "{group}");
            }
            RecordId::Expert { layer, expert } => {
                let src = experts
                    .iter()
                    .find(|e| e.layer == *layer && e.expert == *expert)
                    .unwrap();
                for (t, p) in engine.record_tensors(i).iter().zip(&src.parts) {
                    assert_eq!(t.name, p.part);
                    let got = &loaded.buf[t.offset as usize..(t.offset + t.len) as usize];
                    assert_eq!(
                        got,
                        ckpt.slice(p.file, p.offset, p.len),
                        "{} {}",
                        rec.id,
                        t.name
                    );
                }
            }
        }
        seen += 1;
    }
    assert_eq!(seen, all.len());
}

#[test]
fn every_drive_count_and_mode_reads_back_byte_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synth(&tmp.path().join("model"), "deepseek_v3");
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
    let ckpt = synth(&tmp.path().join("model"), "qwen3_moe");
    let ds = drives(tmp.path(), 3);
    write_layout(&ckpt, &opts(ds.clone(), Mode::Stripe, 4096), &NoProgress).unwrap();
    let engine = engine_with(&ds, Arc::new(PosixBackend::default()), HashCheck::All);
    check_all_records(&ckpt, &engine);
}

#[test]
fn verify_names_a_flipped_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synth(&tmp.path().join("model"), "deepseek_v3");
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
    let ckpt = synth(&tmp.path().join("model"), "deepseek_v3");
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
fn demand_overtakes_prefetch_and_prefetch_can_be_cancelled() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synth(&tmp.path().join("model"), "deepseek_v3");
    let ds = drives(tmp.path(), 1);
    let m = write_layout(
        &ckpt,
        &opts(ds.clone(), Mode::Replicate, 1 << 20),
        &NoProgress,
    )
    .unwrap();
    let slow = Arc::new(FaultyBackend::new(
        Arc::new(PosixBackend::default()),
        vec![Fault::Latency(Duration::from_millis(20))],
    ));
    let (manifest, dirs) = open_layout(&ds[0].join("m")).unwrap();
    let cfg = config(1, HashCheck::Off, slow);
    let engine = Engine::open(Arc::new(manifest), &dirs, cfg).unwrap();
    let experts: Vec<usize> = m
        .records
        .iter()
        .enumerate()
        .filter(|(_, r)| matches!(r.id, RecordId::Expert { .. }))
        .map(|(i, _)| i)
        .collect();
    let (prx, ptickets) = engine.fetch(&experts[..30], Lane::Prefetch).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let started = std::time::Instant::now();
    engine.read_record(experts[40], None).unwrap();
    // One worker, 20 ms per read: without priority the demand read would wait ~600 ms.
    assert!(
        started.elapsed() < Duration::from_millis(200),
        "demand waited {:?}",
        started.elapsed()
    );
    for t in &ptickets[10..] {
        t.cancel();
    }
    let mut ok = 0;
    let mut cancelled = 0;
    for c in prx.iter().take(30) {
        match c.result {
            Ok(_) => ok += 1,
            Err(StorageError::Cancelled) => cancelled += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(cancelled >= 15, "ok {ok} cancelled {cancelled}");
    assert_eq!(ok + cancelled, 30);
    // Promotion moves a queued prefetch ahead.
    let (prx, ptickets) = engine.fetch(&experts[..20], Lane::Prefetch).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let started = std::time::Instant::now();
    ptickets[19].promote();
    let mut got = 0;
    let first = loop {
        let c = prx.recv().unwrap();
        got += 1;
        if c.tag == experts[19] as u64 {
            break started.elapsed();
        }
    };
    assert!(
        first < Duration::from_millis(200),
        "promoted read took {first:?}"
    );
    for t in &ptickets {
        t.cancel();
    }
    let rest = prx.iter().take(20 - got).count();
    assert_eq!(rest + got, 20);
    drop(prx);
    assert_eq!(
        engine.pool().in_use(),
        0,
        "every buffer goes back to the pool"
    );
}

#[test]
fn bad_inputs_name_what_is_wrong() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    let ckpt = synth(&model, "deepseek_v3");
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

    // Unsupported model_type lists what is supported.
    let cfg_path = model.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg["model_type"] = "llama".into();
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    let msg = Checkpoint::open(&model).unwrap_err().to_string();
    assert!(
        msg.contains("llama") && msg.contains("deepseek_v3") && msg.contains("qwen3_moe"),
        "{msg}"
    );

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

/// Replicate mode sends each piece to the drive with the fewest outstanding bytes: with equal
/// drives the load is shared; with one slow drive the fast one serves most of it.
#[test]
fn replicate_reads_go_to_the_least_loaded_drive() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synth(&tmp.path().join("model"), "deepseek_v3");
    let ds = drives(tmp.path(), 2);
    let m = write_layout(&ckpt, &opts(ds.clone(), Mode::Replicate, 4096), &NoProgress).unwrap();
    let experts: Vec<usize> = m
        .records
        .iter()
        .enumerate()
        .filter(|(_, r)| matches!(r.id, RecordId::Expert { .. }))
        .map(|(i, _)| i)
        .collect();
    let run = |faults: Vec<Fault>| {
        let backend = Arc::new(FaultyBackend::new(
            Arc::new(PosixBackend::default()),
            faults,
        ));
        let (manifest, dirs) = open_layout(&ds[0].join("m")).unwrap();
        let cfg = EngineConfig {
            queue_capacity: 4096,
            ..config(2, HashCheck::All, backend)
        };
        let engine = Engine::open(Arc::new(manifest), &dirs, cfg).unwrap();
        let (rx, _t) = engine.fetch(&experts, Lane::Demand).unwrap();
        for c in rx.iter().take(experts.len()) {
            c.result.unwrap();
        }
        engine
            .stats()
            .iter()
            .map(|s| s.bytes_read)
            .collect::<Vec<u64>>()
    };
    let even = run(vec![]);
    let total = (even[0] + even[1]) as f64;
    assert!(
        even.iter().all(|&b| b as f64 > 0.3 * total),
        "equal drives share the load: {even:?}"
    );
    let skewed = run(vec![Fault::SlowPath {
        path_contains: "drive0".into(),
        delay: Duration::from_millis(5),
    }]);
    assert!(
        skewed[1] as f64 > 0.8 * (skewed[0] + skewed[1]) as f64,
        "the fast drive serves most: {skewed:?}"
    );
}

/// Experts are fetched by (layer, expert); an unknown expert is refused by name.
#[test]
fn fetch_by_layer_and_expert() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synth(&tmp.path().join("model"), "qwen3_moe");
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

/// Replicate mode survives a failing drive: with I/O errors injected at the start of every
/// record on drive 0, every record still reads back byte for byte (hash-checked), the errors
/// are counted on drive 0, and another replica served the failed pieces.
#[test]
fn replicate_reads_fail_over_to_another_replica() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synth(&tmp.path().join("model"), "deepseek_v3");
    let ds = drives(tmp.path(), 2);
    let m = write_layout(&ckpt, &opts(ds.clone(), Mode::Replicate, 8192), &NoProgress).unwrap();
    let faults: Vec<Fault> = m
        .records
        .iter()
        .map(|r| Fault::Eio {
            path_contains: "drive0".into(),
            offset: r.offset,
        })
        .collect();
    let backend = Arc::new(FaultyBackend::new(
        Arc::new(PosixBackend::default()),
        faults,
    ));
    let hits = backend.hits.clone();
    let engine = engine_with(&ds, backend, HashCheck::All);
    check_all_records(&ckpt, &engine);
    let failed = hits.load(std::sync::atomic::Ordering::Relaxed);
    let stats = engine.stats();
    assert!(
        failed > 0,
        "drive 0 never served a record start: the test proves nothing"
    );
    assert_eq!(stats[0].read_errors, failed);
    assert_eq!(stats[1].read_errors, 0);
    assert_eq!(engine.replica_recoveries(), failed);
    // Once drive 0 has failed, new pieces go to drive 1.
    let before = stats[0].reads;
    check_all_records(&ckpt, &engine);
    assert_eq!(
        engine.stats()[0].reads,
        before,
        "the failing drive kept getting reads"
    );
}

/// When every replica fails at the same offset the error names each drive's failure.
#[test]
fn replicate_read_fails_only_when_every_replica_fails() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synth(&tmp.path().join("model"), "deepseek_v3");
    let ds = drives(tmp.path(), 2);
    let m = write_layout(&ckpt, &opts(ds.clone(), Mode::Replicate, 8192), &NoProgress).unwrap();
    let rec = m.records.iter().find(|r| r.len > 20_000).unwrap().clone();
    let bad = rec.offset + 9000; // inside the record's second 8 KiB piece
    let faults = ["drive0", "drive1"]
        .map(|d| Fault::Eio {
            path_contains: d.into(),
            offset: bad,
        })
        .to_vec();
    let backend = Arc::new(FaultyBackend::new(
        Arc::new(PosixBackend::default()),
        faults,
    ));
    let engine = engine_with(&ds, backend, HashCheck::All);
    let err = engine
        .read_record(engine.record_index(&rec.id).unwrap(), None)
        .unwrap_err();
    match &err {
        StorageError::ReplicasFailed { failures, .. } => {
            assert_eq!(failures.len(), 2, "{err}");
            let msg = err.to_string();
            assert!(
                msg.contains("drive0/m/data.bin") && msg.contains("drive1/m/data.bin"),
                "{msg}"
            );
        }
        other => panic!("unexpected {other}"),
    }
}

/// Silent corruption of one copy: a record whose bytes fail their hash is read again whole
/// from each replica and the good copy is returned; with both copies corrupt the hash error
/// stands.
#[test]
fn replicate_hash_mismatch_reads_the_other_copy() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synth(&tmp.path().join("model"), "deepseek_v3");
    let ds = drives(tmp.path(), 2);
    let m = write_layout(&ckpt, &opts(ds.clone(), Mode::Replicate, 8192), &NoProgress).unwrap();
    // Flip one byte in every record on drive 0.
    let flips = |drives: &[&str]| -> Vec<Fault> {
        m.records
            .iter()
            .flat_map(|r| {
                drives.iter().map(move |d| Fault::FlipByte {
                    path_contains: (*d).into(),
                    offset: r.offset + r.len / 2,
                })
            })
            .collect()
    };
    // Corrupt copies on either drive: each time the corrupt drive is found (whether its whole
    // copy was re-read or only its piece differed from the good copy) and only it is rested.
    for (bad, good) in [(0, 1), (1, 0)] {
        let backend = Arc::new(FaultyBackend::new(
            Arc::new(PosixBackend::default()),
            flips(&[["drive0", "drive1"][bad]]),
        ));
        let hits = backend.hits.clone();
        let engine = engine_with(&ds, backend, HashCheck::All);
        check_all_records(&ckpt, &engine);
        assert!(hits.load(std::sync::atomic::Ordering::Relaxed) > 0);
        assert!(engine.replica_recoveries() > 0);
        let stats = engine.stats();
        assert!(
            stats[bad].read_errors > 0,
            "corrupt drive {bad} was not marked"
        );
        assert_eq!(stats[good].read_errors, 0, "good drive {good} was marked");
    }

    let backend = Arc::new(FaultyBackend::new(
        Arc::new(PosixBackend::default()),
        flips(&["drive0", "drive1"]),
    ));
    let engine = engine_with(&ds, backend, HashCheck::All);
    let err = engine.read_record(0, None).unwrap_err();
    assert!(matches!(err, StorageError::HashMismatch { .. }), "{err}");
}

/// A replicated layout opens and reads every record with one drive's data file gone (the
/// strict open names the missing file); a striped one does not open; with every copy gone
/// nothing opens.
#[test]
fn replicate_opens_degraded_with_a_drive_missing() {
    use deltafin_storage::layout::open_layout_degraded;
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synth(&tmp.path().join("model"), "deepseek_v3");
    let ds = drives(tmp.path(), 3);
    write_layout(&ckpt, &opts(ds.clone(), Mode::Replicate, 8192), &NoProgress).unwrap();
    std::fs::remove_file(ds[1].join("m").join(DATA_FILE)).unwrap();
    let strict = open_layout(&ds[0].join("m")).unwrap_err();
    assert!(
        matches!(strict, StorageError::MissingDrive { drive: 1, ref path, .. } if path.ends_with("drive1/m/data.bin")),
        "{strict}"
    );
    let (manifest, dirs, problems) = open_layout_degraded(&ds[0].join("m")).unwrap();
    assert_eq!(problems.len(), 1);
    assert_eq!(problems[0].0, 1);
    assert!(
        problems[0].1.to_string().contains("drive1"),
        "{}",
        problems[0].1
    );
    let cfg = EngineConfig {
        unavailable_drives: problems.iter().map(|(d, _)| *d).collect(),
        ..config(2, HashCheck::All, Arc::new(PosixBackend::default()))
    };
    let engine = Engine::open(Arc::new(manifest), &dirs, cfg).unwrap();
    check_all_records(&ckpt, &engine);
    let stats = engine.stats();
    assert_eq!(stats[1].bytes_read, 0);
    assert!(stats[0].bytes_read > 0 && stats[2].bytes_read > 0);

    // Every copy but the one pointed at gone, then that one too.
    std::fs::remove_file(ds[2].join("m").join(DATA_FILE)).unwrap();
    let (_, _, problems) = open_layout_degraded(&ds[0].join("m")).unwrap();
    assert_eq!(problems.len(), 2);
    std::fs::remove_file(ds[0].join("m").join(DATA_FILE)).unwrap();
    assert!(open_layout_degraded(&ds[0].join("m")).is_err());

    let tmp = tempfile::tempdir().unwrap();
    let ds = drives(tmp.path(), 2);
    write_layout(&ckpt, &opts(ds.clone(), Mode::Stripe, 8192), &NoProgress).unwrap();
    std::fs::remove_file(ds[1].join("m").join(DATA_FILE)).unwrap();
    assert!(open_layout_degraded(&ds[0].join("m")).is_err());
}

/// A replica that failed once gets pieces again after `replica_retry_after`: one EIO on drive
/// 0 sends the following reads to drive 1, and once the period has passed drive 0 serves
/// reads again.
#[test]
fn a_failed_replica_is_tried_again_after_the_retry_period() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synth(&tmp.path().join("model"), "deepseek_v3");
    let ds = drives(tmp.path(), 2);
    let m = write_layout(&ckpt, &opts(ds.clone(), Mode::Replicate, 8192), &NoProgress).unwrap();
    let first = m.records[0].clone();
    let backend = Arc::new(FaultyBackend::new(
        Arc::new(PosixBackend::default()),
        vec![Fault::Eio {
            path_contains: "drive0".into(),
            offset: first.offset,
        }],
    ));
    let (manifest, dirs) = open_layout(&ds[0].join("m")).unwrap();
    let cfg = EngineConfig {
        replica_retry_after: Duration::from_millis(300),
        ..config(1, HashCheck::All, backend)
    };
    let engine = Engine::open(Arc::new(manifest), &dirs, cfg).unwrap();
    // Read record 0 until drive 0 has failed once (a stealing worker may serve it from drive 1).
    let mut tries = 0;
    while engine.stats()[0].read_errors == 0 {
        engine.read_record(0, None).unwrap();
        tries += 1;
        assert!(tries < 1000, "drive 0 never got record 0");
    }
    let reads0 = engine.stats()[0].reads;
    // Within the retry period: every piece goes to drive 1.
    for i in 1..m.records.len().min(20) {
        engine.read_record(i, None).unwrap();
    }
    assert_eq!(
        engine.stats()[0].reads,
        reads0,
        "a failed drive got pieces within the period"
    );
    std::thread::sleep(Duration::from_millis(350));
    for i in 1..m.records.len().min(20) {
        engine.read_record(i, None).unwrap();
    }
    assert!(
        engine.stats()[0].reads > reads0,
        "drive 0 was not tried again"
    );
}

/// A replica holding another layout's copy (re-laid out under the same name) is rejected by the
/// degraded open, and the engine reads nothing from it although its data file opens.
#[test]
fn a_foreign_replica_is_never_read() {
    use deltafin_storage::layout::open_layout_degraded;
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synth(&tmp.path().join("model"), "deepseek_v3");
    let ds = drives(tmp.path(), 2);
    write_layout(&ckpt, &opts(ds.clone(), Mode::Replicate, 8192), &NoProgress).unwrap();
    // Drive 1 now holds a different layout called "m" (another model, one drive).
    let other = synth(&tmp.path().join("other"), "qwen3_moe");
    let mut o = opts(vec![ds[1].clone()], Mode::Stripe, 8192);
    o.force = true;
    write_layout(&other, &o, &NoProgress).unwrap();
    let (manifest, dirs, problems) = open_layout_degraded(&ds[0].join("m")).unwrap();
    assert_eq!(problems.len(), 1);
    assert!(
        matches!(
            problems[0],
            (1, StorageError::DriveMismatch { drive: 1, .. })
        ),
        "{}",
        problems[0].1
    );
    let cfg = EngineConfig {
        unavailable_drives: problems.iter().map(|(d, _)| *d).collect(),
        ..config(2, HashCheck::Off, Arc::new(PosixBackend::default()))
    };
    let engine = Engine::open(Arc::new(manifest), &dirs, cfg).unwrap();
    check_all_records(&ckpt, &engine);
    assert_eq!(engine.stats()[1].bytes_read, 0);
}

/// A record read half from each drive, with one corrupt piece on drive 1: the good copy comes
/// from drive 0 (which served the first piece, so it is re-read first), and drive 1 is still
/// found and rested because its piece differs from the good copy.
#[test]
fn a_corrupt_piece_marks_the_drive_that_served_it() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synth(&tmp.path().join("model"), "deepseek_v3");
    let ds = drives(tmp.path(), 2);
    let unit = 8192;
    let m = write_layout(&ckpt, &opts(ds.clone(), Mode::Replicate, unit), &NoProgress).unwrap();
    let (i, rec) = m
        .records
        .iter()
        .enumerate()
        .find(|(_, r)| r.len > 3 * unit)
        .unwrap();
    // Inside the record's second piece, which goes to drive 1.
    let flip = (rec.offset / unit + 1) * unit + 100;
    let backend = Arc::new(FaultyBackend::new(
        Arc::new(PosixBackend::default()),
        vec![
            // Both workers busy on their own lane's pieces: no stealing, so the pieces
            // alternate drive 0, drive 1, ... as assigned.
            Fault::Latency(Duration::from_millis(50)),
            Fault::FlipByte {
                path_contains: "drive1".into(),
                offset: flip,
            },
        ],
    ));
    let (manifest, dirs) = open_layout(&ds[0].join("m")).unwrap();
    let cfg = config(1, HashCheck::All, backend);
    let engine = Engine::open(Arc::new(manifest), &dirs, cfg).unwrap();
    let loaded = engine.read_record(i, None).unwrap();
    assert!(loaded.verified);
    assert_eq!(engine.replica_recoveries(), 1);
    let stats = engine.stats();
    assert!(
        stats[1].read_errors > 0,
        "drive 1 served a corrupt piece but was not marked"
    );
    assert_eq!(stats[0].read_errors, 0);
}
