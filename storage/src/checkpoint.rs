//! A Hugging Face checkpoint directory: `config.json` plus one or many `*.safetensors`
//! (with `model.safetensors.index.json` when sharded), and the split of its tensors into the
//! resident set and routed-expert records.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{Result, StorageError};
use crate::safetensors::{self, TensorInfo};

/// One tensor of the checkpoint and the shard holding it.
#[derive(Clone, Debug)]
pub struct CheckpointTensor {
    pub info: TensorInfo,
    /// Index into [`Checkpoint::files`].
    pub file: usize,
}

/// An opened checkpoint directory.
#[derive(Debug)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: serde_json::Value,
    pub model_type: String,
    /// Shard paths.
    pub files: Vec<PathBuf>,
    pub tensors: Vec<CheckpointTensor>,
    by_name: HashMap<String, usize>,
    /// Shared, so a model can keep resident tensors without copying them ([`Checkpoint::share`]).
    maps: Vec<Arc<Mmap>>,
}

impl Checkpoint {
    /// Open `dir`, read `config.json`, parse and validate every shard header.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let config_path = dir.join("config.json");
        let config = read_config(&config_path)?;
        let model_type = config
            .get("model_type")
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string();

        let files = shard_files(dir)?;
        let mut tensors = Vec::new();
        let mut by_name = HashMap::new();
        let mut maps = Vec::new();
        for (fi, path) in files.iter().enumerate() {
            let header = safetensors::read_header(path)?;
            let file = File::open(path).map_err(|e| StorageError::io(path, "open", e))?;
            // SAFETY: the map is read-only; we validated above that every tensor lies within the
            // file's current length. A file truncated by someone else while we run would fault,
            // which is the usual contract of reading model weights through mmap.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| StorageError::io(path, "mmap", e))?;
            for info in header.tensors {
                if by_name.insert(info.name.clone(), tensors.len()).is_some() {
                    return Err(StorageError::Tensor {
                        path: path.clone(),
                        tensor: info.name,
                        reason: "appears in more than one shard".into(),
                    });
                }
                tensors.push(CheckpointTensor { info, file: fi });
            }
            maps.push(Arc::new(map));
        }
        let ckpt = Checkpoint {
            dir: dir.to_path_buf(),
            config,
            model_type,
            files,
            tensors,
            by_name,
            maps,
        };
        ckpt.check_index()?;
        Ok(ckpt)
    }

    /// When an index exists, every tensor it names must be in the shard it names.
    fn check_index(&self) -> Result<()> {
        let index_path = self.dir.join("model.safetensors.index.json");
        if !index_path.exists() {
            return Ok(());
        }
        let map = read_index(&index_path)?;
        for (name, file) in map {
            let Some(&i) = self.by_name.get(&name) else {
                return Err(StorageError::Tensor {
                    path: index_path.clone(),
                    tensor: name,
                    reason: format!("listed in the index (in {file}) but found in no shard"),
                });
            };
            let actual = &self.files[self.tensors[i].file];
            if actual.file_name().and_then(|n| n.to_str()) != Some(file.as_str()) {
                return Err(StorageError::Tensor {
                    path: index_path.clone(),
                    tensor: name,
                    reason: format!("index says {file} but it is in {}", actual.display()),
                });
            }
        }
        Ok(())
    }

    pub fn get(&self, name: &str) -> Option<&CheckpointTensor> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor (borrowed from the memory map).
    pub fn bytes(&self, name: &str) -> Option<&[u8]> {
        let t = self.get(name)?;
        Some(self.slice(t.file, t.info.offset, t.info.len))
    }

    /// The shard map that `bytes` (a slice this checkpoint handed out) lies in, and where: a
    /// caller keeps the tensor without copying it. `None` for bytes from anywhere else.
    pub fn share(&self, bytes: &[u8]) -> Option<(Arc<Mmap>, Range<usize>)> {
        let start = bytes.as_ptr() as usize;
        let end = start.checked_add(bytes.len())?;
        self.maps.iter().find_map(|m| {
            let base = m.as_ptr() as usize;
            let top = base.checked_add(m.len())?;
            (base <= start && end <= top).then(|| (m.clone(), start - base..end - base))
        })
    }

    /// Bytes `offset..offset+len` of shard `file` (bounds were validated at open).
    /// Bytes of all shards together.
    pub fn mapped_bytes(&self) -> u64 {
        self.maps.iter().map(|m| m.len() as u64).sum()
    }

    /// Map every shard's pages in now (`MADV_POPULATE_READ`), reading what the page cache does
    /// not hold, so the forward pass takes no page faults on first touching a weight. Best
    /// effort: a kernel without it (before Linux 5.14) or a failure leaves the lazy mapping,
    /// which still works.
    pub fn populate(&self) {
        #[cfg(target_os = "linux")]
        for m in &self.maps {
            let _ = m.advise(memmap2::Advice::PopulateRead);
        }
    }

    pub fn slice(&self, file: usize, offset: u64, len: u64) -> &[u8] {
        &self.maps[file][offset as usize..(offset + len) as usize]
    }
}

/// Read and parse `config.json` as a JSON object.
pub fn read_config(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read(path).map_err(|e| StorageError::io(path, "read", e))?;
    let value: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| StorageError::Config {
            path: path.to_path_buf(),
            reason: format!("not valid JSON: {e}"),
        })?;
    if !value.is_object() {
        return Err(StorageError::Config {
            path: path.to_path_buf(),
            reason: "not a JSON object".into(),
        });
    }
    Ok(value)
}

fn read_index(path: &Path) -> Result<BTreeMap<String, String>> {
    let text = std::fs::read(path).map_err(|e| StorageError::io(path, "read", e))?;
    let value: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| StorageError::Config {
            path: path.to_path_buf(),
            reason: format!("not valid JSON: {e}"),
        })?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| StorageError::Config {
            path: path.to_path_buf(),
            reason: "missing object `weight_map`".into(),
        })?;
    map.iter()
        .map(|(k, v)| {
            v.as_str()
                .map(|f| (k.clone(), f.to_string()))
                .ok_or_else(|| StorageError::Config {
                    path: path.to_path_buf(),
                    reason: format!("weight_map[{k}] is not a file name"),
                })
        })
        .collect()
}

/// The shard files: those the index names, or every `*.safetensors` in the directory.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index_path = dir.join("model.safetensors.index.json");
    let mut files: Vec<PathBuf> = if index_path.exists() {
        let map = read_index(&index_path)?;
        let mut names: Vec<String> = map.into_values().collect();
        names.sort();
        names.dedup();
        for n in &names {
            if n.contains('/') || n.contains("..") {
                return Err(StorageError::Config {
                    path: index_path.clone(),
                    reason: format!("shard name `{n}` leaves the model directory"),
                });
            }
        }
        names.into_iter().map(|n| dir.join(n)).collect()
    } else {
        let rd = std::fs::read_dir(dir).map_err(|e| StorageError::io(dir, "read_dir", e))?;
        let mut v = Vec::new();
        for entry in rd {
            let entry = entry.map_err(|e| StorageError::io(dir, "read_dir", e))?;
            let p = entry.path();
            if p.extension().and_then(|e| e.to_str()) == Some("safetensors") {
                v.push(p);
            }
        }
        v
    };
    files.sort();
    if files.is_empty() {
        return Err(StorageError::Config {
            path: dir.to_path_buf(),
            reason: "no *.safetensors files in the model directory".into(),
        });
    }
    for f in &files {
        if !f.exists() {
            return Err(StorageError::io(
                f,
                "open",
                std::io::Error::from(std::io::ErrorKind::NotFound),
            ));
        }
    }
    Ok(files)
}
