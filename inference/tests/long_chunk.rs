//! A long prefill chunk through a matrix equals its inputs one at a time, bit for bit: chunked
//! prefill, batched verification and token-by-token decoding give the same numbers.

mod common;

use common::lcg_values as values;
use deltafin_inference::kernels::KernelConfig;
use deltafin_inference::linear::WeightMatrix;
use deltafin_inference::run::calibrate::packed_matrix;

#[test]
fn a_long_chunk_equals_its_inputs_one_at_a_time() {
    // 517 inputs of a 600-row matrix: 310k outputs, inputs in L1-sized chunks with a tail.
    let (rows, cols, n) = (600, 64, 517);
    for fmt in ["bf16", "int4", "q8"] {
        let (format, data, scale, st) = packed_matrix(fmt, &values(rows * cols, 11), rows, cols);
        let m = WeightMatrix::new(rows, cols, format, &data, &scale, st)
            .expect("matrix")
            .with_kernels(KernelConfig::default());
        let x = values(n * cols, 12);
        let mut all = vec![0f32; n * rows];
        m.matmul(&x, n, &mut all);
        for t in [0, 1, 63, 64, 65, 300, n - 1] {
            let mut one = vec![0f32; rows];
            m.matmul(&x[t * cols..(t + 1) * cols], 1, &mut one);
            assert_eq!(one, all[t * rows..(t + 1) * rows], "{fmt} input {t}");
        }
    }
}
