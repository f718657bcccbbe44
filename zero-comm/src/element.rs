//! Element types a communicator moves, and the reductions it applies to them.

use std::fmt;

/// The element type of a buffer, as the backends (and NCCL's `ncclDataType_t`) see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// bfloat16 ([`half::bf16`]).
    BF16,
    /// IEEE binary16 ([`half::f16`]).
    F16,
    /// Raw bytes (quantized payloads). Gathered, broadcast and exchanged, never reduced.
    U8,
}

impl DType {
    /// Every dtype, in a fixed order.
    pub const ALL: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::U8];

    /// Size of one element in bytes.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }

    /// Lower-case name used in messages.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::U8 => "u8",
        }
    }

    /// Whether [`ReduceOp`]s are defined on this dtype.
    pub const fn is_reducible(self) -> bool {
        !matches!(self, DType::U8)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How a reduce-scatter or all-reduce combines the ranks' values.
///
/// Both are computed in one canonical order so that every backend that honours it is bit-exact:
/// `out[i] = (((x₀[i] + x₁[i]) + x₂[i]) + …) + xₙ₋₁[i]` in group-rank order, accumulated in `f32`
/// (16-bit inputs are widened exactly and rounded to their own type once, at the end). `Mean` then
/// divides that sum by `n` (a division, not a multiplication by `1/n`) before the final rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Rank-ordered sum.
    Sum,
    /// Rank-ordered sum divided by the group size.
    Mean,
}

impl ReduceOp {
    /// Lower-case name used in messages.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

pub(crate) mod sealed {
    /// Seals [`super::Element`] and carries the widening used by reductions. Only the four types
    /// of [`super::DType`] implement it, so a buffer's `DTYPE` always names its real layout.
    pub trait Sealed {
        /// Widens to the `f32` accumulator (exact for every reducible type).
        fn widen(self) -> f32;
        /// Rounds the accumulator back (round to nearest, ties to even).
        fn narrow(acc: f32) -> Self;
    }
}

/// A type a communicator can move: `f32`, [`half::bf16`], [`half::f16`] or `u8`.
///
/// The trait is sealed: [`Element::DTYPE`] always names the type's real layout, which the backends
/// rely on when they hand raw memory to each other.
pub trait Element:
    Copy + Send + Sync + bytemuck::Pod + sealed::Sealed + fmt::Debug + 'static
{
    /// The dtype tag of this type.
    const DTYPE: DType;
}

impl sealed::Sealed for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    #[inline(always)]
    fn narrow(acc: f32) -> Self {
        acc
    }
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}

impl sealed::Sealed for half::bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn narrow(acc: f32) -> Self {
        half::bf16::from_f32(acc)
    }
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
}

impl sealed::Sealed for half::f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn narrow(acc: f32) -> Self {
        half::f16::from_f32(acc)
    }
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}

impl sealed::Sealed for u8 {
    // Never called: reductions on `U8` are rejected before any data moves. Defined (and not
    // `unreachable!`) so the generic kernels stay panic-free.
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from(self)
    }
    #[inline(always)]
    fn narrow(acc: f32) -> Self {
        acc as u8
    }
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_sizes_match_types() {
        assert_eq!(DType::F32.size_bytes(), size_of::<f32>());
        assert_eq!(DType::BF16.size_bytes(), size_of::<half::bf16>());
        assert_eq!(DType::F16.size_bytes(), size_of::<half::f16>());
        assert_eq!(DType::U8.size_bytes(), size_of::<u8>());
        assert!(!DType::U8.is_reducible());
    }
}
