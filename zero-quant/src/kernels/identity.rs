//! The identity codec: `f32` little-endian on the wire, checked for finiteness both ways.

#[allow(clippy::wildcard_imports)]
use super::*;

/// Identity codec, encode: `src` widened to `f32`, written little-endian.
#[inline(always)]
pub(super) fn identity_encode_impl<E: Element>(src: &[E], dst: &mut [u8]) -> Result<()> {
    let mut buf = [0f32; CHUNK];
    for (k, (xc, dc)) in src.chunks(CHUNK).zip(dst.chunks_mut(4 * CHUNK)).enumerate() {
        if E::absmax_bits(xc) >= NON_FINITE_BITS {
            return Err(first_non_finite(xc, k * CHUNK));
        }
        if E::INLINE {
            for (d, v) in dc.chunks_exact_mut(4).zip(xc) {
                d.copy_from_slice(&v.load().to_le_bytes());
            }
        } else {
            let b = &mut buf[..xc.len()];
            E::widen(xc, b);
            for (d, v) in dc.chunks_exact_mut(4).zip(b.iter()) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
    Ok(())
}

/// Reads little-endian `f32`s into `y`, checking that all are finite.
#[inline(always)]
fn identity_read(src: &[u8], y: &mut [f32], base: usize) -> Result<()> {
    for (o, s) in y.iter_mut().zip(src.chunks_exact(4)) {
        *o = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
    if <f32 as Sealed>::absmax_bits(y) >= NON_FINITE_BITS {
        return Err(first_non_finite(y, base));
    }
    Ok(())
}

/// Identity codec, decode.
#[inline(always)]
pub(super) fn identity_decode_impl<E: Element>(src: &[u8], dst: &mut [E]) -> Result<()> {
    let mut buf = [0f32; CHUNK];
    for (k, (yc, sc)) in dst.chunks_mut(CHUNK).zip(src.chunks(4 * CHUNK)).enumerate() {
        let b = &mut buf[..yc.len()];
        identity_read(sc, b, k * CHUNK)?;
        E::narrow_finite(b, yc);
        if E::absmax_bits(yc) >= NON_FINITE_BITS {
            let i = first_non_finite_index(yc);
            return Err(Error::Overflow {
                index: k * CHUNK + i,
                value: b[i],
                dtype: E::DTYPE,
            });
        }
    }
    Ok(())
}

/// Identity codec, accumulate. Reads `CHUNK` values at a time so that a
/// non-finite wire value is reported before anything is added from its chunk.
#[inline(always)]
pub(super) fn identity_accumulate_impl(src: &[u8], acc: &mut [f32]) -> Result<()> {
    let mut buf = [0f32; CHUNK];
    for (k, (a, s)) in acc.chunks_mut(CHUNK).zip(src.chunks(4 * CHUNK)).enumerate() {
        let b = &mut buf[..a.len()];
        identity_read(s, b, k * CHUNK)?;
        for (o, v) in a.iter_mut().zip(b.iter()) {
            *o += *v;
        }
    }
    Ok(())
}
