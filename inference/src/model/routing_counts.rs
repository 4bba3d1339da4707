//! [`RoutingCounts`]: how often each routed expert of each MoE layer was chosen, over the
//! positions a model ran while recording ([`crate::Model::record_routing`]). `generate
//! --save-routing FILE` writes it; `plan --routing FILE` predicts expert-cache hit rates from
//! it instead of assuming uniform routing (real and synthetic models route skewed).

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{InferenceError, Result};
use crate::ffn::router::Routing;

/// The largest routing file read (a full Kimi K3's counts are ~1 MB of JSON).
pub const MAX_ROUTING_FILE_BYTES: u64 = 64 << 20;

/// One MoE layer's counts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LayerCounts {
    /// Positions routed.
    pub positions: u64,
    /// `counts[e]`: positions that chose expert `e`.
    pub counts: Vec<u64>,
}

/// Counts per MoE layer (decoder layer index).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RoutingCounts {
    /// `model_type` of the model recorded.
    pub model_type: String,
    pub layers: BTreeMap<usize, LayerCounts>,
}

impl RoutingCounts {
    /// Count one forward's routes of decoder layer `layer`.
    pub fn add(&mut self, layer: usize, routes: &[Routing]) {
        let l = self.layers.entry(layer).or_default();
        for r in routes {
            l.positions += 1;
            for &e in &r.experts {
                if e >= l.counts.len() {
                    l.counts.resize(e + 1, 0);
                }
                l.counts[e] += 1;
            }
        }
    }

    /// Per layer, each expert's probability of being chosen by a position (`counts /
    /// positions`, padded to `experts` values; they sum to the experts per token). Layers
    /// without positions are left out.
    pub fn probabilities(&self, experts: usize) -> BTreeMap<usize, Vec<f64>> {
        self.layers
            .iter()
            .filter(|(_, l)| l.positions > 0)
            .map(|(&i, l)| {
                let mut p: Vec<f64> = l
                    .counts
                    .iter()
                    .map(|&c| c as f64 / l.positions as f64)
                    .collect();
                p.resize(experts.max(p.len()), 0.0);
                (i, p)
            })
            .collect()
    }

    /// Read a file [`RoutingCounts::save`] wrote, checking it against a model of
    /// `model_type` with `layers` decoder layers, `experts` routed experts per layer and
    /// `top_k` per position.
    pub fn load(
        path: &Path,
        model_type: &str,
        layers: usize,
        experts: usize,
        top_k: usize,
    ) -> Result<RoutingCounts> {
        let bad =
            |why: String| InferenceError::InvalidArgument(format!("{}: {why}", path.display()));
        let len = std::fs::metadata(path)
            .map_err(|e| bad(e.to_string()))?
            .len();
        if len > MAX_ROUTING_FILE_BYTES {
            return Err(bad(format!(
                "{len} bytes, more than a routing file holds ({MAX_ROUTING_FILE_BYTES})"
            )));
        }
        let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
        let r: RoutingCounts =
            serde_json::from_slice(&bytes).map_err(|e| bad(format!("not routing counts: {e}")))?;
        if r.model_type != model_type {
            return Err(bad(format!(
                "recorded on a `{}` model, not this `{model_type}` one",
                r.model_type
            )));
        }
        for (&i, l) in &r.layers {
            if i >= layers {
                return Err(bad(format!("layer {i}: the model has {layers} layers")));
            }
            if l.counts.len() > experts {
                return Err(bad(format!(
                    "layer {i}: {} experts counted, the model has {experts}",
                    l.counts.len()
                )));
            }
            let chosen: u64 = l.counts.iter().fold(0u64, |a, &c| a.saturating_add(c));
            if l.positions == 0 || chosen != l.positions.saturating_mul(top_k as u64) {
                return Err(bad(format!(
                    "layer {i}: {chosen} choices over {} positions, not {top_k} each",
                    l.positions
                )));
            }
        }
        if r.layers.is_empty() {
            return Err(bad("no layer was counted".into()));
        }
        Ok(r)
    }

    /// Write as JSON (atomically: a temporary file renamed over `path`).
    pub fn save(&self, path: &Path) -> Result<()> {
        let io = |e: std::io::Error| {
            InferenceError::InvalidArgument(format!("writing {}: {e}", path.display()))
        };
        let json = serde_json::to_vec(self).map_err(|e| {
            InferenceError::InvalidArgument(format!("encoding routing counts: {e}"))
        })?;
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, json).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn route(experts: &[usize]) -> Routing {
        Routing {
            experts: experts.to_vec(),
            weights: vec![0.5; experts.len()],
        }
    }

    #[test]
    fn counts_round_trip_and_are_checked() {
        let mut c = RoutingCounts {
            model_type: "deepseek_v3".into(),
            ..Default::default()
        };
        c.add(1, &[route(&[0, 3]), route(&[3, 2])]);
        c.add(2, &[route(&[1, 0])]);
        let p = c.probabilities(4);
        assert_eq!(p[&1], vec![0.5, 0.0, 0.5, 1.0]);
        assert_eq!(p[&2].iter().sum::<f64>(), 2.0);
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("r.json");
        c.save(&f).unwrap();
        assert_eq!(RoutingCounts::load(&f, "deepseek_v3", 3, 4, 2).unwrap(), c);
        for (mt, layers, experts, k, what) in [
            ("qwen3_moe", 3, 4, 2, "model"),
            ("deepseek_v3", 2, 4, 2, "layer 2"),
            ("deepseek_v3", 3, 3, 2, "experts counted"),
            ("deepseek_v3", 3, 4, 3, "choices"),
        ] {
            let e = RoutingCounts::load(&f, mt, layers, experts, k)
                .unwrap_err()
                .to_string();
            assert!(e.contains(what) && e.contains("r.json"), "{e}");
        }
        std::fs::write(&f, b"{\"model_type\": 3").unwrap();
        let e = RoutingCounts::load(&f, "deepseek_v3", 3, 4, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not routing counts"), "{e}");
    }
}
