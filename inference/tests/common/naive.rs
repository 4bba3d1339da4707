//! A deliberately plain, uncached reference forward pass written independently of the engine:
//! f32 weights read straight from the checkpoint, MLA with K and V expanded through kv_b_proj,
//! per-position loops, frequencies computed in f64. Used to check the engine on configurations
//! for which no transformers reference exists.
#![allow(dead_code, clippy::unwrap_used, clippy::needless_range_loop)]

use std::path::Path;

use deltafin_formats::Dtype;
use deltafin_storage::checkpoint::Checkpoint;
use serde_json::Value;

struct W {
    ck: Checkpoint,
}

impl W {
    fn has(&self, name: &str) -> bool {
        self.ck.get(name).is_some()
    }
    fn shape(&self, name: &str) -> Vec<usize> {
        self.ck
            .get(name)
            .unwrap_or_else(|| panic!("{name}"))
            .info
            .shape
            .iter()
            .map(|&d| d as usize)
            .collect()
    }
    fn t(&self, name: &str) -> Vec<f32> {
        let info = &self
            .ck
            .get(name)
            .unwrap_or_else(|| panic!("missing {name}"))
            .info;
        let b = self.ck.bytes(name).unwrap();
        match info.dtype {
            Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::Bf16 => b
                .chunks_exact(2)
                .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
                .collect(),
            ref d => panic!("{name}: {d}"),
        }
    }
    /// `W x (+ b)` for the linear `prefix`.
    fn lin(&self, prefix: &str, x: &[f32]) -> Vec<f32> {
        let wn = format!("{prefix}.weight");
        let s = self.shape(&wn);
        let w = self.t(&wn);
        let mut y = matvec(&w, s[0], s[1], x);
        let bn = format!("{prefix}.bias");
        if self.has(&bn) {
            for (y, b) in y.iter_mut().zip(self.t(&bn)) {
                *y += b;
            }
        }
        y
    }
}

fn matvec(w: &[f32], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
    assert_eq!(x.len(), cols);
    (0..rows)
        .map(|r| {
            (0..cols)
                .map(|c| w[r * cols + c] as f64 * x[c] as f64)
                .sum::<f64>() as f32
        })
        .collect()
}

fn rms(x: &[f32], w: &[f32], eps: f64) -> Vec<f32> {
    let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, w)| (*v as f64 * inv) as f32 * w)
        .collect()
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn dotf(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| *x as f64 * *y as f64)
        .sum::<f64>() as f32
}

fn softmax(v: &mut [f32]) {
    let m = v.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let s: f64 = v.iter().map(|x| ((x - m) as f64).exp()).sum();
    for x in v.iter_mut() {
        *x = (((*x - m) as f64).exp() / s) as f32;
    }
}

fn num(c: &Value, k: &str) -> f64 {
    c[k].as_f64().unwrap_or_else(|| panic!("config field {k}"))
}
fn us(c: &Value, k: &str) -> usize {
    num(c, k) as usize
}

/// Rope frequencies and the cos/sin factor, from either spelling of the rope config.
fn rope_setup(c: &Value, dim: usize) -> (Vec<f64>, f64, Value) {
    let rp = if !c["rope_parameters"].is_null() {
        c["rope_parameters"].clone()
    } else {
        c["rope_scaling"].clone()
    };
    let theta = rp["rope_theta"]
        .as_f64()
        .or(c["rope_theta"].as_f64())
        .unwrap_or(10000.0);
    let ty = rp["rope_type"]
        .as_str()
        .or(rp["type"].as_str())
        .unwrap_or("default")
        .to_string();
    let base: Vec<f64> = (0..dim / 2)
        .map(|i| theta.powf(-(2.0 * i as f64) / dim as f64))
        .collect();
    if ty != "yarn" {
        return (base, 1.0, rp);
    }
    let factor = rp["factor"].as_f64().unwrap();
    let orig = rp["original_max_position_embeddings"]
        .as_f64()
        .unwrap_or(num(c, "max_position_embeddings"));
    let gm = |s: f64, m: f64| {
        if s <= 1.0 {
            1.0
        } else {
            0.1 * m * s.ln() + 1.0
        }
    };
    let af = match (rp["mscale"].as_f64(), rp["mscale_all_dim"].as_f64()) {
        (Some(a), Some(b)) if a != 0.0 && b != 0.0 => gm(factor, a) / gm(factor, b),
        _ => gm(factor, 1.0),
    };
    let bf = rp["beta_fast"].as_f64().unwrap_or(32.0);
    let bs = rp["beta_slow"].as_f64().unwrap_or(1.0);
    let cd =
        |r: f64| dim as f64 * (orig / (r * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
    let low = cd(bf).floor().max(0.0);
    let mut high = cd(bs).ceil().min(dim as f64 - 1.0);
    if low == high {
        high += 0.001;
    }
    let inv = base
        .iter()
        .enumerate()
        .map(|(i, &b)| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            b / factor * ramp + b * (1.0 - ramp)
        })
        .collect();
    (inv, af, rp)
}

fn rotate(x: &mut [f32], pos: usize, inv: &[f64], af: f64, interleaved: bool) {
    let half = x.len() / 2;
    for i in 0..half {
        let a = pos as f64 * inv[i];
        let (c, s) = ((a.cos() * af) as f32, (a.sin() * af) as f32);
        let (ia, ib) = if interleaved {
            (2 * i, 2 * i + 1)
        } else {
            (i, i + half)
        };
        let (p, q) = (x[ia], x[ib]);
        x[ia] = p * c - q * s;
        x[ib] = q * c + p * s;
    }
}

fn swiglu(w: &W, prefix: &str, x: &[f32]) -> Vec<f32> {
    let g = w.lin(&format!("{prefix}.gate_proj"), x);
    let u = w.lin(&format!("{prefix}.up_proj"), x);
    let h: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
    w.lin(&format!("{prefix}.down_proj"), &h)
}

/// Descending order of `v` (ties by index).
fn order(v: &[f32]) -> Vec<usize> {
    let mut i: Vec<usize> = (0..v.len()).collect();
    i.sort_by(|&a, &b| v[b].partial_cmp(&v[a]).unwrap().then(a.cmp(&b)));
    i
}

/// Logits `[n, vocab]` of one uncached forward over `tokens`.
pub fn naive_logits(dir: &Path, tokens: &[u32]) -> Vec<f32> {
    let ck = Checkpoint::open(dir).unwrap();
    let c = ck.config.clone();
    let w = W { ck };
    let ds = c["model_type"].as_str().unwrap() != "qwen3_moe";
    let (hsz, layers, eps) = (
        us(&c, "hidden_size"),
        us(&c, "num_hidden_layers"),
        num(&c, "rms_norm_eps"),
    );
    let emb = w.t("model.embed_tokens.weight");
    let mut h: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&t| emb[t as usize * hsz..(t as usize + 1) * hsz].to_vec())
        .collect();
    let n = tokens.len();
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        let a = format!("{p}.self_attn");
        let ln1 = w.t(&format!("{p}.input_layernorm.weight"));
        let x: Vec<Vec<f32>> = h.iter().map(|r| rms(r, &ln1, eps)).collect();
        let attn: Vec<Vec<f32>> = if ds {
            let (hn, nope, rd, vd, kl) = (
                us(&c, "num_attention_heads"),
                us(&c, "qk_nope_head_dim"),
                us(&c, "qk_rope_head_dim"),
                us(&c, "v_head_dim"),
                us(&c, "kv_lora_rank"),
            );
            let (inv, af, rp) = rope_setup(&c, rd);
            let interleaved = c["rope_interleave"].as_bool().unwrap_or(true);
            let mut scale = ((nope + rd) as f64).powf(-0.5);
            if let (Some(m), Some(f)) = (rp["mscale_all_dim"].as_f64(), rp["factor"].as_f64()) {
                if m != 0.0 && f > 1.0 {
                    let ms = 0.1 * m * f.ln() + 1.0;
                    scale *= ms * ms;
                }
            }
            let mut qs = Vec::new();
            let mut ks = Vec::new();
            let mut vs = Vec::new();
            for t in 0..n {
                let q = if c["q_lora_rank"].is_null() {
                    w.lin(&format!("{a}.q_proj"), &x[t])
                } else {
                    let qa = w.lin(&format!("{a}.q_a_proj"), &x[t]);
                    let qa = rms(&qa, &w.t(&format!("{a}.q_a_layernorm.weight")), 1e-6);
                    w.lin(&format!("{a}.q_b_proj"), &qa)
                };
                let kv = w.lin(&format!("{a}.kv_a_proj_with_mqa"), &x[t]);
                let lat = rms(&kv[..kl], &w.t(&format!("{a}.kv_a_layernorm.weight")), 1e-6);
                let mut kpe = kv[kl..].to_vec();
                rotate(&mut kpe, t, &inv, af, interleaved);
                let kvb = w.lin(&format!("{a}.kv_b_proj"), &lat);
                let mut qh = Vec::new();
                let mut kh = Vec::new();
                let mut vh = Vec::new();
                for hh in 0..hn {
                    let mut qq = q[hh * (nope + rd)..(hh + 1) * (nope + rd)].to_vec();
                    rotate(&mut qq[nope..], t, &inv, af, interleaved);
                    qh.push(qq);
                    let blk = &kvb[hh * (nope + vd)..(hh + 1) * (nope + vd)];
                    let mut k = blk[..nope].to_vec();
                    k.extend_from_slice(&kpe);
                    kh.push(k);
                    vh.push(blk[nope..].to_vec());
                }
                qs.push(qh);
                ks.push(kh);
                vs.push(vh);
            }
            (0..n)
                .map(|t| {
                    let mut o = Vec::new();
                    for hh in 0..hn {
                        let mut sc: Vec<f32> = (0..=t)
                            .map(|j| dotf(&qs[t][hh], &ks[j][hh]) * scale as f32)
                            .collect();
                        softmax(&mut sc);
                        let mut out = vec![0f32; vd];
                        for j in 0..=t {
                            for d in 0..vd {
                                out[d] += sc[j] * vs[j][hh][d];
                            }
                        }
                        o.extend(out);
                    }
                    w.lin(&format!("{a}.o_proj"), &o)
                })
                .collect()
        } else {
            let (hn, kvh) = (us(&c, "num_attention_heads"), us(&c, "num_key_value_heads"));
            let d = c["head_dim"]
                .as_u64()
                .map(|v| v as usize)
                .unwrap_or(hsz / hn);
            let (inv, af, _) = rope_setup(&c, d);
            let qn = w.t(&format!("{a}.q_norm.weight"));
            let kn = w.t(&format!("{a}.k_norm.weight"));
            let mut qs = Vec::new();
            let mut ks = Vec::new();
            let mut vs = Vec::new();
            for t in 0..n {
                let q = w.lin(&format!("{a}.q_proj"), &x[t]);
                let k = w.lin(&format!("{a}.k_proj"), &x[t]);
                let v = w.lin(&format!("{a}.v_proj"), &x[t]);
                qs.push(
                    (0..hn)
                        .map(|hh| {
                            let mut r = rms(&q[hh * d..(hh + 1) * d], &qn, eps);
                            rotate(&mut r, t, &inv, af, false);
                            r
                        })
                        .collect::<Vec<_>>(),
                );
                ks.push(
                    (0..kvh)
                        .map(|hh| {
                            let mut r = rms(&k[hh * d..(hh + 1) * d], &kn, eps);
                            rotate(&mut r, t, &inv, af, false);
                            r
                        })
                        .collect::<Vec<_>>(),
                );
                vs.push(
                    (0..kvh)
                        .map(|hh| v[hh * d..(hh + 1) * d].to_vec())
                        .collect::<Vec<_>>(),
                );
            }
            let g = hn / kvh;
            (0..n)
                .map(|t| {
                    let mut o = Vec::new();
                    for hh in 0..hn {
                        let kvi = hh / g;
                        let mut sc: Vec<f32> = (0..=t)
                            .map(|j| dotf(&qs[t][hh], &ks[j][kvi]) / (d as f32).sqrt())
                            .collect();
                        softmax(&mut sc);
                        let mut out = vec![0f32; d];
                        for j in 0..=t {
                            for e in 0..d {
                                out[e] += sc[j] * vs[j][kvi][e];
                            }
                        }
                        o.extend(out);
                    }
                    w.lin(&format!("{a}.o_proj"), &o)
                })
                .collect()
        };
        for (hr, ar) in h.iter_mut().zip(&attn) {
            for (x, y) in hr.iter_mut().zip(ar) {
                *x += y;
            }
        }
        let ln2 = w.t(&format!("{p}.post_attention_layernorm.weight"));
        let m = format!("{p}.mlp");
        for hr in h.iter_mut() {
            let x = rms(hr, &ln2, eps);
            let y = if !w.has(&format!("{m}.gate.weight")) {
                swiglu(&w, &m, &x)
            } else {
                let logits = w.lin(&format!("{m}.gate"), &x);
                let e = logits.len();
                let (chosen, weights): (Vec<usize>, Vec<f32>) = if ds {
                    let k = us(&c, "num_experts_per_tok");
                    let (ng, tg) = (us(&c, "n_group"), us(&c, "topk_group"));
                    let s: Vec<f32> = logits.iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect();
                    let bias = w.t(&format!("{m}.gate.e_score_correction_bias"));
                    let ch: Vec<f32> = s.iter().zip(&bias).map(|(a, b)| a + b).collect();
                    let per = e / ng;
                    let gs: Vec<f32> = (0..ng)
                        .map(|g| {
                            let o = order(&ch[g * per..(g + 1) * per]);
                            ch[g * per + o[0]] + ch[g * per + o[1]]
                        })
                        .collect();
                    let keep: Vec<usize> = order(&gs)[..tg].to_vec();
                    let masked: Vec<f32> = (0..e)
                        .map(|i| {
                            if keep.contains(&(i / per)) {
                                ch[i]
                            } else {
                                0.0
                            }
                        })
                        .collect();
                    let chosen = order(&masked)[..k].to_vec();
                    let mut wts: Vec<f32> = chosen.iter().map(|&i| s[i]).collect();
                    if c["norm_topk_prob"].as_bool().unwrap() {
                        let sum: f32 = wts.iter().sum::<f32>() + 1e-20;
                        wts.iter_mut().for_each(|x| *x /= sum);
                    }
                    let rsf = num(&c, "routed_scaling_factor") as f32;
                    wts.iter_mut().for_each(|x| *x *= rsf);
                    (chosen, wts)
                } else {
                    let k = us(&c, "num_experts_per_tok");
                    let mut pr = logits.clone();
                    softmax(&mut pr);
                    let chosen = order(&pr)[..k].to_vec();
                    let mut wts: Vec<f32> = chosen.iter().map(|&i| pr[i]).collect();
                    if c["norm_topk_prob"].as_bool().unwrap() {
                        let sum: f32 = wts.iter().sum();
                        wts.iter_mut().for_each(|x| *x /= sum);
                    }
                    (chosen, wts)
                };
                let mut out = vec![0f32; hsz];
                let fused = w.has(&format!("{m}.experts.gate_up_proj"));
                for (&ex, &wt) in chosen.iter().zip(&weights) {
                    let y = if fused {
                        let gu = w.t(&format!("{m}.experts.gate_up_proj"));
                        let dn = w.t(&format!("{m}.experts.down_proj"));
                        let s = w.shape(&format!("{m}.experts.gate_up_proj"));
                        let (it2, hh) = (s[1], s[2]);
                        let it = it2 / 2;
                        let gu_e = &gu[ex * it2 * hh..(ex + 1) * it2 * hh];
                        let yy = matvec(gu_e, it2, hh, &x);
                        let hmid: Vec<f32> = (0..it).map(|i| silu(yy[i]) * yy[it + i]).collect();
                        matvec(&dn[ex * hh * it..(ex + 1) * hh * it], hh, it, &hmid)
                    } else {
                        swiglu(&w, &format!("{m}.experts.{ex}"), &x)
                    };
                    for (o, v) in out.iter_mut().zip(y) {
                        *o += wt * v;
                    }
                }
                if w.has(&format!("{m}.shared_experts.gate_proj.weight")) {
                    for (o, v) in out
                        .iter_mut()
                        .zip(swiglu(&w, &format!("{m}.shared_experts"), &x))
                    {
                        *o += v;
                    }
                }
                out
            };
            for (a, b) in hr.iter_mut().zip(y) {
                *a += b;
            }
        }
    }
    let nw = w.t("model.norm.weight");
    let tied = c["tie_word_embeddings"].as_bool().unwrap_or(false);
    let head = if tied {
        emb.clone()
    } else {
        w.t("lm_head.weight")
    };
    let vocab = us(&c, "vocab_size");
    h.iter()
        .flat_map(|r| matvec(&head, vocab, hsz, &rms(r, &nw, eps)))
        .collect()
}
