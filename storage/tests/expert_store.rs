//! The expert store end to end over a layout in temp folders: what `fetch` hands over is the
//! checkpoint's bytes, and no interleaving of prefetches, cancels and budget changes can block
//! it (the completion channel is bounded).
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::mpsc;
use std::time::Duration;

use common::{drives, naming, opts, write_model, MODEL_A};
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::expert_parts::{expert_sources, ExpertSource};
use deltafin_storage::layout::{write_layout, NoProgress};
use deltafin_storage::store::{ExpertStore, StoreOptions};
use deltafin_storage::stripe::Mode;

/// Run `f` on its own thread; fail if it has not finished within a minute (a deadlock).
fn within_a_minute(what: &str, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => handle.join().unwrap(),
        // The thread panicked: re-raise its panic.
        Err(mpsc::RecvTimeoutError::Disconnected) => handle.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{what}: still blocked after a minute"),
    }
}

/// Fetch `experts` of `layer` and check every part against the checkpoint.
fn fetch_and_check(
    store: &ExpertStore,
    ckpt: &Checkpoint,
    sources: &[ExpertSource],
    layer: u32,
    experts: &[u32],
) {
    let mut seen = Vec::new();
    for landed in store.fetch(layer, experts).unwrap() {
        let landed = landed.unwrap();
        let src = sources
            .iter()
            .find(|s| s.layer == layer && s.expert == landed.expert)
            .unwrap();
        for (t, p) in landed.tensors.iter().zip(&src.parts) {
            assert_eq!(t.name, p.part);
            assert_eq!(
                landed.tensor_bytes(t).unwrap(),
                ckpt.slice(p.file, p.offset, p.len),
                "layer {layer} expert {} {}",
                landed.expert,
                t.name
            );
        }
        seen.push(landed.expert);
    }
    seen.sort_unstable();
    let mut want = experts.to_vec();
    want.sort_unstable();
    assert_eq!(seen, want, "layer {layer}");
}

/// Lay MODEL_A out striped over two drives; the store opens it with `store_opts`.
fn setup(root: &std::path::Path, store_opts: StoreOptions) -> (ExpertStore, Checkpoint) {
    let ckpt = write_model(&root.join("ckpt"), MODEL_A, 7);
    let ds = drives(root, 2);
    write_layout(&ckpt, &opts(ds.clone(), Mode::Stripe, 4096), &NoProgress).unwrap();
    let store = ExpertStore::open(&ds[0].join("m"), &store_opts).unwrap();
    (store, ckpt)
}

/// Prefetches of a whole layer, most of them then cancelled as mispredicted, with room for
/// only two reads outstanding and a budget raised after opening (as `generate` does): every
/// completion, including those a cancel sends from the fetching thread, has room.
#[test]
fn cancelled_prefetches_never_block_the_fetch() {
    let tmp = tempfile::tempdir().unwrap();
    let (store, ckpt) = setup(
        tmp.path(),
        StoreOptions {
            threads_per_drive: 2,
            buffer_cap_bytes: 0,
            max_outstanding_reads: 2,
            ..StoreOptions::default()
        },
    );
    within_a_minute("prefetch + cancel", move || {
        let sources = expert_sources(&ckpt, &naming()).unwrap();
        store.set_cap(64 << 20);
        let all: Vec<u32> = (0..MODEL_A.experts as u32).collect();
        for round in 0..3u32 {
            for layer in MODEL_A.first_moe as u32..MODEL_A.layers as u32 {
                store.prefetch(layer, &all);
                let wanted = [round, 5 + round, 9 + round];
                fetch_and_check(&store, &ckpt, &sources, layer, &wanted);
                // The next layer's prediction is wrong on purpose.
                store.prefetch(layer + 1, &all[8..]);
            }
        }
        let stats = store.stats();
        assert!(stats.fetch.prefetch_cancelled > 0, "{stats:?}");
    });
}

/// A budget of one expert and one read outstanding: every expert of every layer still comes
/// through, correct, one at a time.
#[test]
fn one_read_at_a_time_serves_every_expert() {
    let tmp = tempfile::tempdir().unwrap();
    let (store, ckpt) = setup(
        tmp.path(),
        StoreOptions {
            threads_per_drive: 1,
            buffer_cap_bytes: 0,
            max_outstanding_reads: 1,
            ..StoreOptions::default()
        },
    );
    within_a_minute("one read at a time", move || {
        let sources = expert_sources(&ckpt, &naming()).unwrap();
        let largest = store.manifest().largest_expert_record();
        store.set_cap(largest.next_multiple_of(4096));
        let all: Vec<u32> = (0..MODEL_A.experts as u32).collect();
        for layer in MODEL_A.first_moe as u32..MODEL_A.layers as u32 {
            store.prefetch(layer, &all[..4]);
            fetch_and_check(&store, &ckpt, &sources, layer, &all);
        }
    });
}

/// Preallocated spare buffers fill the free budget (at most one per expert, whatever the
/// cap), stay within it, and every read into one of them (a reused, already-touched buffer)
/// still hands over exactly the checkpoint's bytes, over evictions.
#[test]
fn preallocated_buffers_stay_in_budget_and_serve_exact_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let (store, ckpt) = setup(
        tmp.path(),
        StoreOptions {
            threads_per_drive: 2,
            buffer_cap_bytes: 0,
            ..StoreOptions::default()
        },
    );
    within_a_minute("preallocated buffers", move || {
        let sources = expert_sources(&ckpt, &naming()).unwrap();
        let largest = store.manifest().largest_expert_record();
        let experts = store.manifest().expert_records().count() as u64;
        // A huge cap: no more than one buffer per expert.
        store.set_cap(1 << 40);
        assert_eq!(store.preallocate_buffers(2), experts * largest);
        // A cap of three experts (and a bit): three buffers, nothing more on a second call.
        let tmp2 = tempfile::tempdir().unwrap();
        let (small, _) = setup(tmp2.path(), StoreOptions::default());
        small.set_cap(3 * largest + largest / 2);
        assert_eq!(small.preallocate_buffers(3), 3 * largest);
        assert_eq!(small.preallocate_buffers(3), 0);
        let all: Vec<u32> = (0..MODEL_A.experts as u32).collect();
        for layer in MODEL_A.first_moe as u32..MODEL_A.layers as u32 {
            for e in &all {
                fetch_and_check(&small, &ckpt, &sources, layer, &[*e]);
                let s = small.stats();
                assert!(s.expert_memory_bytes <= s.expert_memory_cap, "{s:?}");
            }
        }
        assert!(small.stats().fetch.evictions > 0);
        fetch_and_check(&store, &ckpt, &sources, MODEL_A.first_moe as u32, &all);
    });
}

/// A prediction for layer L+1 made before layer L is fetched (the forward's order) is read only
/// once L's demand reads are all submitted, then lands in time for L+1's fetch; a layer after
/// one without routed experts is prefetched at once.
#[test]
fn next_layer_prefetch_waits_for_the_layer_before_then_serves_its_fetch() {
    let tmp = tempfile::tempdir().unwrap();
    let (store, ckpt) = setup(tmp.path(), StoreOptions::default());
    within_a_minute("deferred prefetch", move || {
        let sources = expert_sources(&ckpt, &naming()).unwrap();
        store.set_cap(64 << 20);
        let first = MODEL_A.first_moe as u32;
        // The layer before the first MoE layer has no routed experts: read now.
        store.prefetch(first, &[0, 1]);
        assert_eq!(store.stats().fetch.prefetch_reads, 2);
        fetch_and_check(&store, &ckpt, &sources, first, &[0, 1]);
        assert_eq!(store.stats().fetch.prefetch_hits, 2);

        store.prefetch(first + 1, &[2, 3, 4]);
        assert_eq!(
            store.stats().fetch.prefetch_reads,
            2,
            "held back until the fetch"
        );
        fetch_and_check(&store, &ckpt, &sources, first, &[5, 6]);
        let s = store.stats().fetch;
        assert_eq!(s.prefetch_reads, 5, "issued behind the demand reads: {s:?}");
        fetch_and_check(&store, &ckpt, &sources, first + 1, &[2, 3, 4]);
        assert_eq!(store.stats().fetch.prefetch_hits, 5);

        // A held-back prediction of the layer that is then fetched directly is dropped (its
        // demand reads cover it), not read twice.
        store.prefetch(first + 2, &[7, 8]);
        fetch_and_check(&store, &ckpt, &sources, first + 2, &[7, 8]);
        fetch_and_check(&store, &ckpt, &sources, first, &[9]);
        assert_eq!(store.stats().fetch.prefetch_reads, 5);
    });
}

/// A better prediction for layer L+1 made while layer L's batch is being fetched replaces the
/// first: before L's demand reads are submitted the first is never read; after, the new one's
/// experts are read at once (those already in flight not twice) and every fetch still hands
/// over the checkpoint's bytes, including experts of a replaced prediction.
#[test]
fn a_prediction_made_during_the_fetch_replaces_the_first() {
    let tmp = tempfile::tempdir().unwrap();
    let (store, ckpt) = setup(tmp.path(), StoreOptions::default());
    within_a_minute("repredict", move || {
        let sources = expert_sources(&ckpt, &naming()).unwrap();
        store.set_cap(64 << 20);
        let first = MODEL_A.first_moe as u32;
        fetch_and_check(&store, &ckpt, &sources, first, &[0]);
        let before = store.stats().fetch.prefetch_reads;

        // Replaced while still held back: only the new prediction is read.
        store.prefetch(first + 1, &[2, 3, 4]);
        let mut batch = store.fetch(first, &[5, 6]).unwrap();
        batch.repredict(first + 1, &[3, 7]);
        for landed in batch.by_ref() {
            landed.unwrap();
        }
        drop(batch);
        let s = store.stats().fetch;
        assert_eq!(s.prefetch_reads - before, 2, "{s:?}");
        assert_eq!(s.repredictions, 1);
        fetch_and_check(&store, &ckpt, &sources, first + 1, &[3, 7]);
        assert_eq!(store.stats().fetch.prefetch_hits, 2);

        // Replaced after the first was issued: the new experts not yet in flight are read.
        let before = store.stats().fetch.prefetch_reads;
        store.prefetch(first + 1, &[8, 9]);
        let mut batch = store.fetch(first, &[10, 11]).unwrap();
        // The first expert handed over: the demand reads, then 8 and 9, are submitted.
        batch.next().unwrap().unwrap();
        batch.repredict(first + 1, &[9, 12]);
        for landed in batch {
            landed.unwrap();
        }
        let s = store.stats().fetch;
        assert_eq!(
            s.prefetch_reads - before,
            3,
            "8 and 9, then 12 (9 not twice): {s:?}"
        );
        fetch_and_check(&store, &ckpt, &sources, first + 1, &[9, 12]);
        // The dropped guess (cancelled if no drive had started it) reads correctly later.
        fetch_and_check(&store, &ckpt, &sources, first + 1, &[8]);
        assert_eq!(store.stats().fetch.repredictions, 2);
    });
}
