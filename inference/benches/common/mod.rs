//! Shared by the `formats` and `membw_ratio` benches: the packed test matrices and the
//! streaming read that measures memory bandwidth.

use deltafin_formats::quantize as quant;
use deltafin_inference::linear::{ScaleType, WeightFormat, WeightMatrix};
use rayon::prelude::*;

pub fn quick() -> bool {
    std::env::var("DELTAFIN_BENCH_QUICK").is_ok()
}

/// A packed matrix's bytes (one expert); the ring repeats `copies` distinct buffers.
pub struct Packed {
    pub name: &'static str,
    pub format: WeightFormat,
    pub scale_type: ScaleType,
    pub data: Vec<u8>,
    pub scale: Vec<u8>,
}

pub fn pseudo(i: usize) -> f32 {
    // Deterministic, roughly normal-looking weights.
    let h = (i as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left(17)
        .wrapping_mul(0xBF58_476D_1CE4_E5B9);
    ((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.05
}

pub fn make(name: &'static str, rows: usize, cols: usize) -> Packed {
    let w: Vec<f32> = (0..rows * cols).map(pseudo).collect();
    match name {
        "bf16" => Packed {
            name,
            format: WeightFormat::Bf16,
            scale_type: ScaleType::None,
            data: w
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
            scale: Vec::new(),
        },
        "fp8" => {
            let (br, bc) = (128, 128);
            let scales = rows.div_ceil(br) * cols.div_ceil(bc);
            Packed {
                name,
                format: WeightFormat::Fp8Block {
                    block_rows: br,
                    block_cols: bc,
                },
                scale_type: ScaleType::F32,
                // Any e4m3 code but the NaNs.
                data: (0..rows * cols)
                    .map(|i| (pseudo(i).to_bits() as u8) & 0xf7)
                    .collect(),
                scale: (0..scales).flat_map(|_| 1e-3f32.to_le_bytes()).collect(),
            }
        }
        "int4" => {
            let q = quant::quantize_int4(&w, rows, cols, 32);
            Packed {
                name,
                format: WeightFormat::Int4 { group: 32 },
                scale_type: ScaleType::Bf16,
                data: q.data,
                scale: q.scale,
            }
        }
        "mxfp4" => {
            let q = quant::quantize_mxfp4(&w, rows, cols, 32);
            Packed {
                name,
                format: WeightFormat::Mxfp4 { group: 32 },
                scale_type: ScaleType::E8m0,
                data: q.data,
                scale: q.scale,
            }
        }
        "q8" => {
            let q = quant::quantize_q8(&w, rows, cols, 32);
            Packed {
                name,
                format: WeightFormat::Q8 { group: 32 },
                scale_type: ScaleType::F16,
                data: q.data,
                scale: q.scale,
            }
        }
        _ => unreachable!("unknown format {name}"),
    }
}

pub fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("rayon pool")
}

pub fn threads_all() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The thread count the kernels run on in this process: `RAYON_NUM_THREADS`, else every
/// core. The kernels' pool (`kernels::pool::pool`) is sized once, at its first use, by the
/// rayon pool it is used from, so one process can time the kernels at one thread count only
/// (timing "1 and 2 threads" in one process measured the first size twice).
#[allow(dead_code)]
pub fn kernel_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(threads_all)
}

/// A streaming read of `buf` (8 u64 accumulators) that prefetches 4 KiB ahead in software,
/// as the kernels do: on this machine a plain read loop measured 28-32 GiB/s on one thread
/// and this one 34-35, and comparing kernels with the lower figure would flatter them.
#[inline(never)]
pub fn stream_read(buf: &[u64]) -> u64 {
    const AHEAD: usize = 4096 / 8;
    let mut acc = [0u64; 8];
    for (i, c) in buf.chunks_exact(8).enumerate() {
        prefetch(buf.as_ptr().wrapping_add(i * 8 + AHEAD));
        for j in 0..8 {
            acc[j] = acc[j].wrapping_add(c[j]);
        }
    }
    acc.iter().fold(0, |a, &b| a ^ b)
}

/// A hint to bring the line at `p` into L1 (x86_64; nothing elsewhere).
#[inline(always)]
fn prefetch(p: *const u64) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of the x86_64 baseline; a prefetch is a hint that neither faults
    // nor changes memory, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// One parallel streaming read of `buf` on `pool`, one chunk per thread.
pub fn read_pass(pool: &rayon::ThreadPool, buf: &[u64], threads: usize) -> u64 {
    pool.install(|| {
        let per = buf.len().div_ceil(threads);
        buf.par_chunks(per)
            .map(stream_read)
            .reduce(|| 0, |a, b| a ^ b)
    })
}

/// Memory-read bandwidth (GiB/s) of one [`read_pass`].
#[allow(dead_code)] // used by membw_ratio only
pub fn membw_pass(pool: &rayon::ThreadPool, buf: &[u64], threads: usize) -> f64 {
    let t = std::time::Instant::now();
    std::hint::black_box(read_pass(pool, buf, threads));
    (buf.len() * 8) as f64 / t.elapsed().as_secs_f64() / (1u64 << 30) as f64
}

/// Expert shapes to bench: `DELTAFIN_BENCH_SHAPES=256x7168,...`, else DeepSeek-V3's
/// gate/up (2048x7168) and down (7168x2048).
pub fn bench_shapes() -> Vec<(usize, usize)> {
    match std::env::var("DELTAFIN_BENCH_SHAPES") {
        Ok(v) => v
            .split(',')
            .map(|s| {
                let (r, c) = s.split_once('x').expect("DELTAFIN_BENCH_SHAPES: RxC,...");
                (r.parse().expect("rows"), c.parse().expect("cols"))
            })
            .collect(),
        Err(_) => vec![(2048, 7168), (7168, 2048)],
    }
}

/// Formats to bench, in this order: all, or those `DELTAFIN_BENCH_FORMATS=int4,mxfp4` names.
pub fn bench_formats() -> Vec<&'static str> {
    let only = std::env::var("DELTAFIN_BENCH_FORMATS").ok();
    ["bf16", "fp8", "q8", "int4", "mxfp4"]
        .into_iter()
        .filter(|name| {
            only.as_ref()
                .is_none_or(|f| f.split(',').any(|f| f == *name))
        })
        .collect()
}

/// Distinct copies (same contents) of a packed matrix's bytes totalling at least `ring_bytes`
/// (at least two), so that a pass over them streams from DRAM: `(data, scale)` each.
pub fn ring(one: &Packed, ring_bytes: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
    let bytes = one.data.len() + one.scale.len();
    (0..ring_bytes.div_ceil(bytes).max(2))
        .map(|_| (one.data.clone(), one.scale.clone()))
        .collect()
}

/// The ring's copies as `rows x cols` matrices of `one`'s format.
pub fn ring_matrices<'r>(
    one: &Packed,
    ring: &'r [(Vec<u8>, Vec<u8>)],
    rows: usize,
    cols: usize,
) -> Vec<WeightMatrix<'r>> {
    ring.iter()
        .map(|(d, s)| {
            WeightMatrix::new(rows, cols, one.format, d, s, one.scale_type).expect("bench matrix")
        })
        .collect()
}
