//! [`MoeFfn`]: a routed Mixture-of-Experts block. The router chooses experts per position; the
//! weight source hands over each chosen expert's record as it becomes available (from memory,
//! or streamed from drives); [`RoutedExperts`] computes the expert from its record —
//! `down(act(gate(x), up(x)))`, separate gate/up or fused `gate_up_proj`, in any packed format
//! the resolver understands; the weighted outputs are summed in a fixed order, plus optional
//! always-on shared experts.
//!
//! Every expert of a layer has the same parts (the layout's per-layer template; a checkpoint's
//! experts are checked to agree), so the layer's matrices are resolved by name once — which
//! part holds each matrix's weights and scales, in what format — and every later expert only
//! slices its bytes.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use deltafin_formats::{ScaleType, WeightFormat};
use deltafin_storage::naming::ExpertNaming;

use crate::error::{InferenceError, Result};
use crate::ffn::dense::DenseMlp;
use crate::ffn::feed_forward::{FeedForward, FfnContext};
use crate::ffn::router::Router;
use crate::kernels::isa::KernelConfig;
use crate::kernels::jobs::{matmul_jobs, MatmulJob};
use crate::linear::matrix::WeightMatrix;
use crate::linear::owned::Linear;
use crate::linear::resolve::{resolve_matrix, MatrixParts, QuantHints};
use crate::ops::{Activation, RmsNorm};
use crate::spans::{span, timed, Phase};
use crate::weights::ExpertView;

/// Routed experts plus optional always-on shared experts.
#[derive(Debug)]
pub struct MoeFfn {
    pub router: Box<dyn Router>,
    pub experts: RoutedExperts,
    pub shared_experts: Option<DenseMlp>,
    pub act: Arc<dyn Activation>,
    /// Kimi K3's latent MoE: the routed experts run in a smaller space.
    pub latent: Option<LatentMoe>,
}

/// The projections around latent routed experts (Kimi K3): `x_r = down(x)` `[R, hidden]`,
/// the experts' weighted sum `y` `[R]`, optionally `RMSNorm(y)`, then `up(y)` `[hidden, R]`.
/// The router and the shared experts see the full hidden state.
#[derive(Debug, Clone)]
pub struct LatentMoe {
    pub down: Linear,
    pub up: Linear,
    pub norm: Option<RmsNorm>,
}

impl FeedForward for MoeFfn {
    fn predict_experts(&self, x: &[f32], n: usize) -> Option<Vec<usize>> {
        // Most likely first (chosen by more positions, then by a higher rank), so that when
        // bandwidth is short the reads that land first are the likeliest to be used and the
        // unlikely ones are still queued, and so cancellable, when the guess is checked.
        let mut score: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
        for r in self.router.route(x, n) {
            for (rank, e) in r.experts.into_iter().enumerate() {
                let s = score.entry(e).or_insert((0, usize::MAX));
                s.0 += 1;
                s.1 = s.1.min(rank);
            }
        }
        let mut e: Vec<(usize, (usize, usize))> = score.into_iter().collect();
        e.sort_by(|a, b| {
            b.1 .0
                .cmp(&a.1 .0)
                .then(a.1 .1.cmp(&b.1 .1))
                .then(a.0.cmp(&b.0))
        });
        Some(e.into_iter().map(|(e, _)| e).collect())
    }

    fn forward(&self, full: &[f32], n: usize, ctx: &mut FfnContext<'_>) -> Result<Vec<f32>> {
        let hd = self.experts.hidden;
        let layer = ctx.layer;
        let routes = timed(Phase::Router, || self.router.route(full, n));
        let latent_x;
        let x: &[f32] = match &self.latent {
            Some(l) => {
                latent_x = timed(Phase::Latent, || l.down.forward(full, n));
                &latent_x
            }
            None => full,
        };
        let top_k = routes.iter().map(|r| r.experts.len()).max().unwrap_or(0);
        // expert -> [(position, slot)]
        let mut by_expert: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
        for (t, r) in routes.iter().enumerate() {
            for (slot, &e) in r.experts.iter().enumerate() {
                by_expert.entry(e).or_default().push((t, slot));
            }
        }
        let wanted: Vec<usize> = by_expert.keys().copied().collect();
        let mut delivered = vec![false; wanted.len()];
        // Per (position, slot) weighted outputs, summed in slot order afterwards so the result
        // does not depend on the order in which experts arrive.
        let mut slots = vec![0f32; n * top_k * hd];
        let act: &dyn Activation = &*self.act;
        // The shared expert rides along with the first group (biases: computed on its own).
        let fuse_shared = self.shared_experts.as_ref().filter(|m| {
            !m.gate_proj.has_bias() && !m.up_proj.has_bias() && !m.down_proj.has_bias()
        });
        let mut shared_out: Option<Vec<f32>> = None;
        // Every position in order: the experts can read `x` itself (and share its prepared
        // form) instead of a gathered copy.
        ctx.source
            .with_expert_groups(layer, &wanted, &mut |group: &[(
                usize,
                ExpertView<'_>,
            )]| {
                let mut gathered: Vec<Vec<f32>> = Vec::with_capacity(group.len());
                let mut whole: Vec<bool> = Vec::with_capacity(group.len());
                for &(e, _) in group {
                    let Ok(k) = wanted.binary_search(&e) else {
                        return Err(InferenceError::MissingExpert {
                            layer,
                            expert: e,
                            reason: "the weight source delivered an expert that was not requested"
                                .into(),
                        });
                    };
                    delivered[k] = true;
                    let assign = &by_expert[&e];
                    let in_order =
                        assign.len() == n && assign.iter().enumerate().all(|(i, a)| a.0 == i);
                    whole.push(in_order);
                    let mut xs = Vec::new();
                    if !in_order {
                        xs.reserve(assign.len() * hd);
                        for &(t, _) in assign {
                            xs.extend_from_slice(&x[t * hd..(t + 1) * hd]);
                        }
                    }
                    gathered.push(xs);
                }
                let inputs: Vec<(&[f32], usize)> = group
                    .iter()
                    .zip(gathered.iter().zip(&whole))
                    .map(|((e, _), (xs, &w))| {
                        let m = by_expert[e].len();
                        if w {
                            (x, m)
                        } else {
                            (xs.as_slice(), m)
                        }
                    })
                    .collect();
                let shared_job = match (fuse_shared, &shared_out) {
                    (Some(mlp), None) => Some((mlp, full, n)),
                    _ => None,
                };
                let (ys, s) = self
                    .experts
                    .forward_group_with(group, layer, act, &inputs, shared_job)?;
                if s.is_some() {
                    shared_out = s;
                }
                let _combine_span = span(Phase::ExpertsCombine);
                for ((e, _), ys) in group.iter().zip(&ys) {
                    for (i, &(t, slot)) in by_expert[e].iter().enumerate() {
                        let w = routes[t].weights[slot];
                        let dst = &mut slots[(t * top_k + slot) * hd..(t * top_k + slot + 1) * hd];
                        for (d, &y) in dst.iter_mut().zip(&ys[i * hd..(i + 1) * hd]) {
                            *d = w * y;
                        }
                    }
                }
                Ok(())
            })?;
        if let Some(k) = delivered.iter().position(|d| !d) {
            return Err(InferenceError::MissingExpert {
                layer,
                expert: wanted[k],
                reason: "the weight source returned without delivering it".into(),
            });
        }
        let combine_span = span(Phase::ExpertsCombine);
        let mut out = vec![0f32; n * hd];
        for (t, o) in out.chunks_mut(hd).enumerate() {
            for slot in 0..top_k {
                let s = &slots[(t * top_k + slot) * hd..(t * top_k + slot + 1) * hd];
                for (o, &v) in o.iter_mut().zip(s) {
                    *o += v;
                }
            }
        }
        drop(combine_span);
        if let Some(l) = &self.latent {
            let _latent_span = span(Phase::Latent);
            if let Some(norm) = &l.norm {
                norm.apply_inplace(&mut out);
            }
            out = l.up.forward(&out, n);
        }
        if let Some(shared) = &self.shared_experts {
            let s = match shared_out {
                Some(s) => s,
                None => timed(Phase::Shared, || shared.apply(full, n)),
            };
            for (o, v) in out.iter_mut().zip(&s) {
                *o += v;
            }
        }
        if let Some(trace) = ctx.routing.as_deref_mut() {
            trace.extend(routes);
        }
        Ok(out)
    }
}

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
pub type GroupOutputs = (Vec<Vec<f32>>, Option<Vec<f32>>);

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
        Ok(self.forward_group_with(group, layer, act, inputs, None)?.0)
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
        let mut shared_gu: Option<(Vec<f32>, Vec<f32>)> = shared.map(|(mlp, _, n)| {
            (
                vec![0f32; n * mlp.gate_proj.rows()],
                vec![0f32; n * mlp.up_proj.rows()],
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
        let mut gu_out: Vec<Vec<Vec<f32>>> = gate_up
            .iter()
            .zip(inputs)
            .map(|(ms, &(_, m))| ms.iter().map(|w| vec![0f32; m * w.rows()]).collect())
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
        let shared_h: Option<Vec<f32>> = match (shared, &shared_gu) {
            (Some((mlp, _, _)), Some((g, u))) => {
                let mut h = vec![0f32; g.len()];
                mlp.act.gated_into(g, u, &mut h);
                Some(h)
            }
            _ => None,
        };
        let mut shared_out: Option<Vec<f32>> =
            shared.map(|(mlp, _, n)| vec![0f32; n * mlp.down_proj.rows()]);
        let hs: Vec<Vec<f32>> = gu_out
            .iter()
            .zip(inputs)
            .map(|(outs, &(_, m))| {
                let mut h = vec![0f32; m * it];
                match &outs[..] {
                    [y] => {
                        for (hrow, yrow) in h.chunks_mut(it).zip(y.chunks(2 * it)) {
                            let (g, u) = yrow.split_at(it);
                            act.gated_into(g, u, hrow);
                        }
                    }
                    [g, u] => act.gated_into(g, u, &mut h),
                    _ => {}
                }
                h
            })
            .collect();
        drop(act_span);
        let mut ys: Vec<Vec<f32>> = inputs.iter().map(|&(_, m)| vec![0f32; m * hd]).collect();
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
