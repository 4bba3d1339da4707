//! Quick GEMM rate probe: `cargo run --release -p deltafin-inference --example gemm_rate -- ROWS COLS N FORMAT`
//! (bf16 | q8 | int4) [ITERS, default 25]: GMAC/s of `WeightMatrix::matmul` on in-cache weights, median of 20.
use std::time::Instant;

use deltafin_inference::kernels::KernelConfig;
use deltafin_inference::linear::WeightMatrix;
use deltafin_inference::run::calibrate::packed_matrix;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let rows: usize = a.get(1).and_then(|v| v.parse().ok()).unwrap_or(2048);
    let cols: usize = a.get(2).and_then(|v| v.parse().ok()).unwrap_or(1024);
    let n: usize = a.get(3).and_then(|v| v.parse().ok()).unwrap_or(32);
    let fmt = a.get(4).cloned().unwrap_or_else(|| "bf16".into());
    let iters: usize = a.get(5).and_then(|v| v.parse().ok()).unwrap_or(25);
    let mut s = 1u64;
    let mut r = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    };
    let w: Vec<f32> = (0..rows * cols).map(|_| r() * 0.1).collect();
    let x: Vec<f32> = (0..n * cols).map(|_| r()).collect();
    let (format, data, scale, st) = packed_matrix(&fmt, &w, rows, cols);
    let m = WeightMatrix::new(rows, cols, format, &data, &scale, st)
        .expect("matrix")
        .with_kernels(KernelConfig::default());
    let mut out = vec![0f32; n * rows];
    let mut times = Vec::new();
    for _ in 0..iters {
        let t = Instant::now();
        m.matmul(&x, n, &mut out);
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    println!(
        "{fmt} {rows}x{cols} n={n}: {:.3} ms, {:.1} GMAC/s",
        med * 1e3,
        (rows * cols * n) as f64 / med / 1e9
    );
}
