//! [`RoutedExperts`]: computing one routed expert of a layer from its record
//! ([`ExpertView`]) — `down(act(gate(x), up(x)))`, separate gate/up or fused `gate_up_proj`, in
//! any packed format the resolver understands.
//!
//! Every expert of a layer has the same parts (the layout's per-layer template; a checkpoint's
//! experts are checked to agree), so the layer's matrices are resolved by name once — which
//! part holds each matrix's weights and scales, in what format — and every later expert only
//! slices its bytes.

use std::sync::{Arc, Mutex};

use deltafin_formats::{ScaleType, WeightFormat};
use deltafin_storage::naming::ExpertNaming;

use crate::error::{InferenceError, Result};
use crate::kernels::isa::KernelConfig;
use crate::linear::matrix::{matmul_many, WeightMatrix};
use crate::linear::resolve::{resolve_matrix, MatrixParts, QuantHints};
use crate::ops::Activation;
use crate::weights::ExpertView;

/// Names of a routed expert's matrices within its record: DeepSeek / Qwen `gate_proj`,
/// `up_proj`, `down_proj`; Kimi Linear / K3 `w1`, `w3`, `w2`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertMatrixNames {
    pub gate: &'static str,
    pub up: &'static str,
    pub down: &'static str,
}

impl ExpertMatrixNames {
    /// `gate_proj` / `up_proj` / `down_proj`.
    pub const HF: ExpertMatrixNames = ExpertMatrixNames {
        gate: "gate_proj",
        up: "up_proj",
        down: "down_proj",
    };
    /// `w1` (gate) / `w3` (up) / `w2` (down).
    pub const W1W3W2: ExpertMatrixNames = ExpertMatrixNames {
        gate: "w1",
        up: "w3",
        down: "w2",
    };
}

/// Where one matrix of the template lives in an expert's parts.
#[derive(Debug, Clone, Copy, PartialEq)]
struct MatrixSpec {
    rows: usize,
    cols: usize,
    format: WeightFormat,
    scale_type: ScaleType,
    /// Part index of the weight bytes.
    data: usize,
    /// Part index of the scale bytes (`None`: unscaled).
    scale: Option<usize>,
}

/// A layer's resolved template: its parts' names and where each matrix lives.
#[derive(Debug, Clone, PartialEq)]
struct Template {
    parts: Vec<String>,
    /// `[gate, up]` or `[gate_up]` (fused, gate rows first).
    gate_up: Vec<MatrixSpec>,
    down: MatrixSpec,
}

/// The routed experts of one MoE layer (shapes, names, how their matrices are stored).
#[derive(Debug)]
pub struct RoutedExperts {
    /// Input and output width of an expert (K3's latent width for latent MoE).
    pub hidden: usize,
    pub intermediate: usize,
    pub names: ExpertMatrixNames,
    pub hints: QuantHints,
    pub kernels: KernelConfig,
    /// Names the expert tensors in errors.
    pub naming: ExpertNaming,
    template: Mutex<Option<Arc<Template>>>,
}

impl RoutedExperts {
    pub fn new(
        hidden: usize,
        intermediate: usize,
        names: ExpertMatrixNames,
        hints: QuantHints,
        kernels: KernelConfig,
        naming: ExpertNaming,
    ) -> RoutedExperts {
        RoutedExperts {
            hidden,
            intermediate,
            names,
            hints,
            kernels,
            naming,
            template: Mutex::new(None),
        }
    }

    /// Resolve matrix `part` of `view` by name (the slow path, once per layer).
    fn resolve<'v>(
        &self,
        view: &ExpertView<'v>,
        layer: usize,
        expert: usize,
        part: &str,
        rows: usize,
        cols: usize,
    ) -> Result<(WeightMatrix<'v>, MatrixSpec)> {
        let get = |n: &str| Ok(view.part(n));
        let full = |n: &str| self.naming.expert_tensor(layer as u32, expert as u32, n);
        let m = resolve_matrix(
            &MatrixParts {
                get: &get,
                full_name: &full,
            },
            part,
            rows,
            cols,
            &self.hints,
        )
        .map_err(|e| match e {
            InferenceError::MissingTensor { name } => InferenceError::MissingExpert {
                layer,
                expert,
                reason: format!(
                    "part `{name}` is missing (parts present: {:?})",
                    view.part_names()
                ),
            },
            e => e,
        })?;
        // Which parts the resolver took: the ones whose bytes the matrix borrows.
        let index_of = |bytes: &[u8]| {
            view.parts().iter().position(|p| {
                std::ptr::eq(p.tensor.bytes.as_ptr(), bytes.as_ptr())
                    && p.tensor.bytes.len() == bytes.len()
            })
        };
        let data = index_of(m.data_bytes()).ok_or_else(|| InferenceError::BadTensor {
            name: full(part),
            reason: "its weight bytes are not one of the expert's parts".into(),
        })?;
        let scale = if m.scale_bytes().is_empty() {
            None
        } else {
            Some(
                index_of(m.scale_bytes()).ok_or_else(|| InferenceError::BadTensor {
                    name: full(part),
                    reason: "its scale bytes are not one of the expert's parts".into(),
                })?,
            )
        };
        let spec = MatrixSpec {
            rows,
            cols,
            format: m.format(),
            scale_type: m.scale_type(),
            data,
            scale,
        };
        Ok((m.with_kernels(self.kernels), spec))
    }

    /// Resolve the whole template from one expert's view.
    fn resolve_template(
        &self,
        view: &ExpertView<'_>,
        layer: usize,
        expert: usize,
    ) -> Result<Template> {
        let (hd, it) = (self.hidden, self.intermediate);
        // Fused as shipped (`gate_up_proj`) or quantized at layout time (`gate_up_proj.*`).
        let gate_up = if view.has_matrix("gate_up_proj") {
            vec![
                self.resolve(view, layer, expert, "gate_up_proj", 2 * it, hd)?
                    .1,
            ]
        } else {
            vec![
                self.resolve(view, layer, expert, self.names.gate, it, hd)?
                    .1,
                self.resolve(view, layer, expert, self.names.up, it, hd)?.1,
            ]
        };
        let down = self
            .resolve(view, layer, expert, self.names.down, hd, it)?
            .1;
        Ok(Template {
            parts: view.parts().iter().map(|p| p.name.to_string()).collect(),
            gate_up,
            down,
        })
    }

    /// This layer's template for `view`: resolved on first use (and again should an expert
    /// ever carry other parts).
    fn template(
        &self,
        view: &ExpertView<'_>,
        layer: usize,
        expert: usize,
    ) -> Result<Arc<Template>> {
        let mut slot = self.template.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = slot.as_ref() {
            let same = t.parts.len() == view.parts().len()
                && t.parts.iter().zip(view.parts()).all(|(a, b)| a == b.name);
            if same {
                return Ok(t.clone());
            }
        }
        let t = Arc::new(self.resolve_template(view, layer, expert)?);
        *slot = Some(t.clone());
        Ok(t)
    }

    /// The matrix `spec` over `view`'s bytes (length-checked).
    fn matrix<'v>(
        &self,
        view: &ExpertView<'v>,
        spec: &MatrixSpec,
        layer: usize,
        expert: usize,
    ) -> Result<WeightMatrix<'v>> {
        let parts = view.parts();
        let data = parts.get(spec.data).map(|p| p.tensor.bytes);
        let scale = match spec.scale {
            Some(i) => parts.get(i).map(|p| p.tensor.bytes),
            None => Some(&[][..]),
        };
        let (Some(data), Some(scale)) = (data, scale) else {
            return Err(InferenceError::MissingExpert {
                layer,
                expert,
                reason: "its record has fewer parts than its layer's template".into(),
            });
        };
        WeightMatrix::new(
            spec.rows,
            spec.cols,
            spec.format,
            data,
            scale,
            spec.scale_type,
        )
        .map(|m| m.with_kernels(self.kernels))
        .map_err(|reason| InferenceError::BadTensor {
            name: self
                .naming
                .expert_tensor(layer as u32, expert as u32, parts[spec.data].name),
            reason,
        })
    }

    /// `x [m, hidden] -> [m, hidden]` through expert `expert` of `layer`.
    pub fn forward(
        &self,
        view: &ExpertView<'_>,
        layer: usize,
        expert: usize,
        act: &dyn Activation,
        x: &[f32],
        m: usize,
    ) -> Result<Vec<f32>> {
        let (hd, it) = (self.hidden, self.intermediate);
        let t = self.template(view, layer, expert)?;
        let mut h = vec![0f32; m * it];
        if let [gu] = &t.gate_up[..] {
            // transformers-5 fused layout: [2I, H], gate rows first.
            let gu = self.matrix(view, gu, layer, expert)?;
            let mut y = vec![0f32; m * 2 * it];
            gu.matmul(x, m, &mut y);
            for (hrow, yrow) in h.chunks_mut(it).zip(y.chunks(2 * it)) {
                let (g, u) = yrow.split_at(it);
                for ((o, &g), &u) in hrow.iter_mut().zip(g).zip(u) {
                    *o = act.gated(g, u);
                }
            }
        } else {
            let gate = self.matrix(view, &t.gate_up[0], layer, expert)?;
            let up = self.matrix(view, &t.gate_up[1], layer, expert)?;
            let mut g = vec![0f32; m * it];
            let mut u = vec![0f32; m * it];
            // One pass over the same (once-quantized) inputs for both.
            matmul_many(&[&gate, &up], x, m, &mut [&mut g, &mut u]);
            for ((o, &g), &u) in h.iter_mut().zip(&g).zip(&u) {
                *o = act.gated(g, u);
            }
        }
        let down = self.matrix(view, &t.down, layer, expert)?;
        let mut out = vec![0f32; m * hd];
        down.matmul(&h, m, &mut out);
        Ok(out)
    }
}
