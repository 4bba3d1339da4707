//! Which tensors of a checkpoint form routed experts. The storage crate knows no model family:
//! a model family (in the inference crate) describes its names with an [`ExpertNaming`], and
//! layouts and readers classify tensors through it.

use serde::{Deserialize, Serialize};

/// How a checkpoint names its per-layer and routed-expert tensors.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertNaming {
    /// Per-layer tensors are `{layers_prefix}{layer}.{rest}` (`model.layers.`).
    pub layers_prefix: String,
    /// Within a layer, routed-expert tensors are `{experts_prefix}{expert}.{part}`
    /// (`mlp.experts.`), or `{experts_prefix}{part}` with every expert of the layer along the
    /// first dimension (fused checkpoints).
    pub experts_prefix: String,
    /// Experts per layer of fused per-layer tensors, when the config states it.
    pub fused_experts: Option<u64>,
    /// Tensors under these prefixes are not part of the language model (a vision tower);
    /// layouts leave them out.
    pub skipped_prefixes: Vec<String>,
}

/// Where a tensor goes in a layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TensorRole {
    /// Kept in RAM for the whole run: embeddings, attention, norms, routers, shared experts,
    /// dense MLPs, lm_head.
    Resident,
    /// One routed expert's own tensor (`...experts.E.gate_proj.weight`).
    Expert {
        layer: u32,
        expert: u32,
        part: String,
    },
    /// A per-layer tensor holding every routed expert along its first dimension
    /// (`...experts.gate_up_proj`).
    FusedExperts { layer: u32, part: String },
    /// Not laid out (see [`ExpertNaming::skipped_prefixes`]).
    Skipped,
}

impl ExpertNaming {
    /// Hugging Face's usual naming: `model.layers.N.mlp.experts.E.part`.
    pub fn hf(experts_prefix: &str) -> ExpertNaming {
        ExpertNaming {
            layers_prefix: "model.layers.".into(),
            experts_prefix: experts_prefix.into(),
            fused_experts: None,
            skipped_prefixes: Vec::new(),
        }
    }

    /// Classify a tensor by its name.
    pub fn role(&self, name: &str) -> TensorRole {
        if self.skipped_prefixes.iter().any(|p| name.starts_with(p)) {
            return TensorRole::Skipped;
        }
        let Some(rest) = name.strip_prefix(self.layers_prefix.as_str()) else {
            return TensorRole::Resident;
        };
        let Some((layer, rest)) = rest.split_once('.') else {
            return TensorRole::Resident;
        };
        let Ok(layer) = layer.parse::<u32>() else {
            return TensorRole::Resident;
        };
        let Some(rest) = rest.strip_prefix(self.experts_prefix.as_str()) else {
            return TensorRole::Resident;
        };
        match rest.split_once('.') {
            Some((e, part)) if !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()) => {
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

    /// The checkpoint name of part `part` of expert `expert` of `layer` (error messages).
    pub fn expert_tensor(&self, layer: u32, expert: u32, part: &str) -> String {
        format!(
            "{}{layer}.{}{expert}.{part}",
            self.layers_prefix, self.experts_prefix
        )
    }

    /// The checkpoint name of fused per-layer expert tensor `part` of `layer`.
    pub fn fused_tensor(&self, layer: u32, part: &str) -> String {
        format!(
            "{}{layer}.{}{part}",
            self.layers_prefix, self.experts_prefix
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles() {
        let n = ExpertNaming::hf("mlp.experts.");
        assert_eq!(n.role("model.embed_tokens.weight"), TensorRole::Resident);
        assert_eq!(
            n.role("model.layers.3.mlp.gate.weight"),
            TensorRole::Resident
        );
        assert_eq!(
            n.role("model.layers.3.mlp.shared_experts.up_proj.weight"),
            TensorRole::Resident
        );
        assert_eq!(
            n.role("model.layers.3.mlp.experts.12.down_proj.weight_scale_inv"),
            TensorRole::Expert {
                layer: 3,
                expert: 12,
                part: "down_proj.weight_scale_inv".into()
            }
        );
        assert_eq!(
            n.role("model.layers.7.mlp.experts.gate_up_proj"),
            TensorRole::FusedExperts {
                layer: 7,
                part: "gate_up_proj".into()
            }
        );
        assert_eq!(n.role("lm_head.weight"), TensorRole::Resident);
        assert_eq!(
            n.expert_tensor(3, 12, "w1.weight"),
            "model.layers.3.mlp.experts.12.w1.weight"
        );
    }

    #[test]
    fn prefixed_and_skipped() {
        let n = ExpertNaming {
            layers_prefix: "language_model.model.layers.".into(),
            experts_prefix: "block_sparse_moe.experts.".into(),
            fused_experts: None,
            skipped_prefixes: vec!["vision_tower.".into()],
        };
        assert_eq!(
            n.role("language_model.model.layers.1.block_sparse_moe.experts.5.w2.weight_packed"),
            TensorRole::Expert {
                layer: 1,
                expert: 5,
                part: "w2.weight_packed".into()
            }
        );
        assert_eq!(
            n.role("vision_tower.blocks.0.attn.weight"),
            TensorRole::Skipped
        );
        assert_eq!(
            n.role("language_model.model.layers.1.block_sparse_moe.gate.weight"),
            TensorRole::Resident
        );
    }
}
