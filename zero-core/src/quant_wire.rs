//! Wire sizes of zero-quant's block codecs, for the plan's byte predictions.
//!
//! Layout (zero-quant's, fixed): `[codes][zero padding to a 4-byte boundary][one little-endian
//! f32 scale per block]`. int8 stores one byte per element; int4 packs two elements per byte.
//! zero-comm's tests check these against zero-quant's own `encoded_len`.

/// Bytes of `n` elements encoded as block int8 with `block`-element blocks.
pub fn int8_wire_len(n: u64, block: u64) -> u64 {
    n.next_multiple_of(4) + 4 * n.div_ceil(block)
}

/// Bytes of `n` elements encoded as block int4 with `block`-element blocks.
pub fn int4_wire_len(n: u64, block: u64) -> u64 {
    n.div_ceil(2).next_multiple_of(4) + 4 * n.div_ceil(block)
}
