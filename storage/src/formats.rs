//! Packed weight formats as checkpoints ship them: value decoders and the round-to-nearest
//! quantizers producing exactly the bytes each format stores (bit layouts in
//! testdata/fixtures/README.md), with the error they introduce.
//!
//! They live here, below inference, so `synth` (writing checkpoints in each format) and
//! `layout --quantize-experts` (the [`QuantizeExperts`] transform) can encode, and the
//! inference kernels decode with the very same tables (`deltafin_inference::kernels::quant`
//! re-exports this module's quantizers).
//!
//! All quantizers take a row-major f32 `[rows, cols]` matrix.

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde_json::{json, Value};

use crate::error::{Result, StorageError};
use crate::layout::{ExpertTransform, PartSpec};
use crate::safetensors::Dtype;

/// E2M1 nibble -> value (bit 3 is the sign).
pub const MXFP4_LUT: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Scale group (columns) used for INT4, MXFP4 and Q8.
pub const GROUP: usize = 32;
/// DeepSeek-V3 FP8 block.
pub const FP8_BLOCK: [usize; 2] = [128, 128];

/// FP8 e4m3fn (bias 7, subnormals, no infinities, 0x7f/0xff NaN).
#[inline]
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0xf) as i32;
    let man = (b & 0x7) as f32;
    let mag = if exp == 0 {
        man / 8.0 * 2f32.powi(-6)
    } else if exp == 15 && b & 0x7 == 7 {
        f32::NAN
    } else {
        (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    };
    sign * mag
}

/// Nearest FP8 e4m3fn code of `v` (ties to even mantissa), saturating at ±448.
pub fn f32_to_fp8_e4m3(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs();
    if a.is_nan() {
        return 0x7f;
    }
    if a >= 448.0 {
        return sign | 0x7e;
    }
    if a == 0.0 {
        return sign;
    }
    let mut e = (a.log2().floor() as i32).max(-6);
    let mut m = (a / 2f32.powi(e - 3)).round_ties_even() as u32;
    if e == -6 && m < 8 {
        return sign | m as u8;
    }
    if m >= 16 {
        e += 1;
        m = 8;
    }
    let code = (((e + 7) as u32) << 3) | (m - 8);
    sign | code.min(0x7e) as u8
}

/// `2^(e-127)`; 255 is NaN.
#[inline]
pub fn e8m0_to_f32(e: u8) -> f32 {
    match e {
        255 => f32::NAN,
        0 => f32::from_bits(0x0040_0000), // 2^-127, subnormal
        e => f32::from_bits((e as u32) << 23),
    }
}

/// BF16 / F16 / F32 little-endian bytes to f32 (`None` for other dtypes).
pub fn float_bytes_to_f32(dtype: &Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::Bf16 => bytes
            .chunks_exact(2)
            .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        _ => return None,
    })
}

/// Packed weight bytes and scale bytes of one quantized matrix, plus the error made.
#[derive(Debug, Clone)]
pub struct Quantized {
    /// `weight_packed` (INT4: I32 LE words; MXFP4: U8; Q8: I8).
    pub data: Vec<u8>,
    /// `weight_scale` (INT4: BF16; MXFP4: U8 E8M0; Q8: F16).
    pub scale: Vec<u8>,
    pub error: QuantError,
}

/// Error of a quantized matrix against its f32 source.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct QuantError {
    /// max |w - dequant(q)|.
    pub max_abs: f32,
    /// ||w - dequant(q)||_2 / ||w||_2.
    pub rel_rms: f32,
}

impl QuantError {
    fn measure(w: &[f32], back: impl Iterator<Item = f32>) -> QuantError {
        let (mut num, mut den, mut max_abs) = (0f64, 0f64, 0f32);
        for (&a, b) in w.iter().zip(back) {
            let e = a - b;
            max_abs = max_abs.max(e.abs());
            num += (e as f64).powi(2);
            den += (a as f64).powi(2);
        }
        QuantError {
            max_abs,
            rel_rms: if den > 0.0 {
                (num / den).sqrt() as f32
            } else {
                0.0
            },
        }
    }
}

fn check(w: &[f32], rows: usize, cols: usize, group: usize) {
    assert_eq!(w.len(), rows * cols, "quantize: matrix length");
    assert!(
        group > 0 && cols.is_multiple_of(group) && group.is_multiple_of(2),
        "quantize: group {group} must divide cols {cols}"
    );
}

/// Q8: `q = round(w / s)`, `s = absmax / 127` per group, stored as F16 (then used rounded).
pub fn quantize_q8(w: &[f32], rows: usize, cols: usize, group: usize) -> Quantized {
    check(w, rows, cols, group);
    let mut data = Vec::with_capacity(w.len());
    let mut scale = Vec::with_capacity(w.len() / group * 2);
    let mut back = Vec::with_capacity(w.len());
    for g in w.chunks_exact(group) {
        let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = half::f16::from_f32(amax / 127.0);
        let sf = s.to_f32();
        let inv = if sf > 0.0 { 1.0 / sf } else { 0.0 };
        scale.extend_from_slice(&s.to_bits().to_le_bytes());
        for &v in g {
            let q = (v * inv).round().clamp(-127.0, 127.0) as i8;
            data.push(q as u8);
            back.push(q as f32 * sf);
        }
    }
    let error = QuantError::measure(w, back.into_iter());
    Quantized { data, scale, error }
}

/// INT4 compressed-tensors `pack-quantized` (symmetric): `q = clamp(round(w / s), -8, 7)`,
/// `s = absmax / 7` per group as BF16 (the rounded value is the one used), stored q+8, 8 per
/// LE i32 word, element c at bits 4(c%8). `cols` must be a multiple of 8.
pub fn quantize_int4(w: &[f32], rows: usize, cols: usize, group: usize) -> Quantized {
    check(w, rows, cols, group);
    assert_eq!(cols % 8, 0, "INT4 packs 8 values per word");
    let mut codes = Vec::with_capacity(w.len());
    let mut scale = Vec::with_capacity(w.len() / group * 2);
    let mut back = Vec::with_capacity(w.len());
    for g in w.chunks_exact(group) {
        let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = half::bf16::from_f32(amax / 7.0);
        let sf = s.to_f32();
        let inv = if sf > 0.0 { 1.0 / sf } else { 0.0 };
        scale.extend_from_slice(&s.to_bits().to_le_bytes());
        for &v in g {
            let q = (v * inv).round().clamp(-8.0, 7.0) as i32;
            codes.push((q + 8) as u32);
            back.push(q as f32 * sf);
        }
    }
    let data = codes
        .chunks_exact(8)
        .flat_map(|c| {
            c.iter()
                .enumerate()
                .fold(0u32, |w, (k, &q)| w | (q << (4 * k)))
                .to_le_bytes()
        })
        .collect();
    let error = QuantError::measure(w, back.into_iter());
    Quantized { data, scale, error }
}

/// Nearest E2M1 code of `v` (ties to the even code, as the OCP spec rounds).
fn e2m1_code(v: f32) -> u8 {
    let mag = v.abs();
    let mut best = 0usize;
    for (i, &m) in MXFP4_LUT[..8].iter().enumerate() {
        let d = (mag - m).abs();
        let bd = (mag - MXFP4_LUT[best]).abs();
        if d < bd || (d == bd && i % 2 == 0 && best % 2 == 1) {
            best = i;
        }
    }
    let sign = if v.is_sign_negative() && best != 0 {
        8
    } else {
        0
    };
    best as u8 | sign
}

/// MXFP4 (OCP microscaling): shared scale `2^(floor(log2(absmax)) - 2)` per group (E8M0,
/// the OCP rule: the largest magnitude maps to [4, 8) and saturates at 6), elements RTN to E2M1,
/// element 2b in the low nibble of byte b.
pub fn quantize_mxfp4(w: &[f32], rows: usize, cols: usize, group: usize) -> Quantized {
    check(w, rows, cols, group);
    let mut data = Vec::with_capacity(w.len() / 2);
    let mut scale = Vec::with_capacity(w.len() / group);
    let mut back = Vec::with_capacity(w.len());
    for g in w.chunks_exact(group) {
        let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
        let e: i32 = if amax > 0.0 && amax.is_finite() {
            (amax.log2().floor() as i32 - 2).clamp(-127, 127)
        } else {
            -127
        };
        scale.push((e + 127) as u8);
        let s = e8m0_to_f32((e + 127) as u8);
        for pair in g.chunks_exact(2) {
            let lo = e2m1_code(pair[0] / s);
            let hi = e2m1_code(pair[1] / s);
            data.push(lo | (hi << 4));
            back.push(MXFP4_LUT[lo as usize] * s);
            back.push(MXFP4_LUT[hi as usize] * s);
        }
    }
    let error = QuantError::measure(w, back.into_iter());
    Quantized { data, scale, error }
}

/// DeepSeek-V3 block FP8: per `[block[0], block[1]]` block (edge blocks partial) the scale is
/// `absmax / 448` (f32, stored as `weight_scale_inv` `[ceil(rows/b0), ceil(cols/b1)]`), values
/// are RTN to e4m3fn of `w / scale`; `w ≈ fp8(q) * scale`.
pub fn quantize_fp8_block(w: &[f32], rows: usize, cols: usize, block: [usize; 2]) -> Quantized {
    assert_eq!(w.len(), rows * cols, "quantize: matrix length");
    assert!(
        block[0] > 0 && block[1] > 0,
        "quantize: FP8 block must be > 0"
    );
    let nbc = cols.div_ceil(block[1]);
    let mut amax = vec![0f32; rows.div_ceil(block[0]) * nbc];
    for (r, row) in w.chunks_exact(cols.max(1)).enumerate() {
        for (c, v) in row.iter().enumerate() {
            let b = (r / block[0]) * nbc + c / block[1];
            amax[b] = amax[b].max(v.abs());
        }
    }
    let scales: Vec<f32> = amax
        .iter()
        .map(|&a| {
            if a > 0.0 && a.is_finite() {
                a / 448.0
            } else {
                1.0
            }
        })
        .collect();
    let mut data = Vec::with_capacity(w.len());
    let mut back = Vec::with_capacity(w.len());
    for (r, row) in w.chunks_exact(cols.max(1)).enumerate() {
        for (c, &v) in row.iter().enumerate() {
            let s = scales[(r / block[0]) * nbc + c / block[1]];
            let q = f32_to_fp8_e4m3(v / s);
            data.push(q);
            back.push(fp8_e4m3_to_f32(q) * s);
        }
    }
    let error = QuantError::measure(w, back.into_iter());
    let scale = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
    Quantized { data, scale, error }
}

/// What `layout --quantize-experts` (and `synth --format`) store routed experts as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertFormat {
    /// compressed-tensors `pack-quantized` INT4, group 32, symmetric (Kimi K2-Thinking).
    Int4,
    /// compressed-tensors `mxfp4-pack-quantized` (Kimi K3).
    Mxfp4,
    /// int8 per 32-value group with an F16 scale (`weight_packed` I8, `weight_scale` F16).
    Q8,
}

impl std::str::FromStr for ExpertFormat {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "int4" => Ok(ExpertFormat::Int4),
            "mxfp4" => Ok(ExpertFormat::Mxfp4),
            "q8" => Ok(ExpertFormat::Q8),
            o => Err(format!("unknown expert format `{o}` (int4, mxfp4, q8)")),
        }
    }
}

impl std::fmt::Display for ExpertFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ExpertFormat::Int4 => "int4",
            ExpertFormat::Mxfp4 => "mxfp4",
            ExpertFormat::Q8 => "q8",
        })
    }
}

/// Modules that stay unquantized when only routed experts are packed (the shipped INT4/MXFP4
/// checkpoints' `ignore` list, plus the Qwen3-MoE router, an `nn.Linear` there).
pub fn expert_only_ignore() -> Value {
    json!([
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*mlp\\.gate$"
    ])
}

impl ExpertFormat {
    /// Whether a `[rows, cols]` matrix can be stored in this format.
    pub fn fits(self, cols: u64) -> bool {
        cols > 0 && cols.is_multiple_of(GROUP as u64)
    }

    /// The tensors `{prefix}.weight` `[rows, cols]` becomes, in the shipped naming.
    pub fn parts(self, prefix: &str, rows: u64, cols: u64) -> Vec<PartSpec> {
        let groups = cols.div_ceil(GROUP as u64);
        let (packed, scale) = match self {
            ExpertFormat::Int4 => (
                PartSpec::new(
                    format!("{prefix}.weight_packed"),
                    Dtype::I32,
                    &[rows, cols / 8],
                ),
                PartSpec::new(
                    format!("{prefix}.weight_scale"),
                    Dtype::Bf16,
                    &[rows, groups],
                ),
            ),
            ExpertFormat::Mxfp4 => (
                PartSpec::new(
                    format!("{prefix}.weight_packed"),
                    Dtype::U8,
                    &[rows, cols / 2],
                ),
                PartSpec::new(format!("{prefix}.weight_scale"), Dtype::U8, &[rows, groups]),
            ),
            ExpertFormat::Q8 => (
                PartSpec::new(format!("{prefix}.weight_packed"), Dtype::I8, &[rows, cols]),
                PartSpec::new(
                    format!("{prefix}.weight_scale"),
                    Dtype::F16,
                    &[rows, groups],
                ),
            ),
        };
        let mut v = vec![packed, scale];
        if self == ExpertFormat::Int4 {
            v.push(PartSpec::new(
                format!("{prefix}.weight_shape"),
                Dtype::I32,
                &[2],
            ));
        }
        v
    }

    /// Quantize `w` `[rows, cols]`: the bytes of each of [`Self::parts`], in that order.
    /// `cols` must satisfy [`Self::fits`].
    pub fn encode(self, w: &[f32], rows: usize, cols: usize) -> (Vec<Vec<u8>>, QuantError) {
        let q = match self {
            ExpertFormat::Int4 => quantize_int4(w, rows, cols, GROUP),
            ExpertFormat::Mxfp4 => quantize_mxfp4(w, rows, cols, GROUP),
            ExpertFormat::Q8 => quantize_q8(w, rows, cols, GROUP),
        };
        let mut v = vec![q.data, q.scale];
        if self == ExpertFormat::Int4 {
            let shape: Vec<u8> = [rows as i32, cols as i32]
                .iter()
                .flat_map(|d| d.to_le_bytes())
                .collect();
            v.push(shape);
        }
        (v, q.error)
    }

    /// The `quantization_config` a checkpoint with routed experts in this format carries
    /// (INT4 and MXFP4 exactly as compressed-tensors writes them; Q8 in the same shape under
    /// `quant_method: deltafin`, which `deltafin-inference` reads the group size from).
    pub fn quantization_config(self) -> Value {
        let ignore = expert_only_ignore();
        match self {
            ExpertFormat::Int4 => json!({
                "config_groups": {"group_0": {
                    "input_activations": null, "output_activations": null, "targets": ["Linear"],
                    "weights": {"actorder": null, "block_structure": null, "dynamic": false,
                        "group_size": GROUP, "num_bits": 4, "observer": "minmax",
                        "observer_kwargs": {}, "strategy": "group", "symmetric": true,
                        "type": "int"}}},
                "format": "pack-quantized",
                "ignore": ignore,
                "kv_cache_scheme": null,
                "quant_method": "compressed-tensors",
                "quantization_status": "compressed"
            }),
            ExpertFormat::Mxfp4 => json!({
                "config_groups": {"group_0": {
                    "format": "mxfp4-pack-quantized",
                    "input_activations": null, "output_activations": null, "targets": ["Linear"],
                    "weights": {"actorder": null, "block_structure": null, "dynamic": false,
                        "group_size": GROUP, "num_bits": 4, "observer": "minmax",
                        "observer_kwargs": {}, "scale_dtype": "torch.uint8",
                        "strategy": "group", "symmetric": true, "type": "float",
                        "zp_dtype": null}}},
                "format": "mxfp4-pack-quantized",
                "global_compression_ratio": null,
                "ignore": ignore,
                "kv_cache_scheme": null,
                "quant_method": "compressed-tensors",
                "quantization_status": "compressed"
            }),
            ExpertFormat::Q8 => json!({
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"dynamic": false, "group_size": GROUP, "num_bits": 8,
                        "strategy": "group", "symmetric": true, "type": "int",
                        "scale_dtype": "torch.float16"}}},
                "format": "q8-group",
                "ignore": ignore,
                "quant_method": "deltafin",
                "quantization_status": "compressed"
            }),
        }
    }
}

/// The `quantization_config` of a DeepSeek-V3 block-FP8 checkpoint.
pub fn fp8_quantization_config() -> Value {
    json!({
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": FP8_BLOCK
    })
}

/// Error of one quantized expert tensor.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct TensorQuantError {
    /// Checkpoint name of the source tensor.
    pub tensor: String,
    pub layer: u32,
    pub expert: u32,
    pub max_abs: f32,
    pub rel_rms: f32,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

/// [`ExpertTransform`] quantizing every routed expert matrix (`*.weight`, or a fused
/// `gate_up_proj` / `down_proj` slice; BF16/F16/F32, columns a multiple of 32) to `format`;
/// other parts are copied. Records each tensor's error.
#[derive(Debug)]
pub struct QuantizeExperts {
    pub format: ExpertFormat,
    errors: Mutex<Vec<TensorQuantError>>,
}

impl QuantizeExperts {
    pub fn new(format: ExpertFormat) -> QuantizeExperts {
        QuantizeExperts {
            format,
            errors: Mutex::new(Vec::new()),
        }
    }

    /// Every tensor quantized so far, in (layer, expert, part) order.
    pub fn errors(&self) -> Vec<TensorQuantError> {
        let mut v = self.errors.lock().map(|e| e.clone()).unwrap_or_default();
        v.sort_by(|a, b| (a.layer, a.expert, &a.tensor).cmp(&(b.layer, b.expert, &b.tensor)));
        v
    }

    /// The matrix name (`gate_proj`; a fused transformers-5 slice is named `gate_up_proj`
    /// with no suffix), rows and columns of a part this transform quantizes.
    fn quantizable(&self, p: &PartSpec) -> Option<(String, u64, u64)> {
        let prefix = match p.name.strip_suffix(".weight") {
            Some(prefix) => prefix,
            None if !p.name.contains('.') => p.name.as_str(),
            None => return None,
        };
        let float = matches!(p.dtype, Dtype::Bf16 | Dtype::F16 | Dtype::F32);
        match p.shape[..] {
            [rows, cols] if float && self.format.fits(cols) => {
                Some((prefix.to_string(), rows, cols))
            }
            _ => None,
        }
    }
}

impl ExpertTransform for QuantizeExperts {
    fn parts(&self, source: &[PartSpec]) -> Result<Vec<PartSpec>> {
        let mut out = Vec::new();
        for p in source {
            if matches!(p.dtype, Dtype::F8E4m3 | Dtype::I32 | Dtype::U8 | Dtype::I8) {
                return Err(StorageError::InvalidArgument(format!(
                    "--quantize-experts needs a BF16/F16/F32 checkpoint; expert part `{}` is {}",
                    p.name, p.dtype
                )));
            }
            match self.quantizable(p) {
                Some((prefix, rows, cols)) => out.extend(self.format.parts(&prefix, rows, cols)),
                None => out.push(p.clone()),
            }
        }
        Ok(out)
    }

    fn apply(
        &self,
        layer: u32,
        expert: u32,
        source: &[(&PartSpec, &[u8])],
    ) -> Result<Vec<Vec<u8>>> {
        let mut out = Vec::new();
        let mut errs = Vec::new();
        for (p, bytes) in source {
            let Some((prefix, rows, cols)) = self.quantizable(p) else {
                out.push(bytes.to_vec());
                continue;
            };
            let w = float_bytes_to_f32(&p.dtype, bytes)
                .filter(|w| w.len() as u64 == rows * cols)
                .ok_or_else(|| {
                    StorageError::InvalidArgument(format!(
                        "layer {layer} expert {expert} `{}`: {} bytes do not hold {rows}x{cols} {}",
                        p.name,
                        bytes.len(),
                        p.dtype
                    ))
                })?;
            let (parts, error) = self.format.encode(&w, rows as usize, cols as usize);
            let tensor = if p.name.ends_with(".weight") {
                format!("model.layers.{layer}.mlp.experts.{expert}.{prefix}.weight")
            } else {
                format!("model.layers.{layer}.mlp.experts.{prefix}[{expert}]")
            };
            errs.push(TensorQuantError {
                tensor,
                layer,
                expert,
                max_abs: error.max_abs,
                rel_rms: error.rel_rms,
                bytes_in: bytes.len() as u64,
                bytes_out: parts.iter().map(|b| b.len() as u64).sum(),
            });
            out.extend(parts);
        }
        if let Ok(mut e) = self.errors.lock() {
            e.extend(errs);
        }
        Ok(out)
    }

    fn config(&self, source: &Value) -> Result<Value> {
        if source
            .get("quantization_config")
            .is_some_and(|q| !q.is_null())
        {
            return Err(StorageError::InvalidArgument(
                "--quantize-experts needs an unquantized (BF16) checkpoint; this one has a \
                 quantization_config"
                    .into(),
            ));
        }
        let mut cfg = source.clone();
        if let Some(o) = cfg.as_object_mut() {
            o.insert(
                "quantization_config".into(),
                self.format.quantization_config(),
            );
        }
        Ok(cfg)
    }

    fn meta(&self) -> BTreeMap<String, String> {
        let errs = self.errors();
        let n = errs.len().max(1) as f64;
        let mut m = BTreeMap::new();
        m.insert("quantize_experts".into(), self.format.to_string());
        m.insert("quantize_tensors".into(), errs.len().to_string());
        let max_rel = errs.iter().fold(0f32, |a, e| a.max(e.rel_rms));
        let mean_rel = errs.iter().map(|e| e.rel_rms as f64).sum::<f64>() / n;
        let max_abs = errs.iter().fold(0f32, |a, e| a.max(e.max_abs));
        m.insert("quantize_rel_rms_max".into(), format!("{max_rel:.6}"));
        m.insert("quantize_rel_rms_mean".into(), format!("{mean_rel:.6}"));
        m.insert("quantize_max_abs".into(), format!("{max_abs:.6}"));
        let (bi, bo) = errs
            .iter()
            .fold((0u64, 0u64), |(a, b), e| (a + e.bytes_in, b + e.bytes_out));
        m.insert("quantize_bytes_in".into(), bi.to_string());
        m.insert("quantize_bytes_out".into(), bo.to_string());
        m
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn fp8_encode_round_trips_every_code() {
        for b in 0u8..=255 {
            let v = fp8_e4m3_to_f32(b);
            if v.is_nan() {
                continue;
            }
            let c = f32_to_fp8_e4m3(v);
            assert_eq!(fp8_e4m3_to_f32(c), v, "code {b:#x} -> {c:#x}");
        }
        assert_eq!(f32_to_fp8_e4m3(1000.0), 0x7e);
        assert_eq!(f32_to_fp8_e4m3(-1000.0), 0xfe);
        // RTN: halfway between 1.0 (0x38) and 1.125 (0x39) goes to even 1.0.
        assert_eq!(f32_to_fp8_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_fp8_e4m3(1.07), 0x39);
        // Nearest for random values.
        for i in 0..2000 {
            let v = (i as f32 - 1000.0) * 0.173;
            let c = f32_to_fp8_e4m3(v);
            let best = (0u8..=255)
                .filter(|&b| !fp8_e4m3_to_f32(b).is_nan())
                .map(|b| (fp8_e4m3_to_f32(b) - v).abs())
                .fold(f32::INFINITY, f32::min);
            assert_eq!((fp8_e4m3_to_f32(c) - v).abs(), best, "{v}");
        }
    }

    #[test]
    fn fp8_block_error_small() {
        let (rows, cols) = (200, 300);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1)
            .collect();
        let q = quantize_fp8_block(&w, rows, cols, FP8_BLOCK);
        assert_eq!(q.data.len(), rows * cols);
        assert_eq!(q.scale.len(), 2 * 3 * 4);
        assert!(q.error.rel_rms < 0.05, "{:?}", q.error);
    }

    #[test]
    fn transform_parts_match_encode() {
        let t = QuantizeExperts::new(ExpertFormat::Int4);
        let src = [PartSpec::new("gate_proj.weight", Dtype::Bf16, &[4, 64])];
        let parts = t.parts(&src).unwrap();
        let names: Vec<_> = parts.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "gate_proj.weight_packed",
                "gate_proj.weight_scale",
                "gate_proj.weight_shape"
            ]
        );
        let bytes = vec![0x3fu8; 4 * 64 * 2];
        let out = t.apply(1, 2, &[(&src[0], &bytes)]).unwrap();
        for (p, b) in parts.iter().zip(&out) {
            assert_eq!(p.len, b.len() as u64, "{}", p.name);
        }
        assert_eq!(t.errors().len(), 1);
    }
}
