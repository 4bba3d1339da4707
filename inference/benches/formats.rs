//! Weight-format kernels against the machine's memory bandwidth, in one criterion run:
//! `cargo bench -p deltafin-inference --bench formats` (filter e.g. `-- mxfp4`).
//!
//! - `membw/read`: a streaming read (8 u64 accumulators, software prefetch 4 KiB ahead) of a
//!   1 GiB buffer, single-threaded and with all threads (rayon, one chunk per thread): the
//!   memory-read bandwidth to compare with. `--bench membw_ratio` measures the same ratios
//!   in interleaved pairs, which the host's drifting bandwidth disturbs less.
//! - `matvec/<format>/<rows>x<cols>/<act>/<threads>`: one matvec per iteration over a ring of
//!   matrices (experts) totalling >= 384 MiB of weights, so every iteration streams its weights
//!   from DRAM, not from the 32 MiB L3. Throughput = weight + scale bytes consumed per second.
//! - `matmul8/...`: the same with 8 inputs per pass (prefill / speculative verification).
//! - `<act>`: `F32`, `I8` or `I16` activations (`KernelConfig::act` says which the model runs:
//!   `I16` for INT4/MXFP4/Q8 on AVX-512 VNNI machines, `F32` otherwise).
//!   `DELTAFIN_KERNELS=avx2` benches the AVX2 kernels on an AVX-512 machine.
//!
//! `DELTAFIN_BENCH_FORMATS=int4,mxfp4` benches only those formats; `DELTAFIN_BENCH_QUICK=1` shrinks the rings and sample counts (smoke run).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

mod common;
use common::{
    bench_formats, bench_shapes, kernel_threads, make, pool, pseudo, quick, read_pass, ring,
    ring_matrices, threads_all,
};
use deltafin_inference::kernels::{self, Act, Isa};

fn membw(c: &mut Criterion) {
    let bytes: usize = if quick() { 256 << 20 } else { 1 << 30 };
    let buf: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();
    let mut g = c.benchmark_group("membw");
    g.throughput(Throughput::Bytes(bytes as u64));
    g.sample_size(10);
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(if quick() { 2 } else { 5 }));
    for threads in [1, threads_all()] {
        let p = pool(threads);
        g.bench_function(BenchmarkId::new("read", format!("{threads}t")), |b| {
            b.iter(|| read_pass(&p, &buf, threads))
        });
    }
    g.finish();
}

fn formats(c: &mut Criterion) {
    // DELTAFIN_BENCH_SHAPES=256x7168,... overrides the expert shapes.
    // DELTAFIN_BENCH_SHAPES=256x7168,... overrides the expert shapes.
    let shapes = bench_shapes();
    // DELTAFIN_BENCH_RING_KIB=512 keeps the weights in cache: the kernels' compute ceiling.
    let ring_bytes: usize = match std::env::var("DELTAFIN_BENCH_RING_KIB") {
        Ok(k) => k.parse::<usize>().expect("DELTAFIN_BENCH_RING_KIB: KiB") << 10,
        Err(_) if quick() => 64 << 20,
        Err(_) => 384 << 20,
    };
    let isa = Isa::detect();
    eprintln!("kernels: {isa:?}, {} threads", kernel_threads());
    for &(rows, cols) in &shapes {
        // DELTAFIN_BENCH_FORMATS=int4,mxfp4 skips building the other rings.
        for name in bench_formats() {
            let one = make(name, rows, cols);
            let bytes = one.data.len() + one.scale.len();
            let ring = ring(&one, ring_bytes);
            let mats = ring_matrices(&one, &ring, rows, cols);
            let x: Vec<f32> = (0..cols * 8).map(|i| pseudo(i + 7) * 20.0).collect();
            let mut out = vec![0f32; rows * 8];
            let acts: &[Act] = if matches!(name, "q8" | "int4" | "mxfp4") {
                &[Act::F32, Act::I8, Act::I16]
            } else {
                &[Act::F32]
            };
            for (n, label) in [(1usize, "matvec"), (8, "matmul8")] {
                let mut g = c.benchmark_group(format!("{label}/{}", one.name));
                g.throughput(Throughput::Bytes(bytes as u64));
                g.sample_size(if quick() { 10 } else { 20 });
                g.warm_up_time(Duration::from_millis(500));
                g.measurement_time(Duration::from_secs(if quick() { 1 } else { 3 }));
                for &act in acts {
                    if n > 1 && act == Act::I8 && name != "mxfp4" {
                        continue;
                    }
                    // One thread count per process (`kernel_threads`).
                    {
                        let threads = kernel_threads();
                        let p = pool(threads);
                        let id = BenchmarkId::new(
                            format!("{rows}x{cols}/{act:?}"),
                            format!("{threads}t"),
                        );
                        let mut k = 0usize;
                        // The timing loop runs on a pool thread, as the model's generation
                        // does: each call then costs no hand-off to the pool.
                        g.bench_function(id, |b| {
                            p.install(|| {
                                b.iter(|| {
                                    let m = &mats[k % mats.len()];
                                    k += 1;
                                    kernels::matmul_with(
                                        isa,
                                        m,
                                        &x[..n * cols],
                                        n,
                                        &mut out[..n * rows],
                                        act,
                                    );
                                    black_box(out[0])
                                })
                            })
                        });
                    }
                }
                g.finish();
            }
        }
    }
}

criterion_group!(benches, membw, formats);
criterion_main!(benches);
