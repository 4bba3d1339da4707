//! `deltafin layout`: plan records, check space, write every drive, write manifests last.
//!
//! Order of operations, so that an interrupted run never looks complete, can be rerun, and
//! never loses the layout it replaces:
//! 1. lock the name on every drive (a concurrent `layout` or a reader fails at once: [`lock`]);
//! 2. plan, check space and that every drive is writable; refuse an existing layout unless
//!    forced (see [`replace`]: the new layout is written beside the old one and swapped in
//!    when complete, or in place only after every check has passed);
//! 3. write `data.bin` on every drive (one writer thread per drive), fsync;
//! 4. write `units.blake3`, then `manifest.json` on every drive, each via temp+fsync+rename;
//! 5. swap the new folders in.
//!
//! Files: [`plan`] (records and their places), [`space`] (free space), [`replace`] (staging
//! and the swap), [`writer`] (the logical space onto the drives), [`records`] (each record's
//! bytes), [`transform`] (layout-time rewrites of expert records), [`open`] (reading a layout
//! back from any drive), [`agree`] (the drives' manifest copies agree), [`progress`].
//!
//! [`lock`]: crate::lock

pub mod agree;
pub mod open;
pub mod plan;
pub mod progress;
mod records;
mod replace;
pub mod space;
pub mod transform;
mod writer;

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::path::PathBuf;
use std::sync::Arc;

pub use open::{open_layout, open_layout_degraded};
pub use plan::{plan, plan_with, Plan};
pub use progress::{NoProgress, Progress};
pub use space::free_space;
pub use transform::{ExpertTransform, PartSpec};

use crate::checkpoint::Checkpoint;
use crate::error::{Result, StorageError};
use crate::layout::records::write_records;
use crate::layout::replace::remove_stale_staging;
use crate::layout::writer::{spawn_writer, DriveWriter, LogicalWriter};
use crate::lock::{LayoutLock, LockKind};
use crate::manifest::{
    write_atomic, DriveEntry, Manifest, RecordEntry, DATA_FILE, MANIFEST_FILE, MANIFEST_FORMAT,
    MANIFEST_VERSION, UNIT_HASHES_FILE,
};
use crate::naming::ExpertNaming;
use crate::stripe::{Mode, Placement};

/// Default stripe unit (see README: measured with `benches/unit_sweep.sh`).
pub const DEFAULT_STRIPE_UNIT: u64 = 512 * 1024;

/// What to lay out where.
#[derive(Clone, Debug)]
pub struct LayoutOptions {
    pub name: String,
    pub drives: Vec<PathBuf>,
    pub mode: Mode,
    pub stripe_unit: u64,
    pub force: bool,
    /// Which tensors are routed experts (from the model family).
    pub naming: ExpertNaming,
    /// Rewrites every routed expert record while laying out (e.g. quantizing it); `None`
    /// copies the checkpoint's bytes.
    pub transform: Option<Arc<dyn ExpertTransform>>,
    /// Bytes to leave free on every drive (`layout --keep-free`): a layout that would leave
    /// less is refused before anything is written.
    pub keep_free: u64,
}

/// Lay `ckpt` out according to `opts`. Returns the manifest (as written on drive 0).
pub fn write_layout(
    ckpt: &Checkpoint,
    opts: &LayoutOptions,
    progress: &dyn Progress,
) -> Result<Manifest> {
    let placement = check_options(opts)?;
    let final_dirs: Vec<PathBuf> = canonical_drives(&opts.drives)?
        .iter()
        .map(|d| d.join(&opts.name))
        .collect();

    // 1. the name, locked on every drive for the whole run
    let _lock = LayoutLock::acquire(&final_dirs, LockKind::Exclusive)?;
    remove_stale_staging(&final_dirs)?;

    // 2. everything that can fail before a byte is written
    let transform = opts.transform.as_deref();
    let config = match transform {
        Some(t) => t.config(&ckpt.config)?,
        None => ckpt.config.clone(),
    };
    let plan = plan_with(ckpt, &opts.naming, transform)?;
    let space = space::drive_space(&final_dirs, placement, &plan, opts.keep_free)?;
    let layout_id = random_id();
    let target = replace::prepare(final_dirs, opts.force, &space, &layout_id)?;

    let written = (|| -> Result<Manifest> {
        // 3. data
        let writers = create_data_files(&target.write_dirs, placement, plan.logical_len)?;
        progress.start(plan.logical_len, "laying out");
        let mut lw = LogicalWriter::new(placement, writers, plan.logical_len, progress);
        let entries = write_records(ckpt, &plan, transform, &mut lw)?;
        lw.pad_to(plan.logical_len)?;
        let unit_hashes = lw.finish()?;
        progress.finish();

        // 4. hashes and manifests, last (naming the final folders)
        let manifest = build_manifest(
            ckpt,
            opts,
            &target.final_dirs,
            placement,
            plan,
            entries,
            config,
            &unit_hashes,
            layout_id.clone(),
        )?;
        write_manifests(manifest, &target.write_dirs, &unit_hashes)
    })();
    match written {
        // 5. swap in
        Ok(m) => {
            target.commit()?;
            Ok(m)
        }
        Err(e) => {
            target.abandon();
            Err(e)
        }
    }
}

/// A plain layout name and a valid placement over at least one drive.
fn check_options(opts: &LayoutOptions) -> Result<Placement> {
    if opts.drives.is_empty() {
        return Err(StorageError::InvalidArgument(
            "give at least one --drive".into(),
        ));
    }
    if opts.name.is_empty() || opts.name.contains('/') || opts.name == "." || opts.name == ".." {
        return Err(StorageError::InvalidArgument(format!(
            "layout name `{}` must be a plain folder name",
            opts.name
        )));
    }
    Placement::new(opts.mode, opts.drives.len(), opts.stripe_unit)
        .map_err(StorageError::InvalidArgument)
}

/// Each drive folder, canonical: it must exist, be a directory and be given once.
fn canonical_drives(drives: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut canon = Vec::new();
    for (i, d) in drives.iter().enumerate() {
        let c = fs::canonicalize(d).map_err(|e| StorageError::MissingDrive {
            drive: i,
            path: d.clone(),
            reason: e.to_string(),
        })?;
        if !c.is_dir() {
            return Err(StorageError::MissingDrive {
                drive: i,
                path: d.clone(),
                reason: "not a directory".into(),
            });
        }
        if canon.contains(&c) {
            return Err(StorageError::InvalidArgument(format!(
                "drive {} is given twice",
                d.display()
            )));
        }
        canon.push(c);
    }
    Ok(canon)
}

/// Create every drive's `data.bin` at its final length, reserving the space up front so a
/// full disk fails now, not half-way, and start its writer thread.
fn create_data_files(
    dirs: &[PathBuf],
    placement: Placement,
    logical_len: u64,
) -> Result<Vec<DriveWriter>> {
    let mut writers = Vec::new();
    for (i, dir) in dirs.iter().enumerate() {
        fs::create_dir_all(dir).map_err(|e| StorageError::io(dir, "create layout folder", e))?;
        let path = dir.join(DATA_FILE);
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&path)
            .map_err(|e| StorageError::io(&path, "create", e))?;
        let len = placement.drive_file_len(i, logical_len);
        if len > 0 {
            space::reserve(&file, &path, i, len)?;
            file.set_len(len)
                .map_err(|e| StorageError::io(&path, "set_len", e))?;
        }
        writers.push(spawn_writer(i, path, file));
    }
    Ok(writers)
}

/// The manifest as drive 0 holds it.
#[allow(clippy::too_many_arguments)]
fn build_manifest(
    ckpt: &Checkpoint,
    opts: &LayoutOptions,
    dirs: &[PathBuf],
    placement: Placement,
    plan: Plan,
    records: Vec<RecordEntry>,
    config: serde_json::Value,
    unit_hashes: &[u8],
    layout_id: String,
) -> Result<Manifest> {
    let drives: Vec<DriveEntry> = dirs
        .iter()
        .enumerate()
        .map(|(i, dir)| DriveEntry {
            index: i,
            path: dir.clone(),
            drive_id: random_id(),
            data_len: placement.drive_file_len(i, plan.logical_len),
        })
        .collect();
    let mut meta = BTreeMap::new();
    meta.insert("source".to_string(), ckpt.dir.display().to_string());
    meta.insert(
        "writer".to_string(),
        format!("deltafin {}", env!("CARGO_PKG_VERSION")),
    );
    meta.insert(
        "resident_bytes".to_string(),
        plan.resident_bytes.to_string(),
    );
    meta.insert("expert_bytes".to_string(), plan.expert_bytes.to_string());
    if let Some(t) = &opts.transform {
        meta.extend(t.meta());
    }
    let manifest = Manifest {
        format: MANIFEST_FORMAT.into(),
        version: MANIFEST_VERSION,
        name: opts.name.clone(),
        layout_id,
        created_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        mode: opts.mode,
        stripe_unit: opts.stripe_unit,
        model_type: ckpt.model_type.clone(),
        config,
        drives,
        this_drive: 0,
        logical_len: plan.logical_len,
        unit_hashes_blake3: blake3::hash(unit_hashes).to_hex().to_string(),
        records,
        expert_templates: plan.templates,
        meta,
        content_hash: String::new(),
    };
    manifest.validate(&dirs[0].join(MANIFEST_FILE))?;
    Ok(manifest)
}

/// `units.blake3` on every drive, then every drive's manifest copy (each naming its drive).
fn write_manifests(
    mut manifest: Manifest,
    dirs: &[PathBuf],
    unit_hashes: &[u8],
) -> Result<Manifest> {
    for dir in dirs {
        write_atomic(&dir.join(UNIT_HASHES_FILE), unit_hashes)?;
    }
    for (i, dir) in dirs.iter().enumerate() {
        manifest.this_drive = i;
        manifest.store(dir)?;
    }
    manifest.this_drive = 0;
    Ok(manifest.sealed())
}

/// 128 random bits as hex (`/dev/urandom`, or a hash of the time and pid).
fn random_id() -> String {
    let mut bytes = [0u8; 16];
    let ok =
        File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes));
    if ok.is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let h = blake3::hash(format!("{t:?}{}", std::process::id()).as_bytes());
        bytes.copy_from_slice(&h.as_bytes()[..16]);
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
