//! Loading resident weights from a [`WeightSource`] into prepared types, with shape checks.

use crate::error::{InferenceError, Result};
use crate::linear::{resolve_matrix, tensor_to_f32, Linear, MatrixParts, QuantHints, WeightMatrix};
use crate::ops::RmsNorm;
use crate::weights::{try_tensor, ExpertView, WeightSource};

/// Resident-weight loader: a source plus the quantization hints of its config.
#[derive(Clone, Copy)]
pub(crate) struct Loader<'a> {
    pub src: &'a dyn WeightSource,
    pub hints: QuantHints,
}

impl<'a> Loader<'a> {
    /// The matrix `{prefix}.weight` (or its packed parts) as a `[rows, cols]` matrix.
    pub fn matrix(&self, prefix: &str, rows: usize, cols: usize) -> Result<WeightMatrix<'a>> {
        let src = self.src;
        let get = |n: &str| try_tensor(src, n);
        let full = |n: &str| n.to_string();
        resolve_matrix(
            &MatrixParts {
                get: &get,
                full_name: &full,
            },
            prefix,
            rows,
            cols,
            &self.hints,
        )
    }

    /// An owned linear layer, with `{prefix}.bias` when `bias`.
    pub fn linear(&self, prefix: &str, rows: usize, cols: usize, bias: bool) -> Result<Linear> {
        let m = self.matrix(prefix, rows, cols)?;
        let b = if bias {
            Some(self.vector(&format!("{prefix}.bias"), rows)?)
        } else {
            None
        };
        Ok(Linear::from_matrix(&m, b))
    }

    /// A float vector of exactly `len` elements.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.src.tensor(name)?;
        if t.shape != [len as u64] {
            return Err(InferenceError::TensorShape {
                name: name.to_string(),
                expected: vec![len as u64],
                got: t.shape.to_vec(),
            });
        }
        tensor_to_f32(&t, name)
    }

    pub fn norm(&self, name: &str, dim: usize, eps: f64) -> Result<RmsNorm> {
        RmsNorm::load(self.src, name, dim, eps)
    }
}

/// One matrix of a routed expert (`part` = `gate_proj`, `gate_up_proj`, ...).
pub(crate) fn expert_matrix<'v>(
    view: &ExpertView<'v>,
    layer: usize,
    expert: usize,
    part: &str,
    rows: usize,
    cols: usize,
    hints: &QuantHints,
) -> Result<WeightMatrix<'v>> {
    let get = |n: &str| Ok(view.part(n));
    let full = |n: &str| format!("model.layers.{layer}.mlp.experts.{expert}.{n}");
    resolve_matrix(
        &MatrixParts {
            get: &get,
            full_name: &full,
        },
        part,
        rows,
        cols,
        hints,
    )
    .map_err(|e| match e {
        InferenceError::MissingTensor { name } => InferenceError::MissingExpert {
            layer,
            expert,
            reason: format!(
                "part `{name}` is missing (parts present: {:?})",
                view.part_names()
            ),
        },
        e => e,
    })
}
