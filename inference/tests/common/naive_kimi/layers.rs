//! The layers of the naive Kimi reference: config, KDA, NoPE MLA, MLP / MoE, Attention
//! Residuals.
#![allow(dead_code, clippy::unwrap_used, clippy::needless_range_loop)]

use super::config::*;
use super::weights::*;
use super::MoeRoute;

// ---------------------------------------------------------------------------------------------
// KDA

pub(crate) struct KdaOut {
    pub(crate) out: Vec<Vec<f32>>,
    pub(crate) g: Vec<f32>,
    pub(crate) beta: Vec<f32>,
    pub(crate) core: Vec<f32>,
    pub(crate) state: Vec<f32>,
    pub(crate) conv_state: Vec<f32>,
}

/// Depthwise causal conv over `x` ([n][channels]) with weight [channels, 1, K], then SiLU.
pub(crate) fn short_conv(x: &[Vec<f32>], w: &[f32], k: usize) -> Vec<Vec<f32>> {
    let n = x.len();
    let ch = x[0].len();
    assert_eq!(w.len(), ch * k);
    (0..n)
        .map(|t| {
            (0..ch)
                .map(|c| {
                    let mut s = 0f64;
                    for j in 0..k {
                        // tap j reads token t − (K−1) + j; w[c, 0, K−1] multiplies token t.
                        if t + j + 1 >= k {
                            let src = t + j + 1 - k;
                            s += w[c * k + j] as f64 * x[src][c] as f64;
                        }
                    }
                    silu(s) as f32
                })
                .collect()
        })
        .collect()
}

pub(crate) fn kda(w: &W, cfg: &Cfg, a: &str, x: &[Vec<f32>]) -> KdaOut {
    let (n, hh, d, k) = (x.len(), cfg.kda_heads, cfg.kda_dim, cfg.conv_k);
    let hd = hh * d;
    // 1. projections
    let proj = |name: &str| -> Vec<Vec<f32>> {
        x.iter().map(|r| w.lin(&format!("{a}.{name}"), r)).collect()
    };
    let (q0, k0, v0) = (proj("q_proj"), proj("k_proj"), proj("v_proj"));
    assert_eq!(q0[0].len(), hd, "{a}.q_proj rows != num_heads*head_dim");
    // conv cache tap: the last K pre-conv inputs, oldest first
    let mut conv_state = vec![0f32; 3 * hd * k];
    for (p, src) in [&q0, &k0, &v0].iter().enumerate() {
        for c in 0..hd {
            for j in 0..k {
                if n + j >= k {
                    conv_state[(p * hd + c) * k + j] = src[n + j - k][c];
                }
            }
        }
    }
    // 2. short convolutions + SiLU
    let conv = |src: &[Vec<f32>], name: &str| -> Vec<Vec<f32>> {
        let wn = format!("{a}.{name}.weight");
        assert_eq!(w.shape(&wn), vec![hd, 1, k], "{wn}");
        short_conv(src, &w.t(&wn), k)
    };
    let (q1, k1, v1) = (
        conv(&q0, "q_conv1d"),
        conv(&k0, "k_conv1d"),
        conv(&v0, "v_conv1d"),
    );
    // 3. forget gate (log-decay g)
    let dt_bias = w.t(&format!("{a}.dt_bias"));
    assert_eq!(dt_bias.len(), hd);
    let a_log = w.t(&format!("{a}.A_log"));
    assert!(a_log.len() >= hh, "A_log has {} < {hh} values", a_log.len());
    let mut g = vec![0f64; n * hd];
    for t in 0..n {
        let f = w.lin(
            &format!("{a}.f_b_proj"),
            &w.lin(&format!("{a}.f_a_proj"), &x[t]),
        );
        for h in 0..hh {
            let rate = (a_log[h] as f64).exp();
            for i in 0..d {
                let c = h * d + i;
                let z = f[c] as f64 + dt_bias[c] as f64;
                g[t * hd + c] = match cfg.lower_bound {
                    Some(lb) => lb * sigmoid(rate * z),
                    None => -rate * softplus(z),
                };
            }
        }
    }
    // 4. beta
    let beta: Vec<f64> = x
        .iter()
        .flat_map(|r| w.lin(&format!("{a}.b_proj"), r))
        .map(|v| sigmoid(v as f64))
        .collect();
    assert_eq!(beta.len(), n * hh);
    // 5 + 6. normalised q, k; recurrence per head
    let qscale = (d as f64).powf(-0.5);
    let mut core = vec![0f32; n * hd];
    let mut state = vec![0f32; hh * d * d];
    for h in 0..hh {
        let mut s = vec![0f64; d * d]; // [key, value]
        for t in 0..n {
            let q: Vec<f64> = l2norm(&q1[t][h * d..(h + 1) * d])
                .iter()
                .map(|v| v * qscale)
                .collect();
            let kk = l2norm(&k1[t][h * d..(h + 1) * d]);
            let v = &v1[t][h * d..(h + 1) * d];
            let b = beta[t * hh + h];
            for i in 0..d {
                let decay = g[t * hd + h * d + i].exp();
                for j in 0..d {
                    s[i * d + j] *= decay;
                }
            }
            let mut u = vec![0f64; d];
            for j in 0..d {
                let pred: f64 = (0..d).map(|i| s[i * d + j] * kk[i]).sum();
                u[j] = b * (v[j] as f64 - pred);
            }
            for i in 0..d {
                for j in 0..d {
                    s[i * d + j] += kk[i] * u[j];
                }
            }
            for j in 0..d {
                let o: f64 = (0..d).map(|i| s[i * d + j] * q[i]).sum();
                core[t * hd + h * d + j] = o as f32;
            }
        }
        for i in 0..d * d {
            state[h * d * d + i] = s[i] as f32;
        }
    }
    // 7 + 8. gated RMSNorm per head, o_proj
    let onorm = w.t(&format!("{a}.o_norm.weight"));
    assert_eq!(onorm.len(), d);
    let out = (0..n)
        .map(|t| {
            let z = if cfg.full_rank_gate {
                w.lin(&format!("{a}.g_proj"), &x[t])
            } else {
                w.lin(
                    &format!("{a}.g_b_proj"),
                    &w.lin(&format!("{a}.g_a_proj"), &x[t]),
                )
            };
            let mut y = vec![0f32; hd];
            for h in 0..hh {
                let nrm = rms(&core[t * hd + h * d..t * hd + (h + 1) * d], &onorm, cfg.eps);
                for i in 0..d {
                    y[h * d + i] = (nrm[i] as f64 * sigmoid(z[h * d + i] as f64)) as f32;
                }
            }
            w.lin(&format!("{a}.o_proj"), &y)
        })
        .collect();
    KdaOut {
        out,
        g: g.iter().map(|v| *v as f32).collect(),
        beta: beta.iter().map(|v| *v as f32).collect(),
        core,
        state,
        conv_state,
    }
}

// ---------------------------------------------------------------------------------------------
// MLA (NoPE)

pub(crate) fn mla(w: &W, cfg: &Cfg, a: &str, x: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let (n, hn, nope, rd, vd, kl) = (
        x.len(),
        cfg.heads,
        cfg.nope,
        cfg.rope,
        cfg.vdim,
        cfg.kv_lora,
    );
    let qk = nope + rd;
    let scale = (qk as f64).powf(-0.5);
    let mut qs = Vec::new(); // [t][h][qk]
    let mut ks = Vec::new(); // [t][h][qk]
    let mut vs = Vec::new(); // [t][h][vd]
    for t in 0..n {
        let q = match cfg.q_lora {
            None => w.lin(&format!("{a}.q_proj"), &x[t]),
            Some(_) => {
                let qa = w.lin(&format!("{a}.q_a_proj"), &x[t]);
                let qa = rms(&qa, &w.t(&format!("{a}.q_a_layernorm.weight")), 1e-6);
                w.lin(&format!("{a}.q_b_proj"), &qa)
            }
        };
        assert_eq!(q.len(), hn * qk);
        let kv = w.lin(&format!("{a}.kv_a_proj_with_mqa"), &x[t]);
        assert_eq!(kv.len(), kl + rd);
        let lat = rms(&kv[..kl], &w.t(&format!("{a}.kv_a_layernorm.weight")), 1e-6);
        let k_rope = &kv[kl..]; // one head shared by all heads, never rotated
        let kvb = w.lin(&format!("{a}.kv_b_proj"), &lat);
        assert_eq!(kvb.len(), hn * (nope + vd));
        let mut qh = Vec::new();
        let mut kh = Vec::new();
        let mut vh = Vec::new();
        for h in 0..hn {
            qh.push(q[h * qk..(h + 1) * qk].to_vec());
            let blk = &kvb[h * (nope + vd)..(h + 1) * (nope + vd)];
            let mut kk = blk[..nope].to_vec();
            kk.extend_from_slice(k_rope);
            kh.push(kk);
            vh.push(blk[nope..].to_vec());
        }
        qs.push(qh);
        ks.push(kh);
        vs.push(vh);
    }
    (0..n)
        .map(|t| {
            let mut att = Vec::with_capacity(hn * vd);
            for h in 0..hn {
                let sc: Vec<f64> = (0..=t)
                    .map(|j| {
                        qs[t][h]
                            .iter()
                            .zip(&ks[j][h])
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let p = softmax(&sc);
                for e in 0..vd {
                    let o: f64 = (0..=t).map(|j| p[j] * vs[j][h][e] as f64).sum();
                    att.push(o as f32);
                }
            }
            if cfg.mla_gate {
                let gt = w.lin(&format!("{a}.g_proj"), &x[t]);
                for (o, gv) in att.iter_mut().zip(&gt) {
                    *o = (*o as f64 * sigmoid(*gv as f64)) as f32;
                }
            }
            w.lin(&format!("{a}.o_proj"), &att)
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// MLP / MoE

pub(crate) fn gated_mlp(w: &W, act: Act, gate: &str, up: &str, down: &str, x: &[f32]) -> Vec<f32> {
    let g = w.lin(gate, x);
    let u = w.lin(up, x);
    let m: Vec<f32> = g.iter().zip(&u).map(|(g, u)| act.apply(*g, *u)).collect();
    w.lin(down, &m)
}

/// Router for one token: (chosen experts in selection order, their combine weights).
pub(crate) fn route(w: &W, cfg: &Cfg, m: &str, x: &[f32]) -> (Vec<usize>, Vec<f32>) {
    let logits = w.lin(&format!("{m}.gate"), x);
    let e = logits.len();
    assert_eq!(e, cfg.experts, "{m}.gate rows");
    let s: Vec<f64> = if cfg.softmax_router {
        softmax(&logits.iter().map(|v| *v as f64).collect::<Vec<_>>())
    } else {
        logits.iter().map(|v| sigmoid(*v as f64)).collect()
    };
    let bias = w.t(&format!("{m}.gate.e_score_correction_bias"));
    assert_eq!(bias.len(), e);
    let mut c: Vec<f64> = s
        .iter()
        .zip(bias.iter())
        .map(|(a, b)| a + *b as f64)
        .collect();
    let (ng, tg) = (cfg.n_group, cfg.topk_group);
    if ng > 1 && ng > tg {
        assert_eq!(e % ng, 0, "experts not divisible into groups");
        let per = e / ng;
        let gs: Vec<f64> = (0..ng)
            .map(|g| {
                let grp = &c[g * per..(g + 1) * per];
                let o = order(grp);
                grp[o[0]] + grp[o[1]]
            })
            .collect();
        let keep = &order(&gs)[..tg];
        for i in 0..e {
            if !keep.contains(&(i / per)) {
                c[i] = f64::NEG_INFINITY;
            }
        }
    }
    let chosen: Vec<usize> = order(&c)[..cfg.top_k].to_vec();
    let mut wts: Vec<f64> = chosen.iter().map(|&i| s[i]).collect();
    // K3 ([M]): renormalise only when top_k > 1; Kimi Linear (transformers): whenever
    // moe_renormalize.
    if cfg.renorm && (cfg.top_k > 1 || !cfg.k3) {
        let sum: f64 = wts.iter().sum::<f64>() + 1e-20;
        wts.iter_mut().for_each(|v| *v /= sum);
    }
    wts.iter_mut().for_each(|v| *v *= cfg.scaling);
    (chosen, wts.iter().map(|v| *v as f32).collect())
}

pub(crate) fn ffn(w: &W, cfg: &Cfg, l: usize, x: &[Vec<f32>]) -> (Vec<Vec<f32>>, Option<MoeRoute>) {
    let p = format!("model.layers.{l}");
    if l < cfg.first_dense {
        let m = format!("{p}.mlp");
        let out = x
            .iter()
            .map(|r| {
                gated_mlp(
                    w,
                    cfg.act,
                    &format!("{m}.gate_proj"),
                    &format!("{m}.up_proj"),
                    &format!("{m}.down_proj"),
                    r,
                )
            })
            .collect();
        return (out, None);
    }
    let m = format!("{p}.block_sparse_moe");
    let mut ids = Vec::new();
    let mut weights = Vec::new();
    let mut outs = Vec::new();
    for r in x {
        let (chosen, wts) = route(w, cfg, &m, r);
        // routed experts, in the latent space when configured
        let xin = match cfg.latent {
            Some(_) => w.lin(&format!("{m}.routed_expert_down_proj"), r),
            None => r.clone(),
        };
        let mut y = vec![0f64; xin.len()];
        for (&ex, &wt) in chosen.iter().zip(&wts) {
            let e = format!("{m}.experts.{ex}");
            let o = gated_mlp(
                w,
                cfg.act,
                &format!("{e}.w1"),
                &format!("{e}.w3"),
                &format!("{e}.w2"),
                &xin,
            );
            for (a, b) in y.iter_mut().zip(o) {
                *a += wt as f64 * b as f64;
            }
        }
        let mut y: Vec<f32> = y.iter().map(|v| *v as f32).collect();
        if cfg.latent.is_some() {
            if cfg.latent_norm {
                y = rms(&y, &w.t(&format!("{m}.routed_expert_norm.weight")), cfg.eps);
            }
            y = w.lin(&format!("{m}.routed_expert_up_proj"), &y);
        }
        if w.has(&format!("{m}.shared_experts.gate_proj.weight")) {
            let sh = gated_mlp(
                w,
                cfg.act,
                &format!("{m}.shared_experts.gate_proj"),
                &format!("{m}.shared_experts.up_proj"),
                &format!("{m}.shared_experts.down_proj"),
                r,
            );
            for (a, b) in y.iter_mut().zip(sh) {
                *a += b;
            }
        }
        ids.push(chosen);
        weights.push(wts);
        outs.push(y);
    }
    (
        outs,
        Some(MoeRoute {
            layer: l,
            ids,
            weights,
        }),
    )
}

// ---------------------------------------------------------------------------------------------
// Attention Residuals

/// `AttnRes(sources; norm, proj)` per token: softmax over the sources of
/// `proj · RMSNorm(V_i; norm)`, then `Σ p_i V_i` (un-normalised values).
pub(crate) fn attn_res(w: &W, cfg: &Cfg, which: &str, sources: &[&Vec<Vec<f32>>]) -> Vec<Vec<f32>> {
    let nw = w.t(&format!("{which}_norm.weight"));
    let pw = w.t(&format!("{which}_proj.weight"));
    assert_eq!(pw.len(), cfg.hidden, "{which}_proj");
    let n = sources[0].len();
    (0..n)
        .map(|t| {
            let scores: Vec<f64> = sources
                .iter()
                .map(|src| {
                    let normed = rms(&src[t], &nw, cfg.eps);
                    normed
                        .iter()
                        .zip(pw.iter())
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum()
                })
                .collect();
            let p = softmax(&scores);
            (0..cfg.hidden)
                .map(|d| {
                    sources
                        .iter()
                        .zip(&p)
                        .map(|(src, pi)| pi * src[t][d] as f64)
                        .sum::<f64>() as f32
                })
                .collect()
        })
        .collect()
}
