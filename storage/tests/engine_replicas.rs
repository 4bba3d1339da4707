//! The engine under load and faults: priority lanes and cancellation, replicate-mode balancing,
//! failover to another copy, degraded opening and retry periods.

#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use deltafin_storage::backend::{Fault, FaultyBackend, PosixBackend};
use deltafin_storage::clock::ManualClock;
use deltafin_storage::engine::{Engine, EngineConfig, HashCheck, Lane, Target};
use deltafin_storage::layout::{open_layout, write_layout, NoProgress};
use deltafin_storage::manifest::{RecordId, DATA_FILE};
use deltafin_storage::stripe::Mode;
use deltafin_storage::StorageError;

#[test]
fn demand_overtakes_prefetch_and_prefetch_can_be_cancelled() {
    let tmp = tempfile::tempdir().unwrap();
    // One worker held at the gate by the first prefetch read while the rest queue up: read
    // order is then decided by the lanes alone, not by timing.
    let (engine, m, gate) = gated_engine(tmp.path());
    let experts = expert_indices(&m);
    let offset = |i: usize| m.records[i].offset;
    let (prx, ptickets) = engine.fetch(&experts[..30], Lane::Prefetch).unwrap();
    wait_until("the worker holds a prefetch read", || gate.started() == 1);
    let (dtx, drx) = crossbeam_channel::bounded(1);
    engine
        .submit(Target::Record(experts[40]), Lane::Demand, 40, dtx, None)
        .unwrap();
    for t in &ptickets[10..] {
        t.cancel();
    }
    gate.open();
    drx.recv().unwrap().result.unwrap();
    let mut ok = 0;
    let mut cancelled = 0;
    for c in prx.iter().take(30) {
        match c.result {
            Ok(_) => ok += 1,
            Err(StorageError::Cancelled) => cancelled += 1,
            Err(e) => panic!("{e}"),
        }
    }
    let log = gate.log.lock().unwrap().clone();
    assert_eq!(log[0], offset(experts[0]), "the held prefetch read");
    assert_eq!(
        log[1],
        offset(experts[40]),
        "demand overtakes the queued prefetches"
    );
    assert_eq!(
        (ok, cancelled),
        (10, 20),
        "started reads finish, queued ones are cancelled"
    );
    assert_eq!(log.len(), 11, "cancelled reads are never issued");

    // Promotion moves a queued prefetch ahead.
    gate.close();
    let (prx, ptickets) = engine.fetch(&experts[..20], Lane::Prefetch).unwrap();
    wait_until("the worker holds a prefetch read", || gate.started() == 1);
    ptickets[19].promote();
    gate.open();
    let got: Vec<u64> = prx.iter().take(20).map(|c| c.tag).collect();
    assert_eq!(got.len(), 20);
    let log = gate.log.lock().unwrap().clone();
    assert_eq!(log[1], offset(experts[19]), "the promoted read goes next");
    drop(prx);
    assert_eq!(
        engine.pool().in_use(),
        0,
        "every buffer goes back to the pool"
    );
}

/// Replicate mode sends each piece to the drive with the fewest outstanding bytes: with equal
/// drives the load is shared; with one slow drive the fast one serves most of it.
#[test]
fn replicate_reads_go_to_the_least_loaded_drive() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 11);
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

/// Replicate mode survives a failing drive: with I/O errors injected at the start of every
/// record on drive 0, every record still reads back byte for byte (hash-checked), the errors
/// are counted on drive 0, and another replica served the failed pieces.
#[test]
fn replicate_reads_fail_over_to_another_replica() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 11);
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
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 11);
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
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 11);
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
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 11);
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
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 11);
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
    let clock = Arc::new(ManualClock::default());
    let cfg = EngineConfig {
        replica_retry_after: Duration::from_millis(300),
        clock: clock.clone(),
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
    clock.advance(Duration::from_millis(299));
    for i in 1..m.records.len().min(20) {
        engine.read_record(i, None).unwrap();
    }
    assert_eq!(
        engine.stats()[0].reads,
        reads0,
        "a failed drive got pieces 1 ms before the end of the period"
    );
    clock.advance(Duration::from_millis(1));
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
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 11);
    let ds = drives(tmp.path(), 2);
    write_layout(&ckpt, &opts(ds.clone(), Mode::Replicate, 8192), &NoProgress).unwrap();
    // Drive 1 now holds a different layout called "m" (another model, one drive).
    let other = write_model(&tmp.path().join("other"), MODEL_B, 12);
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
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 11);
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

/// A refused request leaves the drives' load untouched: `submit` used to count a record's
/// pieces against their drives before the steps that can fail, so every refused submit skewed
/// replicate mode's least-loaded choice for good.
#[test]
fn a_refused_submit_counts_nothing_against_the_drives() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 11);
    let ds = drives(tmp.path(), 2);
    let m = write_layout(&ckpt, &opts(ds.clone(), Mode::Replicate, 4096), &NoProgress).unwrap();
    let (manifest, dirs) = open_layout(&ds[0].join("m")).unwrap();
    let cfg = EngineConfig {
        buffer_cap_bytes: 8192,
        ..config(2, HashCheck::Off, Arc::new(PosixBackend::default()))
    };
    let engine = Engine::open(Arc::new(manifest), &dirs, cfg).unwrap();
    let big = *expert_indices(&m).first().unwrap();
    assert!(
        m.records[big].len > 8192,
        "an expert record larger than the pool"
    );
    let (tx, _rx) = crossbeam_channel::bounded(4);
    for _ in 0..5 {
        // A destination buffer too small for the record.
        let small = deltafin_storage::buffer::AlignedBuf::zeroed(16);
        let err = engine
            .submit(
                Target::Record(big),
                Lane::Demand,
                0,
                tx.clone(),
                Some(small),
            )
            .unwrap_err();
        assert!(matches!(err, StorageError::InvalidArgument(_)), "{err}");
        // A pooled buffer beyond the pool's cap.
        let err = engine
            .submit(Target::Record(big), Lane::Demand, 0, tx.clone(), None)
            .unwrap_err();
        assert!(matches!(err, StorageError::BufferTooLarge { .. }), "{err}");
    }
    for (d, s) in engine.stats().iter().enumerate() {
        assert_eq!(s.outstanding, 0, "drive {d} carries refused requests");
    }
}

/// A drive reads at most `prefetch_depth` prefetched pieces at once, however many workers
/// it has; a demand read still gets a worker at once.
#[test]
fn prefetch_reads_in_flight_are_capped_and_demand_still_gets_a_worker() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = write_model(&tmp.path().join("model"), MODEL_A, 11);
    let ds = drives(tmp.path(), 1);
    let m = write_layout(&ckpt, &opts(ds.clone(), Mode::Stripe, 1 << 20), &NoProgress).unwrap();
    let gate = Arc::new(Gate::default());
    let (manifest, dirs) = open_layout(&ds[0].join("m")).unwrap();
    let cfg = EngineConfig {
        prefetch_depth: 2,
        ..config(4, HashCheck::Off, Arc::new(GatedBackend::new(gate.clone())))
    };
    let engine = Engine::open(Arc::new(manifest), &dirs, cfg).unwrap();
    let experts = expert_indices(&m);
    let (prx, _pt) = engine.fetch(&experts[..12], Lane::Prefetch).unwrap();
    wait_until("two prefetch reads are held", || gate.started() >= 2);
    // Two workers are idle with ten prefetches queued: they must not take them.
    std::thread::sleep(Duration::from_millis(30));
    let started = gate.started();
    if started != 2 {
        gate.open(); // let the workers go before failing, so the engine can shut down
        panic!("{started} prefetch reads in flight, the cap is 2");
    }
    let (dtx, drx) = crossbeam_channel::bounded(1);
    engine
        .submit(Target::Record(experts[20]), Lane::Demand, 20, dtx, None)
        .unwrap();
    // Every failure lets the workers go first, so the engine can shut down and the test fails
    // instead of hanging.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while gate.started() < 3 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_micros(50));
    }
    let third = gate.log.lock().unwrap().get(2).copied();
    gate.open();
    assert_eq!(
        third,
        Some(m.records[experts[20]].offset),
        "the third read is the demand, taken while two prefetches hold the cap"
    );
    let wait = Duration::from_secs(10);
    drx.recv_timeout(wait).unwrap().result.unwrap();
    for _ in 0..12 {
        prx.recv_timeout(wait).unwrap().result.unwrap();
    }
}
