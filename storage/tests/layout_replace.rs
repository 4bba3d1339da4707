//! Replacing a layout never loses the old one, and two writers of one name cannot both succeed:
//! a forced replacement that fails (no room, a checkpoint that breaks half-way) leaves the old
//! layout readable and byte-exact; a concurrent `layout` or a reader makes a second writer fail
//! at once.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use common::*;
use deltafin_storage::backend::PosixBackend;
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::engine::HashCheck;
use deltafin_storage::layout::{write_layout, ExpertTransform, NoProgress, PartSpec, Progress};
use deltafin_storage::manifest::MANIFEST_FILE;
use deltafin_storage::store::{ExpertStore, StoreOptions};
use deltafin_storage::stripe::Mode;
use deltafin_storage::StorageError;

/// The layout `m` on `ds` holds exactly `ckpt`'s bytes.
fn holds(ckpt: &Checkpoint, ds: &[PathBuf]) {
    let engine = engine_with(ds, Arc::new(PosixBackend::default()), HashCheck::All);
    check_all_records(ckpt, &engine);
}

/// Folders beside the layout other than the layout itself and its lock file.
fn leftovers(drive: &Path) -> Vec<String> {
    std::fs::read_dir(drive)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n != "m" && n != ".m.lock")
        .collect()
}

fn forced(ds: &[PathBuf], mode: Mode) -> deltafin_storage::layout::LayoutOptions {
    let mut o = opts(ds.to_vec(), mode, 8192);
    o.force = true;
    o
}

#[test]
fn a_forced_replacement_that_does_not_fit_keeps_the_old_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let a = write_model(&tmp.path().join("a"), MODEL_A, 1);
    let b = write_model(&tmp.path().join("b"), MODEL_B, 2);
    for mode in [Mode::Stripe, Mode::Replicate] {
        let ds = drives(&tmp.path().join(format!("{mode}")), 2);
        write_layout(&a, &opts(ds.clone(), mode, 8192), &NoProgress).unwrap();
        let mut o = forced(&ds, mode);
        o.keep_free = u64::MAX / 4; // no drive can leave that much free
        let e = write_layout(&b, &o, &NoProgress).unwrap_err();
        assert!(matches!(e, StorageError::InsufficientSpace { .. }), "{e}");
        holds(&a, &ds);
        for d in &ds {
            assert!(leftovers(d).is_empty(), "{:?}", leftovers(d));
        }
    }
}

/// A layout-time transform that copies experts and fails on one.
#[derive(Debug)]
struct FailsAt {
    layer: u32,
    expert: u32,
}

impl ExpertTransform for FailsAt {
    fn parts(&self, source: &[PartSpec]) -> deltafin_storage::Result<Vec<PartSpec>> {
        Ok(source.to_vec())
    }
    fn apply(
        &self,
        layer: u32,
        expert: u32,
        source: &[(&PartSpec, &[u8])],
    ) -> deltafin_storage::Result<Vec<Vec<u8>>> {
        if (layer, expert) == (self.layer, self.expert) {
            return Err(StorageError::InvalidArgument(format!(
                "layer {layer} expert {expert}: refused by the test"
            )));
        }
        Ok(source.iter().map(|(_, b)| b.to_vec()).collect())
    }
    fn config(&self, source: &serde_json::Value) -> deltafin_storage::Result<serde_json::Value> {
        Ok(source.clone())
    }
}

#[test]
fn a_forced_replacement_that_fails_half_way_keeps_the_old_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let a = write_model(&tmp.path().join("a"), MODEL_A, 1);
    let b = write_model(&tmp.path().join("b"), MODEL_B, 2);
    let ds = drives(&tmp.path().join("drives"), 3);
    write_layout(&a, &opts(ds.clone(), Mode::Stripe, 8192), &NoProgress).unwrap();
    // The replacement fails while writing (its transform refuses an expert half-way).
    let mut o = forced(&ds, Mode::Stripe);
    o.transform = Some(Arc::new(FailsAt {
        layer: 2,
        expert: 5,
    }));
    let e = write_layout(&b, &o, &NoProgress).unwrap_err();
    assert!(e.to_string().contains("layer 2 expert 5"), "{e}");
    holds(&a, &ds);
    for d in &ds {
        assert!(leftovers(d).is_empty(), "{:?}", leftovers(d));
    }
}

#[test]
fn a_completed_forced_replacement_swaps_the_new_layout_in() {
    let tmp = tempfile::tempdir().unwrap();
    let a = write_model(&tmp.path().join("a"), MODEL_A, 1);
    let b = write_model(&tmp.path().join("b"), MODEL_B, 2);
    let ds = drives(&tmp.path().join("drives"), 2);
    write_layout(&a, &opts(ds.clone(), Mode::Replicate, 8192), &NoProgress).unwrap();
    // A staging folder left by an interrupted run is cleaned up.
    std::fs::create_dir_all(ds[1].join(".m.new-deadbeef")).unwrap();
    std::fs::write(ds[1].join(".m.new-deadbeef").join("data.bin"), b"junk").unwrap();
    write_layout(&b, &forced(&ds, Mode::Stripe), &NoProgress).unwrap();
    holds(&b, &ds);
    for d in &ds {
        assert!(leftovers(d).is_empty(), "{:?}", leftovers(d));
        assert!(d.join("m").join(MANIFEST_FILE).exists());
    }
}

/// Holds the first writer inside its data phase until the test lets it go.
struct Held {
    entered: Mutex<Option<mpsc::Sender<()>>>,
    release: Mutex<mpsc::Receiver<()>>,
}

impl Progress for Held {
    fn start(&self, _total: u64, _what: &str) {
        if let Some(tx) = self.entered.lock().unwrap().take() {
            let _ = tx.send(());
            let _ = self
                .release
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(60));
        }
    }
}

#[test]
fn concurrent_layouts_of_one_name_cannot_both_succeed() {
    let tmp = tempfile::tempdir().unwrap();
    let a = write_model(&tmp.path().join("a"), MODEL_A, 1);
    let b = write_model(&tmp.path().join("b"), MODEL_B, 2);
    let ds = drives(&tmp.path().join("drives"), 2);
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel();
    let held = Arc::new(Held {
        entered: Mutex::new(Some(entered_tx)),
        release: Mutex::new(release_rx),
    });
    let first = {
        let (ds, held) = (ds.clone(), held.clone());
        std::thread::spawn(move || write_layout(&a, &opts(ds, Mode::Stripe, 8192), &*held))
    };
    entered_rx.recv_timeout(Duration::from_secs(60)).unwrap();
    // The first run is writing: a second (forced or not) fails at once, naming the layout.
    for force in [false, true] {
        let mut o = opts(ds.clone(), Mode::Replicate, 8192);
        o.force = force;
        let e = write_layout(&b, &o, &NoProgress).unwrap_err();
        assert!(matches!(e, StorageError::LayoutBusy { .. }), "{e}");
        assert!(e.to_string().contains("m"), "{e}");
    }
    release_tx.send(()).unwrap();
    first.join().unwrap().unwrap();
    let a = Checkpoint::open(&tmp.path().join("a")).unwrap();
    holds(&a, &ds);
}

#[test]
fn a_layout_being_read_is_not_replaced_under_its_reader() {
    let tmp = tempfile::tempdir().unwrap();
    let a = write_model(&tmp.path().join("a"), MODEL_A, 1);
    let b = write_model(&tmp.path().join("b"), MODEL_B, 2);
    let ds = drives(&tmp.path().join("drives"), 2);
    write_layout(&a, &opts(ds.clone(), Mode::Stripe, 8192), &NoProgress).unwrap();
    let store = ExpertStore::open(&ds[0].join("m"), &StoreOptions::default()).unwrap();
    let e = write_layout(&b, &forced(&ds, Mode::Stripe), &NoProgress).unwrap_err();
    assert!(matches!(e, StorageError::LayoutBusy { .. }), "{e}");
    holds(&a, &ds);
    drop(store);
    write_layout(&b, &forced(&ds, Mode::Stripe), &NoProgress).unwrap();
    holds(&b, &ds);
}
