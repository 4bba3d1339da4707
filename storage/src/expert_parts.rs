//! A checkpoint's routed experts as records: every expert's tensors (own or sliced out of a
//! fused per-layer tensor) in a fixed order, checked to agree within each layer.

use std::collections::BTreeMap;

use crate::checkpoint::{Checkpoint, CheckpointTensor};
use crate::error::{Result, StorageError};
use crate::naming::{ExpertNaming, TensorRole};
use crate::safetensors::Dtype;

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

/// The checkpoint's resident tensors (not routed experts, not skipped), in file order.
pub fn resident_tensors<'c>(
    ckpt: &'c Checkpoint,
    naming: &'c ExpertNaming,
) -> impl Iterator<Item = &'c CheckpointTensor> + 'c {
    ckpt.tensors
        .iter()
        .filter(move |t| naming.role(&t.info.name) == TensorRole::Resident)
}

/// The tensors a layout leaves out (see [`ExpertNaming::skipped_prefixes`]).
pub fn skipped_tensors<'c>(
    ckpt: &'c Checkpoint,
    naming: &'c ExpertNaming,
) -> impl Iterator<Item = &'c CheckpointTensor> + 'c {
    ckpt.tensors
        .iter()
        .filter(move |t| naming.role(&t.info.name) == TensorRole::Skipped)
}

/// Every routed expert, sorted by (layer, expert), each with its parts sorted by name.
/// Fused per-layer tensors are cut into per-expert slices.
pub fn expert_sources(ckpt: &Checkpoint, naming: &ExpertNaming) -> Result<Vec<ExpertSource>> {
    let mut map: BTreeMap<(u32, u32), Vec<ExpertPart>> = BTreeMap::new();
    for t in &ckpt.tensors {
        match naming.role(&t.info.name) {
            TensorRole::Resident | TensorRole::Skipped => {}
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
                let n = naming.fused_experts.ok_or_else(|| StorageError::Tensor {
                    path: ckpt.files[t.file].clone(),
                    tensor: t.info.name.clone(),
                    reason: "a fused expert tensor, but the config states no expert count".into(),
                })?;
                let bad = |reason: String| StorageError::Tensor {
                    path: ckpt.files[t.file].clone(),
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
                    path: ckpt.dir.clone(),
                    tensor: naming.expert_tensor(layer, b.expert, "*"),
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
