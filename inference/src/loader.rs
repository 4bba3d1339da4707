//! Loading resident weights from a [`WeightSource`] into prepared types, with shape checks.

use deltafin_storage::naming::ExpertNaming;

use crate::error::{InferenceError, Result};
use crate::kernels::isa::KernelConfig;
use crate::linear::convert::tensor_to_f32;
use crate::linear::matrix::WeightMatrix;
use crate::linear::owned::Linear;
use crate::linear::resolve::{resolve_matrix, MatrixParts, QuantHints};
use crate::ops::RmsNorm;
use crate::weights::{try_tensor, WeightSource};

/// Resident-weight loader: a source plus the quantization hints of its config.
#[derive(Clone)]
pub(crate) struct Loader<'a> {
    pub src: &'a dyn WeightSource,
    pub hints: QuantHints,
    /// The kernels every loaded matrix runs.
    pub kernels: KernelConfig,
    /// How the checkpoint names routed experts (errors name expert tensors through it).
    pub naming: ExpertNaming,
    /// Prepended to every tensor name (`language_model.` for Kimi K3's wrapper).
    pub prefix: &'static str,
}

impl<'a> Loader<'a> {
    /// The matrix `{prefix}.weight` (or its packed parts) as a `[rows, cols]` matrix.
    pub fn matrix(&self, prefix: &str, rows: usize, cols: usize) -> Result<WeightMatrix<'a>> {
        let src = self.src;
        let prefix = format!("{}{prefix}", self.prefix);
        let prefix = prefix.as_str();
        let get = |n: &str| try_tensor(src, n);
        let full = |n: &str| n.to_string();
        Ok(resolve_matrix(
            &MatrixParts {
                get: &get,
                full_name: &full,
            },
            prefix,
            rows,
            cols,
            &self.hints,
        )?
        .with_kernels(self.kernels))
    }

    /// An owned linear layer, with `{prefix}.bias` when `bias`.
    pub fn linear(&self, prefix: &str, rows: usize, cols: usize, bias: bool) -> Result<Linear> {
        let m = self.matrix(prefix, rows, cols)?;
        let b = if bias {
            Some(self.vector(&format!("{prefix}.bias"), rows)?)
        } else {
            None
        };
        Ok(Linear::from_matrix_sharing(
            &m,
            b,
            self.src.share(m.data_bytes()),
        ))
    }

    /// A float vector of exactly `len` elements.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let name = &format!("{}{name}", self.prefix);
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
        RmsNorm::load(self.src, &format!("{}{name}", self.prefix), dim, eps)
    }

    /// A float tensor of exactly `shape`, flattened.
    pub fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let name = &format!("{}{name}", self.prefix);
        let t = self.src.tensor(name)?;
        let want: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        if t.shape != want.as_slice() {
            return Err(InferenceError::TensorShape {
                name: name.to_string(),
                expected: want,
                got: t.shape.to_vec(),
            });
        }
        tensor_to_f32(&t, name)
    }

    /// A float tensor of any shape, flattened, with its name as the source holds it (for
    /// checks whose errors must name it).
    pub fn any_f32(&self, name: &str) -> Result<(String, Vec<u64>, Vec<f32>)> {
        let name = format!("{}{name}", self.prefix);
        let t = self.src.tensor(&name)?;
        let v = tensor_to_f32(&t, &name)?;
        Ok((name, t.shape.to_vec(), v))
    }
}
