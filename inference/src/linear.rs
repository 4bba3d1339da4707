//! Weight matrices over dtype-tagged byte buffers, and the f32-accumulating kernels.
//!
//! A [`WeightMatrix`] borrows raw checkpoint bytes (a routed expert straight from its source);
//! a [`Linear`] owns them (resident weights, prepared once at load). Both compute
//! `y = W x` with `W` `[rows (out), cols (in)]` in the Hugging Face `nn.Linear` layout.
//!
//! Every format decodes one row at a time into f32 ([`WeightMatrix::decode_row`]) and the
//! kernels take dot products against it, parallel over rows with rayon. New packed formats add a
//! [`WeightFormat`] variant, its byte-length check and its row decoder; nothing else changes.
//!
//! Supported: F32, F16, BF16; DeepSeek block FP8 (`weight` F8_E4M3 + `weight_scale_inv`);
//! compressed-tensors `pack-quantized` INT4 (`weight_packed` I32 + `weight_scale`);
//! compressed-tensors `mxfp4-pack-quantized` (`weight_packed` U8 + E8M0 `weight_scale` U8).

use deltafin_storage::safetensors::Dtype;
use rayon::prelude::*;

use crate::error::{InferenceError, Result};
use crate::kernels::Kind as Kernel;
use crate::weights::TensorRef;

/// How the bytes of a weight matrix encode its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    F32,
    F16,
    Bf16,
    /// FP8 e4m3fn values, one f32 `weight_scale_inv` per `[block_rows, block_cols]` block
    /// (edge blocks partial).
    Fp8Block {
        block_rows: usize,
        block_cols: usize,
    },
    /// 4-bit symmetric ints, 8 per little-endian i32 word (element c at bits 4(c%8)), stored as
    /// offset binary q+8; one scale per `group` consecutive columns.
    Int4Group {
        group: usize,
    },
    /// E2M1 nibbles (element 2b = low nibble of byte b), one E8M0 scale per `group` columns.
    Mxfp4 {
        group: usize,
    },
    /// int8 values (`weight_packed` I8 `[rows, cols]`), one scale (F16, also BF16/F32) per
    /// `group` consecutive columns (`weight_scale` `[rows, cols/group]`); `w = q * scale`.
    Q8 {
        group: usize,
    },
}

/// Element type of a scale tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleType {
    None,
    F32,
    F16,
    Bf16,
    /// Power-of-two exponent byte: `2^(e-127)`.
    E8m0,
}

impl ScaleType {
    pub(crate) fn size(self) -> usize {
        match self {
            ScaleType::None => 0,
            ScaleType::F32 => 4,
            ScaleType::F16 | ScaleType::Bf16 => 2,
            ScaleType::E8m0 => 1,
        }
    }

    fn from_dtype(d: &Dtype) -> Option<ScaleType> {
        Some(match d {
            Dtype::F32 => ScaleType::F32,
            Dtype::F16 => ScaleType::F16,
            Dtype::Bf16 => ScaleType::Bf16,
            Dtype::U8 => ScaleType::E8m0,
            _ => return None,
        })
    }

    /// Scale `i` of `bytes` as f32.
    #[inline]
    pub fn get(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            ScaleType::None => 1.0,
            ScaleType::F32 => f32::from_le_bytes([
                bytes[4 * i],
                bytes[4 * i + 1],
                bytes[4 * i + 2],
                bytes[4 * i + 3],
            ]),
            ScaleType::F16 => {
                half::f16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32()
            }
            ScaleType::Bf16 => bf16_to_f32(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])),
            ScaleType::E8m0 => e8m0_to_f32(bytes[i]),
        }
    }
}

pub use crate::kernels::scalar::{bf16_to_f32, dot, fp8_e4m3_to_f32};

pub use deltafin_storage::formats::e8m0_to_f32;

/// A weight matrix borrowing its bytes. Constructed only through checked constructors, so the
/// byte lengths always match the shape and every kernel indexes in bounds.
#[derive(Debug, Clone, Copy)]
pub struct WeightMatrix<'a> {
    rows: usize,
    cols: usize,
    format: WeightFormat,
    data: &'a [u8],
    scale: &'a [u8],
    scale_type: ScaleType,
}

fn ceil_div(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

impl<'a> WeightMatrix<'a> {
    /// Checks that `data` and `scale` have exactly the lengths `format` needs for `rows x cols`.
    pub fn new(
        rows: usize,
        cols: usize,
        format: WeightFormat,
        data: &'a [u8],
        scale: &'a [u8],
        scale_type: ScaleType,
    ) -> std::result::Result<Self, String> {
        let (want_data, want_scale, want_st): (usize, usize, &[ScaleType]) = match format {
            WeightFormat::F32 => (rows * cols * 4, 0, &[ScaleType::None]),
            WeightFormat::F16 | WeightFormat::Bf16 => (rows * cols * 2, 0, &[ScaleType::None]),
            WeightFormat::Fp8Block {
                block_rows,
                block_cols,
            } => {
                if block_rows == 0 || block_cols == 0 {
                    return Err("FP8 block size must be > 0".into());
                }
                (
                    rows * cols,
                    ceil_div(rows, block_rows) * ceil_div(cols, block_cols) * scale_type.size(),
                    &[ScaleType::F32, ScaleType::Bf16, ScaleType::F16],
                )
            }
            WeightFormat::Int4Group { group } => {
                if group == 0 {
                    return Err("INT4 group size must be > 0".into());
                }
                (
                    rows * ceil_div(cols, 8) * 4,
                    rows * ceil_div(cols, group) * scale_type.size(),
                    &[ScaleType::F32, ScaleType::Bf16, ScaleType::F16],
                )
            }
            WeightFormat::Mxfp4 { group } => {
                if group == 0 {
                    return Err("MXFP4 group size must be > 0".into());
                }
                (
                    rows * ceil_div(cols, 2),
                    rows * ceil_div(cols, group),
                    &[ScaleType::E8m0],
                )
            }
            WeightFormat::Q8 { group } => {
                if group == 0 {
                    return Err("Q8 group size must be > 0".into());
                }
                (
                    rows * cols,
                    rows * ceil_div(cols, group) * scale_type.size(),
                    &[ScaleType::F16, ScaleType::Bf16, ScaleType::F32],
                )
            }
        };
        if !want_st.contains(&scale_type) {
            return Err(format!(
                "scale type {scale_type:?} does not fit format {format:?}"
            ));
        }
        if data.len() != want_data {
            return Err(format!(
                "{rows}x{cols} {format:?} needs {want_data} weight bytes, got {}",
                data.len()
            ));
        }
        if scale.len() != want_scale {
            return Err(format!(
                "{rows}x{cols} {format:?} needs {want_scale} scale bytes, got {}",
                scale.len()
            ));
        }
        Ok(WeightMatrix {
            rows,
            cols,
            format,
            data,
            scale,
            scale_type,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// Rows `start..start+len` as their own matrix (row-aligned formats only slice the bytes;
    /// block FP8 needs `start` to be a multiple of the block height).
    pub fn rows_slice(
        &self,
        start: usize,
        len: usize,
    ) -> std::result::Result<WeightMatrix<'a>, String> {
        if start + len > self.rows {
            return Err(format!(
                "rows {start}..{} out of {}",
                start + len,
                self.rows
            ));
        }
        let sub = |bytes_per_row: usize, scale_per_row: usize| {
            WeightMatrix::new(
                len,
                self.cols,
                self.format,
                &self.data[start * bytes_per_row..(start + len) * bytes_per_row],
                &self.scale[start * scale_per_row..(start + len) * scale_per_row],
                self.scale_type,
            )
        };
        match self.format {
            WeightFormat::F32 => sub(self.cols * 4, 0),
            WeightFormat::F16 | WeightFormat::Bf16 => sub(self.cols * 2, 0),
            WeightFormat::Int4Group { group } => sub(
                ceil_div(self.cols, 8) * 4,
                ceil_div(self.cols, group) * self.scale_type.size(),
            ),
            WeightFormat::Mxfp4 { group } => {
                sub(ceil_div(self.cols, 2), ceil_div(self.cols, group))
            }
            WeightFormat::Q8 { group } => sub(
                self.cols,
                ceil_div(self.cols, group) * self.scale_type.size(),
            ),
            WeightFormat::Fp8Block {
                block_rows,
                block_cols,
            } => {
                if !start.is_multiple_of(block_rows) {
                    return Err(format!(
                        "FP8 row split at {start} is not on a {block_rows}-row block"
                    ));
                }
                let sc = ceil_div(self.cols, block_cols) * self.scale_type.size();
                let sr0 = start / block_rows;
                let sr1 = ceil_div(start + len, block_rows);
                WeightMatrix::new(
                    len,
                    self.cols,
                    self.format,
                    &self.data[start * self.cols..(start + len) * self.cols],
                    &self.scale[sr0 * sc..sr1 * sc],
                    self.scale_type,
                )
            }
        }
    }

    /// Decode row `r` into `out[..cols]` as f32 (the scalar reference decoder).
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        let kind = Kernel::of(self.format);
        let rb = kind.row_bytes(self.cols);
        let mut scales = Vec::new();
        self.row_scales(r, &mut scales);
        crate::kernels::scalar::decode_row(
            kind,
            &self.data[r * rb..(r + 1) * rb],
            &scales,
            self.cols,
            out,
        );
    }

    /// Row `r`'s scales as f32 (one per group / column block; `[1.0]` for unscaled formats).
    pub fn row_scales(&self, r: usize, out: &mut Vec<f32>) {
        out.clear();
        let cols = self.cols;
        match self.format {
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 => out.push(1.0),
            WeightFormat::Fp8Block {
                block_rows,
                block_cols,
            } => {
                let sc = ceil_div(cols, block_cols);
                let base = (r / block_rows) * sc;
                out.extend((0..sc).map(|i| self.scale_type.get(self.scale, base + i)));
            }
            WeightFormat::Int4Group { group }
            | WeightFormat::Mxfp4 { group }
            | WeightFormat::Q8 { group } => {
                let g = ceil_div(cols, group);
                out.extend((r * g..(r + 1) * g).map(|i| self.scale_type.get(self.scale, i)));
            }
        }
    }

    /// The raw weight bytes.
    pub fn data_bytes(&self) -> &'a [u8] {
        self.data
    }
    /// The raw scale bytes.
    pub fn scale_bytes(&self) -> &'a [u8] {
        self.scale
    }
    pub fn scale_type(&self) -> ScaleType {
        self.scale_type
    }

    /// The whole matrix as row-major f32 `[rows, cols]`.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        out.par_chunks_mut(self.cols.max(1))
            .enumerate()
            .for_each(|(r, o)| self.decode_row(r, o));
        out
    }

    /// `out[r] = dot(W[r], x)`; `x` is `[cols]`, `out` is `[rows]`.
    pub fn matvec(&self, x: &[f32], out: &mut [f32]) {
        self.matmul(x, 1, out)
    }

    /// `out[t, r] = dot(W[r], x[t])` for `n` inputs: `x` is `[n, cols]`, `out` is `[n, rows]`.
    /// Each weight row is decoded once per tile of inputs, in registers, by the best kernels
    /// this CPU runs ([`crate::kernels`]), with the activation precision
    /// [`crate::kernels::model_act`] picks for the format.
    pub fn matmul(&self, x: &[f32], n: usize, out: &mut [f32]) {
        let act = crate::kernels::model_act(crate::kernels::Kind::of(self.format));
        crate::kernels::matmul(self, x, n, out, act)
    }
}

/// [`WeightMatrix::matmul`] of several matrices against the same inputs in one parallel pass
/// (inputs quantized once): `outs[i] = x @ mats[i]^T`, each as the single call gives it.
pub fn matmul_many(mats: &[&WeightMatrix<'_>], x: &[f32], n: usize, outs: &mut [&mut [f32]]) {
    let Some(first) = mats.first() else {
        return;
    };
    let kind = crate::kernels::Kind::of(first.format);
    if mats
        .iter()
        .any(|m| crate::kernels::Kind::of(m.format) != kind)
    {
        // Each format with its own activation precision.
        for (m, out) in mats.iter().zip(outs.iter_mut()) {
            m.matmul(x, n, out);
        }
        return;
    }
    let act = crate::kernels::model_act(kind);
    crate::kernels::matmul_many_with(crate::kernels::Isa::detect(), mats, x, n, outs, act)
}

/// Quantization settings from `config.json` that the checkpoint's tensors do not state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantHints {
    /// DeepSeek FP8 `weight_block_size`.
    pub fp8_block: [usize; 2],
    /// compressed-tensors group size, if the config states one.
    pub group_size: Option<usize>,
}

impl Default for QuantHints {
    fn default() -> Self {
        QuantHints {
            fp8_block: [128, 128],
            group_size: None,
        }
    }
}

impl QuantHints {
    pub fn from_config(q: Option<&serde_json::Value>) -> QuantHints {
        let mut h = QuantHints::default();
        let Some(q) = q else { return h };
        if let Some(b) = q.get("weight_block_size").and_then(|v| v.as_array()) {
            if let (Some(r), Some(c)) = (
                b.first().and_then(|v| v.as_u64()),
                b.get(1).and_then(|v| v.as_u64()),
            ) {
                if r > 0 && c > 0 {
                    h.fp8_block = [r as usize, c as usize];
                }
            }
        }
        if let Some(groups) = q.get("config_groups").and_then(|v| v.as_object()) {
            h.group_size = groups
                .values()
                .filter_map(|g| g.get("weights")?.get("group_size")?.as_u64())
                .find(|&g| g > 0)
                .map(|g| g as usize);
        }
        h
    }
}

/// Looks up the tensors of one matrix by name (`{prefix}.weight`, `{prefix}.weight_scale_inv`,
/// ...). `full_name` turns a relative name into the name to report in errors.
pub(crate) struct MatrixParts<'a, 'f> {
    pub get: &'f dyn Fn(&str) -> Result<Option<TensorRef<'a>>>,
    pub full_name: &'f dyn Fn(&str) -> String,
}

fn shape_err(name: String, expected: &[usize], got: &[u64]) -> InferenceError {
    InferenceError::TensorShape {
        name,
        expected: expected.iter().map(|&d| d as u64).collect(),
        got: got.to_vec(),
    }
}

fn dtype_err(name: String, expected: &str, got: &Dtype) -> InferenceError {
    InferenceError::TensorDtype {
        name,
        expected: expected.into(),
        got: got.to_string(),
    }
}

/// Resolve the matrix `prefix` (`[rows, cols]`) in whatever format the parts are stored.
pub(crate) fn resolve_matrix<'a>(
    parts: &MatrixParts<'a, '_>,
    prefix: &str,
    rows: usize,
    cols: usize,
    hints: &QuantHints,
) -> Result<WeightMatrix<'a>> {
    let name = |s: &str| (parts.full_name)(&format!("{prefix}{s}"));
    let bad = |n: String, reason: String| InferenceError::BadTensor { name: n, reason };
    let dense = |t: TensorRef<'a>, n: String| -> Result<WeightMatrix<'a>> {
        let format = match t.dtype {
            Dtype::F32 => WeightFormat::F32,
            Dtype::F16 => WeightFormat::F16,
            Dtype::Bf16 => WeightFormat::Bf16,
            ref d => {
                return Err(dtype_err(
                    n,
                    "BF16, F16, F32 or F8_E4M3 (with weight_scale_inv)",
                    d,
                ))
            }
        };
        if t.shape != [rows as u64, cols as u64] {
            return Err(shape_err(n, &[rows, cols], t.shape));
        }
        WeightMatrix::new(rows, cols, format, t.bytes, &[], ScaleType::None).map_err(|r| bad(n, r))
    };
    if let Some(w) = (parts.get)(&format!("{prefix}.weight"))? {
        let wname = name(".weight");
        if w.dtype != Dtype::F8E4m3 {
            return dense(w, wname);
        }
        if w.shape != [rows as u64, cols as u64] {
            return Err(shape_err(wname, &[rows, cols], w.shape));
        }
        let sname = name(".weight_scale_inv");
        let s = (parts.get)(&format!("{prefix}.weight_scale_inv"))?.ok_or_else(|| {
            InferenceError::MissingTensor {
                name: sname.clone(),
            }
        })?;
        let st = match s.dtype {
            Dtype::F32 | Dtype::Bf16 | Dtype::F16 => {
                ScaleType::from_dtype(&s.dtype).unwrap_or(ScaleType::F32)
            }
            ref d => return Err(dtype_err(sname, "F32", d)),
        };
        let [br, bc] = hints.fp8_block;
        let want = [ceil_div(rows, br), ceil_div(cols, bc)];
        if s.shape != [want[0] as u64, want[1] as u64] {
            return Err(shape_err(sname, &want, s.shape));
        }
        return WeightMatrix::new(
            rows,
            cols,
            WeightFormat::Fp8Block {
                block_rows: br,
                block_cols: bc,
            },
            w.bytes,
            s.bytes,
            st,
        )
        .map_err(|r| bad(wname, r));
    }
    if let Some(p) = (parts.get)(&format!("{prefix}.weight_packed"))? {
        let pname = name(".weight_packed");
        let sname = name(".weight_scale");
        let s = (parts.get)(&format!("{prefix}.weight_scale"))?.ok_or_else(|| {
            InferenceError::MissingTensor {
                name: sname.clone(),
            }
        })?;
        if let Some(ws) = (parts.get)(&format!("{prefix}.weight_shape"))? {
            let wsname = name(".weight_shape");
            let vals: Vec<i64> = match ws.dtype {
                Dtype::I64 => ws
                    .bytes
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
                    .collect(),
                Dtype::I32 => ws
                    .bytes
                    .chunks_exact(4)
                    .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64)
                    .collect(),
                ref d => return Err(dtype_err(wsname, "I32 or I64", d)),
            };
            if vals != [rows as i64, cols as i64] {
                return Err(bad(
                    wsname,
                    format!("holds {vals:?}; expected [{rows}, {cols}]"),
                ));
            }
        }
        if s.shape.len() != 2 || s.shape[0] != rows as u64 || s.shape[1] == 0 {
            return Err(shape_err(
                sname,
                &[rows, ceil_div(cols, hints.group_size.unwrap_or(32))],
                s.shape,
            ));
        }
        let n_groups = s.shape[1] as usize;
        let group = match hints.group_size {
            Some(g) => g,
            None if cols.is_multiple_of(n_groups) => cols / n_groups,
            None => {
                return Err(bad(
                    sname,
                    format!("{n_groups} scale groups do not divide {cols} columns"),
                ))
            }
        };
        if ceil_div(cols, group) != n_groups {
            return Err(shape_err(sname, &[rows, ceil_div(cols, group)], s.shape));
        }
        let (format, want_cols, st) = match p.dtype {
            Dtype::I32 => {
                let st = match s.dtype {
                    Dtype::F32 | Dtype::Bf16 | Dtype::F16 => {
                        ScaleType::from_dtype(&s.dtype).unwrap_or(ScaleType::F32)
                    }
                    ref d => return Err(dtype_err(sname, "BF16, F16 or F32", d)),
                };
                (WeightFormat::Int4Group { group }, ceil_div(cols, 8), st)
            }
            Dtype::I8 => {
                let st = match s.dtype {
                    Dtype::F32 | Dtype::Bf16 | Dtype::F16 => {
                        ScaleType::from_dtype(&s.dtype).unwrap_or(ScaleType::F16)
                    }
                    ref d => return Err(dtype_err(sname, "F16, BF16 or F32", d)),
                };
                (WeightFormat::Q8 { group }, cols, st)
            }
            Dtype::U8 => {
                if s.dtype != Dtype::U8 {
                    return Err(dtype_err(sname, "U8 (E8M0)", &s.dtype));
                }
                (
                    WeightFormat::Mxfp4 { group },
                    ceil_div(cols, 2),
                    ScaleType::E8m0,
                )
            }
            ref d => {
                return Err(dtype_err(
                    pname,
                    "I32 (INT4 pack-quantized), U8 (MXFP4) or I8 (Q8)",
                    d,
                ))
            }
        };
        if p.shape != [rows as u64, want_cols as u64] {
            return Err(shape_err(pname, &[rows, want_cols], p.shape));
        }
        return WeightMatrix::new(rows, cols, format, p.bytes, s.bytes, st)
            .map_err(|r| bad(pname, r));
    }
    // Fused expert slices (`gate_up_proj`, `down_proj`) carry no `.weight` suffix.
    if let Some(t) = (parts.get)(prefix)? {
        return dense(t, name(""));
    }
    Err(InferenceError::MissingTensor {
        name: name(".weight"),
    })
}

/// A weight matrix owning its bytes (resident weights), with an optional f32 bias.
#[derive(Debug, Clone)]
pub struct Linear {
    rows: usize,
    cols: usize,
    format: WeightFormat,
    data: Vec<u8>,
    scale: Vec<u8>,
    scale_type: ScaleType,
    bias: Option<Vec<f32>>,
}

impl Linear {
    /// Copy a borrowed matrix into an owned one.
    pub fn from_matrix(m: &WeightMatrix<'_>, bias: Option<Vec<f32>>) -> Linear {
        Linear {
            rows: m.rows,
            cols: m.cols,
            format: m.format,
            data: m.data.to_vec(),
            scale: m.scale.to_vec(),
            scale_type: m.scale_type,
            bias,
        }
    }

    /// An f32 matrix (tests, synthetic weights).
    pub fn from_f32(rows: usize, cols: usize, w: &[f32]) -> Result<Linear> {
        if w.len() != rows * cols {
            return Err(InferenceError::InvalidArgument(format!(
                "{} values for a {rows}x{cols} matrix",
                w.len()
            )));
        }
        let data: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        Ok(Linear {
            rows,
            cols,
            format: WeightFormat::F32,
            data,
            scale: Vec::new(),
            scale_type: ScaleType::None,
            bias: None,
        })
    }

    pub fn view(&self) -> WeightMatrix<'_> {
        WeightMatrix {
            rows: self.rows,
            cols: self.cols,
            format: self.format,
            data: &self.data,
            scale: &self.scale,
            scale_type: self.scale_type,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// `x [n, cols] -> [n, rows]` (plus bias).
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n * self.rows];
        self.view().matmul(x, n, &mut out);
        if let Some(b) = &self.bias {
            for row in out.chunks_mut(self.rows) {
                for (o, b) in row.iter_mut().zip(b) {
                    *o += b;
                }
            }
        }
        out
    }

    /// [`Linear::forward`] of several layers on the same inputs, in one parallel pass (the
    /// inputs quantized once): a SwiGLU's gate and up.
    pub fn forward_many(layers: &[&Linear], x: &[f32], n: usize) -> Vec<Vec<f32>> {
        let mut outs: Vec<Vec<f32>> = layers.iter().map(|l| vec![0f32; n * l.rows]).collect();
        let views: Vec<WeightMatrix<'_>> = layers.iter().map(|l| l.view()).collect();
        let refs: Vec<&WeightMatrix<'_>> = views.iter().collect();
        let mut slices: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
        matmul_many(&refs, x, n, &mut slices);
        for (l, out) in layers.iter().zip(&mut outs) {
            if let Some(b) = &l.bias {
                for row in out.chunks_mut(l.rows) {
                    for (o, b) in row.iter_mut().zip(b) {
                        *o += b;
                    }
                }
            }
        }
        outs
    }

    /// Bytes held (weights + scales).
    pub fn memory_bytes(&self) -> usize {
        self.data.len() + self.scale.len() + self.bias.as_ref().map_or(0, |b| b.len() * 4)
    }
}

/// Convert a float tensor (F32/F16/BF16) of any shape to f32.
pub fn tensor_to_f32(t: &TensorRef<'_>, name: &str) -> Result<Vec<f32>> {
    let out: Vec<f32> = match t.dtype {
        Dtype::F32 => t
            .bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::Bf16 => t
            .bytes
            .chunks_exact(2)
            .map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
        Dtype::F16 => t
            .bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        ref d => return Err(dtype_err(name.to_string(), "F32, F16 or BF16", d)),
    };
    if out.len() as u64 != t.numel() {
        return Err(InferenceError::BadTensor {
            name: name.to_string(),
            reason: format!("{} bytes do not hold shape {:?}", t.bytes.len(), t.shape),
        });
    }
    Ok(out)
}

/// Dequantize the matrix stored under `name` (`....weight`, whatever its packed form) to
/// row-major f32 `[rows, cols]`, reading resident tensors by name from `src`.
pub fn dequantize(
    src: &dyn crate::weights::WeightSource,
    name: &str,
    rows: usize,
    cols: usize,
    hints: &QuantHints,
) -> Result<Vec<f32>> {
    let prefix = name.strip_suffix(".weight").unwrap_or(name);
    let get = |n: &str| crate::weights::try_tensor(src, n);
    let full = |n: &str| n.to_string();
    Ok(resolve_matrix(
        &MatrixParts {
            get: &get,
            full_name: &full,
        },
        prefix,
        rows,
        cols,
        hints,
    )?
    .to_f32())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn fp8_values() {
        assert_eq!(fp8_e4m3_to_f32(0x00), 0.0);
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0);
        assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0);
        assert_eq!(fp8_e4m3_to_f32(0xb8), -1.0);
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
        assert!(fp8_e4m3_to_f32(0x7f).is_nan());
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(130), 8.0);
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
    }

    #[test]
    fn matmul_matches_naive() {
        let (rows, cols, n) = (37, 19, 5);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
            .collect();
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.2)
            .collect();
        let lin = Linear::from_f32(rows, cols, &w).unwrap();
        let got = lin.forward(&x, n);
        for t in 0..n {
            for r in 0..rows {
                let want: f32 = (0..cols).map(|c| w[r * cols + c] * x[t * cols + c]).sum();
                assert!((got[t * rows + r] - want).abs() < 1e-4);
            }
        }
        let mut one = vec![0f32; rows];
        lin.view().matvec(&x[..cols], &mut one);
        assert_eq!(&one[..], &got[..rows]);
    }

    #[test]
    fn packed_formats_decode() {
        // INT4: row [0..8) = q values -8..7 step 2, scale 0.5
        let qs: [i32; 8] = [-8, -6, -4, -2, 0, 2, 4, 7];
        let mut word = 0u32;
        for (i, q) in qs.iter().enumerate() {
            word |= (((q + 8) as u32) & 0xf) << (4 * i);
        }
        let data = word.to_le_bytes();
        let scale = half::bf16::from_f32(0.5).to_bits().to_le_bytes();
        let m = WeightMatrix::new(
            1,
            8,
            WeightFormat::Int4Group { group: 8 },
            &data,
            &scale,
            ScaleType::Bf16,
        )
        .unwrap();
        let mut out = [0f32; 8];
        m.decode_row(0, &mut out);
        let want: Vec<f32> = qs.iter().map(|&q| q as f32 * 0.5).collect();
        assert_eq!(&out[..], &want[..]);
        // MXFP4: bytes 0x9_2 -> elements (low=2 -> 1.0, high=0x9 -> -0.5), scale 2^1
        let data = [0x92u8];
        let scale = [128u8];
        let m = WeightMatrix::new(
            1,
            2,
            WeightFormat::Mxfp4 { group: 32 },
            &data,
            &scale,
            ScaleType::E8m0,
        )
        .unwrap();
        let mut out = [0f32; 2];
        m.decode_row(0, &mut out);
        assert_eq!(out, [2.0, -1.0]);
        // Length checks refuse short buffers.
        assert!(
            WeightMatrix::new(2, 8, WeightFormat::Bf16, &[0u8; 30], &[], ScaleType::None).is_err()
        );
    }
}
