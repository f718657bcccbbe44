//! Host block-quantization codecs for ZeRO++: int8 for qwZ (quantized weight
//! all-gather) and int4 for qgZ (quantized gradient all-to-all reduction),
//! plus an exact [`Identity`] codec with the same API.
//!
//! # Role
//!
//! This crate fixes the **wire format** and the **arithmetic** of the
//! quantized collectives. The communicator layer calls it to turn a shard into
//! bytes and back; its GPU kernels produce the same bytes and values and are
//! tested against these host codecs. The crate has no collectives and no
//! knowledge of sharding. Feature `wgpu`: WGSL device kernels bit-identical to
//! the host codecs (`wgpu_kernels::WgpuQuantizer`); feature `cuda`: CUDA
//! kernels (checked-in PTX, loaded through cudarc), likewise.
//!
//! Dependencies: `half` (bf16/f16 types and F16C conversions), `thiserror`,
//! and `bytemuck` (used by the `wgpu` feature); `wgpu` and `pollster` with
//! that feature, and `cudarc` with feature `cuda`. It depends on no other
//! `zero-*` crate.
//!
//! # API in one screen
//!
//! ```
//! use zero_quant::{BlockCodec, Int4Block, Int8Block};
//!
//! # fn main() -> zero_quant::Result<()> {
//! let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
//!
//! // qwZ: int8 weights. The caller owns every buffer; nothing allocates.
//! let int8 = Int8Block::default();
//! let mut wire = vec![0u8; int8.encoded_len(x.len())];
//! int8.encode(&x, &mut wire)?;
//! let mut y = vec![0f32; x.len()];
//! int8.decode(&wire, &mut y)?;
//! assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() <= 1.0 / 254.0 + 1e-6));
//!
//! // qgZ: int4 gradients, dequantized and summed in fp32.
//! let int4 = Int4Block::default();
//! let mut wire4 = vec![0u8; int4.encoded_len(x.len())];
//! int4.encode(&x, &mut wire4)?;
//! let mut acc = vec![0f32; x.len()];
//! int4.decode_accumulate(&wire4, &mut acc)?; // acc += x̂
//! int4.decode_accumulate(&wire4, &mut acc)?; // acc += x̂
//! # Ok(())
//! # }
//! ```
//!
//! [`BlockCodec`] is implemented by [`Int8Block`], [`Int4Block`], [`Identity`]
//! and the runtime-selected [`Codec`] enum. Element types are `f32`,
//! [`half::bf16`] and [`half::f16`] ([`Element`]); decode writes the same type
//! the caller passes, so a bf16 shard comes back as bf16 (DeepSpeed's qwZ
//! kernels return fp16 whatever went in, the bug behind DS#3992/#4852/#7775).
//!
//! # Wire layout
//!
//! One byte buffer per tensor (shard, partition) of `n` elements, exactly
//! [`encoded_len(n)`](BlockCodec::encoded_len) bytes; see [`WireLayout`]:
//!
//! ```text
//! [codes][0..3 zero bytes: pad to a multiple of 4][scales: one little-endian f32 per block]
//! ```
//!
//! | codec | codes | scales |
//! |---|---|---|
//! | [`Int8Block`] | `n` bytes; element `i` is byte `i`, an `i8` in `[-127, 127]` | `ceil(n / block_size)` |
//! | [`Int4Block`] | `ceil(n / 2)` bytes; element `2i` in the **low** nibble of byte `i`, element `2i + 1` in the **high** nibble, two's complement nibbles in `[-7, 7]`; after an odd `n` the last high nibble is 0 | `ceil(n / block_size)` |
//! | [`Identity`] | `4n` bytes: each element widened to `f32`, little-endian | none |
//!
//! Blocks are consecutive runs of `block_size` elements starting at element
//! 0; the last block may be partial, so any `n` works (no fallback path). The
//! element count is not on the wire: both ends know it, as in any collective.
//! Each scale is the block's **dequantization multiplier**. Example, int4
//! with block size 4 and `x = [7, -7, 2.5, -0.4, 2]`:
//! bytes `97 03 07 | 00 | 00 00 80 3f 25 49 92 3e`: codes `(7, -7)`, `(3, 0)`,
//! `(7, unused)`; one pad byte; scales `1.0` and `2/7` (test
//! `hand_computed_int4`).
//!
//! # Arithmetic
//!
//! Symmetric block quantization with `qmax = 127` (int8) or `7` (int4). For a
//! block with largest magnitude `absmax`:
//!
//! - `scale = absmax / qmax`, rounded to `f32` (stored);
//! - `q = clamp(round_half_away_from_zero(x * inv), -qmax, qmax)` with
//!   `inv = 1 / scale` computed once per block (rounded to `f32`);
//! - `x̂ = q * scale` (one `f32` multiply; `decode_accumulate` adds that
//!   rounded product, so it equals decode-then-add bit for bit).
//!
//! Rounding is exactly round-half-away-from-zero for every `f32`, computed as
//! `trunc(v + copysign(0.5 - 2^-25, v))` (plain `trunc(v + 0.5)` would round
//! `0.49999997` up). Edge cases: an all-zero block has scale 0 and decodes to
//! exact zeros (`+0.0`; the sign of zero is not kept); a block whose
//! `absmax / qmax` underflows gets the smallest subnormal scale and is
//! quantized with an `f64` reciprocal; a block near `f32::MAX` gets its scale
//! lowered by one ulp so that `qmax * scale` stays finite.
//!
//! # Error bounds
//!
//! Per element, for `f32` elements (tested by property tests over random
//! lengths 1..5000, block sizes, and values from 1e-45 to 3.4e38):
//!
//! ```text
//! |x - x̂| <= absmax / (2 qmax) + 1e-6 * absmax + (qmax + 1) * 2^-150
//! ```
//!
//! - `absmax / 254` for int8 and `absmax / 14` for int4 is the rounding
//!   half-step. `+absmax` maps to `qmax` **exactly** (tested): there is no
//!   clamped off-by-one. DeepSpeed's kernels use `scale = 2^b / (2 absmax)`
//!   (128/absmax for int8), so `+absmax` maps to 128 and clamps to 127, an
//!   error of `absmax/128`; every other element errs by at most `absmax/256`
//!   there. Here every element errs by at most `absmax/254`.
//! - `1e-6 * absmax` covers the `f32` rounding of `1/scale`, `x * inv` and
//!   `q * scale` (worst case below `3e-7 * absmax`).
//! - The last term (at most `2^-143`, about `9e-44`) only matters for blocks
//!   with `absmax < qmax * 2^-126`, whose scale is subnormal.
//!
//! For bf16 and f16 elements the decoded value is additionally rounded to the
//! element type: add `u * |x̂| + m / 2` with unit roundoff `u = 2^-8` (bf16)
//! or `2^-11` (f16) ([`DType::unit_roundoff`]) and `m` the type's smallest
//! subnormal (`2^-133`, `2^-24`).
//!
//! **Idempotence.** Re-encoding decoded `f32` values reproduces the same codes
//! for every block with a normal scale (`absmax >= qmax * 2^-126`); the
//! re-derived scale may differ from the original by an ulp. It also holds for
//! f16 (blocks with `absmax >= 2^-14`) and for bf16 with int4. It is **not**
//! guaranteed for bf16 with int8: rounding `x̂` to bf16's 8-bit significand
//! can move it by up to `127 * 2^-8` code steps relative to the re-derived
//! scale, enough to flip a code.
//!
//! Relative RMS error on 4 Mi values, `rms(x - x̂) / rms(x)`, from
//! `cargo run -p zero-quant --release --example error_table`:
//!
//! | block | int8 Gaussian | int8 Student-t(3) | int4 Gaussian | int4 Student-t(3) | scale bytes / elem |
//! |---:|---:|---:|---:|---:|---:|
//! | 64 | 0.00593 | 0.0108 | 0.108 | 0.182 | 0.0625 |
//! | 256 | 0.00696 | 0.0173 | 0.126 | 0.277 | 0.0156 |
//! | 512 | 0.00742 | 0.0217 | 0.135 | 0.335 | 0.0078 |
//! | 1024 | 0.00786 | 0.0271 | 0.143 | 0.399 | 0.0039 |
//! | 4096 | 0.00867 | 0.0420 | 0.157 | 0.541 | 0.0010 |
//!
//! # Default block sizes
//!
//! Chosen from the table above and the throughput of the same run (encode,
//! one thread, AVX2): below 128 elements per block the per-block work (one
//! division, a scale store) shows, at 5.5-6.5 GiB/s for blocks of 32-64
//! against 9-12 GiB/s from 256 up; from 256 up speed is flat, so the choice
//! is error against scale bytes (`4 / block_size` per element).
//!
//! - [`DEFAULT_INT8_BLOCK`] = **1024**: scale overhead 0.39% of the int8
//!   payload. Against DeepSpeed's ~4096 it cuts RMS error by 9% (Gaussian)
//!   and 35% (heavy tailed) for +0.3% bytes; going down to 256 would buy
//!   another 11% / 36% for +1.2% bytes on every weight all-gather.
//! - [`DEFAULT_INT4_BLOCK`] = **512**: scale overhead 1.6% of the int4
//!   payload. int4 error is large, so a smaller block pays: against 4096 it
//!   cuts error by 14% (Gaussian) and 38% (heavy tailed). Halving again to
//!   256 buys 6% / 17% for another +1.6% bytes.
//!
//! An asymmetric (min/max, zero-point) quantizer was measured too (the
//! `asym` column of the example): 6-7% lower error on Gaussian data and
//! 20-30% on heavy-tailed blocks, at the price of a second per-block value,
//! no exact zero, and no `+absmax -> qmax` guarantee. Halving the symmetric
//! block size buys about as much, so no asymmetric codec is provided.
//!
//! # Errors
//!
//! Every call checks buffer lengths ([`Error::BufferLen`]). Encode rejects
//! NaN and infinities, reporting the first one ([`Error::NonFinite`]); a
//! single one would otherwise turn its whole block into NaN. Decode validates
//! what it reads (scales, codes, padding), so corrupt bytes yield
//! [`Error::InvalidScale`], [`Error::InvalidCode`] or [`Error::Padding`],
//! never NaN. Constructors reject block size 0 and odd int4 block sizes
//! ([`Error::BlockSize`]).
//!
//! # Performance
//!
//! Hot loops are written to autovectorise and are compiled twice on x86-64,
//! baseline and AVX2, chosen at run time; results are bit-identical (same
//! IEEE operations, no FMA). Serial methods never allocate; the `_par`
//! variants split on block boundaries over `std::thread::scope` threads and
//! return exactly what the serial ones return. Single-thread throughput on a
//! 16 MiB f32 tensor, relative to `memcpy` of the same bytes (AVX2 build):
//! int8 encode 0.96x and decode 1.2x, int4 encode 0.8x and decode 1.3x.
//! Figures and commands are in the `## zero-quant` section of the workspace
//! `BENCHMARKS.md`.

mod codec;
#[cfg(feature = "cuda")]
pub mod cuda;
mod cuda_src;
mod element;
mod error;
mod kernels;
#[cfg(feature = "wgpu")]
pub mod wgpu_kernels;

pub use codec::{
    BlockCodec, Codec, DEFAULT_INT4_BLOCK, DEFAULT_INT8_BLOCK, Identity, Int4Block, Int8Block,
    WireLayout,
};
#[cfg(feature = "cuda")]
pub use cuda::CudaQuantizer;
pub use cuda_src::cuda_ptx_header;
pub use element::{DType, Element};
pub use error::{Error, Result};
#[cfg(feature = "wgpu")]
pub use wgpu_kernels::WgpuQuantizer;
