//! Writing a checkpoint directory in the Hugging Face on-disk format (config.json + safetensors
//! shards, with `model.safetensors.index.json` when sharded) from a list of tensors whose
//! values are drawn from a seed or computed by the caller. `deltafin synth` builds its
//! synthetic models on this; tests build small checkpoints with it.
//!
//! Nothing here knows a model family: the caller says which tensors exist and how their values
//! are drawn.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::Path;

use serde_json::{json, Value};

use crate::error::{Result, StorageError};
use crate::layout::Progress;
use crate::safetensors::{write_header, Dtype, TensorSpec};

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fill {
    /// Uniform with unit-variance output for a linear layer of this fan-in.
    Linear { fan_in: u64 },
    /// Uniform in [-scale, scale].
    Uniform(f32),
    /// Uniform in [lo, hi].
    Range(f32, f32),
    /// Every element this value.
    Constant(f32),
    /// The first `count` elements uniform in [lo, hi], the rest zero (a padded vector).
    Padded { lo: f32, hi: f32, count: u64 },
    /// Part `part` of the bytes the caller's `computed` callback returns for group `group`
    /// (e.g. the quantized form of a weight drawn as `Linear`).
    Computed { group: usize, part: usize },
}

/// One tensor to write.
#[derive(Clone, Debug)]
pub struct PlannedTensor {
    pub spec: TensorSpec,
    pub fill: Fill,
}

/// Where and how to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteOptions {
    /// Seed of every drawn value.
    pub seed: u64,
    /// Shard size: a new shard starts once a tensor would cross it.
    pub shard_bytes: u64,
    /// Replace a checkpoint already in the directory.
    pub force: bool,
}

/// What was written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WriteSummary {
    pub bytes: u64,
    pub tensors: usize,
    pub shards: usize,
}

/// A stateless 64-bit mixer (splitmix64's finalizer).
pub fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The seed of tensor `name`'s values under checkpoint seed `seed`.
pub fn tensor_seed(seed: u64, name: &str) -> u64 {
    splitmix(
        seed ^ u64::from_le_bytes(
            blake3::hash(name.as_bytes()).as_bytes()[..8]
                .try_into()
                .unwrap_or([0; 8]),
        ),
    )
}

/// Value of element `j` of a tensor drawn with `fill` from `seed` (a tensor seed).
fn value(fill: Fill, seed: u64, j: u64) -> f32 {
    let (lo, hi) = match fill {
        Fill::Constant(c) => return c,
        Fill::Computed { .. } => return 0.0,
        Fill::Padded { count, .. } if j >= count => return 0.0,
        Fill::Padded { lo, hi, .. } => (lo, hi),
        Fill::Linear { fan_in } => {
            let s = (3.0 / fan_in.max(1) as f32).sqrt();
            (-s, s)
        }
        Fill::Uniform(s) => (-s, s),
        Fill::Range(lo, hi) => (lo, hi),
    };
    let r = splitmix(seed ^ (j / 4).wrapping_mul(0xD6E8_FEB8_6659_FD93));
    let u = (r >> (16 * (j % 4))) as u16;
    // u / 32768 - 1 is in [-1, 1); map it onto [lo, hi).
    let t = u as f32 / 32768.0 - 1.0;
    (lo + hi) * 0.5 + t * (hi - lo) * 0.5
}

/// Fill `out` with the encoded values of elements `first..` of a `dtype` tensor (F32, or BF16
/// for every other dtype).
fn fill_bytes(out: &mut [u8], dtype: &Dtype, fill: Fill, seed: u64, first: u64) {
    match dtype {
        Dtype::F32 => {
            for (k, c) in out.chunks_exact_mut(4).enumerate() {
                c.copy_from_slice(&value(fill, seed, first + k as u64).to_le_bytes());
            }
        }
        _ => {
            for (k, c) in out.chunks_exact_mut(2).enumerate() {
                let v = half::bf16::from_f32(value(fill, seed, first + k as u64));
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// The values of tensor `spec` drawn with `fill` under checkpoint seed `seed`, exactly as
/// [`write_checkpoint`] writes them (after rounding to the tensor's dtype: F32, else BF16).
pub fn drawn_values(spec: &TensorSpec, fill: Fill, seed: u64) -> Vec<f32> {
    let mut bytes = vec![0u8; spec.byte_len() as usize];
    fill_bytes(
        &mut bytes,
        &spec.dtype,
        fill,
        tensor_seed(seed, &spec.name),
        0,
    );
    match spec.dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        _ => bytes
            .chunks_exact(2)
            .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
            .collect(),
    }
}

/// The bytes of every part of one [`Fill::Computed`] group, in part order.
pub type ComputeParts<'a> = dyn Fn(usize) -> Result<Vec<Vec<u8>>> + 'a;

/// Write `tensors` with `config` into `dir` (created; must not hold config.json unless
/// `opts.force`), in shards of about `opts.shard_bytes`. Values of [`Fill::Computed`] tensors come from
/// `computed` (called once per group, in the order groups are met). config.json is written
/// last, so an interrupted write leaves no checkpoint that opens.
pub fn write_checkpoint(
    dir: &Path,
    config: &Value,
    tensors: Vec<PlannedTensor>,
    opts: &WriteOptions,
    computed: &ComputeParts<'_>,
    progress: &dyn Progress,
) -> Result<WriteSummary> {
    let WriteOptions {
        seed,
        shard_bytes,
        force,
    } = *opts;
    fs::create_dir_all(dir).map_err(|e| StorageError::io(dir, "create", e))?;
    let cfg_path = dir.join("config.json");
    if cfg_path.exists() && !force {
        return Err(StorageError::LayoutExists {
            path: dir.to_path_buf(),
        });
    }
    // Remove what a previous run left so a stale index cannot point at stale shards.
    for entry in fs::read_dir(dir)
        .map_err(|e| StorageError::io(dir, "read_dir", e))?
        .flatten()
    {
        let n = entry.file_name().to_string_lossy().to_string();
        if n.ends_with(".safetensors") || n == "model.safetensors.index.json" || n == "config.json"
        {
            fs::remove_file(entry.path())
                .map_err(|e| StorageError::io(&entry.path(), "remove", e))?;
        }
    }
    let mut shards: Vec<Vec<PlannedTensor>> = vec![Vec::new()];
    let mut cur = 0u64;
    for t in tensors {
        let n = t.spec.byte_len();
        if cur > 0 && cur + n > shard_bytes {
            shards.push(Vec::new());
            cur = 0;
        }
        cur += n;
        if let Some(last) = shards.last_mut() {
            last.push(t);
        }
    }
    let total: u64 = shards.iter().flatten().map(|t| t.spec.byte_len()).sum();
    progress.start(total, "synthesizing");
    let nshards = shards.len();
    let mut weight_map = BTreeMap::new();
    let mut count = 0;
    let mut cached: Option<(usize, Vec<Vec<u8>>)> = None;
    for (si, shard) in shards.iter().enumerate() {
        let fname = if nshards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", si + 1, nshards)
        };
        write_shard(dir, &fname, shard, seed, computed, &mut cached, progress)?;
        for t in shard {
            weight_map.insert(t.spec.name.clone(), fname.clone());
            count += 1;
        }
    }
    if nshards > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let p = dir.join("model.safetensors.index.json");
        fs::write(&p, serde_json::to_vec_pretty(&index).unwrap_or_default())
            .map_err(|e| StorageError::io(&p, "write", e))?;
    }
    let text = serde_json::to_vec_pretty(config).unwrap_or_default();
    crate::manifest::write_atomic(&cfg_path, &text)?;
    progress.finish();
    Ok(WriteSummary {
        bytes: total,
        tensors: count,
        shards: nshards,
    })
}

/// Write one shard through a temporary file, fsync and rename.
fn write_shard(
    dir: &Path,
    fname: &str,
    shard: &[PlannedTensor],
    seed: u64,
    computed: &ComputeParts<'_>,
    cached: &mut Option<(usize, Vec<Vec<u8>>)>,
    progress: &dyn Progress,
) -> Result<()> {
    let path = dir.join(fname);
    let tmp = dir.join(format!("{fname}.partial"));
    let file = File::create(&tmp).map_err(|e| StorageError::io(&tmp, "create", e))?;
    let mut out = BufWriter::with_capacity(8 << 20, file);
    let specs: Vec<TensorSpec> = shard.iter().map(|t| t.spec.clone()).collect();
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    write_header(&mut out, &specs, &meta).map_err(|e| StorageError::io(&tmp, "write", e))?;
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let mut buf = vec![0u8; 16 << 20];
    for t in shard {
        if let Fill::Computed { group, part } = t.fill {
            if cached.as_ref().map(|c| c.0) != Some(group) {
                *cached = Some((group, computed(group)?));
            }
            let bytes = cached
                .as_ref()
                .and_then(|c| c.1.get(part))
                .filter(|b| b.len() as u64 == t.spec.byte_len())
                .ok_or_else(|| {
                    StorageError::InvalidArgument(format!(
                        "computed tensor `{}` has the wrong length",
                        t.spec.name
                    ))
                })?;
            out.write_all(bytes)
                .map_err(|e| StorageError::io(&tmp, "write", e))?;
            progress.advance(bytes.len() as u64);
            continue;
        }
        let tseed = tensor_seed(seed, &t.spec.name);
        let esize = t.spec.dtype.size_bytes().unwrap_or(1);
        let len = t.spec.byte_len();
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(buf.len() as u64) as usize;
            let chunk = &mut buf[..n];
            let per = (n / threads / 64 + 1) * 64;
            std::thread::scope(|s| {
                for (k, piece) in chunk.chunks_mut(per).enumerate() {
                    let first = (done + (k * per) as u64) / esize;
                    let dtype = &t.spec.dtype;
                    let fill = t.fill;
                    s.spawn(move || fill_bytes(piece, dtype, fill, tseed, first));
                }
            });
            out.write_all(chunk)
                .map_err(|e| StorageError::io(&tmp, "write", e))?;
            done += n as u64;
            progress.advance(n as u64);
        }
    }
    let file = out
        .into_inner()
        .map_err(|e| StorageError::io(&tmp, "write", e.into_error()))?;
    file.sync_all()
        .map_err(|e| StorageError::io(&tmp, "fsync", e))?;
    fs::rename(&tmp, &path).map_err(|e| StorageError::io(&path, "rename", e))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::layout::NoProgress;

    #[test]
    fn drawn_values_match_the_file_and_stay_in_range() {
        let dir = tempfile::tempdir().unwrap();
        let opts = WriteOptions {
            seed: 7,
            shard_bytes: 1 << 20,
            force: false,
        };
        let tensors = vec![
            PlannedTensor {
                spec: TensorSpec::new("a", Dtype::Bf16, &[3, 64]),
                fill: Fill::Linear { fan_in: 64 },
            },
            PlannedTensor {
                spec: TensorSpec::new("b", Dtype::F32, &[100]),
                fill: Fill::Range(-2.0, -1.0),
            },
            PlannedTensor {
                spec: TensorSpec::new("c", Dtype::U8, &[4]),
                fill: Fill::Computed { group: 0, part: 0 },
            },
        ];
        let s = write_checkpoint(
            dir.path(),
            &json!({"model_type": "test"}),
            tensors.clone(),
            &opts,
            &|_| Ok(vec![vec![1, 2, 3, 4]]),
            &NoProgress,
        )
        .unwrap();
        assert_eq!((s.tensors, s.shards), (3, 1));
        let ck = crate::checkpoint::Checkpoint::open(dir.path()).unwrap();
        let b = drawn_values(&tensors[1].spec, tensors[1].fill, 7);
        assert!(b.iter().all(|&v| (-2.0..=-1.0).contains(&v)), "{b:?}");
        let got: Vec<f32> = ck
            .bytes("b")
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(got, b);
        assert_eq!(ck.bytes("c").unwrap(), &[1, 2, 3, 4]);
        let a = drawn_values(&tensors[0].spec, tensors[0].fill, 7);
        let s = (3.0f32 / 64.0).sqrt();
        assert!(a.iter().all(|v| v.abs() <= s * 1.01));
        // A second write refuses without force.
        assert!(write_checkpoint(
            dir.path(),
            &json!({}),
            tensors,
            &opts,
            &|_| Ok(vec![vec![1, 2, 3, 4]]),
            &NoProgress,
        )
        .is_err());
    }
}
