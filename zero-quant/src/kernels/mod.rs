//! Host kernels: per-block quantize / dequantize loops written so that LLVM
//! autovectorises them (straight-line bodies, no early exits in hot loops,
//! integer max-reductions, branch-free rounding).
//!
//! Each entry point is compiled twice on x86-64: for the baseline target and
//! with AVX2 enabled, picked at run time. Both use the same IEEE operations
//! (LLVM does not contract `a * b + c` into an FMA without fast-math), so
//! their results are bit-identical; `tests::avx2_matches_portable` checks it.

use crate::element::{Element, Sealed};
use crate::error::{Error, Result};

mod formats;
mod identity;
#[cfg(test)]
mod tests;

pub(crate) use formats::{I4, I8};
use identity::{identity_accumulate_impl, identity_decode_impl, identity_encode_impl};

/// Elements converted per step when the element type is not `f32`
/// (bf16 / f16 are widened into a stack buffer of this many `f32`).
/// Even, so int4 pairs never straddle a step.
const CHUNK: usize = 512;

/// `|x|` bits at or above this are infinities or NaNs.
const NON_FINITE_BITS: u32 = 0x7f80_0000;

/// The `f32` just below one half, `0.5 - 2^-25`.
///
/// `trunc(v + copysign(HALF_BELOW, v))` is round-half-away-from-zero for
/// every finite `f32` `v` with no double-rounding error: when the fractional
/// part of `|v|` is below one half the sum stays below the next integer
/// (the `2^-25` deficit is less than half an ulp of any `v` with `|v| >= 1`,
/// and for `|v| < 1/2` the sum is at most `1 - 2^-24`), and when it is at
/// least one half the sum rounds up to (or past) the next integer. Plain
/// `trunc(v + 0.5)` would round `0.49999997` to 1.
const HALF_BELOW: f32 = 0.499_999_97;

/// Round half away from zero, to `i32` (saturating; exact for |v| < 2^31).
/// Reference for [`quantize`], used by the tests.
#[cfg(test)]
pub(crate) fn round_half_away(v: f32) -> i32 {
    (v + HALF_BELOW.copysign(v)) as i32
}

/// `clamp(round_half_away(v), -qmax, qmax)` for a `qmax` below 2^23.
///
/// The clamp is done in `f32` before the conversion: `f32::max`/`min`
/// return the non-NaN operand, so the clamped value is a finite number in
/// `[-qmax, qmax]` even for a NaN `v`, and the conversion cannot overflow.
/// That is what makes the unchecked conversion sound; a plain `as i32`
/// (saturating) blocks vectorisation and costs 2-4x here. Clamping before
/// truncating is the same as clamping after: `qmax` is an integer.
#[inline(always)]
fn quantize(v: f32, qmax: f32) -> i32 {
    let r = (v + HALF_BELOW.copysign(v)).max(-qmax).min(qmax);
    // SAFETY: `r` is finite and within [-qmax, qmax] (see above), so its
    // truncation is representable in i32.
    unsafe { r.to_int_unchecked::<i32>() }
}

/// Index and value of the first non-finite element (called only after
/// `Sealed::absmax_bits` found one).
#[cold]
fn first_non_finite<E: Element>(x: &[E], base: usize) -> Error {
    let (i, v) = x
        .iter()
        .map(|v| v.to_f32())
        .enumerate()
        .find(|(_, v)| !v.is_finite())
        .expect("absmax_bits saw a non-finite element");
    Error::NonFinite {
        index: base + i,
        value: v,
    }
}

/// Quantizes one block with multiplier `inv`: straight from `x` when `E`
/// converts inline (f32, bf16), else widened to `f32` through `buf`, `CHUNK`
/// elements at a time. (Plain functions, no closures: a closure that LLVM
/// declines to inline would be compiled without the caller's AVX2.)
#[inline(always)]
fn quant_block<F: QFormat, E: Element>(x: &[E], inv: f32, c: &mut [u8], buf: &mut [f32; CHUNK]) {
    if E::INLINE {
        F::quant(x, inv, c);
        return;
    }
    for (xc, cc) in x.chunks(CHUNK).zip(c.chunks_mut(F::codes_len(CHUNK))) {
        let b = &mut buf[..xc.len()];
        E::widen(xc, b);
        F::quant(b, inv, cc);
    }
}

/// Dequantizes one block into `y`: straight when `E` converts inline, else
/// through `buf` and a slice narrowing (round to nearest even).
#[inline(always)]
fn dequant_block<F: QFormat, E: Element>(
    c: &[u8],
    scale: f32,
    y: &mut [E],
    buf: &mut [f32; CHUNK],
) {
    if E::INLINE {
        F::dequant(c, scale, y);
        return;
    }
    for (yc, cc) in y.chunks_mut(CHUNK).zip(c.chunks(F::codes_len(CHUNK))) {
        let b = &mut buf[..yc.len()];
        F::dequant(cc, scale, b);
        E::narrow_finite(b, yc);
    }
}

/// A symmetric block-quantization format: the code range and the packing.
pub(crate) trait QFormat {
    /// Codec name used in errors.
    const NAME: &'static str;
    /// Largest code magnitude; codes lie in `[-QMAX, QMAX]`.
    const QMAX: i32;
    /// Bytes of codes for `n` elements.
    fn codes_len(n: usize) -> usize;
    /// Quantizes `x` with `q = round_half_away(x * inv)`
    /// clamped to `±QMAX`, writing `codes_len(x.len())` bytes.
    fn quant<E: Sealed>(x: &[E], inv: f32, codes: &mut [u8]);
    /// `y[i] = q_i * scale`, rounded to `E`.
    fn dequant<E: Sealed>(codes: &[u8], scale: f32, y: &mut [E]);
    /// `acc[i] += q_i * scale` (the product rounded to `f32` first, exactly
    /// like `dequant` followed by an add).
    fn dequant_add(codes: &[u8], scale: f32, acc: &mut [f32]);
    /// Code of element `i`.
    fn code_at(codes: &[u8], i: usize) -> i8;
    /// First code outside `[-QMAX, QMAX]` among the `n` elements of `codes`:
    /// `(element index, raw code)`.
    fn find_invalid(codes: &[u8], n: usize) -> Option<(usize, u8)>;
}

/// The dequantization multiplier stored for a block with largest magnitude
/// `absmax` (finite, `>= 0`).
///
/// `absmax / QMAX` rounded to `f32`, except:
/// - `absmax == 0`: 0 (codes are all 0; decode is exact);
/// - the quotient underflows to 0 (absmax below `QMAX * 2^-150`): the
///   smallest subnormal, so that tiny non-zero blocks keep their values;
/// - `QMAX * scale` would overflow (absmax within an ulp of `f32::MAX`):
///   the next smaller `f32`, so that no decoded value is infinite.
#[inline]
pub(crate) fn scale_for<F: QFormat>(absmax: f32) -> f32 {
    if absmax == 0.0 {
        return 0.0;
    }
    let qmax = F::QMAX as f32;
    let mut s = absmax / qmax;
    if s == 0.0 {
        s = f32::from_bits(1);
    }
    if !(s * qmax).is_finite() {
        s = f32::from_bits(s.to_bits() - 1);
    }
    s
}

/// Whether a scale read from the wire is one the encoder can produce.
#[inline(always)]
fn scale_ok<F: QFormat>(s: f32) -> bool {
    s >= 0.0 && (s * F::QMAX as f32).is_finite()
}

/// Encodes whole blocks of `src` (the last may be partial): codes into
/// `codes`, one little-endian `f32` scale per block into `scales`.
/// Errors carry indices relative to `src`.
#[inline(always)]
fn encode_blocks<F: QFormat, E: Element>(
    bs: usize,
    src: &[E],
    codes: &mut [u8],
    scales: &mut [u8],
) -> Result<()> {
    debug_assert_eq!(codes.len(), F::codes_len(src.len()));
    debug_assert_eq!(scales.len(), 4 * src.len().div_ceil(bs));
    let mut buf = [0f32; CHUNK];
    let blocks = src
        .chunks(bs)
        .zip(codes.chunks_mut(F::codes_len(bs)))
        .zip(scales.chunks_exact_mut(4));
    for (b, ((x, c), s)) in blocks.enumerate() {
        let m = E::absmax_bits(x);
        if m >= NON_FINITE_BITS {
            return Err(first_non_finite(x, b * bs));
        }
        let absmax = f32::from_bits(m);
        let scale = scale_for::<F>(absmax);
        s.copy_from_slice(&scale.to_le_bytes());
        if absmax == 0.0 {
            c.fill(0);
        } else if scale >= f32::MIN_POSITIVE {
            quant_block::<F, E>(x, 1.0 / scale, c, &mut buf);
        } else {
            encode_subnormal_scale::<F, E>(x, scale, c);
        }
    }
    Ok(())
}

/// Blocks whose scale is subnormal (absmax below `QMAX * 2^-126`): `1/scale`
/// overflows `f32`, so `x / scale` is formed in `f64`. Rare; not vectorised.
#[cold]
fn encode_subnormal_scale<F: QFormat, E: Element>(x: &[E], scale: f32, c: &mut [u8]) {
    let inv = 1.0 / f64::from(scale);
    let mut t = [0f32; CHUNK];
    for (k, xc) in x.chunks(CHUNK).enumerate() {
        for (ti, xi) in t.iter_mut().zip(xc) {
            // |x / scale| <= QMAX + 1 here, so the f32 rounding is harmless.
            *ti = (f64::from(xi.to_f32()) * inv) as f32;
        }
        let off = k * CHUNK;
        F::quant(
            &t[..xc.len()],
            1.0,
            &mut c[F::codes_len(off)..F::codes_len(off + xc.len())],
        );
    }
}

#[inline(always)]
fn read_scale<F: QFormat>(s: &[u8], block: usize) -> Result<f32> {
    let v = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    if scale_ok::<F>(v) {
        Ok(v)
    } else {
        Err(Error::InvalidScale {
            codec: F::NAME,
            block,
            value: v,
        })
    }
}

/// A block's elements, its codes and its scale's 4 bytes.
type Block<'a, T> = (&'a mut [T], &'a [u8], &'a [u8]);

/// Block `b` of `dst` (the last may be partial) with its codes and its scale's 4 bytes.
#[inline(always)]
fn blocks<'a, F: QFormat, T>(
    bs: usize,
    dst: &'a mut [T],
    codes: &'a [u8],
    scales: &'a [u8],
) -> impl Iterator<Item = (usize, Block<'a, T>)> {
    dst.chunks_mut(bs)
        .zip(codes.chunks(F::codes_len(bs)))
        .zip(scales.chunks_exact(4))
        .map(|((y, c), s)| (y, c, s))
        .enumerate()
}

/// Block `b`'s scale, once it and the block's `len` codes are valid.
#[inline(always)]
fn checked_scale<F: QFormat>(bs: usize, b: usize, c: &[u8], s: &[u8], len: usize) -> Result<f32> {
    let scale = read_scale::<F>(s, b)?;
    if let Some((i, code)) = F::find_invalid(c, len) {
        return Err(Error::InvalidCode {
            codec: F::NAME,
            index: b * bs + i,
            code,
        });
    }
    Ok(scale)
}

/// Decodes whole blocks into `dst` (the last may be partial), validating
/// each block's scale, then its codes. Errors carry indices relative to `dst`.
#[inline(always)]
fn decode_blocks<F: QFormat, E: Element>(
    bs: usize,
    codes: &[u8],
    scales: &[u8],
    dst: &mut [E],
) -> Result<()> {
    let mut buf = [0f32; CHUNK];
    for (b, (y, c, s)) in blocks::<F, E>(bs, dst, codes, scales) {
        let scale = checked_scale::<F>(bs, b, c, s, y.len())?;
        dequant_block::<F, E>(c, scale, y, &mut buf);
        if E::absmax_bits(y) >= NON_FINITE_BITS {
            // Only bf16/f16 can get here: f32 values are finite (scale_ok).
            let i = first_non_finite_index(y);
            return Err(Error::Overflow {
                index: b * bs + i,
                value: f32::from(F::code_at(c, i)) * scale,
                dtype: E::DTYPE,
            });
        }
    }
    Ok(())
}

/// Index of the first non-finite element (there must be one).
#[cold]
fn first_non_finite_index<E: Element>(y: &[E]) -> usize {
    y.iter()
        .position(|v| !v.to_f32().is_finite())
        .expect("absmax_bits saw a non-finite element")
}

/// `acc += decode(codes, scales)`, block by block, validating like
/// [`decode_blocks`].
#[inline(always)]
fn accumulate_blocks<F: QFormat>(
    bs: usize,
    codes: &[u8],
    scales: &[u8],
    acc: &mut [f32],
) -> Result<()> {
    for (b, (y, c, s)) in blocks::<F, f32>(bs, acc, codes, scales) {
        let scale = checked_scale::<F>(bs, b, c, s, y.len())?;
        F::dequant_add(c, scale, y);
    }
    Ok(())
}

/// Defines `pub(crate) fn $name` that runs `$imp` compiled with AVX2 when the
/// CPU has it, and the baseline build of `$imp` otherwise.
macro_rules! multiversion {
    ($(#[$m:meta])* fn $name:ident<$($g:ident: $b:path),*>($($a:ident: $t:ty),*) -> $r:ty = $imp:ident;) => {
        $(#[$m])*
        pub(crate) fn $name<$($g: $b),*>($($a: $t),*) -> $r {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                fn avx2<$($g: $b),*>($($a: $t),*) -> $r {
                    $imp::<$($g),*>($($a),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU supports AVX2, checked just above.
                    return unsafe { avx2::<$($g),*>($($a),*) };
                }
            }
            $imp::<$($g),*>($($a),*)
        }
    };
}

multiversion! {
    /// [`encode_blocks`], dispatched.
    fn encode<F: QFormat, E: Element>(bs: usize, src: &[E], codes: &mut [u8], scales: &mut [u8]) -> Result<()> = encode_blocks;
}

multiversion! {
    /// [`decode_blocks`], dispatched.
    fn decode<F: QFormat, E: Element>(bs: usize, codes: &[u8], scales: &[u8], dst: &mut [E]) -> Result<()> = decode_blocks;
}

multiversion! {
    /// [`accumulate_blocks`], dispatched.
    fn accumulate<F: QFormat>(bs: usize, codes: &[u8], scales: &[u8], acc: &mut [f32]) -> Result<()> = accumulate_blocks;
}

multiversion! {
    /// [`identity_encode_impl`], dispatched.
    fn identity_encode<E: Element>(src: &[E], dst: &mut [u8]) -> Result<()> = identity_encode_impl;
}

multiversion! {
    /// [`identity_decode_impl`], dispatched.
    fn identity_decode<E: Element>(src: &[u8], dst: &mut [E]) -> Result<()> = identity_decode_impl;
}

multiversion! {
    /// [`identity_accumulate_impl`], dispatched.
    fn identity_accumulate<>(src: &[u8], acc: &mut [f32]) -> Result<()> = identity_accumulate_impl;
}
