//! The engine's lanes as a caller sees them: what a cancelled request sends back.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use deltafin_storage::engine::{Lane, Target};
use deltafin_storage::StorageError;

/// A cancelled read hands the caller's buffer back with its completion (for reuse: the
/// expert store keeps it as a spare instead of freeing and allocating expert buffers).
#[test]
fn a_cancelled_read_returns_the_callers_buffer() {
    let tmp = tempfile::tempdir().unwrap();
    let (engine, m, gate) = gated_engine(tmp.path());
    let experts = expert_indices(&m);
    let (tx, rx) = crossbeam_channel::bounded(2);
    let len = |i: usize| m.records[i].len as usize;
    let dest = |i: usize| deltafin_storage::buffer::AlignedBuf::zeroed(len(i));
    // The first read holds the only worker; the second waits behind it and is cancelled.
    engine
        .submit(
            Target::Record(experts[0]),
            Lane::Prefetch,
            0,
            tx.clone(),
            Some(dest(experts[0])),
        )
        .unwrap();
    wait_until("the worker holds the first read", || gate.started() == 1);
    let queued = engine
        .submit(
            Target::Record(experts[1]),
            Lane::Prefetch,
            1,
            tx,
            Some(dest(experts[1])),
        )
        .unwrap();
    queued.cancel();
    gate.open();
    let mut got: Vec<_> = rx.iter().take(2).collect();
    got.sort_by_key(|c| c.tag);
    assert!(
        got[0].result.is_ok() && got[0].unused.is_none(),
        "the read that finished"
    );
    assert!(matches!(got[1].result, Err(StorageError::Cancelled)));
    let back = got[1].unused.as_ref().expect("the cancelled read's buffer");
    assert!(back.len() >= len(experts[1]));
}
