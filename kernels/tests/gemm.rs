//! `linear` and `matmul_f32` against a naive f64 triple loop.

mod common;

use ferry_kernels::cpu::gemm::{linear, matmul_f32, MatmulDims, Matrix};
use ferry_kernels::KernelError;

/// Checks `out` against `x · Wᵀ` computed in f64.
///
/// Tolerance: `1e-5 · ‖x_t‖ · ‖w_j‖` per element. f32 accumulation in a different order than
/// the f64 reference errs by about `sqrt(k) · 2^-24 · Σ|x·w|`, which for these sizes
/// (k ≤ 4096) is well under 1e-5 of the norm product (Cauchy–Schwarz bounds `Σ|x·w|` by it).
fn check_linear(x: &[f32], w: &[f32], n: usize, k: usize, out: &[f32]) {
    let m = x.len() / k;
    for t in 0..m {
        let xt = &x[t * k..(t + 1) * k];
        let xn = xt.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
        for j in 0..n {
            let wj = &w[j * k..(j + 1) * k];
            let want: f64 = xt
                .iter()
                .zip(wj)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum();
            let wn = wj.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
            let got = f64::from(out[t * n + j]);
            assert!(
                (got - want).abs() <= 1e-5 * xn * wn + 1e-30,
                "m={m} n={n} k={k} t={t} j={j}: got {got}, want {want}"
            );
        }
    }
}

#[test]
fn linear_matches_naive_for_f32_and_bf16_weights() {
    let mut rng = common::rng(1);
    // (n, k): odd sizes hit the vector tails; (5, 300) has fewer rows than a minimum bf16
    // panel; (600, 4096) spans several bf16 panels.
    for (n, k) in [(67, 45), (5, 300), (300, 129), (600, 4096)] {
        let w32 = common::uniform(&mut rng, n * k, 0.5);
        let w16 = common::uniform_bf16(&mut rng, n * k, 0.5);
        let w16_as_f32: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
        let mats = [
            (
                Matrix::from_f32(n, k, w32.clone()).expect("len matches"),
                w32,
            ),
            (
                Matrix::from_bf16(n, k, w16).expect("len matches"),
                w16_as_f32,
            ),
        ];
        for m in [1, 3, 4, 5, 16, 17, 37, 130] {
            let x = common::uniform(&mut rng, m * k, 1.0);
            for (mat, dense) in &mats {
                let mut out = vec![f32::NAN; m * n];
                linear(&x, mat, &mut out).expect("shapes match");
                check_linear(&x, dense, n, k, &out);
            }
        }
    }
}

/// On the decode path (up to 4 tokens) bf16 weights give bitwise what their exact f32 widening
/// gives: the row is widened as it is read, the products summed in the f32 row's order. Sizes
/// below and above the product size from which the rows are split across threads.
#[test]
fn bf16_gemv_is_bitwise_its_f32_widening() {
    let mut rng = common::rng(2);
    for (n, k) in [(67, 45), (256, 256), (600, 4096)] {
        let w16 = common::uniform_bf16(&mut rng, n * k, 0.5);
        let wide: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
        let bf = Matrix::from_bf16(n, k, w16).expect("len matches");
        let f = Matrix::from_f32(n, k, wide).expect("len matches");
        for m in 1..=4 {
            let x = common::uniform(&mut rng, m * k, 1.0);
            let (mut a, mut b) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
            linear(&x, &bf, &mut a).expect("shapes match");
            linear(&x, &f, &mut b).expect("shapes match");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "n={n} k={k} m={m}");
        }
    }
}

#[test]
fn linear_rejects_bad_shapes() {
    let w = Matrix::from_f32(3, 4, vec![0.0; 12]).expect("len matches");
    let mut out = vec![0.0; 6];
    assert!(matches!(
        linear(&[0.0; 7], &w, &mut out),
        Err(KernelError::NotDivisible { op: "linear", .. })
    ));
    assert!(matches!(
        linear(&[0.0; 8], &w, &mut out[..5]),
        Err(KernelError::ShapeMismatch {
            op: "linear",
            what: "out",
            expected: 6,
            got: 5
        })
    ));
    assert!(Matrix::from_f32(3, 4, vec![0.0; 11]).is_err());
}

#[test]
fn matmul_f32_both_layouts() {
    let mut rng = common::rng(2);
    let (m, k, n) = (19, 33, 27);
    let a = common::uniform(&mut rng, m * k, 1.0);
    let b_nk = common::uniform(&mut rng, n * k, 1.0); // [n][k]
    let mut b_kn = vec![0.0f32; k * n]; // the same matrix stored [k][n]
    for j in 0..n {
        for kk in 0..k {
            b_kn[kk * n + j] = b_nk[j * k + kk];
        }
    }
    let mut out_t = vec![0.0; m * n];
    let mut out_n = vec![0.0; m * n];
    matmul_f32(
        &a,
        &b_nk,
        MatmulDims {
            m,
            k,
            n,
            b_transposed: true,
        },
        &mut out_t,
    )
    .expect("shapes match");
    matmul_f32(
        &a,
        &b_kn,
        MatmulDims {
            m,
            k,
            n,
            b_transposed: false,
        },
        &mut out_n,
    )
    .expect("shapes match");
    check_linear(&a, &b_nk, n, k, &out_t);
    check_linear(&a, &b_nk, n, k, &out_n);
}

#[test]
fn matrix_accessors() {
    let data: Vec<f32> = (0..12).map(|v| v as f32).collect();
    let w = Matrix::from_f32(4, 3, data.clone()).expect("len matches");
    let mut row = [0.0f32; 3];
    w.row_f32(2, &mut row).expect("row in range");
    assert_eq!(row, [6.0, 7.0, 8.0]);
    assert!(matches!(
        w.row_f32(4, &mut row),
        Err(KernelError::IndexOutOfRange {
            index: 4,
            len: 4,
            ..
        })
    ));
    let s = w.slice_rows(1, 2).expect("rows in range");
    assert_eq!((s.rows(), s.cols()), (2, 3));
    assert_eq!(s.to_f32_vec(), data[3..9].to_vec());
    assert!(w.slice_rows(3, 2).is_err());
    let b = Matrix::from_bf16(
        1,
        2,
        vec![half::bf16::from_f32(1.5), half::bf16::from_f32(-2.0)],
    )
    .expect("len matches");
    assert_eq!(b.to_f32_vec(), vec![1.5, -2.0]);
}
