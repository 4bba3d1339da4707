//! `deltafin bench io`: read expert records the way decoding does (k experts of a random MoE
//! layer at a time, the next layer's batch already queued, as with prefetch) and compare with
//! fio doing reads of the same size at the same total queue depth on the same files.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::Context;
use deltafin_storage::bench::{ReadBench, ReadMeasure};
use deltafin_storage::engine::HashCheck;
use serde_json::json;

use crate::util::{human, machine, parse_seconds, parse_size};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Pattern {
    /// k random experts of a random layer per batch.
    Expert,
    /// Every record in layout order.
    Sequential,
}

#[derive(clap::Args, Debug)]
pub struct BenchIoArgs {
    /// Any drive's copy of the manifest, or the layout folder holding it.
    pub layout: PathBuf,
    #[arg(long, value_enum, default_value = "expert")]
    pub pattern: Pattern,
    #[arg(long, default_value = "10", value_parser = parse_seconds)]
    pub seconds: f64,
    /// Ours and fio alternate in this many rounds (of seconds/rounds each, at least 1 s for fio).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Experts per batch (default: the model's num_experts_per_tok).
    #[arg(long)]
    pub k: Option<usize>,
    /// Batches in flight (2 = the current layer plus a prefetched next layer).
    #[arg(long, default_value_t = 2)]
    pub batches_in_flight: usize,
    #[arg(long, default_value_t = 4)]
    pub threads_per_drive: usize,
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub buffer_cap: u64,
    #[arg(long, default_value = "off")]
    pub hash_check: HashCheck,
    /// Skip the fio comparison.
    #[arg(long)]
    pub no_fio: bool,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// fio with the same read size and total queue depth on the same files; returns (bytes, seconds, command).
fn run_fio(
    files: &[PathBuf],
    bs: u64,
    jobs_per_file: usize,
    secs: f64,
    pattern: Pattern,
) -> anyhow::Result<(f64, f64, String)> {
    let mut cmd = Command::new("fio");
    cmd.args([
        "--output-format=json",
        "--direct=1",
        "--ioengine=psync",
        "--time_based",
        "--norandommap",
    ]);
    cmd.arg(format!(
        "--rw={}",
        if pattern == Pattern::Expert {
            "randread"
        } else {
            "read"
        }
    ));
    cmd.arg(format!("--bs={bs}"));
    cmd.arg(format!("--runtime={}", secs.ceil().max(1.0) as u64));
    for (i, f) in files.iter().enumerate() {
        cmd.arg(format!("--name=drive{i}"));
        cmd.arg(format!("--filename={}", f.display()));
        cmd.arg(format!("--numjobs={jobs_per_file}"));
    }
    let line = format!("{cmd:?}").replace('"', "");
    let out = cmd.output().context("running fio")?;
    if !out.status.success() {
        anyhow::bail!("fio failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("parsing fio's JSON")?;
    let jobs = v["jobs"].as_array().context("fio JSON has no jobs")?;
    let mut bytes = 0f64;
    let mut ms = 0f64;
    for j in jobs {
        bytes += j["read"]["io_bytes"].as_f64().unwrap_or(0.0);
        ms = f64::max(ms, j["read"]["runtime"].as_f64().unwrap_or(0.0));
    }
    Ok((bytes, ms / 1000.0, line))
}

pub fn run(a: &BenchIoArgs) -> anyhow::Result<()> {
    let bench = ReadBench::open(&a.layout, a.threads_per_drive, a.buffer_cap, a.hash_check)
        .with_context(|| format!("opening layout {}", a.layout.display()))?;
    if !bench.direct_io() {
        eprintln!("note: a drive's filesystem refused O_DIRECT; reading through the page cache with posix_fadvise(DONTNEED)");
    }
    let manifest = bench.manifest().clone();
    let dirs = bench.dirs().to_vec();
    let k = a.k.unwrap_or_else(|| {
        manifest
            .config
            .get("num_experts_per_tok")
            .and_then(|v| v.as_u64())
            .unwrap_or(8) as usize
    });
    let record_len = bench.expert_record_len();
    let read_size = bench.read_size();
    // Ours and fio take turns in short rounds, so a drive whose speed drifts during the run
    // (host-cached virtual disks, SSD caches filling) affects both sides alike.
    // fio refuses a file smaller than one read (a tiny model leaves a stripe's drive empty):
    // it reads the drives that hold at least that much.
    let fio_files: Vec<PathBuf> = bench
        .data_files()
        .into_iter()
        .filter(|f| std::fs::metadata(f).is_ok_and(|m| m.len() >= read_size))
        .collect();
    let with_fio = !a.no_fio && which("fio").is_some() && !fio_files.is_empty();
    let rounds = a.rounds.max(1);
    let per_round = (a.seconds / rounds as f64).max(if with_fio { 1.0 } else { 0.1 });
    let mut m = ReadMeasure::default();
    let (mut fio_bytes, mut fio_secs, mut fio_line) = (0.0, 0.0, String::new());
    for r in 0..rounds {
        let dur = Duration::from_secs_f64(per_round);
        let seed = a.seed.wrapping_add(r as u64);
        let mi = match a.pattern {
            Pattern::Expert => bench.experts(k, a.batches_in_flight, dur, seed)?,
            Pattern::Sequential => bench.sequential(dur)?,
        };
        m += &mi;
        if with_fio {
            let (b, s, line) = run_fio(
                &fio_files,
                read_size,
                a.threads_per_drive,
                per_round,
                a.pattern,
            )?;
            fio_bytes += b;
            fio_secs += s;
            fio_line = line;
        }
    }
    let stats = bench.drive_stats();
    drop(bench);
    let ours = m.bytes as f64 / m.secs;
    let fio = with_fio.then(|| (fio_bytes / fio_secs.max(1e-9), fio_line));
    let report = json!({
        "bench": "io",
        "pattern": format!("{:?}", a.pattern).to_lowercase(),
        "layout": manifest.name,
        "mode": manifest.mode.to_string(),
        "drives": dirs.len(),
        "stripe_unit": manifest.stripe_unit,
        "record_bytes": record_len,
        "k": k,
        "batches_in_flight": a.batches_in_flight,
        "threads_per_drive": a.threads_per_drive,
        "seconds": m.secs,
        "rounds": rounds,
        "bytes": m.bytes,
        "records": m.records,
        "gb_per_s": ours / 1e9,
        "records_per_s": m.records as f64 / m.secs,
        "per_drive": stats.iter().enumerate().map(|(i, s)| json!({"drive": i, "bytes": s.bytes_read, "reads": s.reads, "busy_s": s.busy.as_secs_f64(), "direct_io": s.direct_io})).collect::<Vec<_>>(),
        "fio_gb_per_s": fio.as_ref().map(|f| f.0 / 1e9),
        "ratio_vs_fio": fio.as_ref().map(|f| ours / f.0),
        "fio_command": fio.as_ref().map(|f| f.1.clone()),
        "fio_read_size": read_size,
        "machine": machine(),
    });
    if a.json {
        println!("{report}");
    } else {
        println!("{} {:?}: {:.3} GB/s, {:.1} records/s ({} records of {}, k={k}, {} drive(s), {} mode, {:.1}s)", manifest.name, a.pattern, ours / 1e9, m.records as f64 / m.secs, m.records, human(record_len), dirs.len(), manifest.mode, m.secs);
        for (i, s) in stats.iter().enumerate() {
            println!(
                "  drive {i}: {} in {} reads, busy {:.2}s",
                human(s.bytes_read),
                s.reads,
                s.busy.as_secs_f64()
            );
        }
        match &fio {
            Some((f, _)) => println!(
                "  fio (bs {}, qd {} per drive): {:.3} GB/s; ours/fio = {:.2}",
                human(read_size),
                a.threads_per_drive,
                f / 1e9,
                ours / f
            ),
            None => println!("  fio not run (not installed or --no-fio)"),
        }
    }
    Ok(())
}

fn which(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(bin))
            .find(|p| p.is_file())
    })
}
