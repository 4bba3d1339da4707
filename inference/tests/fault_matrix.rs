//! The fault-injection matrix (issue 13): through the swappable I/O backend, EIO, short reads,
//! stale (torn or misdirected) data, flipped bytes, a slow drive and a drive that disappears
//! mid-generation, on stripes and mirrors of 1-4 drives, with next-layer prefetch on and off.
//! Every case must end in the clean model's tokens or an error naming what failed - never
//! different tokens. A mirror of two or more drives must always give the clean tokens.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::fixture_dir;
use deltafin_inference::{generate, GenerateConfig, LayoutSource, LayoutSourceOptions, Model};
use deltafin_storage::backend::{Fault, FaultyBackend, PosixBackend};
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::engine::HashCheck;
use deltafin_storage::layout::{write_layout, LayoutOptions, NoProgress};
use deltafin_storage::manifest::{Manifest, RecordId};
use deltafin_storage::stripe::Mode;

const FIXTURE: &str = "deepseek_v3_a";
const NEW: usize = 16;

fn prompt() -> Vec<u32> {
    (0..12u32).map(|i| (i * 41 + 3) % 500 + 1).collect()
}

fn config(model: &Model) -> GenerateConfig {
    let mut c = GenerateConfig::for_model(model, NEW);
    c.stop_tokens.clear();
    c.prefill_chunk = 4;
    c
}

/// The clean tokens, from the model directory.
fn clean() -> Vec<u32> {
    let src = Arc::new(deltafin_inference::DirSource::open(&fixture_dir(FIXTURE)).unwrap());
    let model = Model::load(src).unwrap();
    generate(
        &model,
        &mut model.new_session(),
        &prompt(),
        &config(&model),
        &mut |_| true,
    )
    .unwrap()
    .tokens
}

struct Layout {
    _tmp: Vec<tempfile::TempDir>,
    drives: Vec<PathBuf>,
    manifest: Manifest,
}

fn lay_out(mode: Mode, n: usize) -> Layout {
    let ckpt = Checkpoint::open(&fixture_dir(FIXTURE)).unwrap();
    let tmp: Vec<_> = (0..n).map(|_| tempfile::tempdir().unwrap()).collect();
    let opts = LayoutOptions {
        name: "m".into(),
        drives: tmp.iter().map(|t| t.path().to_path_buf()).collect(),
        mode,
        stripe_unit: 8192,
        force: false,
        naming: deltafin_inference::family::expert_naming(&ckpt.config).unwrap(),
        transform: None,
        keep_free: 0,
    };
    let manifest = write_layout(&ckpt, &opts, &NoProgress).unwrap();
    let drives = manifest.drives.iter().map(|d| d.path.clone()).collect();
    Layout {
        _tmp: tmp,
        drives,
        manifest,
    }
}

/// File offsets on drive 0 holding routed-expert bytes (one per 4 KiB).
fn expert_offsets_on_drive0(m: &Manifest) -> Vec<u64> {
    let p = m.placement();
    let mut out = Vec::new();
    for r in m
        .records
        .iter()
        .filter(|r| matches!(r.id, RecordId::Expert { .. }))
    {
        for logical in (r.offset..r.offset + r.len).step_by(4096) {
            let (d, off) = match m.mode {
                Mode::Replicate => (0, logical),
                Mode::Stripe => {
                    let (d, base) = p.unit_location(logical / p.unit);
                    (d, base + logical % p.unit)
                }
            };
            if d == 0 {
                out.push(off);
            }
        }
    }
    out
}

/// The faults of one case, all on drive 0 except short reads; the drive goes away after
/// `gone_after` reads (mid-generation).
fn faults(kind: &str, drive0: &str, offsets: &[u64], gone_after: u64) -> Vec<Fault> {
    let on0 = |f: &dyn Fn(u64) -> Fault| offsets.iter().map(|&o| f(o)).collect::<Vec<_>>();
    let path = || drive0.to_string();
    match kind {
        "eio" => on0(&|o| Fault::Eio {
            path_contains: path(),
            offset: o,
        }),
        "short reads" => vec![Fault::ShortReads],
        "stale data" => on0(&|o| Fault::Stale {
            path_contains: path(),
            offset: o,
            shift: 4096,
        }),
        "flipped bytes" => on0(&|o| Fault::FlipByte {
            path_contains: path(),
            offset: o + 7,
        }),
        "slow drive" => vec![Fault::SlowPath {
            path_contains: path(),
            delay: Duration::from_millis(1),
        }],
        "drive gone" => vec![Fault::Gone {
            path_contains: path(),
            after_reads: gone_after,
        }],
        _ => unreachable!(),
    }
}

/// Reads a clean run makes: (after loading, after generating).
fn reads_of_a_clean_run(layout: &Layout) -> (u64, u64) {
    let backend = Arc::new(FaultyBackend::new(
        Arc::new(PosixBackend::default()),
        vec![],
    ));
    let reads = backend.reads.clone();
    let loaded = std::cell::Cell::new(0);
    run_with(layout, backend, true, &|| {
        loaded.set(reads.load(std::sync::atomic::Ordering::Relaxed))
    })
    .unwrap();
    (
        loaded.get(),
        reads.load(std::sync::atomic::Ordering::Relaxed),
    )
}

/// Generate over `layout` with `faults`: the tokens, or the error's text.
fn run(layout: &Layout, faults: Vec<Fault>, prefetch: bool) -> Result<Vec<u32>, String> {
    let backend = Arc::new(FaultyBackend::new(
        Arc::new(PosixBackend::default()),
        faults,
    ));
    run_with(layout, backend, prefetch, &|| {})
}

fn run_with(
    layout: &Layout,
    backend: Arc<FaultyBackend>,
    prefetch: bool,
    after_load: &dyn Fn(),
) -> Result<Vec<u32>, String> {
    let largest = layout.manifest.largest_expert_record();
    let opts = LayoutSourceOptions {
        threads_per_drive: 2,
        // A few experts' worth: experts are evicted and read again during the run.
        buffer_cap_bytes: largest * 12,
        hash_check: HashCheck::All,
        backend,
        ..LayoutSourceOptions::default()
    };
    let src = LayoutSource::open(&layout.drives[0], &opts).map_err(|e| e.to_string())?;
    let model = Model::load(Arc::new(src)).map_err(|e| e.to_string())?;
    after_load();
    model.set_next_layer_prefetch(prefetch);
    generate(
        &model,
        &mut model.new_session(),
        &prompt(),
        &config(&model),
        &mut |_| true,
    )
    .map(|o| o.tokens)
    .map_err(|e| e.to_string())
}

#[test]
fn every_fault_ends_in_the_clean_tokens_or_a_clear_error() {
    let want = clean();
    let kinds = [
        "eio",
        "short reads",
        "stale data",
        "flipped bytes",
        "slow drive",
        "drive gone",
    ];
    let mut table = Vec::new();
    for mode in [Mode::Stripe, Mode::Replicate] {
        for n in 1..=4 {
            let layout = lay_out(mode, n);
            let drive0 = layout.drives[0].display().to_string();
            let offsets = expert_offsets_on_drive0(&layout.manifest);
            // The drive goes away half-way through generation.
            let (loaded, total) = reads_of_a_clean_run(&layout);
            assert!(total > loaded + 10, "{mode} x{n}: {loaded} {total}");
            let gone_after = loaded + (total - loaded) / 2;
            for kind in kinds {
                for prefetch in [false, true] {
                    let got = run(
                        &layout,
                        faults(kind, &drive0, &offsets, gone_after),
                        prefetch,
                    );
                    let case = format!("{mode} x{n} {kind} prefetch {prefetch}");
                    match &got {
                        Ok(tokens) => assert_eq!(tokens, &want, "{case}: different tokens"),
                        Err(e) => {
                            // A clear error names the drive, file or record at fault.
                            assert!(
                                e.contains("drive")
                                    || e.contains("data.bin")
                                    || e.contains("expert"),
                                "{case}: unclear error: {e}"
                            );
                        }
                    }
                    // Faults that lose no data, and any fault on a mirror with another copy,
                    // must not stop generation.
                    let harmless = matches!(kind, "short reads" | "slow drive");
                    if harmless || (mode == Mode::Replicate && n >= 2) {
                        assert!(got.is_ok(), "{case}: {:?}", got.err());
                    }
                    table.push(format!(
                        "{case}: {}",
                        match &got {
                            Ok(_) => "clean tokens".to_string(),
                            Err(e) => format!("error: {}", e.chars().take(100).collect::<String>()),
                        }
                    ));
                }
            }
        }
    }
    eprintln!("{}", table.join("\n"));
    assert_eq!(table.len(), 2 * 4 * kinds.len() * 2);
}
