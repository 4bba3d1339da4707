//! [`RoutedExperts`]: one MoE layer's routed experts computed from their records. Every
//! expert of a layer has the same parts (the layout's per-layer template; a checkpoint's
//! experts are checked to agree), so the layer's matrices are resolved by name once (which
//! part holds each matrix's weights and scales, in what format) and every later expert only
//! slices its bytes. A group of experts runs in two parallel passes: every gate and up
//! projection, then every down projection.

use std::sync::{Arc, Mutex};

use deltafin_formats::{ScaleType, WeightFormat};
use deltafin_storage::naming::ExpertNaming;

use crate::error::{InferenceError, Result};
use crate::ffn::dense::DenseMlp;
use crate::kernels::isa::KernelConfig;
use crate::kernels::jobs::{matmul_jobs, MatmulJob};
use crate::linear::matrix::WeightMatrix;
use crate::linear::resolve::{resolve_matrix, MatrixParts, QuantHints};
use crate::ops::Activation;
use crate::scratch::Scratch;
use crate::spans::{span, timed, Phase};
use crate::weights::ExpertView;

/// Gated activations of a group above which they run on the pool's threads.
const PARALLEL_ACT_VALUES: usize = 1 << 15;

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

/// Each expert's output of a group, and the shared expert's when it rode along.
pub type GroupOutputs = (Vec<Scratch<f32>>, Option<Scratch<f32>>);

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

    /// A group of experts of `layer`, each on its own inputs (`inputs[i]` is `[m_i, hidden]`
    /// for `group[i]`): `-> [m_i, hidden]` each. Every expert's gate and up projections run
    /// in one parallel pass, then every down projection in another; each result is what the
    /// expert alone gives, bit for bit.
    pub fn forward_group(
        &self,
        group: &[(usize, ExpertView<'_>)],
        layer: usize,
        act: &dyn Activation,
        inputs: &[(&[f32], usize)],
    ) -> Result<Vec<Vec<f32>>> {
        let (ys, _) = self.forward_group_with(group, layer, act, inputs, None)?;
        Ok(ys.into_iter().map(Scratch::into_vec).collect())
    }

    /// [`RoutedExperts::forward_group`], with the layer's shared expert (on its own inputs
    /// `x` `[n, hidden]`) computed in the same two passes: its gate and up beside the experts'
    /// gate and up, its down beside theirs (one hand-out to the threads fewer per pass each;
    /// decode runs some 150 passes per token). Its output equals [`DenseMlp::apply`]'s.
    pub fn forward_group_with(
        &self,
        group: &[(usize, ExpertView<'_>)],
        layer: usize,
        act: &dyn Activation,
        inputs: &[(&[f32], usize)],
        shared: Option<(&DenseMlp, &[f32], usize)>,
    ) -> Result<GroupOutputs> {
        let (hd, it) = (self.hidden, self.intermediate);
        let shared_views = shared.map(|(mlp, _, _)| {
            (
                mlp.gate_proj.view(),
                mlp.up_proj.view(),
                mlp.down_proj.view(),
            )
        });
        let mut shared_gu: Option<(Scratch<f32>, Scratch<f32>)> = shared.map(|(mlp, _, n)| {
            (
                Scratch::for_overwrite(n * mlp.gate_proj.rows()),
                Scratch::for_overwrite(n * mlp.up_proj.rows()),
            )
        });
        let mut gate_up: Vec<Vec<WeightMatrix<'_>>> = Vec::with_capacity(group.len());
        let mut downs: Vec<WeightMatrix<'_>> = Vec::with_capacity(group.len());
        for (e, view) in group {
            let t = self.template(view, layer, *e)?;
            gate_up.push(
                t.gate_up
                    .iter()
                    .map(|spec| self.matrix(view, spec, layer, *e))
                    .collect::<Result<Vec<_>>>()?,
            );
            downs.push(self.matrix(view, &t.down, layer, *e)?);
        }
        // Gate and up (or the fused gate_up, gate rows first) of every expert.
        let mut gu_out: Vec<Vec<Scratch<f32>>> = gate_up
            .iter()
            .zip(inputs)
            .map(|(ms, &(_, m))| {
                ms.iter()
                    .map(|w| Scratch::for_overwrite(m * w.rows()))
                    .collect()
            })
            .collect();
        {
            let mut jobs = Vec::new();
            for ((ms, &(x, m)), outs) in gate_up.iter().zip(inputs).zip(gu_out.iter_mut()) {
                for (w, out) in ms.iter().zip(outs.iter_mut()) {
                    jobs.push(MatmulJob { m: w, x, n: m, out });
                }
            }
            if let (Some((g, u, _)), Some((_, x, n)), Some((go, uo))) =
                (&shared_views, shared, shared_gu.as_mut())
            {
                jobs.push(MatmulJob {
                    m: g,
                    x,
                    n,
                    out: go,
                });
                jobs.push(MatmulJob {
                    m: u,
                    x,
                    n,
                    out: uo,
                });
            }
            timed(Phase::ExpertsGateUp, || matmul_jobs(&mut jobs));
        }
        let act_span = span(Phase::ExpertsAct);
        let shared_h: Option<Scratch<f32>> = match (shared, &shared_gu) {
            (Some((mlp, _, _)), Some((g, u))) => {
                let mut h = Scratch::for_overwrite(g.len());
                mlp.act.gated_into(g, u, &mut h);
                Some(h)
            }
            _ => None,
        };
        let mut shared_out: Option<Scratch<f32>> =
            shared.map(|(mlp, _, n)| Scratch::for_overwrite(n * mlp.down_proj.rows()));
        let gated = |i: usize| {
            let (outs, m) = (&gu_out[i], inputs[i].1);
            let mut h = Scratch::for_overwrite(m * it);
            match &outs[..] {
                [y] => {
                    for (hrow, yrow) in h.chunks_mut(it).zip(y.chunks(2 * it)) {
                        let (g, u) = yrow.split_at(it);
                        act.gated_into(g, u, hrow);
                    }
                }
                [g, u] => act.gated_into(g, u, &mut h),
                // Templates have one or two gate/up matrices; zeros as before should that
                // change (`h` holds stale values otherwise).
                _ => h.fill(0.0),
            }
            h
        };
        // A prefill's ~100 experts per layer on the pool's threads; a decode token's few
        // inline (one pass costs more than their activations).
        let values: usize = inputs.iter().map(|&(_, m)| m * it).sum();
        let hs: Vec<Scratch<f32>> = if values >= PARALLEL_ACT_VALUES {
            crate::kernels::pool::pool().map(gu_out.len(), gated)
        } else {
            (0..gu_out.len()).map(gated).collect()
        };
        drop(act_span);
        let mut ys: Vec<Scratch<f32>> = inputs
            .iter()
            .map(|&(_, m)| Scratch::for_overwrite(m * hd))
            .collect();
        {
            let mut jobs: Vec<MatmulJob<'_, '_>> = downs
                .iter()
                .zip(&hs)
                .zip(ys.iter_mut())
                .zip(inputs)
                .map(|(((w, h), out), &(_, m))| MatmulJob {
                    m: w,
                    x: h,
                    n: m,
                    out,
                })
                .collect();
            if let (Some((_, _, d)), Some((_, _, n)), Some(h), Some(out)) =
                (&shared_views, shared, &shared_h, shared_out.as_mut())
            {
                jobs.push(MatmulJob { m: d, x: h, n, out });
            }
            timed(Phase::ExpertsDown, || matmul_jobs(&mut jobs));
        }
        Ok((ys, shared_out))
    }
}
