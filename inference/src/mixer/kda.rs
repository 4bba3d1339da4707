//! Kimi Delta Attention: linear attention with a gated delta rule over a fixed-size state.
//!
//! ```text
//! q, k, v = q_proj(x), k_proj(x), v_proj(x)                           [n, H*D] each
//! q, k, v = silu(causal depthwise conv_K(q | k | v))   (tail cached)  per channel
//! f       = f_b(f_a(x)) + dt_bias                                     [n, H*D]
//! g       = -exp(A_log[h]) * softplus(f)       (Kimi Linear)          log-decay <= 0
//!         = lower_bound * sigmoid(exp(A_log[h]) * f)   (K3's safe gate)
//! beta    = sigmoid(b_proj(x))                                        [n, H]
//! q = l2norm(q) * D^-1/2, k = l2norm(k)                               per head
//! per head, S [D_key, D_value] (cached):
//!   S = diag(exp(g_t)) S;  u = beta_t (v_t - S^T k_t);  S = S + k_t u^T;  o_t = S^T q_t
//! y = RMSNorm_D(o) * sigmoid(gate(x))   (gate: g_b(g_a(x)) or K3's full-rank g_proj(x))
//! out = o_proj(y)                                                     [n, hidden]
//! ```
//!
//! Prefill and decode both run the recurrence exactly, one position after another within the
//! forward's chunk of positions, every head in parallel: on a CPU the `4 D^2` flops per head and
//! position are about 1% of the layer's projections, so the chunked (WY) form GPUs use would buy
//! nothing here and give up exactness. Splitting a prompt into any chunks, or feeding it token
//! by token, gives bit-identical results.

use crate::error::Result;
use crate::kernels::pool::pool;
use crate::linear::owned::Linear;
use crate::mixer::delta_rule::{delta_step, push_tail, Recorded};
use crate::mixer::kda_state::KdaState;
use crate::mixer::state::{state_as, MixerState, TokenMixer};
use crate::ops::{sigmoid, RmsNorm};
use crate::spans::{span, Phase};

/// The output gate: low rank (Kimi Linear) or full rank (K3).
#[derive(Debug, Clone)]
pub enum KdaOutputGate {
    /// `g_b_proj(g_a_proj(x))`: `[D, hidden]` then `[H*D, D]`.
    LowRank { a: Linear, b: Linear },
    /// `g_proj(x)`: `[H*D, hidden]`.
    FullRank(Linear),
}

/// How the forget gate's log-decay is formed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ForgetGate {
    /// `-exp(A_log) * softplus(f)`.
    Softplus,
    /// `lower_bound * sigmoid(exp(A_log) * f)`: per-step decay in `(e^lower_bound, 1)`.
    Safe { lower_bound: f32 },
}

/// A KDA layer.
#[derive(Debug)]
pub struct KdaAttention {
    pub num_heads: usize,
    pub head_dim: usize,
    /// Short convolution kernel size `K`.
    pub conv_kernel: usize,
    /// `[H*D, hidden]` each.
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    /// Depthwise conv weights `[H*D, K]` for q, k and v (`w[c, K-1]` multiplies the current
    /// position).
    pub conv: [Vec<f32>; 3],
    /// `[D, hidden]` then `[H*D, D]`.
    pub f_a_proj: Linear,
    pub f_b_proj: Linear,
    /// `[H]` (a checkpoint's padded `A_log` cut to the heads).
    pub a_log: Vec<f32>,
    /// `[H*D]`
    pub dt_bias: Vec<f32>,
    /// `[H, hidden]`
    pub b_proj: Linear,
    pub output_gate: KdaOutputGate,
    pub forget_gate: ForgetGate,
    /// RMSNorm over each head's `D` values, one weight for all heads.
    pub o_norm: RmsNorm,
    /// `[hidden, H*D]`
    pub o_proj: Linear,
}

/// Intermediate values of one forward (tests compare them with the reference).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KdaTaps {
    /// `[n, H, D]` log-decay.
    pub g: Vec<f32>,
    /// `[n, H]`
    pub beta: Vec<f32>,
    /// `[n, H, D]` the delta rule's output before the norm and gate.
    pub core_out: Vec<f32>,
}

#[inline]
fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `log(1 + e^x)`, linear above 20 (torch's threshold).
#[inline]
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x / sqrt(sum(x^2) + 1e-6)` in place.
fn l2norm(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

impl KdaAttention {
    fn channels(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// The causal depthwise convolution + SiLU of `raw` (`[n, 3*H*D]`, q ‖ k ‖ v per row) after
    /// `tail`; returns `[n, 3*H*D]` and leaves the new tail in `tail`.
    fn conv(&self, raw: &[f32], n: usize, tail: &mut [f32]) -> Vec<f32> {
        let (hd, kk) = (self.channels(), self.conv_kernel);
        let (c3, k1) = (3 * hd, kk - 1);
        let mut out = vec![0f32; n * c3];
        // Channel-major work: one task per block of channels.
        const CHANNELS_PER_TASK: usize = 256;
        let blocks: Vec<Vec<Vec<f32>>> = pool().map(c3.div_ceil(CHANNELS_PER_TASK), |b| {
            let c0 = b * CHANNELS_PER_TASK;
            (c0..(c0 + CHANNELS_PER_TASK).min(c3))
                .map(|c| {
                    let w = &self.conv[c / hd][(c % hd) * kk..(c % hd + 1) * kk];
                    let past = &tail[c * k1..(c + 1) * k1];
                    let x = |tau: isize| -> f32 {
                        if tau < 0 {
                            past[(k1 as isize + tau) as usize]
                        } else {
                            raw[tau as usize * c3 + c]
                        }
                    };
                    (0..n)
                        .map(|t| {
                            let acc: f32 = (0..kk)
                                .map(|j| w[j] * x(t as isize - k1 as isize + j as isize))
                                .sum();
                            silu(acc)
                        })
                        .collect::<Vec<f32>>()
                })
                .collect()
        });
        for (c, col) in blocks.iter().flatten().enumerate() {
            for (t, &v) in col.iter().enumerate() {
                out[t * c3 + c] = v;
            }
        }
        for t in 0..n {
            push_tail(tail, &raw[t * c3..(t + 1) * c3], k1);
        }
        out
    }

    /// [`TokenMixer::forward`], returning the intermediate values too.
    pub fn forward_taps(
        &self,
        x: &[f32],
        n: usize,
        state: &mut dyn MixerState,
    ) -> Result<(Vec<f32>, KdaTaps)> {
        let st = state_as::<KdaState>(state, "KDA attention")?;
        let (h_n, d) = (self.num_heads, self.head_dim);
        let hd = self.channels();
        // Every projection of x in one pass (inputs quantized once).
        let mut lins: Vec<&Linear> = vec![
            &self.q_proj,
            &self.k_proj,
            &self.v_proj,
            &self.f_a_proj,
            &self.b_proj,
        ];
        match &self.output_gate {
            KdaOutputGate::LowRank { a, .. } => lins.push(a),
            KdaOutputGate::FullRank(g) => lins.push(g),
        }
        let in_span = span(Phase::MixerIn);
        let mut p = Linear::forward_many(&lins, x, n).into_iter();
        let mut next = || p.next().unwrap_or_default();
        let (q, k, v, fa, b, ga) = (next(), next(), next(), next(), next(), next());
        let f = self.f_b_proj.forward(&fa, n);
        let gate = match &self.output_gate {
            KdaOutputGate::LowRank { b, .. } => b.forward(&ga, n),
            KdaOutputGate::FullRank(_) => ga,
        };
        drop(in_span);
        let core_span = span(Phase::MixerCore);
        st.begin_forward(n);
        let mut raw = vec![0f32; n * 3 * hd];
        for t in 0..n {
            let row = &mut raw[t * 3 * hd..(t + 1) * 3 * hd];
            row[..hd].copy_from_slice(&q[t * hd..(t + 1) * hd]);
            row[hd..2 * hd].copy_from_slice(&k[t * hd..(t + 1) * hd]);
            row[2 * hd..].copy_from_slice(&v[t * hd..(t + 1) * hd]);
        }
        let mut tail = std::mem::take(&mut st.tail);
        tail.copy_from_slice(&st.checkpoint_tail);
        let conv = self.conv(&raw, n, &mut tail);
        st.tail = tail;
        // Per position: q, k (normalised), v, g, beta.
        let mut qs = vec![0f32; n * hd];
        let mut ks = vec![0f32; n * hd];
        let mut vs = vec![0f32; n * hd];
        let mut g = vec![0f32; n * hd];
        let mut beta = vec![0f32; n * h_n];
        let scale = (d as f32).powf(-0.5);
        for t in 0..n {
            let row = &conv[t * 3 * hd..(t + 1) * 3 * hd];
            qs[t * hd..(t + 1) * hd].copy_from_slice(&row[..hd]);
            ks[t * hd..(t + 1) * hd].copy_from_slice(&row[hd..2 * hd]);
            vs[t * hd..(t + 1) * hd].copy_from_slice(&row[2 * hd..]);
            for h in 0..h_n {
                let at = t * hd + h * d..t * hd + (h + 1) * d;
                l2norm(&mut qs[at.clone()]);
                qs[at.clone()].iter_mut().for_each(|v| *v *= scale);
                l2norm(&mut ks[at.clone()]);
                let a = self.a_log[h].exp();
                for c in at {
                    let fv = f[c] + self.dt_bias[c - t * hd];
                    g[c] = match self.forget_gate {
                        ForgetGate::Softplus => -a * softplus(fv),
                        ForgetGate::Safe { lower_bound } => lower_bound * sigmoid(a * fv),
                    };
                }
                beta[t * h_n + h] = sigmoid(b[t * h_n + h]);
            }
        }
        // The delta rule, every head in parallel: the first position reads the checkpoint.
        let mut core = vec![0f32; n * hd];
        // Per head: its state, its checkpoint, its outputs `[n, d]`.
        let mut heads: Vec<(&mut [f32], &[f32], Vec<f32>)> = st
            .current
            .chunks_mut(d * d)
            .zip(st.checkpoint.chunks(d * d))
            .map(|(dst, src)| (dst, src, Vec::new()))
            .collect();
        pool().for_each_mut(&mut heads, |h, (dst, src, out)| {
            let src: &[f32] = src;
            let (mut w, mut o) = (vec![0f32; d], vec![0f32; n * d]);
            for t in 0..n {
                let at = t * hd + h * d..t * hd + (h + 1) * d;
                delta_step(
                    dst,
                    (t == 0).then_some(src),
                    d,
                    &qs[at.clone()],
                    &ks[at.clone()],
                    &vs[at.clone()],
                    &g[at],
                    beta[t * h_n + h],
                    &mut w,
                    &mut o[t * d..(t + 1) * d],
                );
            }
            *out = o;
        });
        for (h, (_, _, o)) in heads.iter().enumerate() {
            for t in 0..n {
                core[t * hd + h * d..t * hd + (h + 1) * d].copy_from_slice(&o[t * d..(t + 1) * d]);
            }
        }
        if let Some(rec) = st.recorded.as_mut() {
            for t in 0..n {
                let at = t * hd..(t + 1) * hd;
                rec.push(Recorded {
                    q: qs[at.clone()].to_vec(),
                    k: ks[at.clone()].to_vec(),
                    v: vs[at.clone()].to_vec(),
                    g: g[at].to_vec(),
                    beta: beta[t * h_n..(t + 1) * h_n].to_vec(),
                    raw: raw[t * 3 * hd..(t + 1) * 3 * hd].to_vec(),
                });
            }
        }
        st.end_forward(n);
        drop(core_span);
        let _out_span = span(Phase::MixerOut);
        // Per-head norm, output gate, o_proj.
        let mut y = core.clone();
        self.o_norm.apply_inplace(&mut y);
        for (yv, gv) in y.iter_mut().zip(&gate) {
            *yv *= sigmoid(*gv);
        }
        let out = self.o_proj.forward(&y, n);
        Ok((
            out,
            KdaTaps {
                g,
                beta,
                core_out: core,
            },
        ))
    }
}

impl TokenMixer for KdaAttention {
    fn new_state(&self) -> Box<dyn MixerState> {
        Box::new(KdaState::new(
            self.num_heads,
            self.head_dim,
            self.conv_kernel,
        ))
    }

    fn forward(&self, x: &[f32], n: usize, state: &mut dyn MixerState) -> Result<Vec<f32>> {
        Ok(self.forward_taps(x, n, state)?.0)
    }

    fn matrices(&self) -> Vec<&Linear> {
        let mut m = vec![
            &self.q_proj,
            &self.k_proj,
            &self.v_proj,
            &self.f_a_proj,
            &self.f_b_proj,
            &self.b_proj,
        ];
        match &self.output_gate {
            KdaOutputGate::LowRank { a, b } => m.extend([a, b]),
            KdaOutputGate::FullRank(g) => m.push(g),
        }
        m.push(&self.o_proj);
        m
    }

    fn state_widths(&self) -> Option<Vec<usize>> {
        Some(Vec::new())
    }

    fn rollback_window(&self) -> Option<usize> {
        Some(crate::mixer::kda_state::RECORD_MAX_POSITIONS)
    }

    fn fixed_state_sizes(&self) -> Vec<usize> {
        let hd = self.channels();
        vec![
            hd * self.head_dim,
            3 * hd * self.conv_kernel.saturating_sub(1),
        ]
    }

    fn fixed_state_bytes(&self) -> usize {
        // The state before the last forward is kept beside the current one (rollback).
        let [s, tail] = [
            self.channels() * self.head_dim,
            3 * self.channels() * self.conv_kernel.saturating_sub(1),
        ];
        (2 * s + 2 * tail) * std::mem::size_of::<f32>()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
