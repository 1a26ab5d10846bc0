//! RoPE and YaRN tables against the formulas, and the two pair layouts against each other.

mod common;

use ferry_kernels::cpu::rope::{
    softmax_scale_multiplier, Rope, RopeParams, RopeScaling, RotaryLayout, YarnParams,
};

fn deepseek_v3_yarn() -> YarnParams {
    YarnParams {
        factor: 40.0,
        original_max_position_embeddings: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: Some(1.0),
        mscale_all_dim: Some(1.0),
        attention_factor: None,
        truncate: true,
    }
}

fn params(scaling: RopeScaling, interleaved: bool) -> RopeParams {
    RopeParams {
        dim: 64,
        theta: 10000.0,
        scaling,
        interleaved,
    }
}

/// Relative closeness; 1e-6 leaves room for the f32 rounding of the table (2^-24 ≈ 6e-8 per
/// operation, a handful of operations) and nothing more.
fn close(got: f32, want: f64, rel: f64) -> bool {
    (f64::from(got) - want).abs() <= rel * want.abs()
}

#[test]
fn plain_inv_freq_matches_formula() {
    let rope = Rope::new(&params(RopeScaling::None, false)).expect("valid params");
    assert_eq!(rope.inv_freq().len(), 32);
    assert_eq!(rope.attention_factor(), 1.0);
    for (i, &f) in rope.inv_freq().iter().enumerate() {
        let want = 1.0 / 10000f64.powf(2.0 * i as f64 / 64.0);
        assert!(close(f, want, 1e-6), "i={i}: {f} vs {want}");
    }
}

#[test]
fn yarn_inv_freq_matches_formula_for_deepseek_v3() {
    let rope =
        Rope::new(&params(RopeScaling::Yarn(deepseek_v3_yarn()), true)).expect("valid params");
    // The formula in f64, written out independently of the implementation.
    let (dim, theta, factor, orig) = (64.0f64, 10000.0f64, 40.0f64, 4096.0f64);
    let corr =
        |rot: f64| dim * (orig / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
    let low = corr(32.0).floor().max(0.0);
    let high = corr(1.0).ceil().min(dim - 1.0);
    assert_eq!((low, high), (10.0, 23.0), "DeepSeek-V3's correction range");
    for (i, &f) in rope.inv_freq().iter().enumerate() {
        let base = 1.0 / theta.powf(2.0 * i as f64 / dim);
        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
        let extrap = 1.0 - ramp;
        let want = base / factor * (1.0 - extrap) + base * extrap;
        assert!(close(f, want, 1e-6), "i={i}: {f} vs {want}");
    }
    // Below the band: pure extrapolation (unscaled); above: pure interpolation (÷ factor).
    assert!(close(
        rope.inv_freq()[3],
        1.0 / theta.powf(6.0 / 64.0),
        1e-6
    ));
    assert!(close(
        rope.inv_freq()[30],
        1.0 / theta.powf(60.0 / 64.0) / 40.0,
        1e-6
    ));
}

#[test]
fn yarn_factors() {
    let p = params(RopeScaling::Yarn(deepseek_v3_yarn()), true);
    // mscale == mscale_all_dim: the cos/sin factor cancels to exactly 1.
    assert_eq!(Rope::new(&p).expect("valid").attention_factor(), 1.0);
    let want = (0.1 * 40f64.ln() + 1.0).powi(2);
    assert!((softmax_scale_multiplier(&p) - want).abs() < 1e-12);
    assert!((softmax_scale_multiplier(&p) - 1.8739).abs() < 1e-3);
    assert_eq!(
        softmax_scale_multiplier(&params(RopeScaling::None, true)),
        1.0
    );

    // Without mscale_all_dim: factor = get_mscale(factor, 1), softmax multiplier 1.
    let mut y = deepseek_v3_yarn();
    y.mscale_all_dim = None;
    let p = params(RopeScaling::Yarn(y.clone()), true);
    assert!(close(
        Rope::new(&p).expect("valid").attention_factor(),
        0.1 * 40f64.ln() + 1.0,
        1e-7
    ));
    assert_eq!(softmax_scale_multiplier(&p), 1.0);

    // An explicit attention factor wins.
    y.attention_factor = Some(0.5);
    assert_eq!(
        Rope::new(&params(RopeScaling::Yarn(y), true))
            .expect("valid")
            .attention_factor(),
        0.5
    );
}

#[test]
fn rotation_matches_hand_computed_values() {
    let rope = Rope::new(&RopeParams {
        dim: 4,
        theta: 100.0,
        scaling: RopeScaling::None,
        interleaved: false,
    })
    .expect("valid params");
    // inv_freq = [1, 1/10]; position 3 → angles [3, 0.3].
    let x = [1.0f32, 2.0, 3.0, 4.0];
    let mut y = x;
    rope.apply(
        &mut y,
        &[3],
        RotaryLayout {
            heads: 1,
            head_stride: 4,
            offset: 0,
        },
    )
    .expect("shapes match");
    let (a0, a1) = (3.0f64, 0.3f64);
    let want = [
        1.0 * a0.cos() - 3.0 * a0.sin(),
        2.0 * a1.cos() - 4.0 * a1.sin(),
        3.0 * a0.cos() + 1.0 * a0.sin(),
        4.0 * a1.cos() + 2.0 * a1.sin(),
    ];
    for (g, w) in y.iter().zip(want) {
        // f32 table and products: absolute error of a few ulp of values ~5.
        assert!((f64::from(*g) - w).abs() < 2e-6, "{g} vs {w}");
    }
}

#[test]
fn interleaved_equals_rotate_half_of_deinterleaved() {
    let mut rng = common::rng(3);
    let (tokens, heads, stride, offset, dim) = (5, 3, 192, 128, 64);
    let positions = [0usize, 1, 7, 4095, 163_839];
    let layout = RotaryLayout {
        heads,
        head_stride: stride,
        offset,
    };
    let scaling = RopeScaling::Yarn(deepseek_v3_yarn());
    let inter = Rope::new(&params(scaling.clone(), true)).expect("valid");
    let plain = Rope::new(&params(scaling, false)).expect("valid");

    let x = common::uniform(&mut rng, tokens * heads * stride, 1.0);
    let mut a = x.clone();
    inter
        .apply(&mut a, &positions, layout)
        .expect("shapes match");

    let mut b = x.clone();
    for head in b.chunks_exact_mut(stride) {
        let v = head[offset..].to_vec();
        for j in 0..dim / 2 {
            head[offset + j] = v[2 * j];
            head[offset + dim / 2 + j] = v[2 * j + 1];
        }
    }
    plain
        .apply(&mut b, &positions, layout)
        .expect("shapes match");
    // Same f32 operations on the same operands: bit-identical.
    assert_eq!(a, b);
    // The nope part is untouched.
    for (ha, hx) in a.chunks_exact(stride).zip(x.chunks_exact(stride)) {
        assert_eq!(&ha[..offset], &hx[..offset]);
    }
}

#[test]
fn invalid_params_are_rejected() {
    for dim in [0, 63] {
        assert!(Rope::new(&RopeParams {
            dim,
            theta: 1e4,
            scaling: RopeScaling::None,
            interleaved: true
        })
        .is_err());
    }
    let rope = Rope::new(&params(RopeScaling::None, true)).expect("valid");
    let mut x = vec![0.0f32; 2 * 64];
    let layout = RotaryLayout {
        heads: 1,
        head_stride: 64,
        offset: 0,
    };
    assert!(
        rope.apply(&mut x, &[0], layout).is_err(),
        "one position for two tokens"
    );
    assert!(
        rope.apply(
            &mut x,
            &[0, 1],
            RotaryLayout {
                offset: 1,
                ..layout
            }
        )
        .is_err(),
        "slice past head end"
    );
}

/// The cached rows are the evaluated ones, bit for bit: positions across chunk boundaries, in
/// any order, from a clone (which shares the cache), and past the cache's bound (evaluated
/// each time); a wrong length is still refused.
#[test]
fn cached_cos_sin_is_bitwise_the_evaluated_table() {
    let rope = Rope::new(&params(RopeScaling::Yarn(deepseek_v3_yarn()), true)).expect("valid");
    let twin = rope.clone();
    let half = rope.dim() / 2;
    let (mut c0, mut s0) = (vec![0.0f32; half], vec![0.0f32; half]);
    let (mut c1, mut s1) = (vec![0.0f32; half], vec![0.0f32; half]);
    // 2^22 is past 64 MB of rows at this width; 163,839 is DeepSeek-V3's last position.
    let positions = [
        0usize,
        1,
        255,
        256,
        257,
        4095,
        511,
        163_839,
        1 << 22,
        3,
        256,
    ];
    for (i, &p) in positions.iter().enumerate() {
        let r = if i % 2 == 0 { &rope } else { &twin };
        r.cos_sin(p, &mut c0, &mut s0).expect("lengths");
        rope.cos_sin_uncached(p, &mut c1, &mut s1).expect("lengths");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&c0), bits(&c1), "cos at {p}");
        assert_eq!(bits(&s0), bits(&s1), "sin at {p}");
    }
    assert!(rope.cos_sin(7, &mut vec![0.0; half - 1], &mut s0).is_err());
    assert_eq!(rope, twin);
}
