//! Finding a matrix's tensors by name and deciding its format: `{prefix}.weight` (BF16/F16/F32,
//! or F8_E4M3 with `weight_scale_inv`), `{prefix}.weight_packed` + `weight_scale` (INT4 /
//! MXFP4 / Q8), or a fused expert slice; every shape and dtype checked, errors naming the tensor.

use deltafin_formats::{Dtype, ScaleType, WeightFormat};

use crate::error::{InferenceError, Result};
use crate::linear::matrix::WeightMatrix;
use crate::weights::TensorRef;

fn ceil_div(a: usize, b: usize) -> usize {
    a.div_ceil(b)
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
                (WeightFormat::Int4 { group }, ceil_div(cols, 8), st)
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
