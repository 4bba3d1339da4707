//! Test matrices of every weight format, inputs and ISA lists shared by the kernel tests.

use deltafin_formats::quantize as quant;
use deltafin_inference::kernels::{self, Act, Isa};
use deltafin_inference::linear::{ScaleType, WeightFormat, WeightMatrix};

pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub format: WeightFormat,
    pub st: ScaleType,
    pub data: Vec<u8>,
    pub scale: Vec<u8>,
}

impl Mat {
    pub fn view(&self) -> WeightMatrix<'_> {
        WeightMatrix::new(
            self.rows,
            self.cols,
            self.format,
            &self.data,
            &self.scale,
            self.st,
        )
        .expect("test matrix")
    }
}

pub fn rng(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

pub fn make(name: &str, rows: usize, cols: usize, seed: u64) -> Mat {
    let mut r = rng(seed);
    let w: Vec<f32> = (0..rows * cols).map(|_| r() * 0.1).collect();
    let (format, st, data, scale) = match name {
        "f32" => (
            WeightFormat::F32,
            ScaleType::None,
            w.iter().flat_map(|v| v.to_le_bytes()).collect(),
            vec![],
        ),
        "f16" => (
            WeightFormat::F16,
            ScaleType::None,
            w.iter()
                .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
            vec![],
        ),
        "bf16" => (
            WeightFormat::Bf16,
            ScaleType::None,
            w.iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
            vec![],
        ),
        "fp8" => {
            let (br, bc) = (128, 128);
            let n = rows.div_ceil(br) * cols.div_ceil(bc);
            // Every code except the NaNs 0x7f / 0xff (subnormals included).
            let data = (0..rows * cols)
                .map(|_| {
                    let b = ((r() + 1.0) * 128.0) as u8;
                    if b & 0x7f == 0x7f {
                        0x7e
                    } else {
                        b
                    }
                })
                .collect();
            let scale = (0..n)
                .flat_map(|_| (0.001 + 0.01 * r().abs()).to_le_bytes())
                .collect();
            (
                WeightFormat::Fp8Block {
                    block_rows: br,
                    block_cols: bc,
                },
                ScaleType::F32,
                data,
                scale,
            )
        }
        "int4" => {
            let q = quant::quantize_int4(&w, rows, cols, 32);
            (
                WeightFormat::Int4 { group: 32 },
                ScaleType::Bf16,
                q.data,
                q.scale,
            )
        }
        "int4g64" => {
            let q = quant::quantize_int4(&w, rows, cols, 64);
            (
                WeightFormat::Int4 { group: 64 },
                ScaleType::Bf16,
                q.data,
                q.scale,
            )
        }
        "mxfp4" => {
            let q = quant::quantize_mxfp4(&w, rows, cols, 32);
            (
                WeightFormat::Mxfp4 { group: 32 },
                ScaleType::E8m0,
                q.data,
                q.scale,
            )
        }
        "q8" => {
            let q = quant::quantize_q8(&w, rows, cols, 32);
            (
                WeightFormat::Q8 { group: 32 },
                ScaleType::F16,
                q.data,
                q.scale,
            )
        }
        _ => unreachable!(),
    };
    Mat {
        rows,
        cols,
        format,
        st,
        data,
        scale,
    }
}

pub const FORMATS: &[&str] = &[
    "f32", "f16", "bf16", "fp8", "int4", "int4g64", "mxfp4", "q8",
];

pub fn integer(name: &str) -> bool {
    matches!(name, "int4" | "int4g64" | "mxfp4" | "q8")
}

/// (rows, cols): SIMD-shaped, FP8 partial blocks (320 = 2.5 x 128), long rows, and non-multiple-of-32
/// columns (scalar fallback on every ISA).
pub fn shapes(name: &str) -> Vec<(usize, usize)> {
    // (9, 4608): an input longer than 16 KiB, which takes the four-row matrix-vector tile.
    // (7, 96) and (5, 224): 3 and 7 32-blocks (the AVX-512 integer kernels' pair and
    // single-block tails after runs of four).
    // (11, 736): 23 blocks, a whole group of 16 (the AVX-512 16-bit kernels convert weight
    // scales 16 blocks at a time) and a masked tail of 7; (3, 1408): 44 blocks.
    let mut s = vec![(37, 256), (130, 320), (9, 4608), (3, 1408)];
    if name != "int4g64" {
        s.push((7, 96));
        s.push((5, 224));
        s.push((11, 736));
    }
    if !integer(name) {
        s.push((5, 72));
    }
    s
}

pub fn inputs(n: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut r = rng(seed);
    // Wide dynamic range, like real activations (a few large entries).
    (0..n * cols)
        .map(|i| r() * if i % 17 == 0 { 8.0 } else { 1.0 })
        .collect()
}

pub fn run(isa: Isa, m: &WeightMatrix<'_>, x: &[f32], n: usize, act: Act) -> Vec<f32> {
    let mut out = vec![0f32; n * m.rows()];
    kernels::matmul_with(isa, m, x, n, &mut out, act);
    out
}

pub fn simd_isas() -> Vec<Isa> {
    [
        Isa::Avx512,
        Isa::Avx512Bw,
        Isa::AvxVnni,
        Isa::Avx2,
        Isa::Neon,
    ]
    .into_iter()
    .filter(|i| i.available())
    .collect()
}
