//! A Hugging Face checkpoint directory: `config.json` plus one or many `*.safetensors`
//! (with `model.safetensors.index.json` when sharded), and the split of its tensors into the
//! resident set and routed-expert records.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{Result, StorageError};
use crate::safetensors::{self, Dtype, TensorInfo};

/// `model_type`s whose tensors we know how to place and run.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &["deepseek_v3", "kimi_k2", "qwen3_moe"];

/// One tensor of the checkpoint and the shard holding it.
#[derive(Clone, Debug)]
pub struct CheckpointTensor {
    pub info: TensorInfo,
    /// Index into [`Checkpoint::files`].
    pub file: usize,
}

/// Where a tensor goes in a layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TensorRole {
    /// Kept in RAM for the whole run: embeddings, attention, norms, routers, shared experts,
    /// dense MLPs, lm_head.
    Resident,
    /// One routed expert's own tensor (`...mlp.experts.E.gate_proj.weight`).
    Expert {
        layer: u32,
        expert: u32,
        part: String,
    },
    /// A per-layer tensor holding every routed expert along its first dimension
    /// (`...mlp.experts.gate_up_proj`).
    FusedExperts { layer: u32, part: String },
}

/// Classify a tensor by its Hugging Face name.
pub fn tensor_role(name: &str) -> TensorRole {
    let Some(rest) = name.strip_prefix("model.layers.") else {
        return TensorRole::Resident;
    };
    let Some((layer, rest)) = rest.split_once('.') else {
        return TensorRole::Resident;
    };
    let Ok(layer) = layer.parse::<u32>() else {
        return TensorRole::Resident;
    };
    let Some(rest) = rest.strip_prefix("mlp.experts.") else {
        return TensorRole::Resident;
    };
    match rest.split_once('.') {
        Some((e, part)) if e.bytes().all(|b| b.is_ascii_digit()) && !e.is_empty() => {
            match e.parse::<u32>() {
                Ok(expert) => TensorRole::Expert {
                    layer,
                    expert,
                    part: part.to_string(),
                },
                Err(_) => TensorRole::Resident,
            }
        }
        _ => TensorRole::FusedExperts {
            layer,
            part: rest.to_string(),
        },
    }
}

/// A piece of an expert record: which bytes of which shard, and what they mean.
#[derive(Clone, Debug)]
pub struct ExpertPart {
    /// Name within the expert (`gate_proj.weight`, `down_proj.weight_scale`, `gate_up_proj`).
    pub part: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub file: usize,
    pub offset: u64,
    pub len: u64,
    /// The full checkpoint tensor name the bytes come from (for error messages).
    pub source: String,
}

/// All tensors of one routed expert, in a fixed order.
#[derive(Clone, Debug)]
pub struct ExpertSource {
    pub layer: u32,
    pub expert: u32,
    pub parts: Vec<ExpertPart>,
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
    maps: Vec<Mmap>,
}

impl Checkpoint {
    /// Open `dir`, read `config.json`, parse and validate every shard header.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let config_path = dir.join("config.json");
        let config = read_config(&config_path)?;
        let model_type = check_model_type(&config_path, &config)?;

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
            maps.push(map);
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

    /// Bytes `offset..offset+len` of shard `file` (bounds were validated at open).
    pub fn slice(&self, file: usize, offset: u64, len: u64) -> &[u8] {
        &self.maps[file][offset as usize..(offset + len) as usize]
    }

    /// Number of routed experts per MoE layer the config declares.
    pub fn n_routed_experts(&self) -> Option<u64> {
        self.config
            .get("n_routed_experts")
            .or_else(|| self.config.get("num_experts"))
            .and_then(|v| v.as_u64())
    }

    /// Resident tensors, in file order.
    pub fn resident(&self) -> impl Iterator<Item = &CheckpointTensor> {
        self.tensors
            .iter()
            .filter(|t| tensor_role(&t.info.name) == TensorRole::Resident)
    }

    /// Every routed expert, sorted by (layer, expert), each with its parts sorted by name.
    /// Fused per-layer tensors are cut into per-expert slices.
    pub fn experts(&self) -> Result<Vec<ExpertSource>> {
        let mut map: BTreeMap<(u32, u32), Vec<ExpertPart>> = BTreeMap::new();
        for t in &self.tensors {
            match tensor_role(&t.info.name) {
                TensorRole::Resident => {}
                TensorRole::Expert {
                    layer,
                    expert,
                    part,
                } => {
                    map.entry((layer, expert)).or_default().push(ExpertPart {
                        part,
                        dtype: t.info.dtype.clone(),
                        shape: t.info.shape.clone(),
                        file: t.file,
                        offset: t.info.offset,
                        len: t.info.len,
                        source: t.info.name.clone(),
                    });
                }
                TensorRole::FusedExperts { layer, part } => {
                    let n = self
                        .n_routed_experts()
                        .ok_or_else(|| StorageError::Config {
                            path: self.dir.join("config.json"),
                            reason: "fused expert tensors need n_routed_experts or num_experts"
                                .into(),
                        })?;
                    let bad = |reason: String| StorageError::Tensor {
                        path: self.files[t.file].clone(),
                        tensor: t.info.name.clone(),
                        reason,
                    };
                    if t.info.shape.first() != Some(&n) || t.info.shape.len() < 2 {
                        return Err(bad(format!(
                            "fused expert tensor has shape {:?}; expected [{n}, ...]",
                            t.info.shape
                        )));
                    }
                    if t.info.len % n != 0 {
                        return Err(bad(format!(
                            "{} bytes do not split into {n} experts",
                            t.info.len
                        )));
                    }
                    let slice = t.info.len / n;
                    for e in 0..n {
                        map.entry((layer, e as u32)).or_default().push(ExpertPart {
                            part: part.clone(),
                            dtype: t.info.dtype.clone(),
                            shape: t.info.shape[1..].to_vec(),
                            file: t.file,
                            offset: t.info.offset + e * slice,
                            len: slice,
                            source: format!("{}[{e}]", t.info.name),
                        });
                    }
                }
            }
        }
        let out: Vec<ExpertSource> = map
            .into_iter()
            .map(|((layer, expert), mut parts)| {
                parts.sort_by(|a, b| a.part.cmp(&b.part));
                ExpertSource {
                    layer,
                    expert,
                    parts,
                }
            })
            .collect();
        // Within a layer every expert must carry the same parts with the same shapes.
        let mut i = 0;
        while i < out.len() {
            let layer = out[i].layer;
            let first = i;
            while i < out.len() && out[i].layer == layer {
                let (a, b) = (&out[first], &out[i]);
                let same = a.parts.len() == b.parts.len()
                    && a.parts
                        .iter()
                        .zip(&b.parts)
                        .all(|(x, y)| x.part == y.part && x.dtype == y.dtype && x.shape == y.shape);
                if !same {
                    let names = |s: &ExpertSource| {
                        s.parts
                            .iter()
                            .map(|p| format!("{} {} {:?}", p.part, p.dtype, p.shape))
                            .collect::<Vec<_>>()
                    };
                    return Err(StorageError::Tensor {
                        path: self.dir.clone(),
                        tensor: format!("model.layers.{layer}.mlp.experts.{}", b.expert),
                        reason: format!(
                            "expert has parts {:?} but expert {} of the same layer has {:?}",
                            names(b),
                            a.expert,
                            names(a)
                        ),
                    });
                }
                i += 1;
            }
        }
        Ok(out)
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

/// The config's `model_type`, if it is one we support.
pub fn check_model_type(path: &Path, config: &serde_json::Value) -> Result<String> {
    let supported = || {
        SUPPORTED_MODEL_TYPES
            .iter()
            .map(|s| s.to_string())
            .collect()
    };
    match config.get("model_type").and_then(|v| v.as_str()) {
        Some(t) if SUPPORTED_MODEL_TYPES.contains(&t) => Ok(t.to_string()),
        Some(t) => Err(StorageError::UnsupportedModelType {
            path: path.to_path_buf(),
            got: t.to_string(),
            supported: supported(),
        }),
        None => Err(StorageError::Config {
            path: path.to_path_buf(),
            reason: format!(
                "missing string field `model_type` (supported: {})",
                SUPPORTED_MODEL_TYPES.join(", ")
            ),
        }),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles() {
        assert_eq!(
            tensor_role("model.embed_tokens.weight"),
            TensorRole::Resident
        );
        assert_eq!(
            tensor_role("model.layers.3.mlp.gate.weight"),
            TensorRole::Resident
        );
        assert_eq!(
            tensor_role("model.layers.3.mlp.shared_experts.up_proj.weight"),
            TensorRole::Resident
        );
        assert_eq!(
            tensor_role("model.layers.3.mlp.experts.12.down_proj.weight_scale_inv"),
            TensorRole::Expert {
                layer: 3,
                expert: 12,
                part: "down_proj.weight_scale_inv".into()
            }
        );
        assert_eq!(
            tensor_role("model.layers.7.mlp.experts.gate_up_proj"),
            TensorRole::FusedExperts {
                layer: 7,
                part: "gate_up_proj".into()
            }
        );
        assert_eq!(tensor_role("lm_head.weight"), TensorRole::Resident);
    }
}
