//! Where weights come from. The forward pass only sees [`WeightSource`]: resident tensors by
//! Hugging Face name, and routed experts delivered per layer through a callback, so that a
//! source may stream experts from drives while the engine computes.
//!
//! [`DirSource`] serves a Hugging Face model directory (memory-mapped safetensors).

use std::collections::HashMap;
use std::path::Path;

use deltafin_formats::Dtype;
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::expert_parts::{expert_sources, ExpertPart};
use deltafin_storage::naming::ExpertNaming;

use crate::error::{InferenceError, Result};
use crate::linear::bytes::WeightBytes;

/// A borrowed tensor: element type, shape and raw little-endian bytes.
#[derive(Debug, Clone)]
pub struct TensorRef<'a> {
    pub dtype: Dtype,
    pub shape: &'a [u64],
    pub bytes: &'a [u8],
}

impl<'a> TensorRef<'a> {
    pub fn new(dtype: Dtype, shape: &'a [u64], bytes: &'a [u8]) -> Self {
        TensorRef {
            dtype,
            shape,
            bytes,
        }
    }

    /// Number of elements the shape declares.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// One part of a routed expert, named relative to `model.layers.L.mlp.experts.E.`
/// (`gate_proj.weight`, `down_proj.weight_scale_inv`, ...) or, for fused per-layer checkpoints,
/// the per-expert slice of `gate_up_proj` / `down_proj` (shape without the expert dimension).
#[derive(Debug, Clone)]
pub struct ExpertPartRef<'a> {
    pub name: &'a str,
    pub tensor: TensorRef<'a>,
}

/// The parts of one routed expert, as handed to the forward pass by [`WeightSource::with_experts`].
#[derive(Debug, Clone, Default)]
pub struct ExpertView<'a> {
    parts: Vec<ExpertPartRef<'a>>,
}

impl<'a> ExpertView<'a> {
    pub fn new(parts: Vec<ExpertPartRef<'a>>) -> Self {
        ExpertView { parts }
    }

    /// The part named `name` (`gate_proj.weight`, `gate_up_proj`, ...).
    pub fn part(&self, name: &str) -> Option<TensorRef<'a>> {
        self.parts
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.tensor.clone())
    }

    pub fn parts(&self) -> &[ExpertPartRef<'a>] {
        &self.parts
    }

    /// Names of all parts (for error messages).
    pub fn part_names(&self) -> Vec<&'a str> {
        self.parts.iter().map(|p| p.name).collect()
    }
    /// Whether a part is named `matrix` or `matrix.<anything>` (e.g. `gate_up_proj.weight_packed`).
    pub fn has_matrix(&self, matrix: &str) -> bool {
        self.parts.iter().any(|p| {
            p.name
                .strip_prefix(matrix)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
        })
    }
}

/// Callback receiving one ready expert: `(expert_id, view)`.
pub type ExpertCallback<'c> = dyn FnMut(usize, &ExpertView<'_>) -> Result<()> + 'c;

/// Callback receiving a group of ready experts: `(expert_id, view)` each.
pub type ExpertGroupCallback<'c> = dyn FnMut(&[(usize, ExpertView<'_>)]) -> Result<()> + 'c;

/// Hints the forward pass gives a source while it waits for a layer's experts.
pub trait ExpertHints {
    /// `experts` of decoder layer `layer` (likeliest first) replace the earlier prediction
    /// for that layer ([`WeightSource::prefetch`]).
    fn repredict(&mut self, layer: usize, experts: &[usize]);
}

/// Idle work while waiting for experts (see [`WeightSource::with_expert_groups_idle`]):
/// `false` when there is none left.
pub type IdleCallback<'a> = dyn FnMut(&mut dyn ExpertHints) -> bool + 'a;

/// Everything the forward pass needs from storage. Object safe; implementations must be
/// shareable across threads.
pub trait WeightSource: Send + Sync {
    /// The model's `config.json`.
    fn config(&self) -> &serde_json::Value;

    /// A resident tensor by its Hugging Face name (embeddings, attention, norms, router gate and
    /// `e_score_correction_bias`, shared experts, dense MLPs, lm_head). Returns
    /// [`InferenceError::MissingTensor`] when the name is unknown.
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>>;

    /// Routed experts `experts` of decoder layer `layer`: call `on_ready(expert_id, &view)`
    /// exactly once for each requested expert, in any order, as soon as its bytes are available.
    /// An error from `on_ready` must be returned unchanged (and may stop further calls).
    fn with_experts(
        &self,
        layer: usize,
        experts: &[usize],
        on_ready: &mut ExpertCallback<'_>,
    ) -> Result<()>;

    /// [`WeightSource::with_experts`] in groups: each call of `on_group` hands over experts
    /// whose bytes are all available now (for a source in memory: all of them at once), so
    /// the forward pass can compute a group in one parallel pass. Every requested expert is
    /// handed over exactly once. The default hands them over one at a time, as they come.
    fn with_expert_groups(
        &self,
        layer: usize,
        experts: &[usize],
        on_group: &mut ExpertGroupCallback<'_>,
    ) -> Result<()> {
        self.with_experts(layer, experts, &mut |e, view| {
            on_group(std::slice::from_ref(&(e, view.clone())))
        })
    }

    /// [`WeightSource::with_expert_groups`], calling `on_idle` while it would otherwise wait
    /// for bytes, until it returns `false` (it does a little work a call: an expert landing
    /// meanwhile is handed over at the next look). `on_idle` may give the source a better
    /// prediction of a later layer's experts through the [`ExpertHints`] it is handed. The
    /// default never waits, so never calls it.
    fn with_expert_groups_idle(
        &self,
        layer: usize,
        experts: &[usize],
        on_group: &mut ExpertGroupCallback<'_>,
        on_idle: &mut IdleCallback<'_>,
    ) -> Result<()> {
        let _ = on_idle;
        self.with_expert_groups(layer, experts, on_group)
    }

    /// A hint that `experts` of decoder layer `layer` will probably be requested soon (e.g.
    /// predicted by applying that layer's router to the current hidden state). Sources that
    /// read from drives may start reading them at low priority. The default does nothing.
    fn prefetch(&self, _layer: usize, _experts: &[usize]) {}

    /// Whether [`WeightSource::prefetch`] does anything (the model then predicts each next
    /// layer's experts). The default is `false`.
    fn wants_prefetch(&self) -> bool {
        false
    }

    /// Drop the source's own copy of the resident tensors once a model has been built from
    /// them (see [`crate::Model::load_owned`]); afterwards [`WeightSource::tensor`] may fail.
    /// Needs `&mut self`, so no borrowed tensor can outlive it. The default keeps everything.
    fn release_resident(&mut self) {}

    /// `bytes` (a slice of a resident tensor this source handed out) as a range of a buffer
    /// the source shares, so a model can keep it without a copy; `None` (the default) when
    /// the source cannot share it (the model then copies).
    fn share(&self, _bytes: &[u8]) -> Option<WeightBytes> {
        None
    }

    /// Decoder layers whose weights this source does not hold but reads for every use
    /// ([`WeightSource::layer_weights`]); the default: none.
    fn streamed_layers(&self) -> Vec<usize> {
        Vec::new()
    }

    /// The weights of streamed decoder layer `layer`, as a source to build the layer from
    /// (its tensors, and everything else as this source has it). `wait`: wait for them;
    /// otherwise `None` unless they have already been read. They are held until the returned
    /// source is dropped (drop what was built from it first, so its buffers can be reused).
    /// The default streams nothing: `None`.
    fn layer_weights(
        &self,
        _layer: usize,
        _wait: bool,
    ) -> Result<Option<Box<dyn WeightSource + '_>>> {
        Ok(None)
    }

    /// Whether a resident tensor exists. The default asks [`WeightSource::tensor`].
    fn has_tensor(&self, name: &str) -> bool {
        self.tensor(name).is_ok()
    }
}

/// A resident tensor if it exists; other errors pass through.
pub(crate) fn try_tensor<'a>(
    src: &'a dyn WeightSource,
    name: &str,
) -> Result<Option<TensorRef<'a>>> {
    match src.tensor(name) {
        Ok(t) => Ok(Some(t)),
        Err(InferenceError::MissingTensor { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// A Hugging Face model directory (`config.json` + safetensors shards), memory-mapped.
#[derive(Debug)]
pub struct DirSource {
    ckpt: Checkpoint,
    naming: ExpertNaming,
    /// (layer, expert) -> parts.
    experts: HashMap<(usize, usize), Vec<ExpertPart>>,
}

impl DirSource {
    /// The view of expert `e` of `layer` over the checkpoint's bytes.
    fn expert_view(&self, layer: usize, e: usize) -> Result<ExpertView<'_>> {
        let parts = self
            .experts
            .get(&(layer, e))
            .ok_or_else(|| InferenceError::MissingExpert {
                layer,
                expert: e,
                reason: format!(
                    "no tensors named {} (or fused experts) in {}",
                    self.naming.expert_tensor(layer as u32, e as u32, "*"),
                    self.ckpt.dir.display()
                ),
            })?;
        let view = ExpertView::new(
            parts
                .iter()
                .map(|p| ExpertPartRef {
                    name: &p.part,
                    tensor: TensorRef {
                        dtype: p.dtype.clone(),
                        shape: &p.shape,
                        bytes: self.ckpt.slice(p.file, p.offset, p.len),
                    },
                })
                .collect(),
        );
        Ok(view)
    }

    /// Open a model directory: parses every shard header and indexes the routed experts.
    pub fn open(dir: &Path) -> Result<DirSource> {
        let ckpt = Checkpoint::open(dir)?;
        Self::from_checkpoint(ckpt)
    }

    /// Bytes of the checkpoint's shards.
    pub fn mapped_bytes(&self) -> u64 {
        self.ckpt.mapped_bytes()
    }

    /// Map the whole checkpoint in now ([`Checkpoint::populate`]).
    pub fn populate(&self) {
        self.ckpt.populate()
    }

    pub fn from_checkpoint(ckpt: Checkpoint) -> Result<DirSource> {
        let naming = crate::family::expert_naming(&ckpt.config)?;
        let experts = expert_sources(&ckpt, &naming)?
            .into_iter()
            .map(|e| ((e.layer as usize, e.expert as usize), e.parts))
            .collect();
        Ok(DirSource {
            ckpt,
            naming,
            experts,
        })
    }

    /// How this checkpoint names its routed experts.
    pub fn naming(&self) -> &ExpertNaming {
        &self.naming
    }

    pub fn checkpoint(&self) -> &Checkpoint {
        &self.ckpt
    }
}

impl WeightSource for DirSource {
    fn config(&self) -> &serde_json::Value {
        &self.ckpt.config
    }

    /// Resident matrices keep a range of the shard's memory map (no copy).
    fn share(&self, bytes: &[u8]) -> Option<WeightBytes> {
        let (map, range) = self.ckpt.share(bytes)?;
        WeightBytes::shared(map, range)
    }

    fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        let t = self
            .ckpt
            .get(name)
            .ok_or_else(|| InferenceError::MissingTensor {
                name: name.to_string(),
            })?;
        let bytes = self.ckpt.slice(t.file, t.info.offset, t.info.len);
        Ok(TensorRef {
            dtype: t.info.dtype.clone(),
            shape: &t.info.shape,
            bytes,
        })
    }

    fn with_experts(
        &self,
        layer: usize,
        experts: &[usize],
        on_ready: &mut ExpertCallback<'_>,
    ) -> Result<()> {
        for &e in experts {
            on_ready(e, &self.expert_view(layer, e)?)?;
        }
        Ok(())
    }

    fn with_expert_groups(
        &self,
        layer: usize,
        experts: &[usize],
        on_group: &mut ExpertGroupCallback<'_>,
    ) -> Result<()> {
        // All in memory: one group.
        let views = experts
            .iter()
            .map(|&e| Ok((e, self.expert_view(layer, e)?)))
            .collect::<Result<Vec<_>>>()?;
        on_group(&views)
    }
}
