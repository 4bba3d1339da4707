//! A deliberately plain, uncached reference forward pass for Kimi Linear (`kimi_linear`) and
//! Kimi K3 (`kimi_k3`, text model in `text_config`, tensors under `language_model.`), written
//! from testdata/fixtures/README.md alone and independently of the engine:
//!
//! - every weight read straight from the checkpoint and widened to f32 (MXFP4 experts decoded
//!   bit by bit), dot products accumulated in f64;
//! - KDA as the per-token recurrence (decay, delta update, output from the updated state), the
//!   short convolution as an explicit sum over its K taps;
//! - MLA (NoPE) with K and V expanded per head through `kv_b_proj` (not absorbed);
//! - the router written out step by step; Attention Residuals as the README's block list.
//!
//! Clarity over speed: only meant for the tiny test models.
#![allow(dead_code, clippy::unwrap_used, clippy::needless_range_loop)]

mod config;
mod layers;
mod weights;

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;

use config::*;
use layers::*;
use weights::*;

// ---------------------------------------------------------------------------------------------
// Outputs

/// Routing of one MoE layer for every position.
#[derive(Clone, Debug)]
pub struct MoeRoute {
    /// 0-based decoder layer.
    pub layer: usize,
    /// `[n][top_k]` expert ids in selection order (descending biased score).
    pub ids: Vec<Vec<usize>>,
    /// `[n][top_k]` combine weights (after renormalisation and `routed_scaling_factor`).
    pub weights: Vec<Vec<f32>>,
}

/// Everything one uncached forward computes that a test may want to compare.
/// All tensors are flat and row-major.
#[derive(Clone, Debug, Default)]
pub struct NaiveKimiOut {
    pub n: usize,
    pub vocab: usize,
    pub hidden: usize,
    /// `[n, vocab]`.
    pub logits: Vec<f32>,
    /// 0-based decoder layers of each kind.
    pub kda_layers: Vec<usize>,
    pub mla_layers: Vec<usize>,
    /// Per KDA layer: recurrent state after the tokens, `[H, Dk, Dv]` (S[h, key, value]).
    pub kda_states: Vec<Vec<f32>>,
    /// Per KDA layer: the last K pre-conv inputs, `[3·H·D, K]`, channels q‖k‖v, oldest first
    /// (zeros before the first token), as transformers' conv cache holds them.
    pub kda_conv_states: Vec<Vec<f32>>,
    /// First KDA layer: log-decay g `[n, H, D]`, β `[n, H]`, delta-rule output `[n, H, D]`.
    pub kda0_g: Vec<f32>,
    pub kda0_beta: Vec<f32>,
    pub kda0_core_out: Vec<f32>,
    /// `L + 1` entries `[n, hidden]`: [0] embeddings, [i] what layer i−1 returns (the residual
    /// stream, or with Attention Residuals the running block sum P).
    pub hidden_states: Vec<Vec<f32>>,
    /// Per layer `[n, hidden]`: the input of the attention sublayer before `input_layernorm`
    /// and of the MLP/MoE before `post_attention_layernorm`.
    pub attn_inputs: Vec<Vec<f32>>,
    pub mlp_inputs: Vec<Vec<f32>>,
    /// Attention Residuals only: completed blocks B after the last layer, each `[n, hidden]`.
    pub attn_res_blocks: Vec<Vec<f32>>,
    /// `[n, hidden]`: the input of `model.norm`.
    pub final_mixed: Vec<f32>,
    /// One entry per MoE layer, in layer order.
    pub router_topk: Vec<MoeRoute>,
    /// MLA q·k scale, (nope + rope)^-1/2.
    pub attn_softmax_scale: f32,
}

// ---------------------------------------------------------------------------------------------
// Forward

/// One uncached forward over `tokens`: logits `[n, vocab]` plus debugging taps.
pub fn naive_kimi_forward(dir: &Path, tokens: &[u32]) -> NaiveKimiOut {
    let (src, top) = Source::open(dir);
    let cfg = Cfg::parse(&top);
    let prefix = if src
        .get("language_model.model.embed_tokens.weight")
        .is_some()
    {
        "language_model."
    } else {
        ""
    };
    let w = W {
        src,
        prefix: prefix.to_string(),
        vecs: RefCell::new(HashMap::new()),
        mats: RefCell::new(HashMap::new()),
    };
    let (hsz, n) = (cfg.hidden, tokens.len());
    let emb = w.t("model.embed_tokens.weight");
    assert_eq!(emb.len(), cfg.vocab * hsz);
    let embeds: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&t| emb[t as usize * hsz..(t as usize + 1) * hsz].to_vec())
        .collect();

    let mut out = NaiveKimiOut {
        n,
        vocab: cfg.vocab,
        hidden: hsz,
        attn_softmax_scale: ((cfg.nope + cfg.rope) as f64).powf(-0.5) as f32,
        ..Default::default()
    };
    out.hidden_states.push(flat(&embeds));

    // Attention Residuals bookkeeping: completed blocks B and the running block sum P.
    // Without Attention Residuals only P is used, as the ordinary residual stream.
    let mut blocks: Vec<Vec<Vec<f32>>> = Vec::new();
    let mut p: Option<Vec<Vec<f32>>> = Some(embeds);

    for l in 0..cfg.layers {
        let pre = format!("model.layers.{l}");
        // attention input
        let x_attn = match cfg.attn_res {
            Some(_) if !blocks.is_empty() => {
                let mut srcs: Vec<&Vec<Vec<f32>>> = blocks.iter().collect();
                srcs.push(p.as_ref().unwrap());
                attn_res(&w, &cfg, &format!("{pre}.self_attention_res"), &srcs)
            }
            _ => p.clone().unwrap(),
        };
        out.attn_inputs.push(flat(&x_attn));
        if let Some(s) = cfg.attn_res {
            if l % s == 0 {
                blocks.push(p.take().unwrap());
            }
        }
        let ln1 = w.t(&format!("{pre}.input_layernorm.weight"));
        let xn: Vec<Vec<f32>> = x_attn.iter().map(|r| rms(r, &ln1, cfg.eps)).collect();
        let a = format!("{pre}.self_attn");
        let att = if cfg.is_kda[l] {
            let k = kda(&w, &cfg, &a, &xn);
            if out.kda_layers.is_empty() {
                out.kda0_g = k.g;
                out.kda0_beta = k.beta;
                out.kda0_core_out = k.core;
            }
            out.kda_layers.push(l);
            out.kda_states.push(k.state);
            out.kda_conv_states.push(k.conv_state);
            k.out
        } else {
            out.mla_layers.push(l);
            mla(&w, &cfg, &a, &xn)
        };
        p = Some(match p.take() {
            None => att,
            Some(prev) => add(&prev, &att),
        });
        // MLP input
        let x_mlp = match cfg.attn_res {
            Some(_) => {
                let mut srcs: Vec<&Vec<Vec<f32>>> = blocks.iter().collect();
                srcs.push(p.as_ref().unwrap());
                attn_res(&w, &cfg, &format!("{pre}.mlp_res"), &srcs)
            }
            None => p.clone().unwrap(),
        };
        out.mlp_inputs.push(flat(&x_mlp));
        let ln2 = w.t(&format!("{pre}.post_attention_layernorm.weight"));
        let xn: Vec<Vec<f32>> = x_mlp.iter().map(|r| rms(r, &ln2, cfg.eps)).collect();
        let (y, r) = ffn(&w, &cfg, l, &xn);
        if let Some(r) = r {
            out.router_topk.push(r);
        }
        p = Some(add(p.as_ref().unwrap(), &y));
        out.hidden_states.push(flat(p.as_ref().unwrap()));
    }

    let final_mixed = match cfg.attn_res {
        Some(_) => {
            let mut srcs: Vec<&Vec<Vec<f32>>> = blocks.iter().collect();
            srcs.push(p.as_ref().unwrap());
            attn_res(&w, &cfg, "model.output_attn_res", &srcs)
        }
        None => p.unwrap(),
    };
    out.attn_res_blocks = blocks.iter().map(|b| flat(b)).collect();
    out.final_mixed = flat(&final_mixed);

    let nw = w.t("model.norm.weight");
    let head = if w.has("lm_head.weight") {
        w.mat("lm_head")
    } else {
        w.mat("model.embed_tokens")
    };
    assert_eq!((head.rows, head.cols), (cfg.vocab, hsz));
    out.logits = final_mixed
        .iter()
        .flat_map(|r| matvec(&head.w, head.rows, head.cols, &rms(r, &nw, cfg.eps)))
        .collect();
    out
}

/// The f32 weight of linear `prefix` (full tensor name without `.weight`, including any
/// `language_model.` prefix) as this reference decodes it: `(values [rows, cols], rows, cols)`.
pub fn naive_kimi_weight(dir: &Path, prefix: &str) -> (Vec<f32>, usize, usize) {
    let (src, _) = Source::open(dir);
    let w = W {
        src,
        prefix: String::new(),
        vecs: RefCell::new(HashMap::new()),
        mats: RefCell::new(HashMap::new()),
    };
    let m = w.mat(prefix);
    (m.w.clone(), m.rows, m.cols)
}

/// Logits `[n, vocab]` only.
pub fn naive_kimi_logits(dir: &Path, tokens: &[u32]) -> Vec<f32> {
    naive_kimi_forward(dir, tokens).logits
}
