//! Streamed decoder layers over a layout: which resident records make up a layer's streamed
//! weights ([`streamable_layers`]), and the source a streamed layer is rebuilt from for one
//! forward ([`StreamedLayerSource`]).
//!
//! A layer's streamed weights are its matrices (records of at least [`MIN_STREAMED_RECORD`]
//! bytes whose tensors all have more than one row and all belong to that layer); its norms,
//! biases, convolution taps and one-row queries stay resident: they are small, and the model
//! around the layers (K3's Attention Residuals) reads some of them.

use std::collections::HashMap;

use deltafin_storage::manifest::{Manifest, RecordId, RecordTensor};
use deltafin_storage::store::LandedGroup;
use serde::Serialize;

use crate::error::Result;
use crate::linear::bytes::WeightBytes;
use crate::weights::{ExpertCallback, ExpertGroupCallback, TensorRef, WeightSource};

/// Smaller resident records are never streamed.
pub const MIN_STREAMED_RECORD: u64 = 64 << 10;

/// One decoder layer's streamable weights.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct LayerWeightBytes {
    pub layer: usize,
    /// Payload bytes of the records below.
    pub bytes: u64,
    /// Bytes of the buffers they are read into (each rounded up to 4 KiB).
    pub buffer_bytes: u64,
    /// Manifest indices of the records.
    #[serde(skip)]
    pub records: Vec<usize>,
}

/// A layout's resident set split into what each layer could stream and the rest.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct StreamableLayers {
    /// Layers with streamable weights, in layer order.
    pub layers: Vec<LayerWeightBytes>,
    /// Every resident record's bytes.
    pub resident_bytes: u64,
}

impl StreamableLayers {
    /// Resident bytes that are never streamed (embeddings, head, norms, small tensors).
    pub fn fixed_bytes(&self) -> u64 {
        self.resident_bytes
            .saturating_sub(self.layers.iter().map(|l| l.bytes).sum())
    }

    pub fn layer(&self, layer: usize) -> Option<&LayerWeightBytes> {
        self.layers.iter().find(|l| l.layer == layer)
    }
}

/// The decoder layer a resident tensor belongs to (`{layers_prefix}{L}.…`).
pub fn layer_of(name: &str, layers_prefix: &str) -> Option<usize> {
    let rest = name.strip_prefix(layers_prefix)?;
    let (digits, tail) = rest.split_once('.')?;
    if tail.is_empty() || digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// What each decoder layer of `manifest` could stream (tensors named `{layers_prefix}{L}.…`,
/// records of at least `min_record` bytes).
pub fn streamable_layers(
    manifest: &Manifest,
    layers_prefix: &str,
    min_record: u64,
) -> StreamableLayers {
    let mut by_layer: std::collections::BTreeMap<usize, LayerWeightBytes> = Default::default();
    let mut resident_bytes = 0u64;
    for (i, r) in manifest.records.iter().enumerate() {
        if !matches!(r.id, RecordId::Resident { .. }) {
            continue;
        }
        resident_bytes += r.len;
        if r.len < min_record || r.tensors.is_empty() {
            continue;
        }
        let matrices = r
            .tensors
            .iter()
            .all(|t| t.shape.len() >= 2 && t.shape[0] > 1);
        let layers: Vec<Option<usize>> = r
            .tensors
            .iter()
            .map(|t| layer_of(&t.name, layers_prefix))
            .collect();
        let Some(Some(layer)) = layers.first().copied() else {
            continue;
        };
        if !matrices || layers.iter().any(|l| *l != Some(layer)) {
            continue;
        }
        let e = by_layer.entry(layer).or_insert(LayerWeightBytes {
            layer,
            bytes: 0,
            buffer_bytes: 0,
            records: Vec::new(),
        });
        e.bytes += r.len;
        e.buffer_bytes += r.len.div_ceil(4096) * 4096;
        e.records.push(i);
    }
    StreamableLayers {
        layers: by_layer.into_values().collect(),
        resident_bytes,
    }
}

/// Where a streamed layer's buffers go back to (the layout's store).
pub(crate) trait GiveBack: Send + Sync {
    fn give_back(&self, landed: LandedGroup);
}

impl GiveBack for deltafin_storage::store::ExpertStore {
    fn give_back(&self, landed: LandedGroup) {
        self.give_back_group(landed);
    }
}

/// A streamed layer's weights for one forward: its landed records first, everything else as
/// the layout source has it. Dropping it gives the buffers back to the stream.
pub struct StreamedLayerSource<'a> {
    parent: &'a dyn WeightSource,
    landed: Option<LandedGroup>,
    give_back: &'a dyn GiveBack,
    /// Tensor name -> (position in `landed.records`, its description).
    by_name: HashMap<&'a str, (usize, &'a RecordTensor)>,
}

impl<'a> StreamedLayerSource<'a> {
    /// The landed group over `parent` (whose layout's `manifest` names the records);
    /// `give_back` takes the buffers when this is dropped.
    pub(crate) fn new(
        parent: &'a dyn WeightSource,
        manifest: &'a Manifest,
        landed: LandedGroup,
        give_back: &'a dyn GiveBack,
    ) -> StreamedLayerSource<'a> {
        let mut by_name = HashMap::new();
        for (pos, (record, _)) in landed.records.iter().enumerate() {
            if let Some(r) = manifest.records.get(*record) {
                for t in &r.tensors {
                    by_name.insert(t.name.as_str(), (pos, t));
                }
            }
        }
        StreamedLayerSource {
            parent,
            landed: Some(landed),
            give_back,
            by_name,
        }
    }

    fn landed_tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        let &(pos, t) = self.by_name.get(name)?;
        let (_, buf) = self.landed.as_ref()?.records.get(pos)?;
        let end = t.offset.checked_add(t.len)?;
        let bytes = buf.get(usize::try_from(t.offset).ok()?..usize::try_from(end).ok()?)?;
        Some(TensorRef::new(t.dtype.clone(), &t.shape, bytes))
    }
}

impl std::fmt::Debug for StreamedLayerSource<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamedLayerSource")
            .field("group", &self.landed.as_ref().map(|l| l.group))
            .field("tensors", &self.by_name.len())
            .finish()
    }
}

impl Drop for StreamedLayerSource<'_> {
    fn drop(&mut self) {
        if let Some(landed) = self.landed.take() {
            self.give_back.give_back(landed);
        }
    }
}

impl WeightSource for StreamedLayerSource<'_> {
    fn config(&self) -> &serde_json::Value {
        self.parent.config()
    }

    fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        match self.landed_tensor(name) {
            Some(t) => Ok(t),
            None => self.parent.tensor(name),
        }
    }

    fn with_experts(
        &self,
        layer: usize,
        experts: &[usize],
        on_ready: &mut ExpertCallback<'_>,
    ) -> Result<()> {
        self.parent.with_experts(layer, experts, on_ready)
    }

    fn with_expert_groups(
        &self,
        layer: usize,
        experts: &[usize],
        on_group: &mut ExpertGroupCallback<'_>,
    ) -> Result<()> {
        self.parent.with_expert_groups(layer, experts, on_group)
    }

    fn share(&self, bytes: &[u8]) -> Option<WeightBytes> {
        let start = bytes.as_ptr() as usize;
        let end = start.checked_add(bytes.len())?;
        let landed = self.landed.as_ref()?;
        for (_, buf) in &landed.records {
            let base = buf.as_ptr() as usize;
            let top = base.checked_add(buf.len())?;
            if base <= start && end <= top {
                return WeightBytes::shared(buf.clone(), start - base..end - base);
            }
        }
        self.parent.share(bytes)
    }

    fn has_tensor(&self, name: &str) -> bool {
        self.by_name.contains_key(name) || self.parent.has_tensor(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_of_reads_the_index_after_the_prefix() {
        let p = "model.layers.";
        assert_eq!(
            layer_of("model.layers.12.self_attn.o_proj.weight", p),
            Some(12)
        );
        assert_eq!(layer_of("model.layers.0.mlp.gate.weight", p), Some(0));
        assert_eq!(layer_of("model.layers.x.mlp", p), None);
        assert_eq!(layer_of("model.layers.3", p), None);
        assert_eq!(layer_of("model.norm.weight", p), None);
        assert_eq!(
            layer_of(
                "language_model.model.layers.7.self_attn.q_proj.weight",
                "language_model.model.layers."
            ),
            Some(7)
        );
    }
}
