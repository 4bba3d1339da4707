//! Memory-streaming probe:
//! `cargo run --release -p deltafin-inference --example stream_rate -- FORMAT [MIB] [N]`
//! (bf16 | q8 | int4 | mxfp4; N inputs per expert, default 1). Lays out MIB (default 2048) of
//! expert-shaped matrices (gate_up 1024x1024, down 1024x512), then times, on the kernel pool's
//! threads:
//! - `read`: every byte loaded once, summed (the ceiling a kernel can reach);
//! - `expert passes`: 8 experts' gate_up in one `matmul_jobs` pass then their down projections
//!   in another, N inputs each, cycling through all experts so nothing stays in cache.
//!
//! GB/s of weight bytes, median of 7 sweeps.
use std::time::Instant;

use deltafin_inference::kernels::pool::pool;
use deltafin_inference::kernels::{matmul_jobs, KernelConfig, MatmulJob};
use deltafin_inference::linear::WeightMatrix;
use deltafin_inference::run::calibrate::packed_matrix;

struct Packed {
    format: deltafin_inference::linear::WeightFormat,
    data: Vec<u8>,
    scale: Vec<u8>,
    st: deltafin_inference::linear::ScaleType,
    rows: usize,
    cols: usize,
}

fn pack(fmt: &str, rows: usize, cols: usize, seed: u64) -> Packed {
    let mut s = seed;
    let w: Vec<f32> = (0..rows * cols)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
        })
        .collect();
    let (format, data, scale, st) = packed_matrix(fmt, &w, rows, cols);
    Packed {
        format,
        data,
        scale,
        st,
        rows,
        cols,
    }
}

fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let fmt = a.get(1).cloned().unwrap_or_else(|| "bf16".into());
    let mib: usize = a.get(2).and_then(|v| v.parse().ok()).unwrap_or(2048);
    // Inputs per expert (prefill: a 32-token chunk gives each of 128 top-8 experts ~2).
    let n: usize = a.get(3).and_then(|v| v.parse().ok()).unwrap_or(1);
    let (h, e) = (1024usize, 512usize);
    let one = pack(&fmt, 2 * e, h, 1);
    let per_expert = {
        let d = pack(&fmt, h, e, 2);
        one.data.len() + one.scale.len() + d.data.len() + d.scale.len()
    };
    let experts = (mib << 20) / per_expert;
    let experts = experts - experts % 8;
    // Each expert its own bytes (copies of two packed matrices: the values do not matter).
    let gate_up: Vec<Packed> = (0..experts)
        .map(|i| pack(&fmt, 2 * e, h, 3 + i as u64))
        .collect();
    let down: Vec<Packed> = (0..experts)
        .map(|i| pack(&fmt, h, e, 1 << 20 | i as u64))
        .collect();
    let mats = |v: &'static [Packed]| -> Vec<WeightMatrix<'static>> {
        v.iter()
            .map(|p| {
                WeightMatrix::new(p.rows, p.cols, p.format, &p.data, &p.scale, p.st)
                    .expect("matrix")
                    .with_kernels(KernelConfig::default())
            })
            .collect()
    };
    let gate_up: &'static [Packed] = Box::leak(gate_up.into_boxed_slice());
    let down: &'static [Packed] = Box::leak(down.into_boxed_slice());
    let (gu, dn) = (mats(gate_up), mats(down));
    let total: usize = gate_up
        .iter()
        .chain(down)
        .map(|p| p.data.len() + p.scale.len())
        .sum();

    // read: one task per 256 KiB of each matrix's data, summed as u64 lanes.
    let mut chunks: Vec<(&[u8], u64)> = gate_up
        .iter()
        .chain(down)
        .flat_map(|p| p.data.chunks(256 << 10).chain(p.scale.chunks(256 << 10)))
        .map(|c| (c, 0u64))
        .collect();
    let mut read = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        pool().for_each_mut(&mut chunks, |_, (c, sum)| {
            let mut acc = [0u64; 8];
            for w in c.chunks_exact(64) {
                for (k, a) in acc.iter_mut().enumerate() {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(&w[8 * k..8 * k + 8]);
                    *a = a.wrapping_add(u64::from_le_bytes(b));
                }
            }
            *sum = acc.iter().fold(0, |x, y| x ^ y);
        });
        read.push(t.elapsed().as_secs_f64());
    }
    let sink: u64 = chunks.iter().fold(0, |x, c| x ^ c.1);

    let x = vec![0.01f32; n * h];
    let mut mid = vec![0f32; 8 * n * 2 * e];
    let act = vec![0.01f32; 8 * n * e];
    let mut out = vec![0f32; 8 * n * h];
    let mut decode = Vec::new();
    // STREAM_RATE_SWEEPS=N: more sweeps of the expert passes, for a profiler.
    let sweeps: usize = std::env::var("STREAM_RATE_SWEEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    for _ in 0..sweeps {
        let t = Instant::now();
        for g in (0..experts).step_by(8) {
            let mut jobs: Vec<MatmulJob<'_, '_>> = gu[g..g + 8]
                .iter()
                .zip(mid.chunks_mut(n * 2 * e))
                .map(|(m, o)| MatmulJob {
                    m,
                    x: &x,
                    n,
                    out: o,
                })
                .collect();
            matmul_jobs(&mut jobs);
            let mut jobs: Vec<MatmulJob<'_, '_>> = dn[g..g + 8]
                .iter()
                .zip(act.chunks(n * e))
                .zip(out.chunks_mut(n * h))
                .map(|((m, a), o)| MatmulJob { m, x: a, n, out: o })
                .collect();
            matmul_jobs(&mut jobs);
        }
        decode.push(t.elapsed().as_secs_f64());
    }
    let gb = total as f64 / 1e9;
    println!(
        "{fmt} n={n}: {experts} experts, {:.2} GB; read {:.1} GB/s, expert passes {:.1} GB/s ({} threads) [{sink:x} {}]",
        gb,
        gb / median(read),
        gb / median(decode),
        rayon::current_num_threads(),
        out[0] + mid[0]
    );
}
