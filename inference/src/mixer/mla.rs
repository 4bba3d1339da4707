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
use crate::kernels::shape::KernelShape;
use crate::kernels::vector::{axpy, dot, dots};
use crate::kernels::vector_decode::{axpy_rows_decoded, dots_rows_decoded, PackedRows};
use crate::kernels::vector_tiles::{self, axpy_rows, dot_many};
use crate::linear::{Linear, WeightMatrix};
use crate::mixer::state::{check_import, check_truncate, state_as, MixerState, TokenMixer};
use crate::ops::RmsNorm;
use crate::rope::Rope;
use crate::spans::{span, Phase};

/// Positions whose absorbed queries and contexts one head keeps while it walks its kv_b_proj
/// rows (16 KiB each at kv_lora 256: L1).
const MLA_TILE: usize = 16;

/// Positions from which a call runs each head in register tiles ([`MlaAttention::head_chunk`])
/// instead of walking kv_b_proj row by row (the same bits either way).
const MLA_CHUNK_POSITIONS: usize = 8;

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

/// Per-position buffers of [`MlaAttention::attend`].
#[derive(Default)]
struct AttendScratch {
    q_pe: Vec<f32>,
    scores: Vec<f32>,
    rope_scores: Vec<f32>,
}

impl MlaAttention {
    /// One head at one position, in the latent space: `cx = sum_j softmax_j(score) c[j]` over
    /// the cached positions `0..=pos`, with `qa` the absorbed query (`W_uk^T q_nope`) and
    /// `q_rope` the unrotated rope part of the query.
    fn attend(
        &self,
        qa: &[f32],
        q_rope: &[f32],
        pos: usize,
        cache: &MlaCache,
        s: &mut AttendScratch,
        cx: &mut [f32],
    ) {
        let kl = self.kv_lora_rank;
        let mut p = std::mem::take(&mut s.scores);
        p.resize(pos + 1, 0.0);
        self.probabilities(qa, q_rope, pos, cache, s, &mut p);
        cx.iter_mut().for_each(|c| *c = 0.0);
        for (j, &pj) in p.iter().enumerate() {
            axpy(cx, pj, &cache.latent[j * kl..(j + 1) * kl]);
        }
        s.scores = p;
    }

    /// `p[j] = softmax_j(score(pos, j))` for the cached positions `j <= pos` (`p` holds
    /// `pos + 1`).
    fn probabilities(
        &self,
        qa: &[f32],
        q_rope: &[f32],
        pos: usize,
        cache: &MlaCache,
        s: &mut AttendScratch,
        p: &mut [f32],
    ) {
        dots(qa, &cache.latent, p);
        self.finish_probabilities(q_rope, pos, cache, s, p);
    }

    /// [`MlaAttention::probabilities`] once `p` holds the latent part of the scores.
    fn finish_probabilities(
        &self,
        q_rope: &[f32],
        pos: usize,
        cache: &MlaCache,
        s: &mut AttendScratch,
        p: &mut [f32],
    ) {
        s.q_pe.clear();
        s.q_pe.extend_from_slice(q_rope);
        if let Some(rope) = &self.rope {
            rope.apply(&mut s.q_pe, pos);
        }
        s.rope_scores.resize(pos + 1, 0.0);
        dots(&s.q_pe, &cache.k_rope, &mut s.rope_scores);
        for (sc, r) in p.iter_mut().zip(&s.rope_scores) {
            *sc = (*sc + r) * self.softmax_scale;
        }
        crate::ops::softmax_inplace(p);
    }

    /// Head `h` over `n` positions (a prefill chunk): its kv_b_proj rows decoded once, then
    /// the absorbed queries `q_nope [n, nope] x W_uk [nope, kl]` and the output `W_uv ctx`
    /// as register tiles ([`crate::kernels::vector_tiles`]). Bit for bit what walking the rows
    /// one position tile at a time gives (the same operations in the same order), so a chunk
    /// still equals position-by-position decoding.
    fn head_chunk(
        &self,
        h: usize,
        q: &[f32],
        n: usize,
        start: usize,
        cache: &MlaCache,
        kv_b: &WeightMatrix<'_>,
    ) -> Vec<f32> {
        let (h_n, nope, rd, vd, kl) = (
            self.num_heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.kv_lora_rank,
        );
        let qk = nope + rd;
        // [nope + vd, kl]: W_uk's rows, then W_uv's.
        let mut w = vec![0f32; (nope + vd) * kl];
        let mut scales = Vec::new();
        let r0 = h * (nope + vd);
        let per_row = head_scales(kv_b, r0, r0 + nope + vd, &mut scales);
        for (r, row) in w.chunks_mut(kl).enumerate() {
            kv_b.decode_row_scaled(r0 + r, &scales[r * per_row..(r + 1) * per_row], row);
        }
        let mut q_abs = vec![0f32; n * kl];
        axpy_rows(
            &q[h * qk..],
            h_n * qk,
            &w[..nope * kl],
            nope,
            kl,
            &mut q_abs,
        );
        // Every position's probabilities over the cache, `[n, len]` (zero past its own).
        let len = start + n;
        let mut probs = vec![0f32; n * len];
        let mut scratch = AttendScratch::default();
        let tile = vector_tiles::TILE_POSITIONS;
        // The latent scores a tile of positions at a time (each cached row loaded once for
        // the tile) over the positions all of them see, then each one's causal rest.
        for t0 in (0..n).step_by(tile) {
            let tn = tile.min(n - t0);
            let common = start + t0 + 1;
            let latent = &cache.latent[..common * kl];
            let rows = &mut probs[t0 * len..(t0 + tn) * len];
            if tn == tile {
                let mut ps = rows.chunks_mut(len);
                let mut next = || ps.next().map(|p| &mut p[..common]).unwrap_or_default();
                let out = [next(), next(), next(), next()];
                let qa = |k: usize| &q_abs[(t0 + k) * kl..(t0 + k + 1) * kl];
                vector_tiles::dots4([qa(0), qa(1), qa(2), qa(3)], latent, common, out);
            } else {
                for (k, p) in rows.chunks_mut(len).enumerate() {
                    dots(
                        &q_abs[(t0 + k) * kl..(t0 + k + 1) * kl],
                        latent,
                        &mut p[..common],
                    );
                }
            }
            for t in t0..t0 + tn {
                let (pos, qa) = (start + t, &q_abs[t * kl..(t + 1) * kl]);
                let p = &mut probs[t * len..t * len + pos + 1];
                dots(
                    qa,
                    &cache.latent[common * kl..(pos + 1) * kl],
                    &mut p[common..],
                );
                let qh = &q[(t * h_n + h) * qk..(t * h_n + h + 1) * qk];
                self.finish_probabilities(&qh[nope..], pos, cache, &mut scratch, p);
            }
        }
        // The contexts, a tile of positions at a time: over the cached positions every one of
        // them sees as register tiles, then each one's remaining (causal) positions, in the
        // same order as `attend`'s axpy calls.
        let mut ctx = vec![0f32; n * kl];
        for t0 in (0..n).step_by(tile) {
            let tn = tile.min(n - t0);
            let common = start + t0 + 1;
            let out = &mut ctx[t0 * kl..(t0 + tn) * kl];
            axpy_rows(&probs[t0 * len..], len, &cache.latent, common, kl, out);
            for t in t0 + 1..t0 + tn {
                let cx = &mut ctx[t * kl..(t + 1) * kl];
                for j in common..=start + t {
                    axpy(cx, probs[t * len + j], &cache.latent[j * kl..(j + 1) * kl]);
                }
            }
        }
        let mut out = vec![0f32; n * vd];
        for dv in 0..vd {
            let row = &w[(nope + dv) * kl..(nope + dv + 1) * kl];
            dot_many(row, &ctx, n, &mut out[dv..], vd);
        }
        out
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

    fn matrices(&self) -> Vec<&Linear> {
        let mut m = vec![self.q.first(), &self.kv_a_proj_with_mqa];
        if let QProj::Lora { b, .. } = &self.q {
            m.push(b);
        }
        m.push(&self.kv_b_proj);
        m.extend(&self.output_gate);
        m.push(&self.o_proj);
        m
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

        // One task per head. A chunk of MLA_CHUNK_POSITIONS or more runs the head in register
        // tiles (`head_chunk`). Fewer positions (decode) walk its kv_b_proj
        // rows, each decoded into an L1-sized buffer and applied to a tile of positions before
        // the next: reading the rows once per tile instead of decoding the whole head into a
        // fresh buffer per forward, which cost more than the arithmetic at decode (1.07 of
        // 16 ms per token on the 3.1B synth, `bench compute --profile`). Either way each value
        // is summed in a fixed order; the vector operations run on AVX-512 / AVX2 where the
        // CPU has them (the baseline target vectorizes plain loops to SSE2 only).
        let kv_b = self.kv_b_proj.view();
        let per_head: Vec<Vec<f32>> = pool().map(h_n, |h| {
            if n >= MLA_CHUNK_POSITIONS {
                return self.head_chunk(h, &q, n, start, cache, &kv_b);
            }
            let mut row = vec![0f32; kl];
            // The head's rows' scales, converted once.
            let mut scales = Vec::new();
            let r0 = h * (nope + vd);
            let per_row = head_scales(&kv_b, r0, r0 + nope + vd, &mut scales);
            let row_scales = |r: usize| &scales[r * per_row..(r + 1) * per_row];
            // W_uk's and W_uv's rows decoded inside the loops that apply them, where the
            // format allows (`vector_decode`: the same bits as decoding then `axpy` / `dot`).
            let rb = kv_b.format().row_len(kl);
            let data = &kv_b.data_bytes()[r0 * rb..];
            let packed = |a: usize, b: usize| {
                let (d, s) = (&data[a * rb..b * rb], &scales[a * per_row..b * per_row]);
                PackedRows::new(kv_b.format(), d, s, per_row, b - a, kl)
            };
            let (uk, uv) = (packed(0, nope), packed(nope, nope + vd));
            let mut out = vec![0f32; n * vd];
            // A tile's positions, at most `n` (decode: one; zeroing 16 positions' buffers per
            // head was a visible share of a decode token's attention).
            let tile = MLA_TILE.min(n);
            let mut q_abs = vec![0f32; tile * kl];
            let mut ctx = vec![0f32; tile * kl];
            let mut scratch = AttendScratch::default();
            for t0 in (0..n).step_by(MLA_TILE) {
                let tn = MLA_TILE.min(n - t0);
                // q_abs[t, c] = sum_d q_nope[t, d] * W_uk[d, c]
                q_abs[..tn * kl].iter_mut().for_each(|a| *a = 0.0);
                if let Some(uk) = &uk {
                    let coef = &q[(t0 * h_n + h) * qk..];
                    axpy_rows_decoded(uk, coef, h_n * qk, &mut q_abs[..tn * kl]);
                } else {
                    for d in 0..nope {
                        kv_b.decode_row_scaled(r0 + d, row_scales(d), &mut row);
                        for (t, qa) in q_abs.chunks_mut(kl).take(tn).enumerate() {
                            axpy(qa, q[((t0 + t) * h_n + h) * qk + d], &row);
                        }
                    }
                }
                for (t, (qa, cx)) in q_abs
                    .chunks(kl)
                    .zip(ctx.chunks_mut(kl))
                    .take(tn)
                    .enumerate()
                {
                    let qh = &q[((t0 + t) * h_n + h) * qk..((t0 + t) * h_n + h + 1) * qk];
                    self.attend(qa, &qh[nope..], start + t0 + t, cache, &mut scratch, cx);
                }
                // out[t, dv] = W_uv[dv] . ctx[t]
                if let Some(uv) = &uv {
                    dots_rows_decoded(uv, &ctx[..tn * kl], tn, &mut out[t0 * vd..], vd);
                } else {
                    for dv in 0..vd {
                        kv_b.decode_row_scaled(r0 + nope + dv, row_scales(nope + dv), &mut row);
                        for (t, cx) in ctx.chunks(kl).take(tn).enumerate() {
                            out[(t0 + t) * vd + dv] = dot(&row, cx);
                        }
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

/// Rows `r0..r1`'s scales as f32 into `out`, the same count for each row (one `1.0` per row
/// for unscaled formats), converted in one pass; returns that count. Converting each row's
/// scales on its own cost more than decoding it.
fn head_scales(kv_b: &WeightMatrix<'_>, r0: usize, r1: usize, out: &mut Vec<f32>) -> usize {
    crate::kernels::scales::row_scales(kv_b.kernels().isa, kv_b, r0, r1, out);
    out.len().checked_div(r1 - r0).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lin(rows: usize, cols: usize, seed: &mut u64) -> Linear {
        let w: Vec<f32> = (0..rows * cols)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.3
            })
            .collect();
        Linear::from_f32(rows, cols, &w).expect("matrix")
    }

    /// `lin`'s matrix packed as `format` ("q8", "int4", "bf16", "mxfp4"): the decode path's
    /// fused row decoding (`vector_decode`) for the first three, rows one by one for MXFP4.
    fn packed(lin: &Linear, format: &str) -> Linear {
        let v = lin.view();
        let (rows, cols) = (v.rows(), v.cols());
        let (f, data, scale, st) =
            crate::run::calibrate::packed_matrix(format, &v.to_f32(), rows, cols);
        let m = WeightMatrix::new(rows, cols, f, &data, &scale, st).expect("packed");
        Linear::from_matrix(&m, None)
    }

    /// A chunk long enough for the tiled path gives, bit for bit, what the row-by-row path
    /// gives one position at a time (the decode path), after a cached prefix; kv_b_proj in
    /// every format the decode path treats its own way.
    #[test]
    fn chunk_in_tiles_equals_position_by_position() {
        for format in ["f32", "q8", "int4", "bf16", "mxfp4"] {
            chunk_equals_positions(format);
        }
    }

    fn chunk_equals_positions(format: &str) {
        let (hidden, h_n, nope, rd, vd, kl) = (64, 4, 16, 8, 16, 64);
        let mut seed = 3u64;
        let mla = MlaAttention {
            num_heads: h_n,
            qk_nope_head_dim: nope,
            qk_rope_head_dim: rd,
            v_head_dim: vd,
            kv_lora_rank: kl,
            q: QProj::Direct(lin(h_n * (nope + rd), hidden, &mut seed)),
            kv_a_proj_with_mqa: lin(kl + rd, hidden, &mut seed),
            kv_a_layernorm: RmsNorm {
                weight: vec![1.0; kl],
                eps: 1e-6,
            },
            kv_b_proj: match lin(h_n * (nope + vd), kl, &mut seed) {
                l if format == "f32" => l,
                l => packed(&l, format),
            },
            o_proj: lin(hidden, h_n * vd, &mut seed),
            rope: None,
            softmax_scale: 0.25,
            output_gate: Some(lin(h_n * vd, hidden, &mut seed)),
        };
        let (prefix, n) = (3, 2 * MLA_CHUNK_POSITIONS + 1);
        let x = lin(prefix + n, hidden, &mut seed).view().to_f32();
        let (mut a, mut b) = (mla.new_state(), mla.new_state());
        mla.forward(&x[..prefix * hidden], prefix, &mut *a).unwrap();
        mla.forward(&x[..prefix * hidden], prefix, &mut *b).unwrap();
        let chunk = mla.forward(&x[prefix * hidden..], n, &mut *a).unwrap();
        let mut one_by_one = Vec::new();
        for t in prefix..prefix + n {
            let y = mla
                .forward(&x[t * hidden..(t + 1) * hidden], 1, &mut *b)
                .unwrap();
            one_by_one.extend(y);
        }
        let scale = one_by_one.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = chunk
            .iter()
            .zip(&one_by_one)
            .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(scale > 1e-3, "a non-trivial output ({scale})");
        assert_eq!(
            err, 0.0,
            "{format}: bit for bit (max error {err} at scale {scale})"
        );
    }
}
