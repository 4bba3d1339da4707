//! Layout-time rewriting of routed-expert records and resident tensors (e.g. quantizing them):
//! the trait a transform implements and the part descriptions it works on.

use std::collections::BTreeMap;

use crate::error::Result;
use crate::safetensors::Dtype;

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
/// The planner asks [`ExpertTransform::parts`] for each expert's output tensors from the source
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
    /// The tensors a resident (non-expert) tensor becomes, in record order; `None` (the
    /// default): copied as it is. Asked while planning, from the name, dtype and shape alone.
    fn resident_parts(&self, source: &PartSpec) -> Result<Option<Vec<PartSpec>>> {
        let _ = source;
        Ok(None)
    }
    /// The bytes of each part [`Self::resident_parts`] returned for `source`.
    fn apply_resident(&self, source: &PartSpec, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let _ = bytes;
        Err(crate::error::StorageError::InvalidArgument(format!(
            "resident tensor `{}`: this transform does not rewrite resident tensors",
            source.name
        )))
    }
}
