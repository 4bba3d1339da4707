//! Driving the kernels: split a matrix's rows into tasks of one pass on the compute pool, prepare the inputs once per
//! call, convert each task's scales once, and pick each row's kernel for the instruction set.

use crate::kernels::pool::pool;
use deltafin_formats::WeightFormat;

#[cfg(target_arch = "aarch64")]
use crate::kernels::aarch64;
use crate::kernels::inputs::Inputs;
use crate::kernels::isa::{Act, Isa};
use crate::kernels::prepare::prepare_inputs;
use crate::kernels::scalar;
use crate::kernels::scales::{group_scale_bytes, row_scales};
#[cfg(target_arch = "x86_64")]
use crate::kernels::shape::l1_input_chunk;
use crate::kernels::shape::{prefetch_l2, KernelShape, BLOCK};
use crate::kernels::tasks::{task_rows, untranspose};
#[cfg(target_arch = "x86_64")]
use crate::kernels::{avx2_q8, x86, x86_amx, x86_avx512, x86_avx512_bf16};
use crate::linear::matrix::WeightMatrix;

/// One row against `n` inputs: `out[t] = dot(W[row], x[t])`.
#[allow(clippy::too_many_arguments)]
fn row_dot(
    isa: Isa,
    kind: WeightFormat,
    row: &[u8],
    scales: &[f32],
    x: &Inputs<'_>,
    cols: usize,
    n: usize,
    out: &mut [f32],
) {
    let simd = isa != Isa::Scalar && kind.simd_shape(cols);
    match x {
        Inputs::F32(x) => {
            if simd {
                #[cfg(target_arch = "x86_64")]
                if isa.has_avx512() && x86_avx512::supports_f32(kind) {
                    // SAFETY: `Isa::Avx512` / `Avx512Bw` are only selected when `available()` saw
                    // AVX-512 F/BW/VL, AVX2, FMA and F16C; the slice lengths are the ones
                    // `x86_avx512::row_f32` documents, checked by `matmul`.
                    unsafe { x86_avx512::row_f32(kind, row, scales, x, cols, n, out) };
                    return;
                }
                #[cfg(target_arch = "x86_64")]
                if isa.has_avx2() {
                    // SAFETY: `Isa::Avx2`/`AvxVnni`/`Avx512` are only selected when
                    // `available()` saw AVX2, FMA and F16C; `simd_shape` holds and the slices
                    // have the lengths `x86::row_f32` documents (row = row_bytes(cols), scales
                    // = cols/group, x = n*cols, out = n), all checked by `matmul`.
                    unsafe { x86::row_f32(kind, row, scales, x, cols, n, out) };
                    return;
                }
                #[cfg(target_arch = "aarch64")]
                if isa == Isa::Neon && aarch64::supports(kind) {
                    // SAFETY: `Isa::Neon` is only selected when NEON was detected; the lengths
                    // are the ones `aarch64::row_f32` documents, checked by `matmul`.
                    unsafe { aarch64::row_f32(kind, row, scales, x, cols, n, out) };
                    return;
                }
            }
            scalar::row_f32(kind, row, scales, x, cols, n, out)
        }
        Inputs::Bf16(x) => {
            #[cfg(target_arch = "x86_64")]
            if simd && kind == WeightFormat::Bf16 && x86_avx512_bf16::available() {
                // SAFETY: AVX-512 F/BW/BF16 were detected; `simd_shape` makes `cols` a
                // multiple of 32, the row is `2 * cols` bytes (BF16), `x` `n * cols` and `out`
                // `n`, checked by `matmul`.
                unsafe { x86_avx512_bf16::rows_bf16::<1>([row], x, cols, n, [out]) };
                return;
            }
            scalar::row_bf16_act(row, x, cols, n, out)
        }
        // `rows_task` hands these to the AMX tiles whenever `KernelConfig::act` could pick
        // them (AMX available) and `prepare` made them (`simd_shape`), so this is not reached;
        // if it were, f32 (not the tiles' arithmetic: decode would then differ from prefill).
        #[cfg(target_arch = "x86_64")]
        Inputs::Bf16Pairs { x, .. } => scalar::row_f32(kind, row, scales, x, cols, n, out),
        // x86 takes 8-bit inputs in the 16-bit layout (`prepare`): these are the portable ones.
        Inputs::I8 { q, d } => scalar::row_i8(kind, row, scales, q, d, cols, n, out),
        Inputs::I16(x) => {
            #[cfg(target_arch = "x86_64")]
            if simd && isa.has_avx512() {
                // SAFETY: as above (VNNI only for `Isa::Avx512`); `x` holds `n*cols` codes per
                // plane and `n*cols/32` scales and sums, checked by `matmul`.
                unsafe {
                    x86_avx512::row_i16(
                        isa == Isa::Avx512,
                        kind,
                        row,
                        x86_avx512::BlockScales::F32(scales),
                        x,
                        cols,
                        n,
                        out,
                    )
                };
                return;
            }
            #[cfg(target_arch = "x86_64")]
            if simd && isa.has_avx2() {
                // SAFETY: `has_avx2` means AVX2, FMA and F16C were detected; the slices are
                // as for the AVX-512 kernel above.
                unsafe {
                    avx2_q8::rows_i16(
                        isa == Isa::AvxVnni,
                        kind,
                        row,
                        row.len(),
                        x86::RowScales::F32(scales),
                        cols / BLOCK,
                        x,
                        0,
                        n,
                        cols,
                        &mut out[..n],
                        n,
                    )
                };
                return;
            }
            scalar::row_i16(kind, row, scales, x, cols, n, out)
        }
    }
}

/// `out[t, r] = dot(W[r], x[t])`: `x` is `[n, cols]`, `out` is `[n, rows]`, on the kernels the
/// matrix was loaded with ([`WeightMatrix::kernels`]).
pub fn matmul(m: &WeightMatrix<'_>, x: &[f32], n: usize, out: &mut [f32]) {
    let k = m.kernels();
    matmul_with(k.isa, m, x, n, out, k.act(m.format()))
}

/// [`matmul`] on a chosen instruction set (falls back to scalar if `isa` is unavailable).
pub fn matmul_with(isa: Isa, m: &WeightMatrix<'_>, x: &[f32], n: usize, out: &mut [f32], act: Act) {
    matmul_many_with(isa, &[m], x, n, &mut [out], act)
}

/// Several matrices of the same format and width against the same inputs, in one parallel
/// pass: the inputs are quantized once and every matrix's row blocks are tasks of the same
/// pass (a SwiGLU's gate and up projections: one quantization and one hand-out to the
/// threads instead of two). `outs[i]` is `[n, mats[i].rows()]`; each output is bit-identical
/// to [`matmul_with`] on that matrix alone. Matrices of different formats or widths run one
/// after another.
pub fn matmul_many_with(
    isa: Isa,
    mats: &[&WeightMatrix<'_>],
    x: &[f32],
    n: usize,
    outs: &mut [&mut [f32]],
    act: Act,
) {
    assert_eq!(mats.len(), outs.len(), "one output per matrix");
    let Some(first) = mats.first() else {
        return;
    };
    let (kind, cols) = (first.format(), first.cols());
    if mats.iter().any(|m| m.format() != kind || m.cols() != cols) {
        for (m, out) in mats.iter().zip(outs.iter_mut()) {
            matmul_many_with(isa, &[m], x, n, &mut [&mut **out], act);
        }
        return;
    }
    assert_eq!(x.len(), n * cols, "matmul input length");
    for (m, out) in mats.iter().zip(outs.iter()) {
        assert_eq!(out.len(), n * m.rows(), "matmul output length");
    }
    if n == 0 {
        return;
    }
    let isa = isa.for_format(kind);
    let mut slot = Vec::new();
    let xin = prepare_inputs(isa, kind, cols, act, x, &mut slot);
    let block = task_rows(kind, cols, n, act);
    let task = |m: &WeightMatrix<'_>, bi: usize, o: &mut [f32]| {
        rows_task(isa, m, kind, &xin, n, block, bi, o)
    };
    // Every matrix's row blocks (`chunk` output values each) as tasks of one parallel pass.
    let run_all = |bufs: &mut [&mut [f32]], chunk: usize| {
        let mut tasks: Vec<(usize, usize, &mut [f32])> = bufs
            .iter_mut()
            .enumerate()
            .flat_map(|(i, buf)| {
                buf.chunks_mut(chunk)
                    .enumerate()
                    .map(move |(bi, o)| (i, bi, o))
            })
            .collect();
        pool().for_each_mut(&mut tasks, |_, (i, bi, o)| task(mats[*i], *bi, o));
    };
    if n == 1 {
        run_all(outs, block);
        return;
    }
    // Transposed scratch [rows, n] per matrix so that each task writes a contiguous range.
    let mut tmps: Vec<Vec<f32>> = mats.iter().map(|m| vec![0f32; m.rows() * n]).collect();
    run_all(
        &mut tmps
            .iter_mut()
            .map(|t| t.as_mut_slice())
            .collect::<Vec<_>>(),
        block * n,
    );
    for ((m, tmp), out) in mats.iter().zip(&tmps).zip(outs.iter_mut()) {
        untranspose(tmp, n, m.rows(), out);
    }
}

/// Rows `bi * block ..` of `m` (as many as `o` holds, `n` outputs each) against prepared
/// inputs: one task of [`matmul_many_with`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn rows_task(
    isa: Isa,
    m: &WeightMatrix<'_>,
    kind: WeightFormat,
    xin: &Inputs<'_>,
    n: usize,
    block: usize,
    bi: usize,
    o: &mut [f32],
) {
    let cols = m.cols();
    let rb = kind.row_len(cols);
    let data = m.data_bytes();
    let r0 = bi * block;
    let nr = o.len() / n;
    #[cfg(target_arch = "x86_64")]
    if let Inputs::Bf16Pairs { pairs, .. } = xin {
        if kind == WeightFormat::Bf16 && kind.simd_shape(cols) && x86_amx::available() {
            // SAFETY: `available()` and `simd_shape` (cols a multiple of 32) were checked; the
            // task's rows are `rb = 2 * cols` bytes each and `pairs` holds the call's `n`
            // inputs of `cols` (checked by `matmul`), `o` `nr * n` outputs.
            unsafe { x86_amx::rows_task(&data[r0 * rb..(r0 + nr) * rb], rb, pairs, cols, o) };
            return;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if let Inputs::Bf16(xf) = xin {
        if kind == WeightFormat::Bf16 && kind.simd_shape(cols) && x86_avx512_bf16::available() {
            let chunk = l1_input_chunk(4 * cols);
            // SAFETY: `available()` and `simd_shape` (cols a multiple of 32) were checked; the
            // task's rows are `rb = 2 * cols` bytes each, `xf` holds `n * cols` values (checked by
            // `matmul`) and `o` `nr * n`.
            unsafe {
                x86_avx512_bf16::rows_task(
                    &data[r0 * rb..(r0 + nr) * rb],
                    rb,
                    xf,
                    cols,
                    n,
                    chunk,
                    o,
                )
            };
            return;
        }
    }
    let group = kind.group(cols);
    let expand = !matches!(xin, Inputs::F32(_)) && group != BLOCK;
    // Scales of the task's rows `a..b` as f32 into `buf`; the integer kernels take one
    // scale per 32-block.
    let scales_of = |a: usize, b: usize, buf: &mut Vec<f32>| {
        row_scales(isa, m, r0 + a, r0 + b, buf);
        if expand {
            *buf = buf
                .chunks(cols.div_ceil(group))
                .flat_map(|g| (0..cols / BLOCK).map(move |b| g[b * BLOCK / group]))
                .collect();
        }
    };
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut first = 0;
    // Matrix-vector products with a long `x` (over half of a 32 KiB L1 data cache): four
    // rows at a time share each load of `x` instead of re-reading it from L2 per row.
    // With a short `x` the single-row tile (four accumulators) measured faster
    // (benches/results/kernels_idle_rows4_all_shapes.json vs kernels_idle.json), except
    // for FP8 on AVX-512, whose decode leaves fewer spare loads (22.3 vs 19.9 GiB/s at
    // 7168x2048). The AVX-512 tiles prefetch the next tile's rows in software.
    #[cfg(target_arch = "x86_64")]
    if n == 1 && isa.has_avx512() && kind.simd_shape(cols) && group == BLOCK {
        if let Inputs::I16(xq) = xin {
            // Eight rows at a time, then four, share each input load. The tiles read the
            // matrix's scale bytes themselves: a separate conversion pass per task stalled
            // on DRAM (6-14% of the INT4 / MXFP4 / Q8 matvec time, prefetching or not).
            let st = m.scale_type();
            let sb = group_scale_bytes(m, r0, r0 + nr);
            let per_row = sb.len() / nr;
            macro_rules! tile {
                ($r:literal) => {
                    while first + $r <= nr {
                        let r = r0 + first;
                        let rows: [&[u8]; $r] =
                            std::array::from_fn(|k| &data[(r + k) * rb..(r + k + 1) * rb]);
                        let sc: [x86_avx512::BlockScales<'_>; $r] = std::array::from_fn(|k| {
                            let i = first + k;
                            x86_avx512::BlockScales::Raw(&sb[i * per_row..(i + 1) * per_row], st)
                        });
                        // SAFETY: `Isa::Avx512` / `Avx512Bw` imply AVX-512 F/BW/VL (VNNI: `Avx512` only), AVX2 and FMA
                        // were detected; `simd_shape` holds; each row is `row_bytes(cols)`
                        // long, each scale slice holds the row's `cols / 32` block scales
                        // (group 32) in the matrix's type, `xq` one input of `cols`,
                        // `o[first..first + R]` the outputs.
                        unsafe {
                            x86_avx512::rows_i16::<$r>(
                                isa == Isa::Avx512,
                                kind,
                                rows,
                                sc,
                                xq,
                                cols,
                                &mut o[first..first + $r],
                            )
                        };
                        first += $r;
                    }
                };
            }
            tile!(8);
            tile!(4);
        }
    }
    // Products of 16-bit inputs on AVX-512 with one scale per 32-block: the pair tile reads
    // the matrix's own scale bytes too (the conversion pass was 4% of an INT4 prefill).
    #[cfg(target_arch = "x86_64")]
    let raw_pairs = n > 1
        && isa.has_avx512()
        && kind.simd_shape(cols)
        && group == BLOCK
        && kind.integer()
        && matches!(xin, Inputs::I16(_));
    #[cfg(not(target_arch = "x86_64"))]
    let raw_pairs = false;
    // AVX2 without AVX-512, a matrix-vector product on 16-bit inputs, one scale per
    // 32-block: `avx2_rows` takes every row of the task and its kernels read the matrix's own
    // scale bytes (alternated A/Bs on the 3.1B synth: INT4 decode 2-5% faster; Q8 decode 2-6%
    // once the rows were prefetched). With several inputs the row's scales would be converted
    // once per run of 4 inputs: Q8 prefills measured 3-4% slower than one pass per task.
    #[cfg(target_arch = "x86_64")]
    let raw_avx2 = n == 1
        && isa.has_avx2()
        && !isa.has_avx512()
        && kind.simd_shape(cols)
        && group == BLOCK
        && kind.integer()
        && cols / BLOCK <= x86::RAW_SCALE_BLOCKS
        && matches!(xin, Inputs::I16(_));
    #[cfg(not(target_arch = "x86_64"))]
    let raw_avx2 = false;
    // The other rows' scales as f32: `scales[(i - s0) * per_row..]` for task row `i`.
    let s0 = first;
    let mut scales = Vec::new();
    if raw_avx2 {
        prefetch_l2(group_scale_bytes(m, r0 + nr, r0 + 2 * nr));
    } else if !raw_pairs {
        scales_of(s0, nr, &mut scales);
        if s0 == 0 {
            // One conversion pass for the task: ask for the next task's scales now, or that
            // pass stalls on DRAM, too short for the hardware prefetcher to ramp up.
            prefetch_l2(group_scale_bytes(m, r0 + nr, r0 + 2 * nr));
        }
    }
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut per_row = scales.len() / (nr - s0).max(1);
    if raw_avx2 {
        per_row = cols / BLOCK;
    }
    #[cfg(target_arch = "x86_64")]
    if n == 1
        && (cols * 4 > 16 << 10
            || (isa.has_avx512() && matches!(kind, WeightFormat::Fp8Block { .. })))
        && isa.has_avx2()
        && kind.simd_shape(cols)
        // Without AVX-512 the unscaled formats take the dense tiles (`avx2_dense`).
        && (isa.has_avx512() || !crate::kernels::avx2_dense::supports(kind))
    {
        if let Inputs::F32(xf) = xin {
            while first + 4 <= nr {
                let r = r0 + first;
                let row = |k: usize| &data[(r + k) * rb..(r + k + 1) * rb];
                let sc = |k: usize| {
                    let i = first + k - s0;
                    &scales[i * per_row..(i + 1) * per_row]
                };
                let rows4 = [row(0), row(1), row(2), row(3)];
                let sc4 = [sc(0), sc(1), sc(2), sc(3)];
                let o4 = &mut o[first..first + 4];
                if isa.has_avx512() && x86_avx512::supports_f32(kind) {
                    // SAFETY: `Isa::Avx512` / `Avx512Bw` imply AVX-512 F/BW/VL (VNNI: `Avx512` only), AVX2, FMA and
                    // F16C were detected; the slices are as for `x86::rows4_f32` below.
                    unsafe { x86_avx512::rows4_f32(kind, rows4, sc4, xf, cols, o4) };
                } else {
                    // SAFETY: `has_avx2` means AVX2, FMA and F16C were detected;
                    // `simd_shape` holds; each row is `row_bytes(cols)` long, each scale
                    // slice covers the row's groups, `x` is `cols` long (n == 1, checked
                    // by `matmul`) and `o4` holds the four outputs.
                    unsafe { x86::rows4_f32(kind, rows4, sc4, xf, cols, o4) };
                }
                first += 4;
            }
        }
    }
    // Matrix products on AVX-512 (f32 path and 16-bit activations): two rows at a time share
    // each input load, over the inputs in chunks that stay in L1 (at 32 inputs of 1024 f32 the
    // 128 KiB of inputs streamed from L2 for every pair of rows: 68 GMAC/s against 94 at 8
    // inputs, BF16 2048x1024); the task's rows are read once per chunk, from L2.
    #[cfg(target_arch = "x86_64")]
    if n > 1 && isa.has_avx512() && kind.simd_shape(cols) {
        let f32_path = x86_avx512::supports_f32(kind) && matches!(xin, Inputs::F32(_));
        let i16_path = kind.integer() && matches!(xin, Inputs::I16(_));
        if f32_path || i16_path {
            let per_input = match xin {
                Inputs::F32(_) => 4 * cols,
                _ => 2 * cols + 8 * (cols / BLOCK),
            };
            let chunk = l1_input_chunk(per_input);
            let pairs_end = first + (nr - first) / 2 * 2;
            let (st, sb) = if raw_pairs {
                (m.scale_type(), group_scale_bytes(m, r0, r0 + nr))
            } else {
                (m.scale_type(), &[][..])
            };
            let raw_per_row = sb.len() / nr.max(1);
            let raw = |i: usize| {
                x86_avx512::BlockScales::Raw(&sb[i * raw_per_row..(i + 1) * raw_per_row], st)
            };
            for t0 in (0..n).step_by(chunk) {
                let nn = chunk.min(n - t0);
                let mut p = first;
                while p < pairs_end {
                    let r = r0 + p;
                    let (i0, i1) = (p - s0, p + 1 - s0);
                    let rows2 = [
                        &data[r * rb..(r + 1) * rb],
                        &data[(r + 1) * rb..(r + 2) * rb],
                    ];
                    let sc2 = || {
                        [
                            &scales[i0 * per_row..(i0 + 1) * per_row],
                            &scales[i1 * per_row..(i1 + 1) * per_row],
                        ]
                    };
                    let (a, b) = o[p * n..(p + 2) * n].split_at_mut(n);
                    let (a, b) = (&mut a[t0..t0 + nn], &mut b[t0..t0 + nn]);
                    match xin {
                        // SAFETY: `Isa::Avx512` / `Avx512Bw` imply AVX-512 F/BW/VL (VNNI: `Avx512` only), AVX2, FMA and
                        // F16C were detected; `supports_f32` and `simd_shape` hold; each row is
                        // `row_bytes(cols)` long with its scales, the slice of `xf` holds `nn *
                        // cols` (`xf` holds `n * cols`, checked by `matmul`) and `a`, `b` `nn`
                        // outputs each.
                        Inputs::F32(xf) => unsafe {
                            x86_avx512::rows2_f32(
                                kind,
                                rows2,
                                sc2(),
                                &xf[t0 * cols..(t0 + nn) * cols],
                                cols,
                                nn,
                                [a, b],
                            )
                        },
                        // SAFETY: as above, for an integer format; each row's scales are its
                        // `cols / 32` block scales, raw in the matrix's type (group 32) or as
                        // f32 (expanded above), `xq` holds `n >= t0 + nn` inputs.
                        Inputs::I16(xq) => unsafe {
                            let sc = if raw_pairs {
                                [raw(p), raw(p + 1)]
                            } else {
                                let [s0, s1] = sc2();
                                [
                                    x86_avx512::BlockScales::F32(s0),
                                    x86_avx512::BlockScales::F32(s1),
                                ]
                            };
                            x86_avx512::rows2_i16(
                                isa == Isa::Avx512,
                                kind,
                                rows2,
                                sc,
                                xq,
                                cols,
                                t0,
                                nn,
                                [a, b],
                            )
                        },
                        Inputs::I8 { .. } | Inputs::Bf16(_) | Inputs::Bf16Pairs { .. } => {
                            unreachable!("f32_path or i16_path")
                        }
                    }
                    p += 2;
                }
            }
            first = pairs_end;
            if raw_pairs && first < nr {
                // An odd last row runs the single-row kernel on f32 scales.
                scales_of(s0, nr, &mut scales);
                per_row = scales.len() / (nr - s0).max(1);
            }
        }
    }
    // AVX2 without AVX-512: one call per task and L1-sized chunk of inputs (`avx2_rows`;
    // F32 / BF16 / F16 against f32 inputs in the register tiles of `avx2_dense`).
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() && !isa.has_avx512() && kind.simd_shape(cols) && first < nr {
        let task = crate::kernels::avx2_rows::TaskRows {
            data,
            rb,
            r0,
            s0,
            nr,
            scales: &scales,
            per_row,
            raw: raw_avx2.then(|| (group_scale_bytes(m, r0, r0 + nr), m.scale_type())),
        };
        first = crate::kernels::avx2_rows::rows(isa, kind, &task, first, xin, n, cols, o);
    }
    for (i, orow) in o.chunks_mut(n).enumerate().skip(first) {
        let r = r0 + i;
        row_dot(
            isa,
            kind,
            &data[r * rb..(r + 1) * rb],
            &scales[(i - s0) * per_row..(i - s0 + 1) * per_row],
            xin,
            cols,
            n,
            orow,
        );
    }
}

/// The products of a weight matrix, on the kernels it carries.
impl WeightMatrix<'_> {
    /// `out[r] = dot(W[r], x)`; `x` is `[cols]`, `out` is `[rows]`.
    pub fn matvec(&self, x: &[f32], out: &mut [f32]) {
        self.matmul(x, 1, out)
    }

    /// `out[t, r] = dot(W[r], x[t])` for `n` inputs: `x` is `[n, cols]`, `out` is `[n, rows]`.
    /// Each weight row is decoded once per tile of inputs, in registers, by the kernels this
    /// matrix carries ([`WeightMatrix::kernels`]) with the activation precision they pick for
    /// the format.
    pub fn matmul(&self, x: &[f32], n: usize, out: &mut [f32]) {
        matmul(self, x, n, out)
    }
}

/// [`WeightMatrix::matmul`] of several matrices against the same inputs in one parallel pass
/// (inputs quantized once): `outs[i] = x @ mats[i]^T`, each as the single call gives it.
/// Matrices of different formats run one after another, each with its own activation
/// precision; the first matrix's kernels run them all.
pub fn matmul_many(mats: &[&WeightMatrix<'_>], x: &[f32], n: usize, outs: &mut [&mut [f32]]) {
    let Some(first) = mats.first() else {
        return;
    };
    let format = first.format();
    if mats.iter().any(|m| m.format() != format) {
        for (m, out) in mats.iter().zip(outs.iter_mut()) {
            m.matmul(x, n, out);
        }
        return;
    }
    let k = first.kernels();
    matmul_many_with(k.isa, mats, x, n, outs, k.act(format))
}
