//! [`WeightFormat`]: how the bytes of a `[rows, cols]` weight matrix (Hugging Face `nn.Linear`
//! layout, row = output) encode its values, and the byte sizes that follow from it.
//!
//! Every size is computed with checked arithmetic and returned as `None` on overflow: the
//! shapes come from files, and the kernels' safety rests on these lengths.

use crate::codec::{bf16_to_f32, e8m0_to_f32};
use crate::dtype::Dtype;

/// How a weight matrix's bytes encode its values (one variant per packed format; the kernels
/// dispatch on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    F16,
    Bf16,
    /// FP8 e4m3fn values, one `weight_scale_inv` per `[block_rows, block_cols]` block (edge
    /// blocks partial).
    Fp8Block {
        block_rows: usize,
        block_cols: usize,
    },
    /// 4-bit symmetric ints, 8 per little-endian i32 word (element c at bits 4(c%8)), stored as
    /// offset binary q+8; one scale per `group` consecutive columns (compressed-tensors
    /// `pack-quantized`).
    Int4 {
        group: usize,
    },
    /// E2M1 nibbles (element 2b = low nibble of byte b), one E8M0 scale per `group` columns
    /// (compressed-tensors `mxfp4-pack-quantized`).
    Mxfp4 {
        group: usize,
    },
    /// int8 values, one scale (F16, also BF16/F32) per `group` consecutive columns;
    /// `w = q * scale`.
    Q8 {
        group: usize,
    },
}

/// Element type of a scale tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScaleType {
    None,
    F32,
    F16,
    Bf16,
    /// Power-of-two exponent byte: `2^(e-127)`.
    E8m0,
}

impl ScaleType {
    /// Bytes per scale.
    pub fn size(self) -> usize {
        match self {
            ScaleType::None => 0,
            ScaleType::F32 => 4,
            ScaleType::F16 | ScaleType::Bf16 => 2,
            ScaleType::E8m0 => 1,
        }
    }

    /// The scale type stored as `dtype` (`U8` is E8M0), if scales can be stored so.
    pub fn from_dtype(d: &Dtype) -> Option<ScaleType> {
        Some(match d {
            Dtype::F32 => ScaleType::F32,
            Dtype::F16 => ScaleType::F16,
            Dtype::Bf16 => ScaleType::Bf16,
            Dtype::U8 => ScaleType::E8m0,
            _ => return None,
        })
    }

    /// Scale `i` of `bytes` as f32. Panics if `bytes` is shorter than scale `i`.
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

impl WeightFormat {
    /// Columns sharing one scale along a row (`cols` for unscaled formats; FP8: the block width).
    pub fn group(self, cols: usize) -> usize {
        match self {
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 => cols.max(1),
            WeightFormat::Fp8Block { block_cols, .. } => block_cols,
            WeightFormat::Int4 { group }
            | WeightFormat::Mxfp4 { group }
            | WeightFormat::Q8 { group } => group,
        }
    }

    /// Whether the format carries scales.
    pub fn scaled(self) -> bool {
        !matches!(
            self,
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16
        )
    }

    /// Whether the integer-activation kernels apply (INT4, MXFP4, Q8).
    pub fn integer(self) -> bool {
        matches!(
            self,
            WeightFormat::Int4 { .. } | WeightFormat::Mxfp4 { .. } | WeightFormat::Q8 { .. }
        )
    }

    /// Whether the format's block / group sizes are usable (all > 0).
    pub fn valid(self) -> bool {
        match self {
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 => true,
            WeightFormat::Fp8Block {
                block_rows,
                block_cols,
            } => block_rows > 0 && block_cols > 0,
            WeightFormat::Int4 { group }
            | WeightFormat::Mxfp4 { group }
            | WeightFormat::Q8 { group } => group > 0,
        }
    }

    /// Bytes of one row of `cols` values.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        match self {
            WeightFormat::F32 => cols.checked_mul(4),
            WeightFormat::F16 | WeightFormat::Bf16 => cols.checked_mul(2),
            WeightFormat::Fp8Block { .. } | WeightFormat::Q8 { .. } => Some(cols),
            WeightFormat::Int4 { .. } => cols.div_ceil(8).checked_mul(4),
            WeightFormat::Mxfp4 { .. } => Some(cols.div_ceil(2)),
        }
    }

    /// Weight bytes of a `rows x cols` matrix.
    pub fn data_bytes(self, rows: usize, cols: usize) -> Option<usize> {
        self.row_bytes(cols)?.checked_mul(rows)
    }

    /// Scales per row (`0` for unscaled formats; block FP8: scale columns of one block row).
    pub fn scales_per_row(self, cols: usize) -> usize {
        if !self.scaled() || !self.valid() {
            return 0;
        }
        cols.div_ceil(self.group(cols))
    }

    /// Number of scales of a `rows x cols` matrix (block FP8: one per block).
    pub fn scale_count(self, rows: usize, cols: usize) -> Option<usize> {
        match self {
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 => Some(0),
            WeightFormat::Fp8Block {
                block_rows,
                block_cols,
            } => {
                if block_rows == 0 || block_cols == 0 {
                    return None;
                }
                rows.div_ceil(block_rows)
                    .checked_mul(cols.div_ceil(block_cols))
            }
            WeightFormat::Int4 { group }
            | WeightFormat::Mxfp4 { group }
            | WeightFormat::Q8 { group } => {
                if group == 0 {
                    return None;
                }
                rows.checked_mul(cols.div_ceil(group))
            }
        }
    }

    /// Scale bytes of a `rows x cols` matrix with scales of type `st`.
    pub fn scale_bytes(self, rows: usize, cols: usize, st: ScaleType) -> Option<usize> {
        self.scale_count(rows, cols)?.checked_mul(st.size())
    }

    /// The scale types this format's scales may be stored as.
    pub fn scale_types(self) -> &'static [ScaleType] {
        match self {
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::Bf16 => &[ScaleType::None],
            WeightFormat::Fp8Block { .. } | WeightFormat::Int4 { .. } => {
                &[ScaleType::F32, ScaleType::Bf16, ScaleType::F16]
            }
            WeightFormat::Mxfp4 { .. } => &[ScaleType::E8m0],
            WeightFormat::Q8 { .. } => &[ScaleType::F16, ScaleType::Bf16, ScaleType::F32],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        let f = WeightFormat::Int4 { group: 32 };
        assert_eq!(f.row_bytes(64), Some(32));
        assert_eq!(f.data_bytes(3, 64), Some(96));
        assert_eq!(f.scale_bytes(3, 64, ScaleType::Bf16), Some(12));
        let m = WeightFormat::Mxfp4 { group: 32 };
        assert_eq!(m.data_bytes(2, 64), Some(64));
        assert_eq!(m.scale_bytes(2, 64, ScaleType::E8m0), Some(4));
        let b = WeightFormat::Fp8Block {
            block_rows: 128,
            block_cols: 128,
        };
        assert_eq!(b.scale_count(320, 64), Some(3));
        assert_eq!(WeightFormat::Bf16.scale_count(5, 5), Some(0));
    }

    #[test]
    fn overflow_is_none() {
        let huge = usize::MAX / 2 + 1;
        assert_eq!(WeightFormat::F32.row_bytes(huge), None);
        assert_eq!(WeightFormat::Bf16.data_bytes(huge, 2), None);
        assert_eq!(
            WeightFormat::Q8 { group: 1 }.scale_bytes(huge, 2, ScaleType::F32),
            None
        );
        assert_eq!(WeightFormat::Q8 { group: 0 }.scale_count(1, 1), None);
    }
}
