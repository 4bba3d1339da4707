//! Row-decode rate probe: `cargo run --release -p deltafin-inference --example decode_rate -- ROWS COLS FORMAT`
//! (bf16 | q8 | int4 | mxfp4): ns per `WeightMatrix::decode_row_with` of an in-cache row, as
//! MLA decodes `kv_b_proj` rows every forward; median of 25 passes over the matrix.
use std::time::Instant;

use deltafin_inference::kernels::KernelConfig;
use deltafin_inference::linear::WeightMatrix;
use deltafin_inference::run::calibrate::packed_matrix;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let rows: usize = a.get(1).and_then(|v| v.parse().ok()).unwrap_or(128);
    let cols: usize = a.get(2).and_then(|v| v.parse().ok()).unwrap_or(256);
    let fmt = a.get(3).cloned().unwrap_or_else(|| "int4".into());
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 8) as f32 / (1u32 << 24) as f32 - 0.5)
        .collect();
    let (format, data, scale, st) = packed_matrix(&fmt, &w, rows, cols);
    let m = WeightMatrix::new(rows, cols, format, &data, &scale, st)
        .expect("matrix")
        .with_kernels(KernelConfig::default());
    let (mut row, mut scales) = (vec![0f32; cols], Vec::new());
    let mut times = Vec::new();
    let mut sink = 0f32;
    for _ in 0..25 {
        let t = Instant::now();
        for r in 0..rows {
            m.decode_row_with(r, &mut row, &mut scales);
            sink += row[r % cols];
        }
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    println!(
        "{fmt} {rows}x{cols}: {:.1} ns per row ({:.2} ns per value) [{sink}]",
        med * 1e9 / rows as f64,
        med * 1e9 / (rows * cols) as f64
    );
}
