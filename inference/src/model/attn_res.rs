//! [`AttnRes`]: Attention Residuals (Kimi K3). There is no residual stream: each sublayer's
//! input is a softmax mix, per position, over the completed blocks of layers and the running
//! sum of the current block, with a learned pseudo-query per sublayer.
//!
//! ```text
//! streams = [B_0 .. B_{n-1}, P]          B_0 = embeddings, P = running sum of the block
//! layer l:  x = mix(streams; attn_l)    (P alone while there is no block yet)
//!           if l % S == 0: B_n = P, P := a   else P += a        a = attn(norm(x))
//!           m = mix(streams; mlp_l);  P += mlp(norm(m))
//! output:   mix(streams; out) -> final norm -> lm_head
//! mix(V; w, p): score_i = sum_d p[d] w[d] V_i[d] / rms(V_i);  sum_i softmax(score)_i V_i
//! ```
//! Token-local: a position's mix sees only its own blocks, so nothing is cached across tokens.

use std::borrow::Cow;

use crate::model::residual::ResidualMixer;

/// The learned vectors of one mix: the norm weight times the projection (`[hidden]`).
#[derive(Debug, Clone, PartialEq)]
pub struct AttnResQuery {
    /// `norm.weight * proj.weight`, folded.
    pub w: Vec<f32>,
}

impl AttnResQuery {
    /// From an RMSNorm weight and a `[1, hidden]` projection.
    pub fn new(norm: &[f32], proj: &[f32]) -> AttnResQuery {
        AttnResQuery {
            w: norm.iter().zip(proj).map(|(a, b)| a * b).collect(),
        }
    }
}

/// Attention Residuals over blocks of `block_size` decoder layers.
#[derive(Debug, Clone)]
pub struct AttnRes {
    pub block_size: usize,
    pub hidden: usize,
    pub eps: f32,
    /// Per decoder layer: the attention's and the MLP's query.
    pub layers: Vec<(AttnResQuery, AttnResQuery)>,
    /// The output mix's query.
    pub output: AttnResQuery,
}

impl AttnRes {
    /// `sum_i softmax_i(score_i) V_i` for every position of the streams, `q`'s query.
    fn mix(&self, streams: &[Vec<f32>], q: &AttnResQuery) -> Vec<f32> {
        let hd = self.hidden;
        let n = streams.first().map_or(0, |s| s.len() / hd.max(1));
        let mut out = vec![0f32; n * hd];
        let mut scores = vec![0f32; streams.len()];
        for t in 0..n {
            for (s, v) in scores.iter_mut().zip(streams) {
                let row = &v[t * hd..(t + 1) * hd];
                let ms = row.iter().map(|x| x * x).sum::<f32>() / hd as f32;
                let inv = 1.0 / (ms + self.eps).sqrt();
                *s = row.iter().zip(&q.w).map(|(x, w)| x * w).sum::<f32>() * inv;
            }
            crate::ops::softmax_inplace(&mut scores);
            let o = &mut out[t * hd..(t + 1) * hd];
            for (p, v) in scores.iter().zip(streams) {
                for (o, x) in o.iter_mut().zip(&v[t * hd..(t + 1) * hd]) {
                    *o += p * x;
                }
            }
        }
        out
    }
}

impl ResidualMixer for AttnRes {
    fn init(&self, embeddings: Vec<f32>) -> Vec<Vec<f32>> {
        vec![embeddings]
    }

    fn block_input<'s>(&self, layer: usize, sub: usize, streams: &'s [Vec<f32>]) -> Cow<'s, [f32]> {
        let Some((attn, mlp)) = self.layers.get(layer) else {
            return Cow::Borrowed(self.layer_state(streams));
        };
        if sub == 0 && streams.len() == 1 {
            // No completed block yet (layer 0): the attention sees P itself.
            return Cow::Borrowed(&streams[0]);
        }
        Cow::Owned(self.mix(streams, if sub == 0 { attn } else { mlp }))
    }

    fn block_output(&self, layer: usize, sub: usize, streams: &mut Vec<Vec<f32>>, out: &[f32]) {
        if sub == 0 && layer.is_multiple_of(self.block_size) {
            // A block boundary: P becomes a completed block, the attention output starts the
            // next one.
            streams.push(out.to_vec());
            return;
        }
        if let Some(p) = streams.last_mut() {
            for (h, o) in p.iter_mut().zip(out) {
                *h += o;
            }
        }
    }

    fn output<'s>(&self, streams: &'s [Vec<f32>]) -> Cow<'s, [f32]> {
        Cow::Owned(self.mix(streams, &self.output))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Block bookkeeping as the README gives it: with S = 2 over 4 layers, the output mixes
    /// B_0 = embeddings, B_1 = layers 0-1's sum, and P = layers 2-3's sum.
    #[test]
    fn blocks_follow_decoder_layers() {
        let q = AttnResQuery::new(&[1.0, 1.0], &[0.0, 0.0]);
        let r = AttnRes {
            block_size: 2,
            hidden: 2,
            eps: 1e-6,
            layers: vec![(q.clone(), q.clone()); 4],
            output: q,
        };
        let mut s = r.init(vec![1.0, 0.0]);
        for l in 0..4 {
            let x = r.block_input(l, 0, &s).into_owned();
            assert_eq!(x.len(), 2);
            r.block_output(l, 0, &mut s, &[l as f32, 1.0]);
            let m = r.block_input(l, 1, &s).into_owned();
            assert_eq!(m.len(), 2);
            r.block_output(l, 1, &mut s, &[10.0, 0.0]);
        }
        assert_eq!(s.len(), 3);
        assert_eq!(s[0], vec![1.0, 0.0]);
        assert_eq!(s[1], vec![0.0 + 10.0 + 1.0 + 10.0, 2.0]);
        assert_eq!(s[2], vec![2.0 + 10.0 + 3.0 + 10.0, 2.0]);
        // Zero queries: a uniform mix of the three.
        let out = r.output(&s);
        assert!((out[0] - (1.0 + 21.0 + 25.0) / 3.0).abs() < 1e-5);
    }
}
