//! The integer formats: int8, one code a byte, and int4, two codes a byte.

#[allow(clippy::wildcard_imports)]
use super::*;

/// int8: one code per byte, `i8` two's complement, range `[-127, 127]`.
#[derive(Debug)]
pub(crate) enum I8 {}

impl QFormat for I8 {
    const NAME: &'static str = "int8";
    const QMAX: i32 = 127;

    #[inline(always)]
    fn codes_len(n: usize) -> usize {
        n
    }

    #[inline(always)]
    fn quant<E: Sealed>(x: &[E], inv: f32, codes: &mut [u8]) {
        for (o, &v) in codes.iter_mut().zip(x) {
            *o = quantize(v.load() * inv, 127.0) as i8 as u8;
        }
    }

    #[inline(always)]
    fn dequant<E: Sealed>(codes: &[u8], scale: f32, y: &mut [E]) {
        for (o, &c) in y.iter_mut().zip(codes) {
            *o = E::store_finite(f32::from(c as i8) * scale);
        }
    }

    #[inline(always)]
    fn dequant_add(codes: &[u8], scale: f32, acc: &mut [f32]) {
        for (o, &c) in acc.iter_mut().zip(codes) {
            *o += f32::from(c as i8) * scale;
        }
    }

    fn code_at(codes: &[u8], i: usize) -> i8 {
        codes[i] as i8
    }

    #[inline(always)]
    fn find_invalid(codes: &[u8], _n: usize) -> Option<(usize, u8)> {
        let bad = codes.iter().fold(false, |a, &c| a | (c == 0x80));
        if !bad {
            return None;
        }
        codes.iter().position(|&c| c == 0x80).map(|i| (i, 0x80))
    }
}

/// int4: two codes per byte (element `2i` in the low nibble, `2i+1` in the
/// high nibble), two's complement nibbles, range `[-7, 7]`.
#[derive(Debug)]
pub(crate) enum I4 {}

/// Sign-extends the low nibble of `c`.
#[inline(always)]
fn lo_nibble(c: u8) -> i8 {
    ((c << 4) as i8) >> 4
}

/// Sign-extends the high nibble of `c`.
#[inline(always)]
fn hi_nibble(c: u8) -> i8 {
    (c as i8) >> 4
}

impl QFormat for I4 {
    const NAME: &'static str = "int4";
    const QMAX: i32 = 7;

    #[inline(always)]
    fn codes_len(n: usize) -> usize {
        n.div_ceil(2)
    }

    #[inline(always)]
    fn quant<E: Sealed>(x: &[E], inv: f32, codes: &mut [u8]) {
        // Groups of 32 through a small array: quantize, then pack. LLVM
        // vectorises this shape far better than a loop over pairs.
        let groups = x.chunks_exact(32);
        let rest = groups.remainder();
        let (head, out) = codes.split_at_mut(16 * (x.len() / 32));
        for (g, o) in groups.zip(head.chunks_exact_mut(16)) {
            let mut t = [0u8; 32];
            for (ti, &v) in t.iter_mut().zip(g) {
                *ti = quantize(v.load() * inv, 7.0) as u8;
            }
            for (oi, p) in o.iter_mut().zip(t.chunks_exact(2)) {
                *oi = (p[0] & 0x0f) | (p[1] << 4);
            }
        }
        let pairs = rest.chunks_exact(2);
        let tail = pairs.remainder();
        for (o, p) in out.iter_mut().zip(pairs) {
            let lo = quantize(p[0].load() * inv, 7.0) as u8;
            let hi = quantize(p[1].load() * inv, 7.0) as u8;
            *o = (lo & 0x0f) | (hi << 4);
        }
        if let [last] = tail {
            out[rest.len() / 2] = quantize(last.load() * inv, 7.0) as u8 & 0x0f;
        }
    }

    #[inline(always)]
    fn dequant<E: Sealed>(codes: &[u8], scale: f32, y: &mut [E]) {
        let mut pairs = y.chunks_exact_mut(2);
        for (o, &c) in (&mut pairs).zip(codes) {
            o[0] = E::store_finite(f32::from(lo_nibble(c)) * scale);
            o[1] = E::store_finite(f32::from(hi_nibble(c)) * scale);
        }
        if let [last] = pairs.into_remainder() {
            *last = E::store_finite(f32::from(lo_nibble(codes[codes.len() - 1])) * scale);
        }
    }

    #[inline(always)]
    fn dequant_add(codes: &[u8], scale: f32, acc: &mut [f32]) {
        let mut pairs = acc.chunks_exact_mut(2);
        for (o, &c) in (&mut pairs).zip(codes) {
            o[0] += f32::from(lo_nibble(c)) * scale;
            o[1] += f32::from(hi_nibble(c)) * scale;
        }
        if let [last] = pairs.into_remainder() {
            *last += f32::from(lo_nibble(codes[codes.len() - 1])) * scale;
        }
    }

    fn code_at(codes: &[u8], i: usize) -> i8 {
        let c = codes[i / 2];
        if i.is_multiple_of(2) {
            lo_nibble(c)
        } else {
            hi_nibble(c)
        }
    }

    #[inline(always)]
    fn find_invalid(codes: &[u8], n: usize) -> Option<(usize, u8)> {
        // Nibble 0x8 is -8. The unused high nibble of an odd tail is checked
        // as padding by the caller (it must be 0, which is valid here).
        let bad = codes.iter().fold(false, |a, &c| {
            a | ((c & 0x0f) == 0x08) | ((c & 0xf0) == 0x80)
        });
        if !bad {
            return None;
        }
        (0..n).find_map(|i| {
            let c = codes[i / 2];
            let nib = if i % 2 == 0 { c & 0x0f } else { c >> 4 };
            (nib == 0x08).then_some((i, nib))
        })
    }
}
