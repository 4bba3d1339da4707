//! [`Linear`]: a weight matrix owning its bytes (resident weights, prepared once at load), with
//! an optional f32 bias.

use deltafin_formats::{ScaleType, WeightFormat};

use crate::error::{InferenceError, Result};
use crate::kernels::dispatch::matmul_many;
use crate::kernels::isa::KernelConfig;
use crate::linear::bytes::WeightBytes;
use crate::linear::matrix::WeightMatrix;

/// A weight matrix owning its bytes (resident weights), with an optional f32 bias.
#[derive(Debug, Clone)]
pub struct Linear {
    rows: usize,
    cols: usize,
    format: WeightFormat,
    data: WeightBytes,
    scale: Vec<u8>,
    scale_type: ScaleType,
    kernels: KernelConfig,
    bias: Option<Vec<f32>>,
}

impl Linear {
    /// Copy a borrowed matrix into an owned one.
    pub fn from_matrix(m: &WeightMatrix<'_>, bias: Option<Vec<f32>>) -> Linear {
        Linear::from_matrix_sharing(m, bias, None)
    }

    /// A borrowed matrix as an owned one, keeping its bytes as `shared` (the same bytes, in a
    /// buffer the source shares) instead of copying them when given.
    pub fn from_matrix_sharing(
        m: &WeightMatrix<'_>,
        bias: Option<Vec<f32>>,
        shared: Option<WeightBytes>,
    ) -> Linear {
        let data = match shared {
            // The very bytes the matrix borrows (same address and length), only held shared.
            Some(s) if std::ptr::eq(s.as_slice(), m.data_bytes()) => s,
            _ => WeightBytes::Owned(m.data_bytes().to_vec()),
        };
        Linear {
            rows: m.rows(),
            cols: m.cols(),
            format: m.format(),
            data,
            scale: m.scale_bytes().to_vec(),
            scale_type: m.scale_type(),
            kernels: m.kernels(),
            bias,
        }
    }

    /// An f32 matrix (tests, synthetic weights).
    pub fn from_f32(rows: usize, cols: usize, w: &[f32]) -> Result<Linear> {
        if rows.checked_mul(cols) != Some(w.len()) {
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
            data: WeightBytes::Owned(data),
            scale: Vec::new(),
            scale_type: ScaleType::None,
            kernels: KernelConfig::default(),
            bias: None,
        })
    }

    /// The bytes a product reads: the weights and their scales.
    pub fn weight_slices(&self) -> [&[u8]; 2] {
        [self.data.as_slice(), &self.scale]
    }

    pub fn view(&self) -> WeightMatrix<'_> {
        // The bytes were checked when the matrix they came from was built (or, for
        // `from_f32`, against rows * cols).
        WeightMatrix::prechecked(
            self.rows,
            self.cols,
            self.format,
            self.data.as_slice(),
            &self.scale,
            self.scale_type,
            self.kernels,
        )
    }

    /// The kernels this layer runs.
    pub fn kernels(&self) -> KernelConfig {
        self.kernels
    }

    /// The same layer on other kernels.
    pub fn set_kernels(&mut self, kernels: KernelConfig) {
        self.kernels = kernels;
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn has_bias(&self) -> bool {
        self.bias.is_some()
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
        self.add_bias(&mut out);
        out
    }

    /// Add the bias (if any) to every `[rows]` row of `out`.
    fn add_bias(&self, out: &mut [f32]) {
        if let Some(b) = &self.bias {
            for row in out.chunks_mut(self.rows) {
                for (o, b) in row.iter_mut().zip(b) {
                    *o += b;
                }
            }
        }
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
            l.add_bias(out);
        }
        outs
    }

    /// Whether the weight bytes are shared with the source they were loaded from.
    pub fn shares_bytes(&self) -> bool {
        self.data.is_shared()
    }

    /// Bytes held (weights + scales).
    pub fn memory_bytes(&self) -> usize {
        self.data.len() + self.scale.len() + self.bias.as_ref().map_or(0, |b| b.len() * 4)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

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
}
