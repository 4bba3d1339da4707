//! Whole tensors as f32: float vectors (norms, biases) and dequantized matrices.

use deltafin_formats::codec::bf16_to_f32;
use deltafin_formats::Dtype;

use crate::error::{InferenceError, Result};
use crate::linear::resolve::{resolve_matrix, MatrixParts, QuantHints};
use crate::weights::TensorRef;

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
        ref d => {
            return Err(InferenceError::TensorDtype {
                name: name.to_string(),
                expected: "F32, F16 or BF16".into(),
                got: d.to_string(),
            })
        }
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
