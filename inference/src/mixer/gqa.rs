//! Grouped-query attention with optional per-head q/k RMSNorm (Qwen3-MoE).
//!
//! ```text
//! q = q_norm(q_proj(x))  per head                  [n, H, d]
//! k = k_norm(k_proj(x))  per head  (cached)        [n, KV, d]
//! v = v_proj(x)                    (cached)        [n, KV, d]
//! rope(q), rope(k) (rotate_half), KV head j serves query heads j*g .. j*g+g-1 (g = H / KV)
//! y = o_proj(softmax(scale * q.k) v)               [n, hidden]
//! ```

use crate::error::Result;
use crate::kernels::pool::pool;
use crate::kernels::vector::{axpy, dot};
use crate::linear::Linear;
use crate::mixer::state::{check_import, check_truncate, state_as, MixerState, TokenMixer};
use crate::ops::RmsNorm;
use crate::rope::Rope;
use crate::spans::{span, timed, Phase};

#[derive(Debug)]
pub struct GqaAttention {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// `[H * d, hidden]`
    pub q_proj: Linear,
    /// `[KV * d, hidden]`
    pub k_proj: Linear,
    /// `[KV * d, hidden]`
    pub v_proj: Linear,
    /// `[hidden, H * d]`
    pub o_proj: Linear,
    /// RMSNorm over `head_dim`, shared by all heads, before RoPE.
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    pub rope: Rope,
    pub softmax_scale: f32,
}

/// Keys (after norm and RoPE) and values per position.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// `[len, KV, d]`
    pub k: Vec<f32>,
    /// `[len, KV, d]`
    pub v: Vec<f32>,
    len: usize,
}

impl MixerState for KvCache {
    fn empty(&self) -> Box<dyn MixerState> {
        Box::new(KvCache::default())
    }
    fn len(&self) -> usize {
        self.len
    }
    fn truncate(&mut self, len: usize) -> Result<()> {
        check_truncate(self.len, len)?;
        if let Some(w) = self.k.len().checked_div(self.len) {
            self.k.truncate(len * w);
            self.v.truncate(len * w);
        }
        self.len = len;
        Ok(())
    }
    fn memory_bytes(&self) -> usize {
        (self.k.capacity() + self.v.capacity()) * 4
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
    fn export_arrays(&self) -> Option<Vec<&[f32]>> {
        Some(vec![&self.k, &self.v])
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
        if let (Some(k), Some(v)) = (it.next(), it.next()) {
            self.k = k;
            self.v = v;
        }
        self.len = len;
        Ok(())
    }
}

impl TokenMixer for GqaAttention {
    fn new_state(&self) -> Box<dyn MixerState> {
        Box::new(KvCache::default())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn state_widths(&self) -> Option<Vec<usize>> {
        let w = self.num_kv_heads * self.head_dim;
        Some(vec![w, w])
    }

    fn matrices(&self) -> Vec<&Linear> {
        vec![&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj]
    }

    fn forward(&self, x: &[f32], n: usize, state: &mut dyn MixerState) -> Result<Vec<f32>> {
        let cache = state_as::<KvCache>(state, "GQA attention")?;
        let (hn, kvh, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let group = hn / kvh;
        let start = cache.len;

        let in_span = span(Phase::MixerIn);
        let mut q = self.q_proj.forward(x, n); // [n, H, d]
        let mut k = self.k_proj.forward(x, n); // [n, KV, d]
        let v = self.v_proj.forward(x, n); // [n, KV, d]
        if let Some(norm) = &self.q_norm {
            norm.apply_inplace(&mut q);
        }
        if let Some(norm) = &self.k_norm {
            norm.apply_inplace(&mut k);
        }
        drop(in_span);
        let core_span = span(Phase::MixerCore);
        let half = d / 2;
        let (mut cos, mut sin) = (vec![0f32; half], vec![0f32; half]);
        for t in 0..n {
            self.rope.cos_sin(start + t, &mut cos, &mut sin);
            for head in q[t * hn * d..(t + 1) * hn * d].chunks_mut(d) {
                self.rope.rotate(head, &cos, &sin);
            }
            for head in k[t * kvh * d..(t + 1) * kvh * d].chunks_mut(d) {
                self.rope.rotate(head, &cos, &sin);
            }
        }
        cache.k.extend_from_slice(&k);
        cache.v.extend_from_slice(&v);
        cache.len = start + n;
        let cache: &KvCache = cache;

        let mut attn = vec![0f32; n * hn * d];
        let mut heads: Vec<&mut [f32]> = attn.chunks_mut(d).collect();
        pool().for_each_mut(&mut heads, |idx, out| {
            let (t, h) = (idx / hn, idx % hn);
            let j_head = h / group;
            let qh = &q[(t * hn + h) * d..(t * hn + h + 1) * d];
            let len = start + t + 1;
            let mut scores: Vec<f32> = (0..len)
                .map(|j| {
                    let kj = &cache.k[(j * kvh + j_head) * d..(j * kvh + j_head + 1) * d];
                    dot(qh, kj) * self.softmax_scale
                })
                .collect();
            crate::ops::softmax_inplace(&mut scores);
            for (j, &p) in scores.iter().enumerate() {
                axpy(
                    out,
                    p,
                    &cache.v[(j * kvh + j_head) * d..(j * kvh + j_head + 1) * d],
                );
            }
        });
        drop(core_span);
        Ok(timed(Phase::MixerOut, || self.o_proj.forward(&attn, n)))
    }
}
