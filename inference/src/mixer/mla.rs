//! DeepSeek-V3 Multi-head Latent Attention.
//!
//! ```text
//! q      = q_b_proj(q_a_layernorm(q_a_proj(x)))   or q_proj(x)        [n, H, nope + rope]
//! kv_a   = kv_a_proj_with_mqa(x)                                      [n, kv_lora + rope]
//! c      = kv_a_layernorm(kv_a[:kv_lora])          (cached)           [n, kv_lora]
//! k_pe   = rope(kv_a[kv_lora:])                    (cached, 1 head)   [n, rope]
//! kv_b_proj = [H, nope + v, kv_lora]: W_uk = rows [..nope], W_uv = rows [nope..]
//! score(h, i, j) = scale * ((W_uk[h]^T q_nope[i,h]) . c[j] + rope(q_pe[i,h]) . k_pe[j])
//! out(h, i)      = W_uv[h] (sum_j softmax_j(score) c[j])              [n, H, v]
//! y = o_proj(out)                                                     [n, hidden]
//! ```
//! Kimi Linear / K3 run it without any rotation (NoPE: `rope` is `None`), and K3 gates the
//! heads' output: `y = o_proj(out * sigmoid(g_proj(x)))`.
//!
//! The cache holds only the compressed latent and the rope key per position; `kv_b_proj` is
//! absorbed into the query and the output (mathematically identical to expanding K and V). It
//! stays in its stored format; each head's rows are decoded once per call.

use crate::kernels::pool::pool;

use crate::error::Result;
use crate::kernels::vector::{axpy, dot, dots};
use crate::linear::Linear;
use crate::mixer::state::{check_import, check_truncate, state_as, MixerState, TokenMixer};
use crate::ops::RmsNorm;
use crate::rope::Rope;
use crate::spans::{span, Phase};

/// Positions whose absorbed queries and contexts one head keeps while it walks its kv_b_proj
/// rows (16 KiB each at kv_lora 256: L1).
const MLA_TILE: usize = 16;

/// Query projection: low-rank with a norm in between, or direct.
#[derive(Debug, Clone)]
pub enum QProj {
    /// `q_b_proj(q_a_layernorm(q_a_proj(x)))`.
    Lora { a: Linear, norm: RmsNorm, b: Linear },
    /// `q_proj(x)` (`q_lora_rank` null).
    Direct(Linear),
}

impl QProj {
    /// The projection applied to the mixer's input.
    fn first(&self) -> &Linear {
        match self {
            QProj::Lora { a, .. } => a,
            QProj::Direct(p) => p,
        }
    }

    /// The query from [`QProj::first`]'s output.
    fn finish(&self, first: Vec<f32>, n: usize) -> Vec<f32> {
        match self {
            QProj::Lora { norm, b, .. } => {
                let mut qa = first;
                norm.apply_inplace(&mut qa);
                b.forward(&qa, n)
            }
            QProj::Direct(_) => first,
        }
    }
}

#[derive(Debug)]
pub struct MlaAttention {
    pub num_heads: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub kv_lora_rank: usize,
    pub q: QProj,
    /// `[kv_lora + rope, hidden]`
    pub kv_a_proj_with_mqa: Linear,
    pub kv_a_layernorm: RmsNorm,
    /// `[H * (nope + v), kv_lora]`: per head, `nope` rows producing k_nope then `v` rows
    /// producing the value.
    pub kv_b_proj: Linear,
    /// `[hidden, H * v]`
    pub o_proj: Linear,
    /// RoPE of the rope part of q and k; `None`: never rotated (Kimi's NoPE MLA).
    pub rope: Option<Rope>,
    /// Softmax scale applied to q.k.
    pub softmax_scale: f32,
    /// K3's output gate `[H * v, hidden]`: `o_proj(attn * sigmoid(g_proj(x)))`.
    pub output_gate: Option<Linear>,
}

/// MLA cache: per position the normalised latent and the rotated rope key.
#[derive(Debug, Clone, Default)]
pub struct MlaCache {
    /// `[len, kv_lora_rank]`
    pub latent: Vec<f32>,
    /// `[len, qk_rope_head_dim]`
    pub k_rope: Vec<f32>,
    len: usize,
}

impl MixerState for MlaCache {
    fn empty(&self) -> Box<dyn MixerState> {
        Box::new(MlaCache::default())
    }
    fn len(&self) -> usize {
        self.len
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        check_truncate(self.len, len)?;
        if let (Some(l), Some(r)) = (
            self.latent.len().checked_div(self.len),
            self.k_rope.len().checked_div(self.len),
        ) {
            self.latent.truncate(len * l);
            self.k_rope.truncate(len * r);
        }
        self.len = len;
        Ok(())
    }
    fn memory_bytes(&self) -> usize {
        (self.latent.capacity() + self.k_rope.capacity()) * 4
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
    fn export_arrays(&self) -> Option<Vec<&[f32]>> {
        Some(vec![&self.latent, &self.k_rope])
    }
    fn import_arrays(
        &mut self,
        len: usize,
        arrays: Vec<Vec<f32>>,
        fixed: Vec<Vec<f32>>,
    ) -> Result<()> {
        check_import(0, &fixed, 0)?;
        check_import(len, &arrays, 2)?;
        let mut it = arrays.into_iter();
        if let (Some(l), Some(r)) = (it.next(), it.next()) {
            self.latent = l;
            self.k_rope = r;
        }
        self.len = len;
        Ok(())
    }
}

impl TokenMixer for MlaAttention {
    fn new_state(&self) -> Box<dyn MixerState> {
        Box::new(MlaCache::default())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn state_widths(&self) -> Option<Vec<usize>> {
        Some(vec![self.kv_lora_rank, self.qk_rope_head_dim])
    }

    fn forward(&self, x: &[f32], n: usize, state: &mut dyn MixerState) -> Result<Vec<f32>> {
        let cache = state_as::<MlaCache>(state, "MLA attention")?;
        let (h_n, nope, rd, vd, kl) = (
            self.num_heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.kv_lora_rank,
        );
        let qk = nope + rd;
        let start = cache.len;

        let in_span = span(Phase::MixerIn);
        // Every projection of x in one pass (one hand-out to the threads, inputs prepared
        // once): the query's first (or only) projection, kv_a, and K3's output gate.
        let mut lins: Vec<&Linear> = vec![self.q.first(), &self.kv_a_proj_with_mqa];
        lins.extend(self.output_gate.as_ref());
        let mut outs = Linear::forward_many(&lins, x, n).into_iter();
        let mut next = || outs.next().unwrap_or_default();
        let (q_first, kv, gate) = (next(), next(), next()); // kv: [n, kv_lora + rope]
        let q = self.q.finish(q_first, n); // [n, H, nope + rope]
        drop(in_span);
        let core_span = span(Phase::MixerCore);
        for t in 0..n {
            let row = &kv[t * (kl + rd)..(t + 1) * (kl + rd)];
            let mut lat = row[..kl].to_vec();
            self.kv_a_layernorm.apply_inplace(&mut lat);
            cache.latent.extend_from_slice(&lat);
            let mut kpe = row[kl..].to_vec();
            if let Some(rope) = &self.rope {
                rope.apply(&mut kpe, start + t);
            }
            cache.k_rope.extend_from_slice(&kpe);
        }
        cache.len = start + n;
        let cache: &MlaCache = cache;

        // One task per head. Its kv_b_proj rows are decoded one at a time into an L1-sized
        // buffer and applied to a tile of positions before the next row: reading the rows once
        // per tile instead of decoding the whole head (nope + v rows) into a fresh buffer per
        // forward, which cost more than the arithmetic at decode (1.07 of 16 ms per token on
        // the 3.1B synth, `bench compute --profile`). Each value is summed in the same order
        // in a fixed order (row by row); the vector operations run on AVX-512 / AVX2 where the
        // CPU has them (the baseline target vectorizes plain loops to SSE2 only).
        let kv_b = self.kv_b_proj.view();
        let per_head: Vec<Vec<f32>> = pool().map(h_n, |h| {
            let mut row = vec![0f32; kl];
            let mut scales = Vec::new();
            let mut out = vec![0f32; n * vd];
            let mut q_abs = vec![0f32; MLA_TILE * kl];
            let mut ctx = vec![0f32; MLA_TILE * kl];
            let mut q_pe = vec![0f32; rd];
            let (mut scores, mut rope_scores) = (Vec::new(), Vec::new());
            for t0 in (0..n).step_by(MLA_TILE) {
                let tn = MLA_TILE.min(n - t0);
                // q_abs[t, c] = sum_d q_nope[t, d] * W_uk[d, c]
                q_abs[..tn * kl].iter_mut().for_each(|a| *a = 0.0);
                for d in 0..nope {
                    kv_b.decode_row_with(h * (nope + vd) + d, &mut row, &mut scales);
                    for (t, qa) in q_abs.chunks_mut(kl).take(tn).enumerate() {
                        axpy(qa, q[((t0 + t) * h_n + h) * qk + d], &row);
                    }
                }
                for (t, (qa, cx)) in q_abs
                    .chunks(kl)
                    .zip(ctx.chunks_mut(kl))
                    .take(tn)
                    .enumerate()
                {
                    let pos = start + t0 + t;
                    let qh = &q[((t0 + t) * h_n + h) * qk..((t0 + t) * h_n + h + 1) * qk];
                    q_pe.copy_from_slice(&qh[nope..]);
                    if let Some(rope) = &self.rope {
                        rope.apply(&mut q_pe, pos);
                    }
                    scores.resize(pos + 1, 0.0);
                    rope_scores.resize(pos + 1, 0.0);
                    dots(qa, &cache.latent, &mut scores);
                    dots(&q_pe, &cache.k_rope, &mut rope_scores);
                    for (s, r) in scores.iter_mut().zip(&rope_scores) {
                        *s = (*s + r) * self.softmax_scale;
                    }
                    crate::ops::softmax_inplace(&mut scores);
                    cx.iter_mut().for_each(|c| *c = 0.0);
                    for (j, &p) in scores.iter().enumerate() {
                        axpy(cx, p, &cache.latent[j * kl..(j + 1) * kl]);
                    }
                }
                // out[t, dv] = W_uv[dv] . ctx[t]
                for dv in 0..vd {
                    kv_b.decode_row_with(h * (nope + vd) + nope + dv, &mut row, &mut scales);
                    for (t, cx) in ctx.chunks(kl).take(tn).enumerate() {
                        out[(t0 + t) * vd + dv] = dot(&row, cx);
                    }
                }
            }
            out
        });
        // [n, H, v]
        let mut attn = vec![0f32; n * h_n * vd];
        for (h, out) in per_head.iter().enumerate() {
            for t in 0..n {
                attn[(t * h_n + h) * vd..(t * h_n + h + 1) * vd]
                    .copy_from_slice(&out[t * vd..(t + 1) * vd]);
            }
        }
        drop(core_span);
        let _out_span = span(Phase::MixerOut);
        if self.output_gate.is_some() {
            for (a, g) in attn.iter_mut().zip(&gate) {
                *a *= crate::ops::sigmoid(*g);
            }
        }
        Ok(self.o_proj.forward(&attn, n))
    }
}
