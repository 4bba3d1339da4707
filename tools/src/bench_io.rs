//! `deltafin bench io`: read expert records the way decoding does (k experts of a random MoE
//! layer at a time, the next layer's batch already queued, as with prefetch) and compare with
//! fio doing reads of the same size at the same total queue depth on the same files.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use deltafin_storage::engine::{Engine, HashCheck, Lane};
use deltafin_storage::manifest::{RecordId, DATA_FILE};
use serde_json::json;

use crate::util::{human, machine, open_engine, parse_size};

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
    #[arg(long, default_value_t = 10.0)]
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

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

struct Measured {
    bytes: u64,
    records: u64,
    secs: f64,
}

fn run_expert(
    engine: &Engine,
    layers: &[Vec<usize>],
    k: usize,
    inflight: usize,
    dur: Duration,
    seed: u64,
) -> anyhow::Result<Measured> {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut queue = VecDeque::new();
    let (mut bytes, mut records) = (0u64, 0u64);
    let start = Instant::now();
    loop {
        while queue.len() < inflight.max(1) && start.elapsed() < dur {
            let layer = &layers[rng.below(layers.len())];
            let mut pick: Vec<usize> = Vec::with_capacity(k);
            while pick.len() < k.min(layer.len()) {
                let e = layer[rng.below(layer.len())];
                if !pick.contains(&e) {
                    pick.push(e);
                }
            }
            let (rx, _t) = engine.fetch(&pick, Lane::Demand)?;
            queue.push_back((rx, pick.len()));
        }
        let Some((rx, n)) = queue.pop_front() else {
            break;
        };
        for c in rx.iter().take(n) {
            let l = c.result?;
            bytes += l.buf.len() as u64;
            records += 1;
        }
    }
    Ok(Measured {
        bytes,
        records,
        secs: start.elapsed().as_secs_f64(),
    })
}

fn run_sequential(engine: &Engine, dur: Duration) -> anyhow::Result<Measured> {
    let n = engine.manifest().records.len();
    let window = engine.drive_count() * engine.threads_per_drive() * 2;
    let (tx, rx) = crossbeam_channel::bounded(window + 1);
    let (mut bytes, mut records, mut next, mut inflight) = (0u64, 0u64, 0usize, 0usize);
    let start = Instant::now();
    loop {
        while inflight < window && start.elapsed() < dur {
            engine.submit(
                deltafin_storage::engine::Target::Record(next % n),
                Lane::Demand,
                0,
                tx.clone(),
                None,
            )?;
            next += 1;
            inflight += 1;
        }
        if inflight == 0 {
            break;
        }
        let c: deltafin_storage::engine::Completion = rx.recv()?;
        inflight -= 1;
        bytes += c.result?.buf.len() as u64;
        records += 1;
    }
    Ok(Measured {
        bytes,
        records,
        secs: start.elapsed().as_secs_f64(),
    })
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
    let (manifest, dirs, engine) =
        open_engine(&a.layout, a.threads_per_drive, a.buffer_cap, a.hash_check)?;
    let mut layers: Vec<Vec<usize>> = Vec::new();
    let mut last_layer = None;
    for (i, r) in manifest.records.iter().enumerate() {
        if let RecordId::Expert { layer, .. } = r.id {
            if last_layer != Some(layer) {
                layers.push(Vec::new());
                last_layer = Some(layer);
            }
            if let Some(l) = layers.last_mut() {
                l.push(i);
            }
        }
    }
    anyhow::ensure!(
        !layers.is_empty(),
        "layout {} has no routed experts",
        manifest.name
    );
    let k = a.k.unwrap_or_else(|| {
        manifest
            .config
            .get("num_experts_per_tok")
            .and_then(|v| v.as_u64())
            .unwrap_or(8) as usize
    });
    let record_len = manifest.records[layers[0][0]].len;
    let read_size = manifest
        .stripe_unit
        .min(deltafin_storage::stripe::align_up(record_len));
    // Ours and fio take turns in short rounds, so a drive whose speed drifts during the run
    // (host-cached virtual disks, SSD caches filling) affects both sides alike.
    let with_fio = !a.no_fio && which("fio").is_some();
    let rounds = a.rounds.max(1);
    let per_round = (a.seconds / rounds as f64).max(if with_fio { 1.0 } else { 0.1 });
    let files: Vec<PathBuf> = dirs.iter().map(|d| d.join(DATA_FILE)).collect();
    let mut m = Measured {
        bytes: 0,
        records: 0,
        secs: 0.0,
    };
    let (mut fio_bytes, mut fio_secs, mut fio_line) = (0.0, 0.0, String::new());
    for r in 0..rounds {
        let dur = Duration::from_secs_f64(per_round);
        let seed = a.seed.wrapping_add(r as u64);
        let mi = match a.pattern {
            Pattern::Expert => run_expert(&engine, &layers, k, a.batches_in_flight, dur, seed)?,
            Pattern::Sequential => run_sequential(&engine, dur)?,
        };
        m.bytes += mi.bytes;
        m.records += mi.records;
        m.secs += mi.secs;
        if with_fio {
            let (b, s, line) =
                run_fio(&files, read_size, a.threads_per_drive, per_round, a.pattern)?;
            fio_bytes += b;
            fio_secs += s;
            fio_line = line;
        }
    }
    let stats = engine.stats();
    drop(engine);
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
