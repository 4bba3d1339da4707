//! `synth --format`: checkpoints in every shipped format load and run, and what our
//! dequantizer reads back is exactly what `synth` quantized: the packed bytes equal the
//! `formats` quantizers applied to the BF16 synth of the same seed, and decoding them by the
//! bit layouts of testdata/fixtures/README.md (independently of the kernels) gives the values
//! `deltafin_inference::linear::dequantize` returns.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;

use deltafin_formats::codec::{fp8_e4m3_to_f32, MXFP4_LUT};
use deltafin_formats::quantize::{quantize_fp8_block, FP8_BLOCK, GROUP};
use deltafin_formats::Dtype;
use deltafin_inference::linear::{dequantize, QuantHints};
use deltafin_inference::quantize::{DenseFormats, ExpertFormat};
use deltafin_inference::synth::presets::preset_config;
use deltafin_inference::synth::{write_synth, SynthFormat};
use deltafin_inference::weights::WeightSource;
use deltafin_inference::{DirSource, Model};
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::checkpoint_writer::WriteOptions;
use deltafin_storage::layout::NoProgress;

const SEED: u64 = 11;

fn synth(dir: &Path, arch: &str, format: SynthFormat) {
    let cfg = preset_config(arch, "tiny").unwrap();
    let opts = WriteOptions {
        seed: SEED,
        shard_bytes: 1 << 30,
        force: false,
    };
    write_synth(dir, &cfg, format, &opts, &NoProgress).unwrap();
}

fn dtype_of(ck: &Checkpoint, name: &str) -> Dtype {
    ck.tensors
        .iter()
        .find(|t| t.info.name == name)
        .unwrap()
        .info
        .dtype
        .clone()
}

fn bf16_values(ck: &Checkpoint, name: &str) -> Vec<f32> {
    ck.bytes(name)
        .unwrap()
        .chunks_exact(2)
        .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
        .collect()
}

/// Decode by the README's bit layouts.
fn decode(ck: &Checkpoint, prefix: &str, f: SynthFormat, rows: usize, cols: usize) -> Vec<f32> {
    let get = |s: &str| ck.bytes(&format!("{prefix}{s}")).unwrap();
    let mut out = vec![0f32; rows * cols];
    match f {
        SynthFormat::Fp8 => {
            let (q, s) = (get(".weight"), get(".weight_scale_inv"));
            let nbc = cols.div_ceil(FP8_BLOCK[1]);
            for r in 0..rows {
                for c in 0..cols {
                    let b = (r / FP8_BLOCK[0]) * nbc + c / FP8_BLOCK[1];
                    let sc = f32::from_le_bytes(s[4 * b..4 * b + 4].try_into().unwrap());
                    out[r * cols + c] = fp8_e4m3_to_f32(q[r * cols + c]) * sc;
                }
            }
        }
        SynthFormat::Experts(ExpertFormat::Int4) => {
            let (q, s, shape) = (
                get(".weight_packed"),
                get(".weight_scale"),
                get(".weight_shape"),
            );
            assert_eq!(
                shape,
                [rows as i32, cols as i32].map(i32::to_le_bytes).concat()
            );
            for r in 0..rows {
                for c in 0..cols {
                    let w = (r * cols / 8 + c / 8) * 4;
                    let word = u32::from_le_bytes(q[w..w + 4].try_into().unwrap());
                    let nib = (word >> (4 * (c % 8))) & 0xf;
                    let g = 2 * (r * cols / GROUP + c / GROUP);
                    let sc = f32::from_bits((u16::from_le_bytes([s[g], s[g + 1]]) as u32) << 16);
                    out[r * cols + c] = (nib as f32 - 8.0) * sc;
                }
            }
        }
        SynthFormat::Experts(ExpertFormat::Mxfp4) => {
            let (q, s) = (get(".weight_packed"), get(".weight_scale"));
            for r in 0..rows {
                for c in 0..cols {
                    let b = q[(r * cols + c) / 2];
                    let nib = if c % 2 == 0 { b & 0xf } else { b >> 4 };
                    let e = s[r * cols / GROUP + c / GROUP] as i32;
                    out[r * cols + c] = MXFP4_LUT[nib as usize] * 2f32.powi(e - 127);
                }
            }
        }
        SynthFormat::Experts(ExpertFormat::Q8) => {
            let (q, s) = (get(".weight_packed"), get(".weight_scale"));
            for r in 0..rows {
                for c in 0..cols {
                    let g = 2 * (r * cols / GROUP + c / GROUP);
                    let sc = half::f16::from_bits(u16::from_le_bytes([s[g], s[g + 1]])).to_f32();
                    out[r * cols + c] = q[r * cols + c] as i8 as f32 * sc;
                }
            }
        }
        SynthFormat::Bf16 | SynthFormat::Packed { .. } => unreachable!(),
    }
    out
}

#[test]
fn synth_formats_round_trip_and_run() {
    let base = tempfile::tempdir().unwrap();
    let bf16_dir = base.path().join("bf16");
    synth(&bf16_dir, "deepseek_v3", SynthFormat::Bf16);
    let bf16 = Checkpoint::open(&bf16_dir).unwrap();
    let bf16_model = Model::load(Arc::new(DirSource::open(&bf16_dir).unwrap())).unwrap();
    let prompt: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % 512).collect();
    let want = bf16_model
        .forward(&mut bf16_model.new_session(), &prompt)
        .unwrap()
        .data;
    let want_max = want.iter().fold(0f32, |m, v| m.max(v.abs()));

    let formats = [
        SynthFormat::Fp8,
        SynthFormat::Experts(ExpertFormat::Int4),
        SynthFormat::Experts(ExpertFormat::Mxfp4),
        SynthFormat::Experts(ExpertFormat::Q8),
    ];
    for f in formats {
        let dir = base.path().join(f.to_string());
        synth(&dir, "deepseek_v3", f);
        let ck = Checkpoint::open(&dir).unwrap();
        let src = DirSource::open(&dir).unwrap();
        let hints = QuantHints::from_config(src.config().get("quantization_config"));
        // (tensor, rows, cols): a routed expert and, for FP8, attention and a dense MLP
        // weight with partial 128x128 blocks.
        let mut names = vec![
            ("model.layers.1.mlp.experts.3.gate_proj", 32, 64),
            ("model.layers.2.mlp.experts.15.down_proj", 64, 32),
        ];
        if f == SynthFormat::Fp8 {
            names.push(("model.layers.0.mlp.gate_proj", 128, 64));
            names.push(("model.layers.1.self_attn.kv_a_proj_with_mqa", 40, 64));
            names.push(("model.layers.1.self_attn.q_b_proj", 96, 48));
            // Embeddings, router, norms, lm_head stay BF16.
            for n in [
                "model.embed_tokens.weight",
                "lm_head.weight",
                "model.layers.1.mlp.gate.weight",
            ] {
                assert_eq!(dtype_of(&ck, n), Dtype::Bf16, "{n}");
            }
        } else {
            // Only routed experts are packed.
            let attn = dtype_of(&ck, "model.layers.1.self_attn.o_proj.weight");
            assert_eq!(attn, Dtype::Bf16);
        }
        for (prefix, rows, cols) in names {
            let source = bf16_values(&bf16, &format!("{prefix}.weight"));
            // Packed bytes are exactly the quantizer's output on the BF16 synth's values.
            match f {
                SynthFormat::Fp8 => {
                    let q = quantize_fp8_block(&source, rows, cols, FP8_BLOCK);
                    println!("fp8 {prefix}: weight error {:?}", q.error);
                    assert_eq!(ck.bytes(&format!("{prefix}.weight")).unwrap(), &q.data[..]);
                    assert_eq!(
                        ck.bytes(&format!("{prefix}.weight_scale_inv")).unwrap(),
                        &q.scale[..]
                    );
                }
                SynthFormat::Experts(e) => {
                    let (parts, _) = e.encode(&source, rows, cols);
                    for (p, bytes) in e.parts(prefix, rows as u64, cols as u64).iter().zip(&parts) {
                        assert_eq!(ck.bytes(&p.name).unwrap(), &bytes[..], "{f} {}", p.name);
                    }
                }
                SynthFormat::Bf16 | SynthFormat::Packed { .. } => unreachable!(),
            }
            // Our dequantizer reads back exactly the quantized values.
            let ours = dequantize(&src, &format!("{prefix}.weight"), rows, cols, &hints).unwrap();
            let expect = decode(&ck, prefix, f, rows, cols);
            assert_eq!(ours, expect, "{f} {prefix}");
        }
        // The checkpoint runs, close to the BF16 synth.
        let model = Model::load(Arc::new(src)).unwrap();
        let got = model
            .forward(&mut model.new_session(), &prompt)
            .unwrap()
            .data;
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!("synth --format {f}: prompt logits max abs err vs bf16 {err:.4} (max |logit| {want_max:.2})");
        assert!(got.iter().all(|v| v.is_finite()));
        // Routed-expert formats stay near the BF16 synth (measured: q8 0.02, int4 0.89, mxfp4
        // 1.08 with max |logit| 3.41). FP8 (every projection, weight rel RMS error 2.5%) moves
        // these random-weight logits by 3.1: not bounded here (see the closing note of issue 5).
        if f != SynthFormat::Fp8 {
            assert!(err <= 0.5 * (1.0 + want_max), "{f}: {err}");
        }
    }
}

/// A model directory whose packed non-expert projections are served as the f32 values they
/// dequantize to (the reference the packed model must compute).
struct Dequantized {
    inner: DirSource,
    f32: std::collections::HashMap<String, (Vec<u64>, Vec<u8>)>,
    hidden: std::collections::HashSet<String>,
}

impl Dequantized {
    fn new(inner: DirSource, packed: &[(String, usize, usize)]) -> Dequantized {
        let hints = QuantHints::from_config(inner.config().get("quantization_config"));
        let mut f32 = std::collections::HashMap::new();
        let mut hidden = std::collections::HashSet::new();
        for (prefix, rows, cols) in packed {
            let name = format!("{prefix}.weight");
            let v = dequantize(&inner, &name, *rows, *cols, &hints).unwrap();
            let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            f32.insert(name, (vec![*rows as u64, *cols as u64], bytes));
            for part in ["weight_packed", "weight_scale", "weight_shape"] {
                hidden.insert(format!("{prefix}.{part}"));
            }
        }
        Dequantized { inner, f32, hidden }
    }
}

impl WeightSource for Dequantized {
    fn config(&self) -> &serde_json::Value {
        self.inner.config()
    }
    fn tensor(&self, name: &str) -> deltafin_inference::Result<deltafin_inference::TensorRef<'_>> {
        if let Some((shape, bytes)) = self.f32.get(name) {
            return Ok(deltafin_inference::TensorRef::new(Dtype::F32, shape, bytes));
        }
        if self.hidden.contains(name) {
            return Err(deltafin_inference::InferenceError::MissingTensor { name: name.into() });
        }
        self.inner.tensor(name)
    }
    fn with_experts(
        &self,
        layer: usize,
        experts: &[usize],
        on_ready: &mut deltafin_inference::weights::ExpertCallback<'_>,
    ) -> deltafin_inference::Result<()> {
        self.inner.with_experts(layer, experts, on_ready)
    }
}

/// `synth --format F --quantize-dense D`: every non-expert projection of every architecture is
/// stored packed (routers, norms, embeddings, lm_head and one-row matrices stay as they are),
/// and the model runs them: its logits equal, to f32 rounding, those of the same checkpoint
/// with each packed projection replaced by the f32 values it dequantizes to.
#[test]
fn dense_projections_packed_on_every_architecture() {
    use deltafin_inference::synth::is_dense_projection;
    use deltafin_inference::synth::presets::SYNTH_ARCHS;
    use deltafin_inference::KernelConfig;
    let base = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = (0..9).map(|i| (i * 41 + 7) % 500).collect();
    // f32 activations, so the packed kernels and the f32 reference differ only in rounding.
    let kernels = KernelConfig {
        f32_activations: true,
        ..KernelConfig::best()
    };
    for arch in SYNTH_ARCHS {
        let bf16_dir = base.path().join(format!("{arch}-bf16"));
        synth(&bf16_dir, arch, SynthFormat::Bf16);
        let bf16 = Checkpoint::open(&bf16_dir).unwrap();
        for (experts, dense) in [
            (ExpertFormat::Q8, ExpertFormat::Q8),
            (ExpertFormat::Int4, ExpertFormat::Q8),
            (ExpertFormat::Mxfp4, ExpertFormat::Int4),
        ] {
            let f = SynthFormat::Packed {
                experts,
                dense: DenseFormats::projections(dense),
            };
            let dir = base.path().join(format!("{arch}-{f}"));
            synth(&dir, arch, f);
            let ck = Checkpoint::open(&dir).unwrap();
            let names: Vec<String> = ck.tensors.iter().map(|t| t.info.name.clone()).collect();
            let mut packed_dense = Vec::new();
            for t in &bf16.tensors {
                let name = &t.info.name;
                let Some(prefix) = name.strip_suffix(".weight") else {
                    continue;
                };
                let shape = &t.info.shape;
                let expert = name.contains(".experts.") && !name.contains("shared");
                let packable = shape.len() == 2 && shape[0] > 1 && shape[1] % 32 == 0;
                let packed = names.contains(&format!("{prefix}.weight_packed"));
                if !expert && packable && is_dense_projection(name) {
                    assert!(packed, "{arch} {f}: {name} not packed");
                    assert!(!names.contains(name), "{arch} {f}: {name} kept too");
                    packed_dense.push((prefix.to_string(), shape[0] as usize, shape[1] as usize));
                } else if !expert {
                    assert!(!packed, "{arch} {f}: {name} packed");
                    assert_eq!(dtype_of(&ck, name), dtype_of(&bf16, name), "{name}");
                }
            }
            assert!(
                !packed_dense.is_empty(),
                "{arch}: no dense projection packed"
            );
            let logits = |src: Arc<dyn WeightSource>| {
                let model = Model::load_with(src, kernels).unwrap();
                model
                    .forward(&mut model.new_session(), &prompt)
                    .unwrap()
                    .data
            };
            let got = logits(Arc::new(DirSource::open(&dir).unwrap()));
            let want = logits(Arc::new(Dequantized::new(
                DirSource::open(&dir).unwrap(),
                &packed_dense,
            )));
            let err = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            let max = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            println!(
                "{arch} {f}: {} dense projections packed; logits max abs err vs dequantized f32 {err:.2e} (max |logit| {max:.2})",
                packed_dense.len()
            );
            assert!(err <= 1e-3 * (1.0 + max), "{arch} {f}: {err}");
        }
    }
}
