//! Property tests: error bound, zero blocks, idempotence, non-finite
//! rejection, dtype round trips and accumulate, over random lengths, block
//! sizes and values (heavy tailed, tiny, huge, signed zeros).

mod common;

use half::{bf16, f16};
use proptest::prelude::*;
use zero_quant::{BlockCodec, Codec, DType, Element, Error, Identity, Int4Block, Int8Block};

/// Per-element slack on top of `absmax / (2 qmax)`, relative to the block
/// absmax: covers f32 rounding of `1/scale`, `x * inv` and `q * scale`
/// (true worst case is below 3e-7).
const REL_SLACK: f64 = 1e-6;

/// 96 cases per property; a failing case is kept in `properties.proptest-regressions` (proptest's
/// default) and replayed first on every later run, so a failure seen once in CI stays reproducible.
fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 96,
        ..ProptestConfig::default()
    }
}

/// One finite value from a mixture: plain, heavy tailed over 60 decades,
/// huge (~1e30), tiny (incl. subnormal), signed zeros, extremes, and any
/// finite bit pattern.
fn value() -> impl Strategy<Value = f32> {
    prop_oneof![
        4 => -1.0f32..1.0,
        2 => (any::<bool>(), -30.0f32..30.0)
            .prop_map(|(neg, e)| if neg { -(10f32.powf(e)) } else { 10f32.powf(e) }),
        1 => -1e30f32..1e30,
        1 => any::<u32>().prop_map(|b| f32::from_bits(b & 0x807f_ffff)), // subnormals
        1 => -1e-37f32..1e-37,
        1 => Just(0.0f32),
        1 => Just(-0.0f32),
        1 => prop_oneof![
            Just(f32::MAX),
            Just(-f32::MAX),
            Just(f32::MIN_POSITIVE),
            Just(f32::from_bits(1))
        ],
        1 => proptest::num::f32::POSITIVE
            | proptest::num::f32::NEGATIVE
            | proptest::num::f32::NORMAL
            | proptest::num::f32::SUBNORMAL
            | proptest::num::f32::ZERO,
    ]
}

/// A tensor: either a mixture per element, or one magnitude class for the
/// whole tensor (so that whole blocks are tiny, huge, or zero).
fn tensor() -> impl Strategy<Value = Vec<f32>> {
    let len = 1usize..5000;
    prop_oneof![
        3 => proptest::collection::vec(value(), len.clone()),
        1 => (proptest::collection::vec(-1.0f32..1.0, len.clone()), -44.0f32..38.0)
            .prop_map(|(v, e)| {
                let s = 10f32.powf(e);
                v.into_iter().map(|x| x * s).collect()
            }),
        1 => (len.clone(), 0usize..64).prop_map(|(n, hole)| {
            // zero blocks next to non-zero ones
            (0..n).map(|i| if (i / 32) % 3 == 0 { 0.0 } else { (i % hole.max(1)) as f32 - 3.0 }).collect()
        }),
        1 => (len, any::<u64>()).prop_map(|(n, seed)| common::student_t(n, 3, seed)),
    ]
}

fn int8() -> impl Strategy<Value = Int8Block> {
    prop_oneof![1usize..=64, 65usize..=1500, Just(4096)].prop_map(|b| Int8Block::new(b).unwrap())
}

fn int4() -> impl Strategy<Value = Int4Block> {
    prop_oneof![1usize..=32, 33usize..=750, Just(2048)].prop_map(|h| Int4Block::new(2 * h).unwrap())
}

fn quant_codec() -> impl Strategy<Value = Codec> {
    prop_oneof![int8().prop_map(Codec::from), int4().prop_map(Codec::from)]
}

fn qmax(c: &Codec) -> f64 {
    match c {
        Codec::Int8(_) => 127.0,
        Codec::Int4(_) => 7.0,
        Codec::Identity(_) => f64::INFINITY,
    }
}

/// Converts to `E`, mapping values that overflow `E` to 0 (f16 tops out at 65504).
fn to_elems<E: Element>(x: &[f32]) -> Vec<E> {
    x.iter()
        .map(|&v| {
            let e = E::from_f32(v);
            if e.to_f32().is_finite() {
                e
            } else {
                E::from_f32(0.0)
            }
        })
        .collect()
}

fn encode<E: Element>(c: &Codec, x: &[E]) -> Vec<u8> {
    let mut w = vec![0u8; c.encoded_len(x.len())];
    c.encode(x, &mut w).unwrap();
    w
}

fn decode<E: Element>(c: &Codec, w: &[u8], n: usize) -> Vec<E> {
    let mut y = vec![E::default(); n];
    c.decode(w, &mut y).unwrap();
    y
}

/// Smallest positive subnormal of `E`, halved: the absolute rounding error
/// of narrowing a tiny `f32` into `E`.
fn half_min_subnormal(d: DType) -> f64 {
    match d {
        DType::F32 => 0.0,
        DType::BF16 => 2f64.powi(-134),
        DType::F16 => 2f64.powi(-25),
    }
}

/// Checks, block by block, `|x - y| <= absmax/(2 qmax) + 1e-6 absmax + t`
/// where `t = qmax * 2^-150 + 2^-150` (non-zero only for blocks whose scale is
/// subnormal) plus, for bf16/f16 output, the element type's own rounding of
/// the decoded value: `u_E |y| + min_subnormal_E / 2`.
fn check_bound<E: Element>(c: &Codec, x: &[E], y: &[E]) {
    let bs = c.block_size();
    let q = qmax(c);
    let u = f64::from(E::DTYPE.unit_roundoff());
    for (b, (xb, yb)) in x.chunks(bs).zip(y.chunks(bs)).enumerate() {
        let absmax = xb
            .iter()
            .map(|v| f64::from(v.to_f32().abs()))
            .fold(0.0, f64::max);
        let base = absmax / (2.0 * q) + REL_SLACK * absmax + (q + 1.0) * 2f64.powi(-150);
        for (i, (xi, yi)) in xb.iter().zip(yb).enumerate() {
            let (xv, yv) = (f64::from(xi.to_f32()), f64::from(yi.to_f32()));
            let tol = if E::DTYPE == DType::F32 {
                base
            } else {
                base + u * yv.abs() + half_min_subnormal(E::DTYPE)
            };
            assert!(
                (xv - yv).abs() <= tol,
                "{c:?} {:?} block {b} elem {}: x={xv:e} y={yv:e} |err|={:e} > tol={tol:e} (absmax {absmax:e})",
                E::DTYPE,
                b * bs + i,
                (xv - yv).abs()
            );
        }
    }
}

fn round_trip_bound<E: Element>(c: &Codec, x32: &[f32]) {
    let x: Vec<E> = to_elems(x32);
    let w = encode(c, &x);
    let y: Vec<E> = decode(c, &w, x.len());
    check_bound(c, &x, &y);
}

/// Codes of block `b` as signed integers.
fn block_codes(c: &Codec, w: &[u8], n: usize, b: usize) -> Vec<i8> {
    let bs = c.block_size();
    let range = b * bs..((b + 1) * bs).min(n);
    match c {
        Codec::Int8(_) => w[range].iter().map(|&v| v as i8).collect(),
        Codec::Int4(_) => range
            .map(|i| {
                let byte = w[i / 2];
                let nib = if i % 2 == 0 { byte << 4 } else { byte & 0xf0 };
                (nib as i8) >> 4
            })
            .collect(),
        Codec::Identity(_) => unreachable!(),
    }
}

/// Re-encoding the decoded tensor gives the same codes in every block whose
/// absmax is at least `min_absmax` (below it the scale is subnormal, or the
/// element type's own subnormals are too coarse, and codes may move).
fn check_idempotent<E: Element>(c: &Codec, x32: &[f32], min_absmax: f32) {
    let x: Vec<E> = to_elems(x32);
    let w = encode(c, &x);
    let y: Vec<E> = decode(c, &w, x.len());
    let w2 = encode(c, &y);
    let bs = c.block_size();
    for (b, xb) in x.chunks(bs).enumerate() {
        let absmax = xb.iter().map(|v| v.to_f32().abs()).fold(0.0, f32::max);
        if absmax != 0.0 && absmax < min_absmax {
            continue;
        }
        assert_eq!(
            block_codes(c, &w, x.len(), b),
            block_codes(c, &w2, x.len(), b),
            "{c:?} {:?} block {b} (absmax {absmax:e})",
            E::DTYPE
        );
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn bound_holds_f32(c in quant_codec(), x in tensor()) {
        round_trip_bound::<f32>(&c, &x);
    }

    #[test]
    fn bound_holds_bf16(c in quant_codec(), x in tensor()) {
        round_trip_bound::<bf16>(&c, &x);
    }

    #[test]
    fn bound_holds_f16(c in quant_codec(), x in tensor()) {
        round_trip_bound::<f16>(&c, &x);
    }

    /// Blocks of zeros (either sign) have scale 0, codes 0 and decode to +0.
    #[test]
    fn zero_blocks_are_exact(c in quant_codec(), x in tensor()) {
        let w = encode(&c, &x);
        let y: Vec<f32> = decode(&c, &w, x.len());
        let l = c.layout(x.len());
        for (b, (xb, yb)) in x.chunks(c.block_size()).zip(y.chunks(c.block_size())).enumerate() {
            if xb.iter().all(|&v| v == 0.0) {
                let s = &w[l.scales_offset + 4 * b..][..4];
                prop_assert_eq!(s, &[0u8; 4][..]);
                prop_assert!(block_codes(&c, &w, x.len(), b).iter().all(|&q| q == 0));
                prop_assert!(yb.iter().all(|v| v.to_bits() == 0));
            }
        }
    }

    /// The `+absmax` element of each block maps to `+qmax` (no clamping
    /// off-by-one), `-absmax` to `-qmax`.
    #[test]
    fn absmax_maps_to_qmax(c in quant_codec(), x in tensor()) {
        let w = encode(&c, &x);
        let q = qmax(&c) as i8;
        for (b, xb) in x.chunks(c.block_size()).enumerate() {
            let absmax = xb.iter().map(|v| v.abs()).fold(0.0, f32::max);
            if absmax < 1e-30 {
                continue;
            }
            let codes = block_codes(&c, &w, x.len(), b);
            for (v, code) in xb.iter().zip(&codes) {
                if v.abs() == absmax {
                    prop_assert_eq!(*code, if *v > 0.0 { q } else { -q });
                }
            }
        }
    }

    #[test]
    fn idempotent_f32(c in quant_codec(), x in tensor()) {
        // Normal scales: absmax >= qmax * 2^-126.
        check_idempotent::<f32>(&c, &x, qmax(&c) as f32 * f32::MIN_POSITIVE);
    }

    /// f16: blocks whose absmax is an f16 normal (>= 2^-14).
    #[test]
    fn idempotent_f16(c in quant_codec(), x in tensor()) {
        check_idempotent::<f16>(&c, &x, 2f32.powi(-14));
    }

    /// bf16: int4 only. For int8, bf16's 8-bit significand can move a decoded
    /// value by up to 127 * 2^-7 ~ 1 code, so re-quantization is not
    /// guaranteed to be idempotent (documented).
    #[test]
    fn idempotent_bf16_int4(c in int4(), x in tensor()) {
        check_idempotent::<bf16>(&Codec::from(c), &x, 7.0 * f32::MIN_POSITIVE);
    }

    /// The first NaN or infinity is reported, with its index, by every codec
    /// and dtype, serial and parallel.
    #[test]
    fn non_finite_is_rejected(
        c in prop_oneof![quant_codec(), Just(Codec::from(Identity))],
        x in tensor(),
        picks in proptest::collection::vec((any::<prop::sample::Index>(), 0usize..3), 1..4),
    ) {
        let mut x = x;
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
        let mut first = usize::MAX;
        for (i, k) in &picks {
            let i = i.index(x.len());
            x[i] = specials[*k];
            first = first.min(i);
        }
        fn run<E: Element>(c: &Codec, x: &[f32], first: usize) -> Result<(), TestCaseError> {
            // Convert the finite values first (f16 would overflow 1e30 to
            // infinity), then put the specials back.
            let x: Vec<E> = to_elems::<E>(x)
                .into_iter()
                .zip(x)
                .map(|(e, v)| if v.is_finite() { e } else { E::from_f32(*v) })
                .collect();
            let mut w = vec![0u8; c.encoded_len(x.len())];
            for threads in [1, 3] {
                match c.encode_par(&x, &mut w, threads) {
                    Err(Error::NonFinite { index, value }) => {
                        prop_assert_eq!(index, first);
                        prop_assert!(!value.is_finite());
                        prop_assert_eq!(value.to_bits(), x[first].to_f32().to_bits());
                    }
                    other => prop_assert!(false, "{:?}: expected NonFinite, got {:?}", c, other),
                }
            }
            Ok(())
        }
        run::<f32>(&c, &x, first)?;
        run::<bf16>(&c, &x, first)?;
        run::<f16>(&c, &x, first)?;
    }

    /// Identity decodes to the input bit for bit, in every dtype.
    #[test]
    fn identity_is_exact(x in tensor()) {
        fn run<E: Element>(x: &[f32]) -> Result<(), TestCaseError> {
            let x: Vec<E> = to_elems(x);
            let c = Codec::from(Identity);
            let y: Vec<E> = decode(&c, &encode(&c, &x), x.len());
            for (i, (a, b)) in x.iter().zip(&y).enumerate() {
                prop_assert_eq!(
                    a.to_f32().to_bits(),
                    b.to_f32().to_bits(),
                    "{:?} at {}: {:?} vs {:?}",
                    E::DTYPE,
                    i,
                    a,
                    b
                );
            }
            Ok(())
        }
        run::<f32>(&x)?;
        run::<bf16>(&x)?;
        run::<f16>(&x)?;
    }

    /// `decode_accumulate` equals decode-to-f32 followed by `+=`, bit for bit.
    #[test]
    fn accumulate_equals_decode_then_add(
        c in prop_oneof![quant_codec(), Just(Codec::from(Identity))],
        x in tensor(),
        seed in any::<u64>(),
    ) {
        let w = encode(&c, &x);
        let acc0 = common::gaussian(x.len(), seed);
        let y: Vec<f32> = decode(&c, &w, x.len());
        let want: Vec<u32> = acc0.iter().zip(&y).map(|(a, b)| (a + b).to_bits()).collect();
        let mut acc = acc0.clone();
        c.decode_accumulate(&w, &mut acc).unwrap();
        let got: Vec<u32> = acc.iter().map(|v| v.to_bits()).collect();
        prop_assert_eq!(got, want);
    }

    /// Decoding into bf16/f16 equals decoding into f32 then rounding (the
    /// output dtype is the input dtype; nothing else changes), or, where that
    /// rounding overflows, `Error::Overflow` at the first such element.
    #[test]
    fn narrow_decode_agrees_with_f32_decode(c in quant_codec(), x in tensor()) {
        fn run<E: Element>(c: &Codec, w: &[u8], y32: &[f32]) -> Result<(), TestCaseError> {
            let want: Vec<E> = y32.iter().map(|&v| E::from_f32(v)).collect();
            let mut got = vec![E::default(); y32.len()];
            let r = c.decode(w, &mut got);
            match want.iter().position(|v| !v.to_f32().is_finite()) {
                None => {
                    prop_assert!(r.is_ok(), "{:?}", r);
                    for i in 0..want.len() {
                        prop_assert_eq!(got[i], want[i], "{:?} at {}", E::DTYPE, i);
                    }
                }
                Some(first) => match r {
                    Err(Error::Overflow { index, value, dtype }) => {
                        prop_assert_eq!(index, first);
                        prop_assert_eq!(value, y32[first]);
                        prop_assert_eq!(dtype, E::DTYPE);
                    }
                    other => prop_assert!(false, "expected Overflow at {}, got {:?}", first, other),
                },
            }
            Ok(())
        }
        let w = encode(&c, &x);
        let y32: Vec<f32> = decode(&c, &w, x.len());
        run::<bf16>(&c, &w, &y32)?;
        run::<f16>(&c, &w, &y32)?;
    }
}
