//! The fixtures laid out over drives (3-drive stripe with a small stripe unit so records
//! straddle drives, 2-drive replicate) and served by `LayoutSource` match transformers exactly
//! as the directory source does; read errors name the layer and expert.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{argmax, assert_close, fixture_dir, Reference};
use deltafin_inference::weights::{ExpertView, WeightSource};
use deltafin_inference::{InferenceError, LayoutSource, LayoutSourceOptions, LoadProgress, Model};
use deltafin_storage::backend::{Fault, FaultyBackend, PosixBackend};
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::engine::HashCheck;
use deltafin_storage::expert_parts::{expert_sources, resident_tensors};
use deltafin_storage::layout::{write_layout, LayoutOptions, NoProgress};
use deltafin_storage::manifest::RecordId;
use deltafin_storage::stripe::{align_up, Mode};
use deltafin_storage::StorageError;

const ALL_FIXTURES: [&str; 5] = [
    "deepseek_v3_a",
    "qwen3_moe_a",
    "deepseek_v3_fp8",
    "deepseek_v3_int4",
    "deepseek_v3_mxfp4",
];

/// A layout of fixture `name` on `drives` fresh directories; returns the tempdirs (keep them
/// alive) and the layout folder on each drive.
fn lay_out(
    name: &str,
    mode: Mode,
    drives: usize,
    unit: u64,
) -> (Vec<tempfile::TempDir>, Vec<PathBuf>) {
    let ckpt = Checkpoint::open(&fixture_dir(name)).unwrap();
    let tmp: Vec<_> = (0..drives).map(|_| tempfile::tempdir().unwrap()).collect();
    let opts = LayoutOptions {
        name: "m".into(),
        drives: tmp.iter().map(|t| t.path().to_path_buf()).collect(),
        mode,
        stripe_unit: unit,
        force: false,
        naming: deltafin_inference::family::expert_naming(&ckpt.config).unwrap(),
        transform: None,
        keep_free: 0,
    };
    let m = write_layout(&ckpt, &opts, &NoProgress).unwrap();
    let dirs = m.drives.iter().map(|d| d.path.clone()).collect();
    (tmp, dirs)
}

fn options() -> LayoutSourceOptions {
    LayoutSourceOptions {
        threads_per_drive: 2,
        hash_check: HashCheck::All,
        ..LayoutSourceOptions::default()
    }
}

/// Prompt logits, 20 greedy ids and the step logits against the reference.
fn check_model(what: &str, model: &Model, r: &Reference) -> (f32, f32) {
    let vocab = model.vocab_size();
    let prompt: Vec<u32> = r.i64("prompt_ids").iter().map(|&t| t as u32).collect();
    let n = prompt.len();
    let logits = model.forward(&mut model.new_session(), &prompt).unwrap();
    assert_eq!((logits.rows, logits.vocab), (n, vocab));
    let want = r.f32("prompt_logits");
    let prompt_err = assert_close(&format!("{what}: prompt logits"), &logits.data, &want);

    let greedy = r.i64("greedy_ids");
    let step_logits = r.f32("greedy_step_logits");
    let mut session = model.new_session();
    let mut last = model.forward_last(&mut session, &prompt).unwrap();
    let mut step_err = 0f32;
    let mut ids = Vec::new();
    for i in 0..greedy.len() {
        let reference = &step_logits[i * vocab..(i + 1) * vocab];
        step_err = step_err.max(assert_close(
            &format!("{what}: greedy step {i}"),
            &last,
            reference,
        ));
        let id = argmax(&last);
        ids.push(id as i64);
        last = model.forward_last(&mut session, &[id as u32]).unwrap();
    }
    assert_eq!(ids, greedy, "{what}: greedy ids");
    (prompt_err, step_err)
}

fn check_layout(name: &str, mode: Mode, drives: usize, unit: u64) {
    let (_tmp, dirs) = lay_out(name, mode, drives, unit);
    // Open from the last drive's folder: any drive works.
    let mut progress = Vec::new();
    let src = LayoutSource::open_with_progress(
        dirs.last().unwrap(),
        &options(),
        &mut |p: &LoadProgress| progress.push(p.clone()),
    )
    .unwrap();
    assert_eq!(src.drive_count(), drives);
    assert_eq!(src.mode(), mode);
    let first = progress.first().unwrap();
    let last = progress.last().unwrap();
    assert_eq!((first.done_records, first.done_bytes), (0, 0));
    assert_eq!(last.done_records, last.total_records);
    assert_eq!(last.done_bytes, last.total_bytes);
    assert!(last.total_records > 0);

    let src = Arc::new(src);
    let model = Model::load(src.clone()).unwrap();
    let r = Reference::open(&fixture_dir(name).join("reference.safetensors"));
    let what = format!("{name} {mode:?}x{drives}");
    let (prompt_err, step_err) = check_model(&what, &model, &r);
    eprintln!(
        "{what}: prompt logits max err {prompt_err:e}, greedy step logits max err {step_err:e}"
    );

    let s = src.stats();
    assert_eq!(s.resident_bytes, last.total_bytes);
    assert_eq!(s.resident_records, last.total_records);
    assert!(s.fetch.reads > 0 && s.fetch.read_bytes > 0 && s.fetch.batches > 0);
    assert_eq!(s.bytes_read, s.resident_bytes + s.fetch.read_bytes);
    assert_eq!(s.drives.len(), drives);
    let drive_bytes: u64 = s.drives.iter().map(|d| d.bytes_read).sum();
    assert!(drive_bytes >= s.bytes_read);
    if mode == Mode::Stripe {
        assert!(s.drives.iter().all(|d| d.bytes_read > 0), "{:?}", s.drives);
    }
}

#[test]
fn striped_layouts_match_transformers() {
    for name in ALL_FIXTURES {
        check_layout(name, Mode::Stripe, 3, 8192);
    }
}

#[test]
fn replicated_layouts_match_transformers() {
    for name in ALL_FIXTURES {
        check_layout(name, Mode::Replicate, 2, 8192);
    }
}

/// Records really straddle drives with this unit (otherwise the striped test proves little).
#[test]
fn expert_records_straddle_drives() {
    let (_tmp, dirs) = lay_out("deepseek_v3_a", Mode::Stripe, 3, 8192);
    let src = LayoutSource::open(&dirs[0], &options()).unwrap();
    let m = src.manifest();
    let p = m.placement();
    let straddling = m
        .records
        .iter()
        .filter(|r| matches!(r.id, RecordId::Expert { .. }))
        .filter(|r| {
            let mut d: Vec<usize> = p
                .pieces(r.offset, align_up(r.len))
                .iter()
                .map(|x| x.drive)
                .collect();
            d.dedup();
            d.len() > 1
        })
        .count();
    assert!(straddling > 0);
}

/// A pool that holds only one expert record at a time still serves every expert (reads are
/// windowed by pool room instead of blocking), also from two threads at once.
#[test]
fn tight_buffer_cap_reads_one_expert_at_a_time() {
    let (_tmp, dirs) = lay_out("qwen3_moe_a", Mode::Stripe, 3, 8192);
    let probe = LayoutSource::open(&dirs[0], &options()).unwrap();
    let biggest = probe
        .manifest()
        .records
        .iter()
        .filter(|r| matches!(r.id, RecordId::Expert { .. }))
        .map(|r| align_up(r.len))
        .max()
        .unwrap();
    drop(probe);
    let opts = LayoutSourceOptions {
        buffer_cap_bytes: biggest,
        ..options()
    };
    let src = Arc::new(LayoutSource::open(&dirs[0], &opts).unwrap());
    let model = Arc::new(Model::load(src.clone()).unwrap());
    let r = Reference::open(&fixture_dir("qwen3_moe_a").join("reference.safetensors"));
    check_model("qwen3_moe_a tight pool", &model, &r);

    let handles: Vec<_> = (0..2)
        .map(|_| {
            let src = src.clone();
            std::thread::spawn(move || {
                for layer in 0..4 {
                    let experts: Vec<usize> = (0..16).collect();
                    let mut seen = Vec::new();
                    src.with_experts(layer, &experts, &mut |e, view: &ExpertView<'_>| {
                        assert!(view.part("gate_proj.weight").is_some());
                        seen.push(e);
                        Ok(())
                    })
                    .unwrap();
                    seen.sort_unstable();
                    assert_eq!(seen, experts);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let s = src.stats();
    assert!(s.fetch.peak_bytes <= biggest && s.expert_memory_bytes <= biggest);
}

/// Expert views hold the same bytes as the checkpoint; resident tensors too.
#[test]
fn views_match_checkpoint_bytes() {
    let dir = fixture_dir("deepseek_v3_int4");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let (_tmp, dirs) = lay_out("deepseek_v3_int4", Mode::Stripe, 3, 8192);
    let src = LayoutSource::open(&dirs[1].join("manifest.json"), &options()).unwrap();
    let naming = deltafin_inference::family::expert_naming(&ckpt.config).unwrap();
    for t in resident_tensors(&ckpt, &naming) {
        let ours = src.tensor(&t.info.name).unwrap();
        assert_eq!(
            ours.bytes,
            ckpt.bytes(&t.info.name).unwrap(),
            "{}",
            t.info.name
        );
        assert_eq!(ours.shape, t.info.shape.as_slice());
        assert_eq!(ours.dtype, t.info.dtype);
    }
    assert_eq!(
        src.resident_names().count(),
        resident_tensors(&ckpt, &naming).count()
    );
    let experts = expert_sources(&ckpt, &naming).unwrap();
    let layer = experts[0].layer as usize;
    let want: Vec<usize> = experts
        .iter()
        .filter(|e| e.layer as usize == layer)
        .map(|e| e.expert as usize)
        .collect();
    let mut got = Vec::new();
    src.with_experts(layer, &want, &mut |e, view: &ExpertView<'_>| {
        let source = experts
            .iter()
            .find(|x| x.layer as usize == layer && x.expert as usize == e)
            .unwrap();
        assert_eq!(view.parts().len(), source.parts.len());
        for p in &source.parts {
            let ours = view.part(&p.part).unwrap();
            assert_eq!(
                ours.bytes,
                ckpt.slice(p.file, p.offset, p.len),
                "{}",
                p.part
            );
            assert_eq!(ours.shape, p.shape.as_slice());
        }
        got.push(e);
        Ok(())
    })
    .unwrap();
    got.sort_unstable();
    assert_eq!(got, want);
}

fn expect_expert_read(err: InferenceError, layer: usize, expert: usize) -> StorageError {
    let msg = err.to_string();
    match err {
        InferenceError::ExpertRead {
            layer: l,
            expert: e,
            source,
        } => {
            assert_eq!((l, e), (layer, expert), "{msg}");
            assert!(
                msg.contains(&format!("layer {layer} expert {expert}")),
                "{msg}"
            );
            *source
        }
        other => panic!("expected ExpertRead, got {other:?}"),
    }
}

/// Drive-relative location of the first byte of record `id` in layout `dirs`.
fn record_location(dirs: &[PathBuf], id: &RecordId) -> (String, u64) {
    let m = deltafin_storage::manifest::Manifest::load(&dirs[0]).unwrap();
    let r = m.records.iter().find(|r| &r.id == id).unwrap();
    let piece = m.placement().pieces(r.offset, align_up(r.len))[0];
    (
        dirs[piece.drive].join("data.bin").display().to_string(),
        piece.file_offset,
    )
}

fn faulty(faults: Vec<Fault>, hash_check: HashCheck) -> LayoutSourceOptions {
    LayoutSourceOptions {
        hash_check,
        backend: Arc::new(FaultyBackend::new(
            Arc::new(PosixBackend::default()),
            faults,
        )),
        ..options()
    }
}

#[test]
fn read_errors_name_layer_and_expert() {
    let (_tmp, dirs) = lay_out("deepseek_v3_a", Mode::Stripe, 3, 8192);
    let (layer, expert) = (2usize, 5usize);
    let id = RecordId::Expert {
        layer: layer as u32,
        expert: expert as u32,
    };
    let (path, offset) = record_location(&dirs, &id);
    let mut noop = |_: usize, _: &ExpertView<'_>| Ok(());

    // I/O error on the drive holding the record's first piece.
    let opts = faulty(
        vec![Fault::Eio {
            path_contains: path.clone(),
            offset: offset + 100,
        }],
        HashCheck::Off,
    );
    let src = LayoutSource::open(&dirs[0], &opts).unwrap();
    let err = src
        .with_experts(layer, &[1, expert, 7], &mut noop)
        .unwrap_err();
    let source = expect_expert_read(err, layer, expert);
    assert!(matches!(source, StorageError::Read { .. }), "{source:?}");
    // Other experts of the layer still read fine afterwards.
    src.with_experts(layer, &[1, 7], &mut noop).unwrap();

    // A flipped byte is caught by the hash check.
    let opts = faulty(
        vec![Fault::FlipByte {
            path_contains: path,
            offset: offset + 10,
        }],
        HashCheck::All,
    );
    let src = LayoutSource::open(&dirs[0], &opts).unwrap();
    let err = src.with_experts(layer, &[expert], &mut noop).unwrap_err();
    let source = expect_expert_read(err, layer, expert);
    assert!(
        matches!(source, StorageError::HashMismatch { .. }),
        "{source:?}"
    );

    // An expert the layout does not hold.
    let src = LayoutSource::open(&dirs[0], &options()).unwrap();
    match src.with_experts(layer, &[3, 99], &mut noop) {
        Err(InferenceError::MissingExpert {
            layer: l,
            expert: 99,
            ..
        }) => assert_eq!(l, layer),
        other => panic!("{other:?}"),
    }
    match src.with_experts(0, &[0], &mut noop) {
        Err(InferenceError::MissingExpert {
            layer: 0,
            expert: 0,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }

    // An error from the callback comes back unchanged and the source stays usable.
    let err = src
        .with_experts(layer, &[1, 2, 3], &mut |_, _: &ExpertView<'_>| {
            Err(InferenceError::InvalidArgument("stop".into()))
        })
        .unwrap_err();
    assert!(matches!(err, InferenceError::InvalidArgument(ref s) if s == "stop"));
    src.with_experts(layer, &[1, 2, 3], &mut noop).unwrap();
}

#[test]
fn resident_read_errors_and_bad_paths() {
    let (_tmp, dirs) = lay_out("qwen3_moe_a", Mode::Replicate, 2, 8192);
    let id = RecordId::Resident {
        group: "model.embed_tokens.weight".into(),
    };
    // Replicate: any drive may serve the read, so corrupt the byte on both.
    let (_, offset) = record_location(&dirs, &id);
    let opts = faulty(
        vec![Fault::FlipByte {
            path_contains: "data.bin".into(),
            offset: offset + 3,
        }],
        HashCheck::All,
    );
    match LayoutSource::open(&dirs[0], &opts) {
        Err(e @ InferenceError::ResidentRead { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("model.embed_tokens.weight"), "{msg}");
        }
        other => panic!("{other:?}"),
    }

    // Not a layout.
    let err = LayoutSource::open(Path::new("/nonexistent/layout"), &options()).unwrap_err();
    assert!(matches!(err, InferenceError::Storage(_)), "{err:?}");
}

/// Prefetch is gated on measured prediction precision: accurate predictions keep producing
/// prefetch reads; once predictions keep missing, no more prefetch reads are issued, and good
/// predictions turn it back on.
#[test]
fn prefetch_gate_follows_measured_precision() {
    use deltafin_inference::WeightSource;
    let (_tmp, dirs) = lay_out("deepseek_v3_a", Mode::Stripe, 2, 8192);
    let src = LayoutSource::open(&dirs[0], &options()).unwrap();
    // A small cache (8 of the 48 expert records) so reads keep happening.
    src.set_expert_memory_cap(8 * 12288);
    let mut sink = |_: usize, _: &deltafin_inference::ExpertView<'_>| Ok(());
    let round = |src: &LayoutSource,
                 predict: &[usize],
                 actual: &[usize],
                 sink: &mut dyn FnMut(
        usize,
        &deltafin_inference::ExpertView<'_>,
    ) -> deltafin_inference::Result<()>| {
        for layer in 1..4 {
            src.prefetch(layer, predict);
            src.with_experts(layer, actual, sink).unwrap();
        }
    };
    for i in 0..6 {
        let e = [i % 16, (i + 5) % 16];
        round(&src, &e, &e, &mut sink);
    }
    let good = src.stats().fetch;
    assert!(
        good.prefetch_reads > 0 && good.prefetch_gated == 0,
        "{good:?}"
    );
    for i in 0..12 {
        round(
            &src,
            &[(i + 8) % 16, (i + 9) % 16],
            &[i % 16, (i + 3) % 16],
            &mut sink,
        );
    }
    let bad = &src.stats().fetch - &good;
    assert!(
        bad.prefetch_gated > 0,
        "wrong predictions must close the gate: {bad:?}"
    );
    let before = src.stats().fetch;
    for _ in 0..6 {
        round(&src, &[0, 1], &[0, 1], &mut sink);
    }
    let after = &src.stats().fetch - &before;
    assert!(
        after.prefetch_gated > 0,
        "still gated until the average recovers: {after:?}"
    );
    for i in 0..30 {
        let e = [(i * 3) % 16, (i * 3 + 1) % 16];
        round(&src, &e, &e, &mut sink);
    }
    let reopened = src.stats().fetch;
    let last = {
        let e = [7, 9];
        let b = src.stats().fetch;
        round(&src, &e, &e, &mut sink);
        &src.stats().fetch - &b
    };
    assert!(
        last.prefetch_reads + last.prefetch_hits + last.cache_hits > 0 && last.prefetch_gated == 0,
        "accurate predictions reopen the gate: {last:?} {reopened:?}"
    );
}

/// `Model::load_owned` drops the layout's copy of the resident weights after building the model:
/// the model still matches transformers, the source no longer serves resident tensors, and the
/// snapshot identity equals that of a model loaded the ordinary way.
#[test]
fn load_owned_releases_the_resident_copy() {
    for name in ["deepseek_v3_a", "qwen3_moe_a"] {
        let (_tmp, dirs) = lay_out(name, Mode::Stripe, 2, 8192);
        let r = Reference::open(&fixture_dir(name).join("reference.safetensors"));
        let kept = Arc::new(LayoutSource::open(&dirs[0], &options()).unwrap());
        let ordinary = Model::load(kept.clone()).unwrap();
        assert!(kept.tensor("model.norm.weight").is_ok());

        let src = LayoutSource::open(&dirs[0], &options()).unwrap();
        let (model, src) = Model::load_owned(src).unwrap();
        assert!(
            src.tensor("model.norm.weight").is_err(),
            "{name}: resident copy released"
        );
        assert!(src.stats().resident_records > 0);
        check_model(&format!("{name} load_owned"), &model, &r);
        assert_eq!(model.weights_digest(), ordinary.weights_digest(), "{name}");
    }
}

/// A mispredicted next-layer prefetch still in flight must not hold the budget that the same
/// layer's demand reads need: with room for one record, a pending prefetch of expert 3 of layer
/// 1 and a demand for expert 5 of layer 1, the prefetch is cancelled and the demand served
/// (it used to fail with `ExpertBudget`, seen after `--load-session` under a tight budget).
#[test]
fn pending_mispredicted_prefetch_yields_the_budget() {
    let (_tmp, dirs) = lay_out("deepseek_v3_a", Mode::Stripe, 1, 8192);
    let opts = LayoutSourceOptions {
        // Slow reads keep the prefetch in flight when the demand arrives.
        backend: Arc::new(FaultyBackend::new(
            Arc::new(PosixBackend::default()),
            vec![Fault::Latency(std::time::Duration::from_millis(150))],
        )),
        // Many reads at once so that loading the resident weights stays quick.
        threads_per_drive: 16,
        resident_in_flight: 64,
        ..options()
    };
    let src = LayoutSource::open(&dirs[0], &opts).unwrap();
    let manifest = src.manifest();
    let biggest = manifest
        .records
        .iter()
        .filter(|r| matches!(r.id, RecordId::Expert { .. }))
        .map(|r| align_up(r.len))
        .max()
        .unwrap();
    src.set_expert_memory_cap(biggest);
    src.prefetch(1, &[3]);
    let mut got = Vec::new();
    src.with_experts(1, &[5], &mut |e: usize, _: &ExpertView<'_>| {
        got.push(e);
        Ok(())
    })
    .unwrap();
    assert_eq!(got, vec![5]);
}
