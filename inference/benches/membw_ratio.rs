//! Each weight format's matvec as a fraction of memory bandwidth, measured in interleaved
//! pairs: `cargo bench -p deltafin-inference --bench membw_ratio`.
//!
//! On a shared host the memory bandwidth itself drifts between runs (this VM: 28-31 GiB/s on
//! one thread, 36-62 GiB/s on two), so a bandwidth measured once at the start of a run says
//! little about a kernel timed minutes later. Here every repeat times one streaming read of a
//! 512 MiB buffer, one pass of the kernel over a ring of >= 384 MiB of matrices (each matvec
//! streams its weights from DRAM), and the streaming read again; the repeat's ratio is the
//! kernel's GiB/s over the mean of the two reads. The report gives the median ratio over the
//! repeats, with the lowest and highest, per format, shape and thread count, on the
//! activations the model uses for that format (`KernelConfig::act`).
//!
//! One thread count per process: all of the machine's, or `RAYON_NUM_THREADS` (the kernels'
//! pool is sized once per process).
//!
//! Output: one JSON object on stdout. `DELTAFIN_BENCH_REPEATS` (default 9),
//! `DELTAFIN_BENCH_FORMATS=int4,mxfp4`, `DELTAFIN_BENCH_SHAPES=2048x7168,...`,
//! `DELTAFIN_BENCH_QUICK=1` (smaller buffers, 3 repeats).

use std::time::Instant;

mod common;
use common::{
    bench_formats, bench_shapes, kernel_threads, make, membw_pass, pool, pseudo, quick, ring,
    ring_matrices,
};
use deltafin_inference::kernels::{self, Isa, KernelConfig};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() {
    let repeats: usize = std::env::var("DELTAFIN_BENCH_REPEATS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick() { 3 } else { 9 });
    let ring_bytes: usize = if quick() { 96 << 20 } else { 384 << 20 };
    let read_bytes: usize = if quick() { 128 << 20 } else { 512 << 20 };
    let isa = Isa::detect();
    let buf: Vec<u64> = (0..read_bytes / 8).map(|i| i as u64).collect();
    // One thread count per process (`kernel_threads`): session 19 found the 2-thread rows of
    // a "1 and 2 threads" run equal to its 1-thread ones.
    let threads = kernel_threads();
    let thread_counts = [threads];
    let pool_threads = pool(threads).install(|| kernels::pool::pool().threads());
    assert_eq!(
        pool_threads, threads,
        "the kernels' pool has {pool_threads} threads"
    );
    let pools: Vec<_> = thread_counts.iter().map(|&t| (t, pool(t))).collect();
    let mut rows = Vec::new();
    for (r, c) in bench_shapes() {
        for name in bench_formats() {
            let one = make(name, r, c);
            let name = one.name;
            let bytes = one.data.len() + one.scale.len();
            let ring = ring(&one, ring_bytes);
            let copies = ring.len();
            let mats = ring_matrices(&one, &ring, r, c);
            let act = KernelConfig::best().act(one.format);
            let x: Vec<f32> = (0..c).map(|i| pseudo(i + 7) * 20.0).collect();
            let mut out = vec![0f32; r];
            for (threads, p) in &pools {
                // One untimed pass: page faults and first touches out of the way.
                p.install(|| {
                    for m in &mats {
                        kernels::matmul_with(isa, m, &x, 1, &mut out, act);
                    }
                });
                let (mut ratios, mut kern, mut bw) = (Vec::new(), Vec::new(), Vec::new());
                for _ in 0..repeats {
                    let before = membw_pass(p, &buf, *threads);
                    // The timing loop runs on a pool thread, as the model's generation does.
                    let secs = p.install(|| {
                        let t = Instant::now();
                        for m in &mats {
                            kernels::matmul_with(isa, m, &x, 1, &mut out, act);
                        }
                        t.elapsed().as_secs_f64()
                    });
                    let after = membw_pass(p, &buf, *threads);
                    let k = (bytes * copies) as f64 / secs / (1u64 << 30) as f64;
                    let m = (before + after) / 2.0;
                    ratios.push(k / m);
                    kern.push(k);
                    bw.push(m);
                }
                let (lo, hi) = ratios
                    .iter()
                    .fold((f64::MAX, f64::MIN), |(a, b), &v| (a.min(v), b.max(v)));
                let row = format!(
                    "{{\"format\": \"{name}\", \"shape\": \"{r}x{c}\", \"act\": \"{act:?}\", \
                     \"threads\": {threads}, \"fraction_of_membw_median\": {:.3}, \
                     \"fraction_min\": {lo:.3}, \"fraction_max\": {hi:.3}, \
                     \"kernel_gib_s_median\": {:.2}, \"membw_gib_s_median\": {:.2}, \
                     \"repeats\": {repeats}}}",
                    median(&mut ratios),
                    median(&mut kern),
                    median(&mut bw),
                );
                eprintln!("{row}");
                rows.push(row);
            }
        }
    }
    println!(
        "{{\"isa\": \"{isa:?}\", \"ring_mib\": {}, \"read_mib\": {}, \"rows\": [\n  {}\n]}}",
        ring_bytes >> 20,
        read_bytes >> 20,
        rows.join(",\n  ")
    );
}
