//! Rough kernel timings (no harness): `cargo bench -p deltafin-inference --bench kernels`.
//! BF16 matvec / matmul at a DeepSeek-V3 expert shape, FP8-block and INT4 row decoding.

use std::time::Instant;

use deltafin_inference::linear::{ScaleType, WeightFormat, WeightMatrix};

fn time<F: FnMut()>(what: &str, bytes: usize, iters: usize, mut f: F) {
    f();
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    let dt = t.elapsed().as_secs_f64() / iters as f64;
    println!(
        "{what:<40} {:>9.3} ms  {:>7.2} GB/s of weights",
        dt * 1e3,
        bytes as f64 / dt / 1e9
    );
}

fn main() {
    let (rows, cols) = (2048usize, 7168usize);
    let bf16: Vec<u8> = (0..rows * cols)
        .flat_map(|i| {
            half::bf16::from_f32(((i % 97) as f32 - 48.0) * 1e-3)
                .to_bits()
                .to_le_bytes()
        })
        .collect();
    let x: Vec<f32> = (0..cols * 8)
        .map(|i| ((i % 13) as f32 - 6.0) * 0.1)
        .collect();
    let m = WeightMatrix::new(rows, cols, WeightFormat::Bf16, &bf16, &[], ScaleType::None)
        .expect("bf16");
    let mut out = vec![0f32; rows * 8];
    time("bf16 matvec 2048x7168", bf16.len(), 20, || {
        m.matvec(&x[..cols], &mut out[..rows])
    });
    time("bf16 matmul 2048x7168 x8", bf16.len(), 10, || {
        m.matmul(&x, 8, &mut out)
    });

    let fp8: Vec<u8> = (0..rows * cols).map(|i| (i % 251) as u8 & 0x7e).collect();
    let scales: Vec<u8> = (0..rows.div_ceil(128) * cols.div_ceil(128))
        .flat_map(|_| 0.01f32.to_le_bytes())
        .collect();
    let m = WeightMatrix::new(
        rows,
        cols,
        WeightFormat::Fp8Block {
            block_rows: 128,
            block_cols: 128,
        },
        &fp8,
        &scales,
        ScaleType::F32,
    )
    .expect("fp8");
    time("fp8 matvec 2048x7168", fp8.len(), 20, || {
        m.matvec(&x[..cols], &mut out[..rows])
    });

    let int4: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 31 % 256) as u8).collect();
    let s: Vec<u8> = (0..rows * cols / 32)
        .flat_map(|_| half::bf16::from_f32(0.01).to_bits().to_le_bytes())
        .collect();
    let m = WeightMatrix::new(
        rows,
        cols,
        WeightFormat::Int4 { group: 32 },
        &int4,
        &s,
        ScaleType::Bf16,
    )
    .expect("int4");
    time("int4 matvec 2048x7168", int4.len() + s.len(), 20, || {
        m.matvec(&x[..cols], &mut out[..rows])
    });
}
