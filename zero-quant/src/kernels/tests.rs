//! The host kernels against references: rounding, scales, and the AVX2 build against the
//! portable one.

use super::*;

fn reference(v: f32) -> i32 {
    // f64 has room for v + 0.5 exactly, and f64::round is half-away.
    f64::from(v).round() as i32
}

#[test]
fn round_half_away_is_exact_near_every_half_integer() {
    for k in -300i32..=300 {
        let mid = k as f32 + 0.5;
        let mut lo = mid;
        let mut hi = mid;
        for _ in 0..64 {
            for v in [lo, hi, -lo, -hi] {
                assert_eq!(round_half_away(v), reference(v), "{v:e}");
            }
            lo = f32::from_bits(lo.to_bits() - 1);
            hi = f32::from_bits(hi.to_bits() + 1);
        }
    }
    // The classic trap for trunc(v + 0.5).
    assert_eq!(round_half_away(0.499_999_97), 0);
    assert_eq!(round_half_away(-0.499_999_97), 0);
    assert_eq!(round_half_away(0.5), 1);
    assert_eq!(round_half_away(-0.5), -1);
    assert_eq!(round_half_away(2.5), 3);
    assert_eq!(round_half_away(-0.0), 0);
    assert_eq!(round_half_away(f32::from_bits(1)), 0);
}

#[test]
fn round_half_away_matches_reference_on_a_sweep() {
    // Every 97th bit pattern of [0, 2^23] (covers every exponent).
    let top = 8_388_608.0f32.to_bits();
    for b in (0..=top).step_by(97) {
        let v = f32::from_bits(b);
        assert_eq!(round_half_away(v), reference(v), "{v:e}");
        assert_eq!(round_half_away(-v), reference(-v), "{:e}", -v);
    }
}

#[test]
fn quantize_is_clamped_round_half_away() {
    let top = 300.0f32.to_bits();
    for b in (0..=top).step_by(13) {
        for v in [f32::from_bits(b), -f32::from_bits(b)] {
            for qmax in [7i32, 127] {
                let want = round_half_away(v).clamp(-qmax, qmax);
                assert_eq!(quantize(v, qmax as f32), want, "{v:e} qmax {qmax}");
            }
        }
    }
    for v in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, -1e30] {
        assert!(quantize(v, 127.0).abs() <= 127, "{v}");
    }
}

/// The AVX2 build and the baseline build give identical bytes and values.
#[test]
fn avx2_matches_portable() {
    use half::bf16;
    let mut seed = 1u64;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        // Heavy-tailed-ish: a uniform mantissa times 2^[-20, 20).
        let u = (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        u * 2f32.powi(((seed >> 20) % 40) as i32 - 20)
    };
    let n = 10_001;
    let x: Vec<f32> = (0..n).map(|_| next()).collect();
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    fn both<F: QFormat, E: Element>(bs: usize, x: &[E]) {
        let nb = x.len().div_ceil(bs);
        let cl = F::codes_len(x.len());
        let (mut c1, mut s1) = (vec![0u8; cl], vec![0u8; 4 * nb]);
        let (mut c2, mut s2) = (c1.clone(), s1.clone());
        encode_blocks::<F, E>(bs, x, &mut c1, &mut s1).unwrap();
        encode::<F, E>(bs, x, &mut c2, &mut s2).unwrap();
        assert_eq!((&c1, &s1), (&c2, &s2), "{} {:?}", F::NAME, E::DTYPE);
        let (mut y1, mut y2) = (vec![E::default(); x.len()], vec![E::default(); x.len()]);
        decode_blocks::<F, E>(bs, &c1, &s1, &mut y1).unwrap();
        decode::<F, E>(bs, &c1, &s1, &mut y2).unwrap();
        assert!(y1 == y2, "{} {:?}", F::NAME, E::DTYPE);
        let mut a1: Vec<f32> = (0..x.len()).map(|i| i as f32).collect();
        let mut a2 = a1.clone();
        accumulate_blocks::<F>(bs, &c1, &s1, &mut a1).unwrap();
        accumulate::<F>(bs, &c1, &s1, &mut a2).unwrap();
        assert!(a1 == a2, "{}", F::NAME);
    }
    for bs in [2, 64, 250, 2048] {
        both::<I8, f32>(bs, &x);
        both::<I4, f32>(bs, &x);
        both::<I8, bf16>(bs, &xb);
        both::<I4, bf16>(bs, &xb);
    }
}

#[test]
fn scale_edge_cases() {
    assert_eq!(scale_for::<I8>(0.0), 0.0);
    assert_eq!(scale_for::<I8>(127.0), 1.0);
    assert_eq!(scale_for::<I4>(7.0), 1.0);
    // Underflow: smallest subnormal instead of 0.
    assert_eq!(scale_for::<I8>(f32::from_bits(3)), f32::from_bits(1));
    // No overflow when decoding the largest code.
    for absmax in [f32::MAX, f32::from_bits(f32::MAX.to_bits() - 1)] {
        assert!((scale_for::<I8>(absmax) * 127.0).is_finite());
        assert!((scale_for::<I4>(absmax) * 7.0).is_finite());
    }
}
