//! Element types the codecs read and write: `f32`, `bf16`, `f16`.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Runtime tag of an [`Element`] type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// bfloat16 (8 exponent bits, 7 mantissa bits).
    BF16,
    /// IEEE binary16.
    F16,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Unit roundoff of the type (half an ulp, relative): the largest
    /// relative error of rounding a finite `f32` in the type's normal range
    /// to it. `2^-24` for f32, `2^-8` for bf16, `2^-11` for f16.
    pub const fn unit_roundoff(self) -> f32 {
        match self {
            DType::F32 => 5.960_464_5e-8, // 2^-24
            DType::BF16 => 3.906_25e-3,   // 2^-8
            DType::F16 => 4.882_812_5e-4, // 2^-11
        }
    }
}

mod sealed {
    /// Conversions the kernels use; not part of the public API.
    pub trait Sealed: Copy {
        /// Whether the per-element conversions below are cheap, branch-free
        /// and vectorise (f32, bf16). If not (f16 without F16C in the
        /// baseline build), kernels convert through a stack buffer with the
        /// slice conversions instead.
        const INLINE: bool;
        /// Widens to `f32`, exactly.
        fn load(self) -> f32;
        /// Rounds a finite `f32` to nearest even (no NaN handling).
        fn store_finite(x: f32) -> Self;
        /// Widens `src` into `dst` (same length), exactly.
        fn widen(src: &[Self], dst: &mut [f32]);
        /// Rounds finite `src` into `dst` (same length), to nearest even.
        fn narrow_finite(src: &[f32], dst: &mut [Self]);
        /// `max |x|` over `src` as `f32` bits: an integer max over the
        /// magnitude bits, so a NaN or infinity yields `>= 0x7f80_0000`
        /// (an `f32` max would skip NaN).
        fn absmax_bits(src: &[Self]) -> u32;
    }
}
pub(crate) use sealed::Sealed;

/// A floating-point element type the codecs encode from and decode into.
///
/// Sealed: implemented for `f32`, [`half::bf16`] and [`half::f16`]. A codec
/// decodes into the same `E` it was handed (no silent dtype change); widening
/// to `f32` is exact and narrowing rounds to nearest, ties to even.
pub trait Element:
    Sealed + Copy + Default + PartialEq + Send + Sync + std::fmt::Debug + 'static
{
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// Widens to `f32` (exact).
    fn to_f32(self) -> f32;
    /// Rounds an `f32` to this type (nearest, ties to even; NaN stays NaN).
    fn from_f32(x: f32) -> Self;
}

impl Sealed for f32 {
    const INLINE: bool = true;
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store_finite(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[inline(always)]
    fn narrow_finite(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
    #[inline(always)]
    fn absmax_bits(src: &[Self]) -> u32 {
        src.iter()
            .fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff))
    }
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

/// bf16 → f32: the bf16 bits are the high half of the f32 (exact, NaN stays NaN).
#[inline(always)]
fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// f32 → bf16 bits, round to nearest even; NaN maps to a quiet NaN.
/// Branch-free so that slice loops vectorise. Same results as
/// `half::bf16::from_f32`.
#[inline(always)]
fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) | 0x0040) as u16;
    if b & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else {
        rounded
    }
}

/// f32 → bf16 bits for finite `x`: round to nearest even (overflow rounds to
/// infinity, as it should).
#[inline(always)]
fn f32_to_bf16_bits_finite(x: f32) -> u16 {
    let b = x.to_bits();
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

impl Sealed for bf16 {
    const INLINE: bool = true;
    #[inline(always)]
    fn load(self) -> f32 {
        bf16_bits_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn store_finite(x: f32) -> Self {
        bf16::from_bits(f32_to_bf16_bits_finite(x))
    }
    #[inline(always)]
    fn widen(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.load();
        }
    }
    #[inline(always)]
    fn narrow_finite(src: &[f32], dst: &mut [Self]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::store_finite(s);
        }
    }
    #[inline(always)]
    fn absmax_bits(src: &[Self]) -> u32 {
        // Magnitude order is bit order; the bf16 bits are the f32's high half.
        // Masked bits fit in i16, whose max is one SSE2 instruction (u16's is not).
        let m = src
            .iter()
            .fold(0i16, |m, v| m.max((v.to_bits() & 0x7fff) as i16));
        (m as u32) << 16
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16_bits_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_bits(f32_to_bf16_bits(x))
    }
}

impl Sealed for f16 {
    const INLINE: bool = false;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store_finite(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline(always)]
    fn widen(src: &[Self], dst: &mut [f32]) {
        // F16C when the CPU has it (runtime detection inside `half`).
        src.convert_to_f32_slice(dst);
    }
    #[inline(always)]
    fn narrow_finite(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
    #[inline(always)]
    fn absmax_bits(src: &[Self]) -> u32 {
        // Magnitude order is bit order; widening is monotonic and maps f16
        // infinities and NaNs to f32 ones.
        let m = src
            .iter()
            .fold(0i16, |m, v| m.max((v.to_bits() & 0x7fff) as i16));
        f16::from_bits(m as u16).to_f32().to_bits()
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_conversion_matches_half() {
        // Every bf16 bit pattern widens like `half` (NaN payloads aside).
        for bits in 0..=u16::MAX {
            let h = bf16::from_bits(bits);
            let ours = bf16_bits_to_f32(bits);
            let theirs = h.to_f32();
            assert!(
                ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
                "{bits:#06x}"
            );
        }
        // Narrowing agrees with `half` on a dense sweep of f32 bit patterns,
        // including every rounding boundary near a few exponents.
        let probe = |b: u32| {
            let x = f32::from_bits(b);
            let ours = f32_to_bf16_bits(x);
            let theirs = bf16::from_f32(x).to_bits();
            assert!(
                ours == theirs || (x.is_nan() && bf16::from_bits(ours).is_nan()),
                "{x:e} ({b:#010x}): {ours:#06x} vs {theirs:#06x}"
            );
        };
        for b in (0..=u32::MAX).step_by(4099) {
            probe(b);
        }
        for base in [
            0x0000_0000u32,
            0x3f80_0000,
            0x7f7f_0000,
            0x8000_0000,
            0xff7f_0000,
        ] {
            for low in 0..0x2_0000u32 {
                probe(base.wrapping_add(low));
            }
        }
    }
}
