//! The layout manifest: a versioned JSON file on every drive at `DRIVE/NAME/manifest.json`,
//! written last and atomically, that says where every tensor and expert record lives.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, StorageError};
use crate::safetensors::Dtype;
use crate::stripe::{Mode, Placement};

/// Format version this build writes and the newest it reads. Version 2 added `content_hash`
/// (version 1 manifests still open; only the cross-drive comparison protects them); version 3
/// a record's `xxh3`, the hash reads check (`record_hash`; older layouts are read with blake3).
pub const MANIFEST_VERSION: u32 = 3;
/// Value of the `format` field.
pub const MANIFEST_FORMAT: &str = "deltafin-layout";
pub const MANIFEST_FILE: &str = "manifest.json";
pub const DATA_FILE: &str = "data.bin";
pub const UNIT_HASHES_FILE: &str = "units.blake3";
/// Manifests larger than this are refused before parsing.
pub const MAX_MANIFEST_BYTES: u64 = 1 << 30;

/// What a record holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum RecordId {
    /// Resident tensors of one group (`global` or `layer.N`).
    Resident { group: String },
    /// One routed expert.
    Expert { layer: u32, expert: u32 },
}

impl std::fmt::Display for RecordId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecordId::Resident { group } => write!(f, "resident {group}"),
            RecordId::Expert { layer, expert } => write!(f, "layer {layer} expert {expert}"),
        }
    }
}

/// One tensor inside a record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordTensor {
    /// Full HF name for resident tensors; the part name (`gate_proj.weight`) for experts.
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Byte offset within the record.
    pub offset: u64,
    pub len: u64,
}

/// A contiguous, 4 KiB-aligned run of the logical space.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordEntry {
    pub id: RecordId,
    /// Logical offset (multiple of 4096).
    pub offset: u64,
    /// Payload length (the record is padded with zeros to 4096 on disk).
    pub len: u64,
    /// blake3 of the `len` payload bytes, hex.
    pub hash: String,
    /// XXH3-128 of the same bytes, 32 hex digits (version 3 on; required there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xxh3: Option<String>,
    /// Tensors of resident records; expert records use their layer's template.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tensors: Vec<RecordTensor>,
}

/// The tensor layout shared by every expert record of one layer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertTemplate {
    pub layer: u32,
    pub len: u64,
    pub tensors: Vec<RecordTensor>,
}

/// One drive of the layout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriveEntry {
    pub index: usize,
    /// The layout folder on this drive (`DRIVE/NAME`) when laid out.
    pub path: PathBuf,
    /// Random identity written into this drive's manifest copy.
    pub drive_id: String,
    /// Length of this drive's `data.bin`.
    pub data_len: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub name: String,
    pub layout_id: String,
    pub created_unix: u64,
    pub mode: Mode,
    pub stripe_unit: u64,
    pub model_type: String,
    /// The checkpoint's config.json, verbatim.
    pub config: serde_json::Value,
    pub drives: Vec<DriveEntry>,
    /// Which drive this copy of the manifest sits on.
    pub this_drive: usize,
    pub logical_len: u64,
    /// blake3 (hex) of `units.blake3`, the 32-byte hashes of every logical stripe unit in order.
    pub unit_hashes_blake3: String,
    pub records: Vec<RecordEntry>,
    pub expert_templates: Vec<ExpertTemplate>,
    /// Optional extra facts (source checkpoint path, quantization, tool version).
    #[serde(default)]
    pub meta: BTreeMap<String, String>,
    /// blake3 (hex) of everything above except `this_drive`: the config, the tensor and record
    /// tables (and through their hashes every data byte), the drives. Every drive's copy
    /// carries the same value; a copy whose content does not hash to it was edited or
    /// corrupted (see [`Manifest::content_hash`]). Empty in version 1 manifests.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub content_hash: String,
}

impl Manifest {
    pub fn placement(&self) -> Placement {
        Placement {
            mode: self.mode,
            drives: self.drives.len(),
            unit: self.stripe_unit,
        }
    }

    pub fn template(&self, layer: u32) -> Option<&ExpertTemplate> {
        self.expert_templates.iter().find(|t| t.layer == layer)
    }

    /// The routed-expert records.
    pub fn expert_records(&self) -> impl Iterator<Item = &RecordEntry> {
        self.records
            .iter()
            .filter(|r| matches!(r.id, RecordId::Expert { .. }))
    }

    /// Payload bytes of every routed-expert record.
    pub fn expert_bytes(&self) -> u64 {
        self.expert_records().map(|r| r.len).sum()
    }

    /// The largest routed-expert record, 4 KiB-aligned as it is read (0 without experts).
    pub fn largest_expert_record(&self) -> u64 {
        self.expert_records()
            .map(|r| crate::stripe::align_up(r.len.max(1)))
            .max()
            .unwrap_or(0)
    }

    /// Tensors of a record (its own list, or its layer's template).
    pub fn record_tensors<'a>(&'a self, record: &'a RecordEntry) -> &'a [RecordTensor] {
        match &record.id {
            RecordId::Expert { layer, .. } => self
                .template(*layer)
                .map(|t| t.tensors.as_slice())
                .unwrap_or(&[]),
            RecordId::Resident { .. } => &record.tensors,
        }
    }

    /// The hash [`Manifest::content_hash`] must hold: blake3 of the manifest's JSON without
    /// `this_drive` (set to 0) and without the hash itself.
    pub fn compute_content_hash(&self) -> String {
        let mut c = self.clone();
        c.this_drive = 0;
        c.content_hash = String::new();
        // Serializing plain data (strings, numbers, maps with string keys) cannot fail.
        let bytes = serde_json::to_vec(&c).unwrap_or_default();
        blake3::hash(&bytes).to_hex().to_string()
    }

    /// A copy carrying its content hash, as written to the drives.
    pub fn sealed(&self) -> Manifest {
        let mut m = self.clone();
        m.version = m.version.max(2);
        m.content_hash = m.compute_content_hash();
        m
    }

    /// The content as the drives' copies must agree on it (`this_drive` aside), as JSON.
    pub fn shared_content(&self) -> serde_json::Value {
        let mut c = self.clone();
        c.this_drive = 0;
        c.content_hash = String::new();
        serde_json::to_value(&c).unwrap_or_default()
    }

    /// Parse and validate from bytes (untrusted), including the content hash.
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Manifest> {
        let m = Manifest::from_bytes_unauthenticated(path, bytes)?;
        if m.version >= 2 {
            let want = m.compute_content_hash();
            if m.content_hash != want {
                return Err(StorageError::ManifestTampered {
                    path: path.to_path_buf(),
                    reason: if m.content_hash.is_empty() {
                        "it has no content_hash".into()
                    } else {
                        "its content does not hash to its content_hash".into()
                    },
                    field: None,
                });
            }
        }
        Ok(m)
    }

    /// [`Manifest::from_bytes`] without the content-hash check (to compare a bad copy with
    /// the good ones and name what differs).
    pub fn from_bytes_unauthenticated(path: &Path, bytes: &[u8]) -> Result<Manifest> {
        let bad = |reason: String| StorageError::Manifest {
            path: path.to_path_buf(),
            reason,
        };
        // Look at the version first so a newer format gets the right message, not a parse error.
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        match value.get("format").and_then(|v| v.as_str()) {
            Some(MANIFEST_FORMAT) => {}
            other => {
                return Err(bad(format!(
                    "format is {other:?}, expected {MANIFEST_FORMAT:?}"
                )))
            }
        }
        let version = value
            .get("version")
            .and_then(|v| v.as_u64())
            .ok_or_else(|| bad("missing numeric `version`".into()))?;
        if version > u64::from(MANIFEST_VERSION) {
            return Err(StorageError::ManifestVersion {
                path: path.to_path_buf(),
                found: u32::try_from(version).unwrap_or(u32::MAX),
                supported: MANIFEST_VERSION,
            });
        }
        let m: Manifest = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
        m.validate(path)?;
        Ok(m)
    }

    /// Structural checks: every number that will index a file or buffer is consistent.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |reason: String| StorageError::Manifest {
            path: path.to_path_buf(),
            reason,
        };
        Placement::new(self.mode, self.drives.len(), self.stripe_unit).map_err(bad)?;
        if self.this_drive >= self.drives.len() {
            return Err(bad(format!(
                "this_drive {} but {} drives",
                self.this_drive,
                self.drives.len()
            )));
        }
        for (i, d) in self.drives.iter().enumerate() {
            if d.index != i {
                return Err(bad(format!("drive entry {i} has index {}", d.index)));
            }
            let want = self.placement().drive_file_len(i, self.logical_len);
            if d.data_len != want {
                return Err(bad(format!(
                    "drive {i} data_len {} but placement needs {want}",
                    d.data_len
                )));
            }
        }
        let mut end = 0u64;
        let mut seen = std::collections::HashSet::new();
        for r in &self.records {
            if r.offset % crate::stripe::ALIGN != 0 {
                return Err(bad(format!(
                    "{}: offset {} is not 4096-aligned",
                    r.id, r.offset
                )));
            }
            if r.offset < end {
                return Err(bad(format!(
                    "{}: offset {} overlaps the previous record",
                    r.id, r.offset
                )));
            }
            let r_end = r
                .offset
                .checked_add(r.len)
                .ok_or_else(|| bad(format!("{}: length overflows", r.id)))?;
            if r_end > self.logical_len {
                return Err(bad(format!(
                    "{}: ends at {r_end}, past logical_len {}",
                    r.id, self.logical_len
                )));
            }
            end = r_end;
            if !seen.insert(&r.id) {
                return Err(bad(format!("{} appears twice", r.id)));
            }
            if r.hash.len() != 64 || !r.hash.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad(format!("{}: hash is not 64 hex digits", r.id)));
            }
            match &r.xxh3 {
                Some(x) if crate::record_hash::parse_xxh3_hex(x).is_none() => {
                    return Err(bad(format!("{}: xxh3 is not 32 hex digits", r.id)));
                }
                None if self.version >= 3 => {
                    return Err(bad(format!("{}: no xxh3 (required from version 3)", r.id)));
                }
                _ => {}
            }
            let (tensors, want_len) = match &r.id {
                RecordId::Expert { layer, .. } => {
                    let t = self.template(*layer).ok_or_else(|| {
                        bad(format!("{}: no expert template for layer {layer}", r.id))
                    })?;
                    (&t.tensors, Some(t.len))
                }
                RecordId::Resident { .. } => (&r.tensors, None),
            };
            if let Some(w) = want_len {
                if w != r.len {
                    return Err(bad(format!(
                        "{}: len {} but its template says {w}",
                        r.id, r.len
                    )));
                }
            }
            for t in tensors {
                let t_end = t.offset.checked_add(t.len);
                if t_end.is_none_or(|e| e > r.len) {
                    return Err(bad(format!(
                        "{}: tensor {} lies outside the record",
                        r.id, t.name
                    )));
                }
            }
        }
        Ok(())
    }

    /// Read `PATH` (a manifest file or the layout folder holding one).
    pub fn load(path: &Path) -> Result<Manifest> {
        let file = manifest_path(path);
        let meta = fs::metadata(&file).map_err(|e| StorageError::io(&file, "open manifest", e))?;
        if meta.len() > MAX_MANIFEST_BYTES {
            return Err(StorageError::Manifest {
                path: file,
                reason: format!(
                    "{} bytes, over the {MAX_MANIFEST_BYTES}-byte cap",
                    meta.len()
                ),
            });
        }
        let bytes = fs::read(&file).map_err(|e| StorageError::io(&file, "read manifest", e))?;
        Manifest::from_bytes(&file, &bytes)
    }

    /// Write to `dir/manifest.json` (sealed with its content hash) via temp file, fsync, rename
    /// and directory fsync.
    pub fn store(&self, dir: &Path) -> Result<()> {
        let bytes =
            serde_json::to_vec_pretty(&self.sealed()).map_err(|e| StorageError::Manifest {
                path: dir.join(MANIFEST_FILE),
                reason: e.to_string(),
            })?;
        write_atomic(&dir.join(MANIFEST_FILE), &bytes)
    }
}

/// `path` itself if it names a file, else `path/manifest.json`.
pub fn manifest_path(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join(MANIFEST_FILE)
    } else {
        path.to_path_buf()
    }
}

/// Replace `path` atomically with `bytes`: a reader sees the old file or the whole new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = path.with_extension("json.tmp");
    let mut f = File::create(&tmp).map_err(|e| StorageError::io(&tmp, "create", e))?;
    f.write_all(bytes)
        .map_err(|e| StorageError::io(&tmp, "write", e))?;
    f.sync_all()
        .map_err(|e| StorageError::io(&tmp, "fsync", e))?;
    drop(f);
    fs::rename(&tmp, path).map_err(|e| StorageError::io(path, "rename", e))?;
    sync_dir(dir)
}

/// fsync a directory so a rename or unlink in it is durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    let d = File::open(dir).map_err(|e| StorageError::io(dir, "open dir", e))?;
    d.sync_all()
        .map_err(|e| StorageError::io(dir, "fsync dir", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Manifest {
        let h = "ab".repeat(32);
        Manifest {
            format: MANIFEST_FORMAT.into(),
            version: MANIFEST_VERSION,
            name: "m".into(),
            layout_id: "id".into(),
            created_unix: 1,
            mode: Mode::Stripe,
            stripe_unit: 8192,
            model_type: "test_moe".into(),
            config: serde_json::json!({"model_type": "test_moe"}),
            drives: (0..2)
                .map(|i| DriveEntry {
                    index: i,
                    path: format!("/d{i}/m").into(),
                    drive_id: format!("d{i}"),
                    data_len: if i == 0 { 8192 } else { 4096 },
                })
                .collect(),
            this_drive: 1,
            logical_len: 12288,
            unit_hashes_blake3: h.clone(),
            records: vec![
                RecordEntry {
                    id: RecordId::Resident {
                        group: "global".into(),
                    },
                    offset: 0,
                    len: 10,
                    hash: h.clone(),
                    xxh3: Some("cd".repeat(16)),
                    tensors: vec![RecordTensor {
                        name: "model.norm.weight".into(),
                        dtype: Dtype::Bf16,
                        shape: vec![5],
                        offset: 0,
                        len: 10,
                    }],
                },
                RecordEntry {
                    id: RecordId::Expert {
                        layer: 1,
                        expert: 0,
                    },
                    offset: 4096,
                    len: 6000,
                    hash: h,
                    xxh3: Some("ef".repeat(16)),
                    tensors: vec![],
                },
            ],
            expert_templates: vec![ExpertTemplate {
                layer: 1,
                len: 6000,
                tensors: vec![RecordTensor {
                    name: "gate_proj.weight".into(),
                    dtype: Dtype::Bf16,
                    shape: vec![3000],
                    offset: 0,
                    len: 6000,
                }],
            }],
            meta: BTreeMap::new(),
            content_hash: String::new(),
        }
    }

    #[test]
    fn round_trip_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let m = sample();
        m.store(dir.path()).unwrap();
        assert!(!dir.path().join("manifest.json.tmp").exists());
        let back = Manifest::load(dir.path()).unwrap();
        assert_eq!(back, m.sealed());
        assert_eq!(back.content_hash, m.compute_content_hash());
        assert_eq!(
            Manifest::load(&dir.path().join(MANIFEST_FILE)).unwrap(),
            back
        );
        // The hash does not depend on which drive's copy it is.
        let mut other = m.clone();
        other.this_drive = 0;
        assert_eq!(other.compute_content_hash(), back.content_hash);
    }

    /// Any edit of a sealed copy is refused, whatever field it touches; a version 1 manifest
    /// (no hash) still loads.
    #[test]
    fn an_edited_copy_fails_its_content_hash() {
        let p = Path::new("d/manifest.json");
        let sealed = serde_json::to_value(sample().sealed()).unwrap();
        assert!(Manifest::from_bytes(p, &serde_json::to_vec(&sealed).unwrap()).is_ok());
        let edits: Vec<(&str, serde_json::Value)> = vec![
            ("/config/model_type", serde_json::json!("other")),
            ("/records/0/hash", serde_json::json!("cd".repeat(32))),
            ("/records/1/xxh3", serde_json::json!("01".repeat(16))),
            (
                "/expert_templates/0/tensors/0/dtype",
                serde_json::json!("F16"),
            ),
            ("/unit_hashes_blake3", serde_json::json!("00".repeat(32))),
            ("/meta", serde_json::json!({"x": "y"})),
        ];
        for (at, value) in edits {
            let mut v = sealed.clone();
            *v.pointer_mut(at).unwrap() = value;
            let e = Manifest::from_bytes(p, &serde_json::to_vec(&v).unwrap()).unwrap_err();
            assert!(
                matches!(e, StorageError::ManifestTampered { .. }),
                "{at}: {e}"
            );
            assert!(e.to_string().contains("d/manifest.json"), "{e}");
        }
        let mut v1 = serde_json::to_value(sample()).unwrap();
        v1["version"] = serde_json::json!(1);
        assert!(Manifest::from_bytes(p, &serde_json::to_vec(&v1).unwrap()).is_ok());
        let mut v2 = v1.clone();
        v2["version"] = serde_json::json!(2);
        assert!(Manifest::from_bytes(p, &serde_json::to_vec(&v2).unwrap()).is_err());
    }

    #[test]
    fn refuses_newer_version_and_bad_fields() {
        let p = Path::new("x/manifest.json");
        let mut v = serde_json::to_value(sample()).unwrap();
        v["version"] = serde_json::json!(MANIFEST_VERSION + 1);
        let err = Manifest::from_bytes(p, &serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert!(
            matches!(err, StorageError::ManifestVersion { found, .. } if found == MANIFEST_VERSION + 1)
        );
        assert!(err.to_string().contains("x/manifest.json"));

        let mut m = sample();
        m.records[1].offset = 4000;
        let err = Manifest::from_bytes(p, &serde_json::to_vec(&m).unwrap()).unwrap_err();
        assert!(err.to_string().contains("layer 1 expert 0"), "{err}");

        let mut m = sample();
        m.records[1].len = 9000;
        assert!(Manifest::from_bytes(p, &serde_json::to_vec(&m).unwrap()).is_err());

        let mut m = sample();
        m.drives[1].data_len = 1;
        assert!(Manifest::from_bytes(p, &serde_json::to_vec(&m).unwrap()).is_err());

        let mut m = sample();
        m.records[0].tensors[0].len = 11;
        assert!(Manifest::from_bytes(p, &serde_json::to_vec(&m).unwrap()).is_err());

        let mut m = sample();
        m.records[0].xxh3 = Some("xyz".into());
        let err = Manifest::from_bytes(p, &serde_json::to_vec(&m.sealed()).unwrap()).unwrap_err();
        assert!(
            err.to_string().contains("xxh3 is not 32 hex digits"),
            "{err}"
        );
        let mut m = sample();
        m.records[1].xxh3 = None;
        let err = Manifest::from_bytes(p, &serde_json::to_vec(&m.sealed()).unwrap()).unwrap_err();
        assert!(
            err.to_string().contains("layer 1 expert 0: no xxh3"),
            "{err}"
        );
        // A version 2 layout has none and still opens (its reads check blake3).
        m.version = 2;
        m.records[0].xxh3 = None;
        assert!(Manifest::from_bytes(p, &serde_json::to_vec(&m.sealed()).unwrap()).is_ok());

        assert!(Manifest::from_bytes(p, b"{\"format\":\"other\"}").is_err());
        assert!(Manifest::from_bytes(p, b"[1,2").is_err());
    }
}
