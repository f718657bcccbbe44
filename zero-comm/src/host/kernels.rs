//! Copy and reduction loops of the host loopback. Slices and fixed-size blocks, so the compiler
//! vectorises them and checks bounds once per block, not per element.

use std::slice;

use crate::element::{Element, ReduceOp};

/// Elements per reduction block: the `f32` accumulator (8 KiB) stays in L1.
const BLOCK: usize = 2048;

/// Copies `len` elements from `src` to `dst`.
///
/// # Safety
///
/// `src` must be valid for reads and `dst` for writes of `len` elements, the two ranges must not
/// overlap, and no other thread may write `src` or access `dst` during the call.
pub(super) unsafe fn copy<E: Element>(src: *const E, dst: *mut E, len: usize) {
    if len == 0 {
        return;
    }
    // SAFETY: the caller guarantees both ranges are valid, disjoint and not concurrently mutated.
    let (s, d) = unsafe {
        (
            slice::from_raw_parts(src, len),
            slice::from_raw_parts_mut(dst, len),
        )
    };
    d.copy_from_slice(s);
}

/// `out[i] = op(inputs[0][i], inputs[1][i], …)` for `i < len`, summing in input order in `f32`
/// and rounding once (see [`ReduceOp`]).
///
/// # Safety
///
/// Every `inputs[k]` must be valid for reads and `out` for writes of `len` elements, and no other
/// thread may write any of them or read `out` during the call. `out` may be exactly one of the
/// inputs (same start), but must not partially overlap any input.
pub(super) unsafe fn reduce<E: Element>(
    inputs: &[*const E],
    out: *mut E,
    len: usize,
    op: ReduceOp,
) {
    let n = inputs.len() as f32;
    let mut acc = [0f32; BLOCK];
    let mut start = 0;
    while start < len {
        let b = (len - start).min(BLOCK);
        let acc = &mut acc[..b];
        for (k, &p) in inputs.iter().enumerate() {
            // SAFETY: `p` is valid for `len` reads and `start + b <= len`. The slice lives only in
            // this iteration, so it never coexists with the `&mut` to `out` below even when
            // `p == out`.
            let x = unsafe { slice::from_raw_parts(p.add(start), b) };
            if k == 0 {
                for (a, &v) in acc.iter_mut().zip(x) {
                    *a = v.widen();
                }
            } else {
                for (a, &v) in acc.iter_mut().zip(x) {
                    *a += v.widen();
                }
            }
        }
        // SAFETY: `out` is valid for `len` writes, no input slice is alive, and no other thread
        // accesses this range.
        let o = unsafe { slice::from_raw_parts_mut(out.add(start), b) };
        match op {
            ReduceOp::Sum => {
                for (o, &a) in o.iter_mut().zip(acc.iter()) {
                    *o = E::narrow(a);
                }
            }
            ReduceOp::Mean => {
                for (o, &a) in o.iter_mut().zip(acc.iter()) {
                    *o = E::narrow(a / n);
                }
            }
        }
        start += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn reduce_is_rank_ordered_and_rounds_once() {
        // 1 + 2^-24 + 2^-24 in order: (1 + 2^-24) rounds to 1, then again to 1.
        let e = f32::EPSILON / 2.0;
        let a = vec![1.0f32; 3000];
        let b = vec![e; 3000];
        let c = vec![e; 3000];
        let mut out = vec![0f32; 3000];
        let ins = [a.as_ptr(), b.as_ptr(), c.as_ptr()];
        // SAFETY: all buffers hold 3000 elements, single-threaded.
        unsafe { reduce(&ins, out.as_mut_ptr(), 3000, ReduceOp::Sum) };
        assert!(out.iter().all(|&x| x == (1.0 + e) + e));
        // bf16 accumulates in f32: 3 × bf16(1 + 2^-8) rounds once.
        let x = [bf16::from_f32(1.0 + 1.0 / 128.0); 5];
        let ins = [x.as_ptr(), x.as_ptr(), x.as_ptr()];
        let mut out = vec![bf16::ZERO; 5];
        // SAFETY: as above.
        unsafe { reduce(&ins, out.as_mut_ptr(), 5, ReduceOp::Mean) };
        assert_eq!(out[4], x[0]);
    }

    #[test]
    fn reduce_in_place_over_one_input() {
        let mut a: Vec<f32> = (0..5000).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..5000).map(|i| 2.0 * i as f32).collect();
        let out = a.as_mut_ptr();
        let ins = [out.cast_const(), b.as_ptr()];
        // SAFETY: `out` is exactly input 0; lengths match; single-threaded.
        unsafe { reduce(&ins, out, 5000, ReduceOp::Sum) };
        assert!(a.iter().enumerate().all(|(i, &x)| x == 3.0 * i as f32));
    }
}
