//! [`WeightMatrix`]: a `[rows (out), cols (in)]` weight matrix borrowing its dtype-tagged bytes
//! (a routed expert straight from its source, or a view of a resident [`super::Linear`]),
//! checked at construction so that every kernel indexes in bounds.

use deltafin_formats::{ScaleType, WeightFormat};
use rayon::prelude::*;

use crate::kernels::isa::{Isa, KernelConfig};
use crate::kernels::shape::KernelShape;

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
    kernels: KernelConfig,
}

impl<'a> WeightMatrix<'a> {
    /// Checks that `data` and `scale` have exactly the lengths `format` needs for `rows x cols`
    /// (sizes computed in checked arithmetic: shapes come from files). Runs on the default
    /// kernels ([`KernelConfig::from_env`]); see [`WeightMatrix::with_kernels`].
    pub fn new(
        rows: usize,
        cols: usize,
        format: WeightFormat,
        data: &'a [u8],
        scale: &'a [u8],
        scale_type: ScaleType,
    ) -> std::result::Result<Self, String> {
        if !format.valid() {
            return Err(format!("{format:?}: block and group sizes must be > 0"));
        }
        if !format.scale_types().contains(&scale_type) {
            return Err(format!(
                "scale type {scale_type:?} does not fit format {format:?}"
            ));
        }
        let overflow = || format!("{rows}x{cols} {format:?} is too large to address");
        let want_data = format.data_bytes(rows, cols).ok_or_else(overflow)?;
        let want_scale = format
            .scale_bytes(rows, cols, scale_type)
            .ok_or_else(overflow)?;
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
            kernels: KernelConfig::default(),
        })
    }

    /// A matrix whose lengths were checked by [`WeightMatrix::new`] before (a
    /// [`super::Linear`]'s own bytes).
    pub(crate) fn prechecked(
        rows: usize,
        cols: usize,
        format: WeightFormat,
        data: &'a [u8],
        scale: &'a [u8],
        scale_type: ScaleType,
        kernels: KernelConfig,
    ) -> Self {
        debug_assert_eq!(format.data_bytes(rows, cols), Some(data.len()));
        WeightMatrix {
            rows,
            cols,
            format,
            data,
            scale,
            scale_type,
            kernels,
        }
    }

    /// The same matrix on other kernels.
    pub fn with_kernels(mut self, kernels: KernelConfig) -> Self {
        self.kernels = kernels;
        self
    }

    pub fn kernels(&self) -> KernelConfig {
        self.kernels
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
        let end = start
            .checked_add(len)
            .filter(|&e| e <= self.rows)
            .ok_or_else(|| format!("rows {start}..{start}+{len} out of {}", self.rows))?;
        let (rb, sr) = (
            self.format.row_len(self.cols),
            self.format.scales_per_row(self.cols) * self.scale_type.size(),
        );
        let (data, scale) = match self.format {
            WeightFormat::Fp8Block { block_rows, .. } => {
                if !start.is_multiple_of(block_rows) {
                    return Err(format!(
                        "FP8 row split at {start} is not on a {block_rows}-row block"
                    ));
                }
                let (sr0, sr1) = (start / block_rows, end.div_ceil(block_rows));
                (
                    &self.data[start * rb..end * rb],
                    &self.scale[sr0 * sr..sr1 * sr],
                )
            }
            _ => (
                &self.data[start * rb..end * rb],
                &self.scale[start * sr..end * sr],
            ),
        };
        Ok(
            WeightMatrix::new(len, self.cols, self.format, data, scale, self.scale_type)?
                .with_kernels(self.kernels),
        )
    }

    /// Decode row `r` into `out[..cols]` as f32 (the scalar reference decoder; BF16, exact, on
    /// the SIMD path where the matrix's kernels have one).
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        self.decode_row_with(r, out, &mut Vec::new())
    }

    /// [`WeightMatrix::decode_row`] with a caller's buffer for the row's scales (no allocation
    /// per row).
    pub fn decode_row_with(&self, r: usize, out: &mut [f32], scales: &mut Vec<f32>) {
        self.row_scales(r, scales);
        self.decode_row_scaled(r, scales, out);
    }

    /// Row `r` decoded into `out[..cols]` with its scales `scales` (as
    /// [`WeightMatrix::row_scales`] gives them; BF16's are not read).
    pub fn decode_row_scaled(&self, r: usize, scales: &[f32], out: &mut [f32]) {
        let rb = self.format.row_len(self.cols);
        let data = &self.data[r * rb..(r + 1) * rb];
        match self.format {
            // Exact either way.
            WeightFormat::Bf16 => {
                crate::kernels::bf16::bf16_to_f32(self.kernels.isa, data, &mut out[..self.cols])
            }
            _ if self.kernels.isa == Isa::Scalar => {
                crate::kernels::scalar::decode_row(self.format, data, scales, self.cols, out)
            }
            _ => crate::kernels::vector::decode_row(self.format, data, scales, self.cols, out),
        }
    }

    /// Row `r`'s scales as f32 (one per group / column block; `[1.0]` for unscaled formats).
    pub fn row_scales(&self, r: usize, out: &mut Vec<f32>) {
        out.clear();
        let per_row = self.format.scales_per_row(self.cols);
        let base = match self.format {
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 => {
                out.push(1.0);
                return;
            }
            WeightFormat::Fp8Block { block_rows, .. } => (r / block_rows) * per_row,
            _ => r * per_row,
        };
        out.extend((base..base + per_row).map(|i| self.scale_type.get(self.scale, i)));
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
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

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
            WeightFormat::Int4 { group: 8 },
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

    /// Shapes whose byte sizes overflow `usize` are refused, not wrapped into a length that a
    /// small buffer would pass (rows * cols * 4 wraps to 0 here on 64-bit).
    #[test]
    fn overflowing_shapes_are_refused() {
        let rows = 1usize << 62;
        let err =
            WeightMatrix::new(rows, 4, WeightFormat::F32, &[], &[], ScaleType::None).unwrap_err();
        assert!(err.contains("too large"), "{err}");
        let err = WeightMatrix::new(
            1usize << 60,
            64,
            WeightFormat::Q8 { group: 32 },
            &[],
            &[],
            ScaleType::F32,
        )
        .unwrap_err();
        assert!(err.contains("too large"), "{err}");
        assert!(WeightMatrix::new(
            2,
            64,
            WeightFormat::Q8 { group: 0 },
            &[0; 128],
            &[],
            ScaleType::F16
        )
        .is_err());
    }

    #[test]
    fn row_slices_keep_their_scales() {
        let (rows, cols) = (6, 64);
        let data: Vec<u8> = (0..rows * cols).map(|i| (i % 251) as u8).collect();
        let scale: Vec<u8> = (0..rows * 2)
            .flat_map(|i| half::f16::from_f32(0.5 + i as f32).to_le_bytes())
            .collect();
        let m = WeightMatrix::new(
            rows,
            cols,
            WeightFormat::Q8 { group: 32 },
            &data,
            &scale,
            ScaleType::F16,
        )
        .unwrap();
        let s = m.rows_slice(2, 3).unwrap();
        let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
        for r in 0..3 {
            m.decode_row(2 + r, &mut a);
            s.decode_row(r, &mut b);
            assert_eq!(a, b);
        }
        assert!(m.rows_slice(4, 3).is_err());
        assert!(m.rows_slice(usize::MAX, 2).is_err());
    }
}
