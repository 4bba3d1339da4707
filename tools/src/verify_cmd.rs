//! `deltafin verify`.

use std::path::PathBuf;

use anyhow::{bail, Context};
use deltafin_storage::layout_repair::repair_layout;
use deltafin_storage::verify::verify_layout;

use crate::progress::Bar;
use crate::util::{human, parse_size};

#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// Any drive's copy of the manifest, or the layout folder holding it.
    pub layout: PathBuf,
    #[arg(long, default_value_t = 4)]
    pub threads_per_drive: usize,
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub buffer_cap: u64,
    /// Mirrors: rewrite every bad or missing part of every drive (data units, unit hashes,
    /// manifest copies) from good copies, then verify again. Stripes: their manifests and unit
    /// hashes are repaired, bad data is reported (there is no second copy of it).
    #[arg(long)]
    pub repair: bool,
    #[arg(long, short)]
    pub quiet: bool,
}

pub fn run(a: &VerifyArgs) -> anyhow::Result<()> {
    if a.repair {
        repair(a)?;
    }
    let (manifest, dirs, report) = verify_layout(
        &a.layout,
        a.threads_per_drive,
        a.buffer_cap,
        &Bar::new(a.quiet),
    )
    .with_context(|| format!("verifying {}", a.layout.display()))?;
    println!(
        "layout {} ({} mode, {} drive(s)): {} stripe units, {} records checked in {:.2}s",
        manifest.name,
        manifest.mode,
        dirs.len(),
        report.units_checked,
        report.records_checked,
        report.elapsed.as_secs_f64()
    );
    for d in &report.drives {
        let busy = d.busy.as_secs_f64();
        println!(
            "  drive {} {}: {} read, {}/s",
            d.index,
            d.file.display(),
            human(d.bytes),
            human((d.bytes as f64 / report.elapsed.as_secs_f64().max(1e-9)) as u64)
        );
        let _ = busy;
    }
    if report.mismatches.is_empty() {
        println!("OK: every hash matches");
        return Ok(());
    }
    for m in &report.mismatches {
        println!("MISMATCH {m}");
    }
    bail!(
        "{} mismatch(es) in layout {}",
        report.mismatches.len(),
        manifest.name
    )
}

/// `--repair`: make the drives whole from good copies, then the normal verify runs.
fn repair(a: &VerifyArgs) -> anyhow::Result<()> {
    let r = repair_layout(&a.layout, &Bar::new(a.quiet))
        .with_context(|| format!("repairing {}", a.layout.display()))?;
    for d in &r.manifests_rewritten {
        println!("REPAIRED drive {d}: manifest copy rewritten");
    }
    for d in &r.unit_files_rewritten {
        println!("REPAIRED drive {d}: unit hash file rewritten");
    }
    for d in &r.data_files_fixed {
        println!("REPAIRED drive {d}: data file recreated or extended");
    }
    for (d, u, from) in &r.units_repaired {
        println!("REPAIRED drive {d}: stripe unit {u} rewritten from drive {from}");
    }
    for u in &r.unrepairable {
        println!("UNREPAIRABLE {u}");
    }
    println!(
        "repair: {} stripe units scanned in {:.2}s, {} rewritten, {} unrepairable",
        r.units_checked,
        r.elapsed.as_secs_f64(),
        r.units_repaired.len(),
        r.unrepairable.len()
    );
    if !r.unrepairable.is_empty() {
        bail!(
            "{} part(s) could not be repaired (see UNREPAIRABLE above)",
            r.unrepairable.len()
        );
    }
    Ok(())
}
