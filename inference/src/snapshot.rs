//! Crash-safe session snapshots: the per-layer mixer states (KV caches, MLA latents, ...) of a
//! [`Session`] with the token history that produced them, so that a later run reuses the
//! longest common prefix of its prompt instead of prefilling it again.
//!
//! # File format (little-endian)
//!
//! ```text
//! magic      8 bytes  "DFSNAP\r\n"
//! version    u32      SNAPSHOT_VERSION
//! model      32 bytes model_hash(): blake3 of config, resident tensor samples and caller bytes
//! tokens     u64 n, then n x u32          token history (= positions held by the states)
//! layers     u32 L, then per layer:
//!              u32 A (per-position arrays), then per array: u64 count, count x f32
//!              (version >= 3) u32 F (fixed-size arrays: a recurrent state), then per array:
//!              u64 count, count x f32
//! outputs    (version >= 2) u8 recorded (0/1), u64 first position s, u64 count,
//!              count = (n - s) x hidden f32: the last layer's output of positions s..n
//! checksum   32 bytes blake3 of every byte before it
//! ```
//!
//! With the outputs, a prompt that lies entirely inside the history resumes with no forward
//! pass at all: its first new token's logits come from the stored output of its last position
//! (final norm and LM head only). Version 1 files (no outputs) still load.
//!
//! Saving writes `FILE.tmp-PID`, fsyncs it, renames it over `FILE` and fsyncs the directory, so
//! a crash leaves either the old or the new snapshot. Loading refuses (with a
//! [`SnapshotError`] naming the reason) a file of another format, a newer version, a truncated or
//! corrupted file (checksum), or one written for another model; callers then start from scratch.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use crate::error::InferenceError;
use crate::model::forward::Model;
use crate::model::session::{OutputStates, Session};

/// First bytes of every snapshot file.
pub const SNAPSHOT_MAGIC: [u8; 8] = *b"DFSNAP\r\n";
/// The format version this build writes (and the newest it reads).
pub const SNAPSHOT_VERSION: u32 = 3;
const CHECKSUM_LEN: usize = 32;
const HEADER_LEN: usize = 8 + 4 + 32;

/// Why a snapshot could not be written or was refused.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("not a deltafin session snapshot (bad magic bytes)")]
    BadMagic,
    #[error("snapshot is truncated ({len} bytes; too short for {what})")]
    Truncated { len: usize, what: &'static str },
    #[error(
        "snapshot format version {found} is newer than this build reads (version {supported})"
    )]
    NewerVersion { found: u32, supported: u32 },
    #[error("snapshot checksum mismatch: the file is corrupted or truncated")]
    Checksum,
    #[error("snapshot was written for another model (model hash {found}, this model {expected})")]
    OtherModel { found: String, expected: String },
    #[error("snapshot is malformed: {0}")]
    Malformed(String),
    #[error("this model's state cannot be saved in a snapshot: {0}")]
    Unsupported(String),
    #[error("{path}: not a regular file ({kind}); snapshots are read from and written to regular files only")]
    NotARegularFile { path: PathBuf, kind: String },
    #[error("{path}: {len} bytes, larger than any snapshot of this model can be ({cap} bytes)")]
    TooLarge { path: PathBuf, len: u64, cap: u64 },
    #[error(transparent)]
    Inference(#[from] InferenceError),
}

pub type SnapshotResult<T> = std::result::Result<T, SnapshotError>;

/// Identity of a model for snapshots: blake3 over the config, the dtype, shape and first and
/// last 64 KiB of the embeddings, the LM head and the final norm (cheap even for huge models),
/// and `extra` (e.g. the bytes of a layout's manifest, which hashes every record).
pub fn model_hash(model: &Model, extra: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(model.weights_digest());
    h.update(&(extra.len() as u64).to_le_bytes());
    h.update(extra);
    *h.finalize().as_bytes()
}

fn hex(b: &[u8]) -> String {
    b.iter().take(8).map(|x| format!("{x:02x}")).collect()
}

/// A writer that hashes everything it passes on.
struct Hashing<W: Write> {
    inner: W,
    hasher: blake3::Hasher,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Write a snapshot of `session` (whose positions were produced by `history`) to `w`.
pub fn write_snapshot<W: Write>(
    w: W,
    model: &Model,
    hash: &[u8; 32],
    session: &Session,
    history: &[u32],
) -> SnapshotResult<W> {
    if history.len() != session.len() {
        return Err(SnapshotError::Unsupported(format!(
            "the token history has {} tokens but the session holds {} positions",
            history.len(),
            session.len()
        )));
    }
    let states = session.states();
    if states.len() != model.layers().len() {
        return Err(InferenceError::StateMismatch(
            "the session was created by another model".into(),
        )
        .into());
    }
    let io = |e| SnapshotError::Io {
        path: PathBuf::from("<snapshot>"),
        op: "write",
        source: e,
    };
    let mut hw = Hashing {
        inner: w,
        hasher: blake3::Hasher::new(),
    };
    let mut put = |b: &[u8]| hw.write_all(b);
    (|| -> std::io::Result<()> {
        put(&SNAPSHOT_MAGIC)?;
        put(&SNAPSHOT_VERSION.to_le_bytes())?;
        put(hash)?;
        put(&(history.len() as u64).to_le_bytes())?;
        for t in history {
            put(&t.to_le_bytes())?;
        }
        put(&(states.len() as u32).to_le_bytes())?;
        Ok(())
    })()
    .map_err(io)?;
    for (i, s) in states.iter().enumerate() {
        let arrays = s.export_arrays().ok_or_else(|| {
            SnapshotError::Unsupported(format!("layer {i}'s mixer state has no snapshot hook"))
        })?;
        let fixed = s.export_fixed();
        (|| -> std::io::Result<()> {
            for group in [&arrays, &fixed] {
                put(&(group.len() as u32).to_le_bytes())?;
                for a in group.iter() {
                    put(&(a.len() as u64).to_le_bytes())?;
                    put_f32s(&mut put, a)?;
                }
            }
            Ok(())
        })()
        .map_err(io)?;
    }
    let hd = model.hidden_size();
    (|| -> std::io::Result<()> {
        let (on, start, data): (u8, usize, &[f32]) = match session.outputs() {
            Some(o) => (1, o.start, &o.data),
            None => (0, history.len(), &[]),
        };
        debug_assert_eq!(data.len(), (history.len() - start) * hd);
        put(&[on])?;
        put(&(start as u64).to_le_bytes())?;
        put(&(data.len() as u64).to_le_bytes())?;
        put_f32s(&mut put, data)
    })()
    .map_err(io)?;
    let sum = *hw.hasher.finalize().as_bytes();
    hw.inner.write_all(&sum).map_err(io)?;
    Ok(hw.inner)
}

/// A snapshot as bytes (see [`write_snapshot`]).
pub fn encode(
    model: &Model,
    hash: &[u8; 32],
    session: &Session,
    history: &[u32],
) -> SnapshotResult<Vec<u8>> {
    write_snapshot(Vec::new(), model, hash, session, history)
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> SnapshotResult<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| SnapshotError::Malformed(format!("{what} runs past the end")))?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> SnapshotResult<u32> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self, what: &str) -> SnapshotResult<u64> {
        let s = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    fn count(&mut self, what: &str, elem: usize) -> SnapshotResult<usize> {
        let n = self.u64(what)?;
        let left = (self.b.len() - self.pos) as u64;
        if n.checked_mul(elem as u64).is_none_or(|bytes| bytes > left) {
            return Err(SnapshotError::Malformed(format!(
                "{what} {n} does not fit in the file"
            )));
        }
        Ok(n as usize)
    }
}

/// Check a snapshot's framing (length, magic, version, checksum) and model hash, then rebuild
/// the session. Returns the session and its token history.
pub fn decode(bytes: &[u8], model: &Model, hash: &[u8; 32]) -> SnapshotResult<(Session, Vec<u32>)> {
    if bytes.len() < SNAPSHOT_MAGIC.len() {
        return Err(SnapshotError::Truncated {
            len: bytes.len(),
            what: "the magic bytes",
        });
    }
    if bytes[..8] != SNAPSHOT_MAGIC {
        return Err(SnapshotError::BadMagic);
    }
    if bytes.len() < HEADER_LEN + CHECKSUM_LEN {
        return Err(SnapshotError::Truncated {
            len: bytes.len(),
            what: "the header and checksum",
        });
    }
    let version = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    let (body, sum) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
    if blake3::hash(body).as_bytes() != sum {
        // A newer version may use another checksum; say so rather than "corrupted".
        if version > SNAPSHOT_VERSION {
            return Err(SnapshotError::NewerVersion {
                found: version,
                supported: SNAPSHOT_VERSION,
            });
        }
        return Err(SnapshotError::Checksum);
    }
    if version > SNAPSHOT_VERSION {
        return Err(SnapshotError::NewerVersion {
            found: version,
            supported: SNAPSHOT_VERSION,
        });
    }
    if version == 0 {
        return Err(SnapshotError::Malformed("format version 0".into()));
    }
    if &body[12..HEADER_LEN] != hash {
        return Err(SnapshotError::OtherModel {
            found: hex(&body[12..HEADER_LEN]),
            expected: hex(hash),
        });
    }
    let mut r = Reader {
        b: body,
        pos: HEADER_LEN,
    };
    let n = r.count("token count", 4)?;
    let history: Vec<u32> = r
        .take(n * 4, "tokens")?
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let vocab = model.vocab_size();
    if let Some(t) = history.iter().find(|&&t| t as usize >= vocab) {
        return Err(SnapshotError::Malformed(format!(
            "token {t} is outside the vocabulary ({vocab})"
        )));
    }
    let layers = r.u32("layer count")? as usize;
    if layers != model.layers().len() {
        return Err(SnapshotError::Malformed(format!(
            "{layers} layers; the model has {}",
            model.layers().len()
        )));
    }
    let mut session = model.new_session();
    {
        let (states, len) = session.restore_parts();
        for (i, (state, layer)) in states.iter_mut().zip(model.layers()).enumerate() {
            let widths = layer.state_widths().ok_or_else(|| {
                SnapshotError::Unsupported(format!("layer {i}'s mixer has no snapshot hook"))
            })?;
            let count = r.u32("array count")? as usize;
            if count != widths.len() {
                return Err(SnapshotError::Malformed(format!(
                    "layer {i}: {count} state arrays; expected {}",
                    widths.len()
                )));
            }
            let mut arrays = Vec::with_capacity(count);
            for (a, &w) in widths.iter().enumerate() {
                let c = r.count("array length", 4)?;
                if n.checked_mul(w) != Some(c) {
                    return Err(SnapshotError::Malformed(format!(
                        "layer {i} array {a}: {c} values; expected {n} positions x {w}"
                    )));
                }
                let data: Vec<f32> = r
                    .take(c * 4, "state array")?
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                arrays.push(data);
            }
            let sizes = layer.fixed_state_sizes();
            let mut fixed = Vec::with_capacity(sizes.len());
            if version >= 3 {
                let count = r.u32("fixed array count")? as usize;
                if count != sizes.len() {
                    return Err(SnapshotError::Malformed(format!(
                        "layer {i}: {count} fixed state arrays; expected {}",
                        sizes.len()
                    )));
                }
                for (a, &want) in sizes.iter().enumerate() {
                    let c = r.count("fixed array length", 4)?;
                    if c != want {
                        return Err(SnapshotError::Malformed(format!(
                            "layer {i} fixed array {a}: {c} values; expected {want}"
                        )));
                    }
                    fixed.push(
                        r.take(c * 4, "fixed state array")?
                            .chunks_exact(4)
                            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                            .collect::<Vec<f32>>(),
                    );
                }
            } else if !sizes.is_empty() {
                return Err(SnapshotError::Malformed(format!(
                    "layer {i}: a version {version} snapshot holds no recurrent state"
                )));
            }
            state.import_arrays(n, arrays, fixed)?;
        }
        *len = n;
    }
    if version >= 2 {
        let on = r.take(1, "output flag")?[0];
        let start = r.u64("output start")?;
        let hd = model.hidden_size();
        let c = r.count("output length", 4)?;
        let start = usize::try_from(start)
            .ok()
            .filter(|&s| s <= n)
            .ok_or_else(|| {
                SnapshotError::Malformed(format!("outputs start at {start}, past {n} positions"))
            })?;
        if on > 1 || (n - start).checked_mul(hd) != Some(c) || (on == 0 && c != 0) {
            return Err(SnapshotError::Malformed(format!(
                "outputs: flag {on}, {c} values from position {start}; expected {} x {hd}",
                n - start
            )));
        }
        let data: Vec<f32> = r
            .take(c * 4, "outputs")?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if on == 1 {
            session.set_outputs(Some(OutputStates { start, data }));
        }
    }
    if r.pos != body.len() {
        return Err(SnapshotError::Malformed(format!(
            "{} trailing bytes",
            body.len() - r.pos
        )));
    }
    Ok((session, history))
}

/// Write a snapshot to `path` atomically: temp file in the same directory, fsync, rename,
/// fsync of the directory.
pub fn save(
    path: &Path,
    model: &Model,
    hash: &[u8; 32],
    session: &Session,
    history: &[u32],
) -> SnapshotResult<()> {
    let io = |op: &'static str, p: &Path| {
        let p = p.to_path_buf();
        move |source| SnapshotError::Io {
            path: p,
            op,
            source,
        }
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| SnapshotError::Io {
            path: path.to_path_buf(),
            op: "name",
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "no file name"),
        })?
        .to_string_lossy()
        .into_owned();
    // Never replace a device, FIFO or directory with a regular file.
    if let Ok(meta) = std::fs::metadata(path) {
        if !meta.is_file() {
            return Err(not_regular(path, &meta));
        }
    }
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| -> SnapshotResult<()> {
        let f = File::create(&tmp).map_err(io("create", &tmp))?;
        let w = write_snapshot(
            BufWriter::with_capacity(1 << 20, f),
            model,
            hash,
            session,
            history,
        )
        .map_err(|e| match e {
            SnapshotError::Io { op, source, .. } => SnapshotError::Io {
                path: tmp.clone(),
                op,
                source,
            },
            e => e,
        })?;
        let f = w
            .into_inner()
            .map_err(|e| io("write", &tmp)(e.into_error()))?;
        f.sync_all().map_err(io("fsync", &tmp))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(io("rename", path))?;
        if let Ok(d) = File::open(&dir) {
            d.sync_all().map_err(io("fsync", &dir))?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Read and check a snapshot file (see [`decode`]).
pub fn load(path: &Path, model: &Model, hash: &[u8; 32]) -> SnapshotResult<(Session, Vec<u32>)> {
    let io = |op: &'static str| {
        move |source| SnapshotError::Io {
            path: path.to_path_buf(),
            op,
            source,
        }
    };
    // A regular file of a size this model's snapshot can have: never read a device or FIFO
    // (/dev/zero would be read until memory runs out) or a file too large to be one.
    let meta = std::fs::metadata(path).map_err(io("stat"))?;
    if !meta.is_file() {
        return Err(not_regular(path, &meta));
    }
    let cap = max_snapshot_bytes(model);
    if meta.len() > cap {
        return Err(SnapshotError::TooLarge {
            path: path.to_path_buf(),
            len: meta.len(),
            cap,
        });
    }
    let mut bytes = Vec::new();
    File::open(path)
        .map_err(io("open"))?
        .take(cap + 1)
        .read_to_end(&mut bytes)
        .map_err(io("read"))?;
    decode(&bytes, model, hash)
}

/// The largest snapshot `model` can have: its whole context of token ids, per-position states
/// and recorded outputs, its fixed states, and the framing.
pub fn max_snapshot_bytes(model: &Model) -> u64 {
    let positions = model.config().max_position_embeddings() as u64;
    let per_position = 4 + model.state_bytes_per_position() + 4 * model.hidden_size() as u64;
    let layers = model.layers().len() as u64;
    positions
        .saturating_mul(per_position)
        .saturating_add(model.fixed_state_bytes())
        .saturating_add(layers.saturating_mul(256))
        .saturating_add(1 << 20)
}

fn not_regular(path: &Path, meta: &std::fs::Metadata) -> SnapshotError {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    let kind = if t.is_dir() {
        "a directory"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    };
    SnapshotError::NotARegularFile {
        path: path.to_path_buf(),
        kind: kind.into(),
    }
}

/// Keep the longest prefix of `history` (the positions `session` holds) that `prompt` starts
/// with. The whole prompt is kept only when the session recorded the output of its last
/// position (the first new token's logits come from it, [`Model::logits_from_recorded`]);
/// otherwise at least one prompt token is left to feed. A recurrent state (KDA) is known only
/// at the end of the history, so with one the prefix is kept only when the prompt extends the
/// whole history; otherwise the session starts over. Truncates `session` (no copy) and returns
/// how many prompt tokens it already holds.
pub fn reuse_prefix(
    session: &mut Session,
    history: &[u32],
    prompt: &[u32],
) -> crate::error::Result<usize> {
    let common = history
        .iter()
        .zip(prompt)
        .take_while(|(a, b)| a == b)
        .count();
    let mut keep = common.min(prompt.len()).min(session.len());
    if keep == prompt.len() && !(keep > 0 && session.has_output(keep - 1)) {
        keep = keep.saturating_sub(1);
    }
    if !session.can_truncate(keep) {
        keep = 0;
    }
    session.truncate(keep)?;
    Ok(keep)
}

/// `data` as little-endian f32 bytes through `put`, 64 Ki values at a time.
fn put_f32s(
    put: &mut impl FnMut(&[u8]) -> std::io::Result<()>,
    data: &[f32],
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(data.len().min(1 << 16) * 4);
    for chunk in data.chunks(1 << 16) {
        buf.clear();
        for x in chunk {
            buf.extend_from_slice(&x.to_le_bytes());
        }
        put(&buf)?;
    }
    Ok(())
}
