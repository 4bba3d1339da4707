//! `deltafin layout`: plan records, check space, write every drive, write manifests last.
//!
//! Order of operations, so that an interrupted run never looks complete and can be rerun:
//! 1. refuse if a manifest exists (unless forced; forced runs delete it first, durably);
//! 2. check free space on every drive;
//! 3. write `data.bin` on every drive (one writer thread per drive), fsync;
//! 4. write `units.blake3`, then `manifest.json` on every drive, each via temp+fsync+rename.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Sender};

use crate::checkpoint::Checkpoint;
use crate::error::{Result, StorageError};
use crate::manifest::{
    sync_dir, DriveEntry, ExpertTemplate, Manifest, RecordEntry, RecordId, RecordTensor, DATA_FILE,
    MANIFEST_FILE, MANIFEST_FORMAT, MANIFEST_VERSION, UNIT_HASHES_FILE,
};
use crate::safetensors::Dtype;
use crate::stripe::{align_up, Mode, Placement, ALIGN};

/// Default stripe unit (see README: measured with `benches/stripe_unit.sh`).
pub const DEFAULT_STRIPE_UNIT: u64 = 512 * 1024;

/// What to lay out where.
#[derive(Clone, Debug)]
pub struct LayoutOptions {
    pub name: String,
    pub drives: Vec<PathBuf>,
    pub mode: Mode,
    pub stripe_unit: u64,
    pub force: bool,
    /// Rewrites every routed expert record while laying out (e.g. quantizing it); `None`
    /// copies the checkpoint's bytes.
    pub transform: Option<Arc<dyn ExpertTransform>>,
}

/// Name, dtype and shape of one tensor inside an expert record (`gate_proj.weight`), and its
/// byte length.
#[derive(Clone, Debug, PartialEq)]
pub struct PartSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub len: u64,
}

impl PartSpec {
    /// A part whose length is its element count times the dtype size.
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: &[u64]) -> PartSpec {
        let len = shape.iter().product::<u64>() * dtype.size_bytes().unwrap_or(1);
        PartSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            len,
        }
    }
}

/// A rewrite of routed expert records applied while laying out (layout-time quantization).
///
/// [`plan`] asks [`ExpertTransform::parts`] for each expert's output tensors from the source
/// parts' names, dtypes and shapes alone (so record lengths are known before anything is
/// written); the writer then calls [`ExpertTransform::apply`] with each expert's bytes and
/// writes (and hashes) what it returns, which must have exactly those lengths.
pub trait ExpertTransform: Send + Sync + std::fmt::Debug {
    /// The parts a record holds after the transform, in record order.
    fn parts(&self, source: &[PartSpec]) -> Result<Vec<PartSpec>>;
    /// The bytes of each part [`Self::parts`] returned for `source`, in the same order.
    fn apply(&self, layer: u32, expert: u32, source: &[(&PartSpec, &[u8])])
        -> Result<Vec<Vec<u8>>>;
    /// The model config the manifest records (the source config goes in).
    fn config(&self, source: &serde_json::Value) -> Result<serde_json::Value>;
    /// Extra manifest `meta` entries, asked once every record is written.
    fn meta(&self) -> BTreeMap<String, String> {
        BTreeMap::new()
    }
}

/// Progress reports (the CLI maps them onto a progress bar).
pub trait Progress: Send + Sync {
    fn start(&self, _total_bytes: u64, _what: &str) {}
    fn advance(&self, _bytes: u64) {}
    fn finish(&self) {}
}

/// A progress sink that ignores everything.
#[derive(Debug, Default)]
pub struct NoProgress;
impl Progress for NoProgress {}

/// One source byte range feeding a record.
#[derive(Clone, Debug)]
struct Source {
    file: usize,
    offset: u64,
    len: u64,
}

#[derive(Clone, Debug)]
struct PlannedRecord {
    id: RecordId,
    offset: u64,
    len: u64,
    sources: Vec<Source>,
    tensors: Vec<RecordTensor>,
    /// Expert records rewritten by the transform: the source parts, in `sources` order.
    transform_from: Option<Vec<PartSpec>>,
}

/// The records and their logical placement, before anything is written.
#[derive(Debug)]
pub struct Plan {
    records: Vec<PlannedRecord>,
    templates: Vec<ExpertTemplate>,
    pub logical_len: u64,
    pub resident_bytes: u64,
    pub expert_bytes: u64,
    pub expert_records: usize,
}

/// Decide the record order: resident tensors first (one record each, file order), then every
/// layer's experts in (layer, expert) order so a layer's records sit together.
pub fn plan(ckpt: &Checkpoint) -> Result<Plan> {
    plan_with(ckpt, None)
}

/// [`plan`], with expert records rewritten by `transform` (lengths from its output parts).
pub fn plan_with(ckpt: &Checkpoint, transform: Option<&dyn ExpertTransform>) -> Result<Plan> {
    let mut records = Vec::new();
    let mut offset = 0u64;
    let mut resident_bytes = 0;
    for t in ckpt.resident() {
        let len = t.info.len;
        records.push(PlannedRecord {
            id: RecordId::Resident {
                group: t.info.name.clone(),
            },
            offset,
            len,
            sources: vec![Source {
                file: t.file,
                offset: t.info.offset,
                len,
            }],
            tensors: vec![RecordTensor {
                name: t.info.name.clone(),
                dtype: t.info.dtype.clone(),
                shape: t.info.shape.clone(),
                offset: 0,
                len,
            }],
            transform_from: None,
        });
        resident_bytes += len;
        offset += align_up(len.max(1));
    }
    let mut templates: Vec<ExpertTemplate> = Vec::new();
    let mut expert_bytes = 0;
    let experts = ckpt.experts()?;
    let expert_records = experts.len();
    for e in experts {
        let sources: Vec<Source> = e
            .parts
            .iter()
            .map(|p| Source {
                file: p.file,
                offset: p.offset,
                len: p.len,
            })
            .collect();
        let source_specs: Vec<PartSpec> = e
            .parts
            .iter()
            .map(|p| PartSpec {
                name: p.part.clone(),
                dtype: p.dtype.clone(),
                shape: p.shape.clone(),
                len: p.len,
            })
            .collect();
        let (out_specs, transform_from) = match transform {
            Some(t) => (t.parts(&source_specs)?, Some(source_specs)),
            None => (source_specs, None),
        };
        let mut tensors = Vec::new();
        let mut len = 0u64;
        for p in out_specs {
            // Each tensor starts 64-byte aligned inside the record so kernels can use aligned loads.
            len = len.div_ceil(64) * 64;
            tensors.push(RecordTensor {
                name: p.name,
                dtype: p.dtype,
                shape: p.shape,
                offset: len,
                len: p.len,
            });
            len += p.len;
        }
        match templates.last() {
            Some(t) if t.layer == e.layer => {
                if t.len != len || t.tensors != tensors {
                    return Err(StorageError::InvalidArgument(format!(
                        "layer {} expert {}: tensors differ from the layer's other experts",
                        e.layer, e.expert
                    )));
                }
            }
            _ => templates.push(ExpertTemplate {
                layer: e.layer,
                len,
                tensors: tensors.clone(),
            }),
        }
        records.push(PlannedRecord {
            id: RecordId::Expert {
                layer: e.layer,
                expert: e.expert,
            },
            offset,
            len,
            sources,
            tensors: Vec::new(),
            transform_from,
        });
        expert_bytes += len;
        offset += align_up(len.max(1));
    }
    Ok(Plan {
        records,
        templates,
        logical_len: offset,
        resident_bytes,
        expert_bytes,
        expert_records,
    })
}

/// Free bytes available to us on the filesystem holding `path`.
pub fn free_space(path: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        StorageError::InvalidArgument(format!("{}: path has a NUL byte", path.display()))
    })?;
    // SAFETY: statvfs is plain old data; zeroed is a valid value; c is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers for the call's duration.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(StorageError::io(
            path,
            "statvfs",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

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

enum WriteMsg {
    Chunk { offset: u64, data: Arc<Vec<u8>> },
}

struct DriveWriter {
    tx: Option<Sender<WriteMsg>>,
    handle: Option<JoinHandle<Result<()>>>,
}

fn spawn_writer(index: usize, path: PathBuf, file: File) -> DriveWriter {
    let (tx, rx) = bounded::<WriteMsg>(32);
    let handle = std::thread::spawn(move || -> Result<()> {
        for msg in rx {
            let WriteMsg::Chunk { offset, data } = msg;
            file.write_all_at(&data, offset)
                .map_err(|e| match e.raw_os_error() {
                    Some(libc::ENOSPC) => StorageError::InsufficientSpace {
                        drive: index,
                        path: path.clone(),
                        needed: offset + data.len() as u64,
                        available: offset,
                    },
                    _ => StorageError::Io {
                        path: path.clone(),
                        op: "write",
                        source: e,
                    },
                })?;
        }
        file.sync_all()
            .map_err(|e| StorageError::io(&path, "fsync", e))
    });
    DriveWriter {
        tx: Some(tx),
        handle: Some(handle),
    }
}

/// Streams the logical space to the drives, cutting it at stripe units, hashing units.
struct LogicalWriter<'a> {
    placement: Placement,
    writers: Vec<DriveWriter>,
    pos: u64,
    unit_hasher: blake3::Hasher,
    unit_hashes: Vec<u8>,
    progress: &'a dyn Progress,
}

impl LogicalWriter<'_> {
    fn write(&mut self, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            let within = self.pos % self.placement.unit;
            let take = ((self.placement.unit - within) as usize).min(data.len());
            let (chunk, rest) = data.split_at(take);
            self.unit_hasher.update(chunk);
            let (drive, base) = self.placement.unit_location(self.pos / self.placement.unit);
            let shared = Arc::new(chunk.to_vec());
            let targets: Vec<usize> = match self.placement.mode {
                Mode::Replicate => (0..self.writers.len()).collect(),
                Mode::Stripe => vec![drive],
            };
            for d in targets {
                self.send(d, base + within, shared.clone())?;
            }
            self.pos += take as u64;
            if self.pos.is_multiple_of(self.placement.unit) {
                self.close_unit();
            }
            self.progress.advance(take as u64);
            data = rest;
        }
        Ok(())
    }

    fn close_unit(&mut self) {
        let h = std::mem::take(&mut self.unit_hasher).finalize();
        self.unit_hashes.extend_from_slice(h.as_bytes());
    }

    fn send(&mut self, d: usize, offset: u64, data: Arc<Vec<u8>>) -> Result<()> {
        let w = &mut self.writers[d];
        let ok =
            w.tx.as_ref()
                .is_some_and(|tx| tx.send(WriteMsg::Chunk { offset, data }).is_ok());
        if ok {
            return Ok(());
        }
        // The writer stopped: surface its error.
        w.tx = None;
        match w.handle.take().map(|h| h.join()) {
            Some(Ok(Err(e))) => Err(e),
            _ => Err(StorageError::InvalidArgument(format!(
                "writer for drive {d} stopped"
            ))),
        }
    }

    fn pad_to(&mut self, target: u64) -> Result<()> {
        const ZEROS: [u8; ALIGN as usize] = [0; ALIGN as usize];
        while self.pos < target {
            let n = ((target - self.pos) as usize).min(ZEROS.len());
            self.write(&ZEROS[..n])?;
        }
        Ok(())
    }

    fn finish(mut self) -> Result<Vec<u8>> {
        if !self.pos.is_multiple_of(self.placement.unit) {
            self.close_unit();
        }
        let mut first_err = None;
        for w in &mut self.writers {
            w.tx = None;
            if let Some(h) = w.handle.take() {
                let r = h.join().unwrap_or_else(|_| {
                    Err(StorageError::InvalidArgument("writer panicked".into()))
                });
                if let (Err(e), None) = (r, &first_err) {
                    first_err = Some(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(self.unit_hashes),
        }
    }
}

/// Lay `ckpt` out according to `opts`. Returns the manifest (as written on drive 0).
pub fn write_layout(
    ckpt: &Checkpoint,
    opts: &LayoutOptions,
    progress: &dyn Progress,
) -> Result<Manifest> {
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
    let placement = Placement::new(opts.mode, opts.drives.len(), opts.stripe_unit)
        .map_err(StorageError::InvalidArgument)?;
    let mut canon = Vec::new();
    for (i, d) in opts.drives.iter().enumerate() {
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
    let dirs: Vec<PathBuf> = canon.iter().map(|d| d.join(&opts.name)).collect();

    // 1. existing layouts
    for dir in &dirs {
        if dir.join(MANIFEST_FILE).exists() && !opts.force {
            return Err(StorageError::LayoutExists { path: dir.clone() });
        }
    }
    for dir in &dirs {
        let m = dir.join(MANIFEST_FILE);
        if m.exists() {
            fs::remove_file(&m).map_err(|e| StorageError::io(&m, "remove old manifest", e))?;
            sync_dir(dir)?;
        }
    }

    let transform = opts.transform.as_deref();
    let config = match transform {
        Some(t) => t.config(&ckpt.config)?,
        None => ckpt.config.clone(),
    };
    let plan = plan_with(ckpt, transform)?;

    // 2. free space (an old data.bin we are about to overwrite counts as free)
    let units = placement.unit_count(plan.logical_len);
    for (i, (drive, dir)) in canon.iter().zip(&dirs).enumerate() {
        let need = placement.drive_file_len(i, plan.logical_len)
            + units * 32
            + (plan.records.len() as u64 * 400)
            + (1 << 20);
        let reclaim = fs::metadata(dir.join(DATA_FILE))
            .map(|m| m.len())
            .unwrap_or(0);
        let have = free_space(drive)? + reclaim;
        if have < need {
            return Err(StorageError::InsufficientSpace {
                drive: i,
                path: drive.clone(),
                needed: need,
                available: have,
            });
        }
    }

    // 3. data
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
        let len = placement.drive_file_len(i, plan.logical_len);
        // Reserve the space up front so a full disk fails now, not half-way.
        if len > 0 {
            // SAFETY: plain syscall on an fd we own.
            let rc = unsafe {
                libc::posix_fallocate(
                    std::os::unix::io::AsRawFd::as_raw_fd(&file),
                    0,
                    len as libc::off_t,
                )
            };
            if rc == libc::ENOSPC {
                return Err(StorageError::InsufficientSpace {
                    drive: i,
                    path: path.clone(),
                    needed: len,
                    available: free_space(dir).unwrap_or(0),
                });
            }
            if rc != 0 && rc != libc::EOPNOTSUPP {
                return Err(StorageError::io(
                    &path,
                    "fallocate",
                    std::io::Error::from_raw_os_error(rc),
                ));
            }
            file.set_len(len)
                .map_err(|e| StorageError::io(&path, "set_len", e))?;
        }
        writers.push(spawn_writer(i, path, file));
    }
    progress.start(plan.logical_len, "laying out");
    let mut lw = LogicalWriter {
        placement,
        writers,
        pos: 0,
        unit_hasher: blake3::Hasher::new(),
        unit_hashes: Vec::with_capacity(units as usize * 32),
        progress,
    };
    let mut entries = Vec::with_capacity(plan.records.len());
    const CHUNK: u64 = 4 << 20;
    for r in &plan.records {
        lw.pad_to(r.offset)?;
        let mut hasher = blake3::Hasher::new();
        let mut rec_pos = 0u64;
        let tensor_offsets: Vec<u64> = if r.tensors.is_empty() {
            plan.templates
                .iter()
                .find(|t| matches!(r.id, RecordId::Expert { layer, .. } if layer == t.layer))
                .map(|t| t.tensors.iter().map(|x| x.offset).collect())
                .unwrap_or_default()
        } else {
            r.tensors.iter().map(|x| x.offset).collect()
        };
        if let (Some(from), Some(t), RecordId::Expert { layer, expert }) =
            (&r.transform_from, transform, &r.id)
        {
            let inputs: Vec<(&PartSpec, &[u8])> = from
                .iter()
                .zip(&r.sources)
                .map(|(p, s)| (p, ckpt.slice(s.file, s.offset, s.len)))
                .collect();
            let parts = t.apply(*layer, *expert, &inputs)?;
            let template = plan
                .templates
                .iter()
                .find(|t| t.layer == *layer)
                .map(|t| t.tensors.as_slice())
                .unwrap_or_default();
            if parts.len() != template.len() {
                return Err(StorageError::InvalidArgument(format!(
                    "{}: transform returned {} parts, planned {}",
                    r.id,
                    parts.len(),
                    template.len()
                )));
            }
            for (bytes, spec) in parts.iter().zip(template) {
                if bytes.len() as u64 != spec.len {
                    return Err(StorageError::InvalidArgument(format!(
                        "{}: transform returned {} bytes for `{}`, planned {}",
                        r.id,
                        bytes.len(),
                        spec.name,
                        spec.len
                    )));
                }
                if spec.offset > rec_pos {
                    let zeros = vec![0u8; (spec.offset - rec_pos) as usize];
                    hasher.update(&zeros);
                    lw.write(&zeros)?;
                    rec_pos = spec.offset;
                }
                hasher.update(bytes);
                lw.write(bytes)?;
                rec_pos += spec.len;
            }
            entries.push(RecordEntry {
                id: r.id.clone(),
                offset: r.offset,
                len: r.len,
                hash: hasher.finalize().to_hex().to_string(),
                tensors: r.tensors.clone(),
            });
            continue;
        }
        for (si, s) in r.sources.iter().enumerate() {
            let at = tensor_offsets.get(si).copied().unwrap_or(rec_pos);
            if at > rec_pos {
                let zeros = vec![0u8; (at - rec_pos) as usize];
                hasher.update(&zeros);
                lw.write(&zeros)?;
                rec_pos = at;
            }
            let mut done = 0;
            while done < s.len {
                let n = (s.len - done).min(CHUNK);
                let bytes = ckpt.slice(s.file, s.offset + done, n);
                hasher.update(bytes);
                lw.write(bytes)?;
                done += n;
            }
            rec_pos += s.len;
        }
        entries.push(RecordEntry {
            id: r.id.clone(),
            offset: r.offset,
            len: r.len,
            hash: hasher.finalize().to_hex().to_string(),
            tensors: r.tensors.clone(),
        });
    }
    lw.pad_to(plan.logical_len)?;
    let unit_hashes = lw.finish()?;
    progress.finish();

    // 4. hashes and manifests, last
    let unit_hashes_blake3 = blake3::hash(&unit_hashes).to_hex().to_string();
    let layout_id = random_id();
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
    if let Some(t) = transform {
        meta.extend(t.meta());
    }
    let mut manifest = Manifest {
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
        unit_hashes_blake3,
        records: entries,
        expert_templates: plan.templates,
        meta,
    };
    manifest.validate(&dirs[0].join(MANIFEST_FILE))?;
    for dir in &dirs {
        crate::manifest::write_atomic(&dir.join(UNIT_HASHES_FILE), &unit_hashes)?;
    }
    for (i, dir) in dirs.iter().enumerate() {
        manifest.this_drive = i;
        manifest.store(dir)?;
    }
    manifest.this_drive = 0;
    Ok(manifest)
}

/// Open a layout from any drive's manifest (file or folder): load it, find every other drive,
/// and check that each holds this layout's copy. Returns the manifest and the drive folders.
pub fn open_layout(path: &Path) -> Result<(Manifest, Vec<PathBuf>)> {
    let (manifest, dirs, mut unavailable) = open_layout_degraded(path)?;
    match unavailable.is_empty() {
        true => Ok((manifest, dirs)),
        false => Err(unavailable.swap_remove(0).1),
    }
}

/// [`open_layout`], except that a replicated layout with some drives missing, foreign or
/// truncated still opens from the drives that are fine: their problems come back as the third
/// value (drive index and the error naming its path); pass the indices as
/// [`crate::engine::EngineConfig::unavailable_drives`] so that the engine reads every record
/// from the remaining copies and nothing from a foreign or truncated one. A striped layout
/// needs every drive, so any problem is an error, as is a replicated one with no usable drive.
#[allow(clippy::type_complexity)]
pub fn open_layout_degraded(
    path: &Path,
) -> Result<(Manifest, Vec<PathBuf>, Vec<(usize, StorageError)>)> {
    let manifest = Manifest::load(path)?;
    let here = crate::manifest::manifest_path(path);
    let here_dir = here.parent().map(Path::to_path_buf).unwrap_or_default();
    let mut dirs = Vec::new();
    let mut unavailable = Vec::new();
    for d in &manifest.drives {
        // The drive we were pointed at is where we found it, even if mounted elsewhere now.
        let dir = if d.index == manifest.this_drive {
            here_dir.clone()
        } else {
            d.path.clone()
        };
        if let Err(e) = check_drive(&manifest, d, &dir) {
            if manifest.mode != Mode::Replicate || manifest.drives.len() < 2 {
                return Err(e);
            }
            unavailable.push((d.index, e));
        }
        dirs.push(dir);
    }
    if unavailable.len() == manifest.drives.len() {
        return Err(unavailable.swap_remove(0).1);
    }
    Ok((manifest, dirs, unavailable))
}

/// Whether `dir` holds drive `d`'s copy of `manifest`'s layout, whole.
fn check_drive(manifest: &Manifest, d: &crate::manifest::DriveEntry, dir: &Path) -> Result<()> {
    let m = dir.join(MANIFEST_FILE);
    let other = Manifest::load(&m).map_err(|e| StorageError::MissingDrive {
        drive: d.index,
        path: dir.to_path_buf(),
        reason: e.to_string(),
    })?;
    if other.layout_id != manifest.layout_id || other.this_drive != d.index {
        return Err(StorageError::DriveMismatch {
            drive: d.index,
            path: dir.to_path_buf(),
            expected: format!("layout {} drive {}", manifest.layout_id, d.index),
            found: format!("layout {} drive {}", other.layout_id, other.this_drive),
        });
    }
    let data = dir.join(DATA_FILE);
    let len = fs::metadata(&data)
        .map_err(|e| StorageError::MissingDrive {
            drive: d.index,
            path: data.clone(),
            reason: e.to_string(),
        })?
        .len();
    if len < d.data_len {
        return Err(StorageError::ShortRead {
            drive: d.index,
            path: data,
            offset: len,
            len: d.data_len,
            got: len,
        });
    }
    Ok(())
}
