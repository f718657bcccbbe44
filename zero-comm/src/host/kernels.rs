//! Copy and reduction loops of the host loopback. Slices and fixed-size blocks, so the compiler
//! vectorises them and checks bounds once per block, not per element.

use std::slice;

use crate::communicator::{ReduceOrder, pairwise_split};
use crate::element::{Element, ReduceOp};

/// Elements per reduction block: the `f32` accumulator (8 KiB) stays in L1.
const BLOCK: usize = 2048;

/// Copies `len` elements from `src` to `dst`.
///
/// # Safety
///
/// `src` must be valid for reads and `dst` for writes of `len` elements, the two ranges must not
/// overlap, and no other thread may write `src` or access `dst` during the call.
pub(crate) unsafe fn copy<E: Element>(src: *const E, dst: *mut E, len: usize) {
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

/// `out[i] = op(inputs[0][i], inputs[1][i], …)` for `i < len`, summing in `f32` in `order` and
/// rounding once (see [`ReduceOp`], [`ReduceOrder`]).
///
/// # Safety
///
/// Every `inputs[k]` must be valid for reads and `out` for writes of `len` elements, and no other
/// thread may write any of them or read `out` during the call. `out` may be exactly one of the
/// inputs (same start), but must not partially overlap any input.
pub(crate) unsafe fn reduce<E: Element>(
    inputs: &[*const E],
    out: *mut E,
    len: usize,
    op: ReduceOp,
    order: ReduceOrder,
) {
    let n = inputs.len() as f32;
    let mut acc = [0f32; BLOCK];
    // The tree keeps one partial sum per level of its right spine: ⌈log₂ n⌉ blocks.
    let levels = match order {
        ReduceOrder::RankSequential => 0,
        ReduceOrder::PairwiseTree => inputs.len().next_power_of_two().trailing_zeros() as usize,
    };
    let mut scratch = vec![0f32; levels * BLOCK];
    let mut start = 0;
    while start < len {
        let b = (len - start).min(BLOCK);
        let acc = &mut acc[..b];
        match order {
            ReduceOrder::RankSequential => {
                for (k, &p) in inputs.iter().enumerate() {
                    if k == 0 {
                        // SAFETY: `p` is valid for `len` reads and `start + b <= len`.
                        unsafe { load(p, start, acc) };
                    } else {
                        // SAFETY: as for `load`.
                        unsafe { add(p, start, acc) };
                    }
                }
            }
            // SAFETY: as above, for every input.
            ReduceOrder::PairwiseTree => unsafe { tree(inputs, start, acc, &mut scratch) },
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

/// `dst = widen(p[start..start + dst.len()])`.
///
/// # Safety
///
/// `p` must be valid for reads of `start + dst.len()` elements, not written by anyone meanwhile.
unsafe fn load<E: Element>(p: *const E, start: usize, dst: &mut [f32]) {
    // SAFETY: the caller's contract. The slice lives only in this call, so it never coexists with
    // the `&mut` to the output even when `p` is the output.
    let x = unsafe { slice::from_raw_parts(p.add(start), dst.len()) };
    for (a, &v) in dst.iter_mut().zip(x) {
        *a = v.widen();
    }
}

/// `dst += widen(p[start..start + dst.len()])`.
///
/// # Safety
///
/// As [`load`].
unsafe fn add<E: Element>(p: *const E, start: usize, dst: &mut [f32]) {
    // SAFETY: as in `load`.
    let x = unsafe { slice::from_raw_parts(p.add(start), dst.len()) };
    for (a, &v) in dst.iter_mut().zip(x) {
        *a += v.widen();
    }
}

/// `dst` = the [`ReduceOrder::PairwiseTree`] sum of `inputs` (at least one) over the block at
/// `start`. `scratch` holds `BLOCK` floats per remaining tree level.
///
/// # Safety
///
/// Every input must be valid for reads of `start + dst.len()` elements, not written meanwhile.
unsafe fn tree<E: Element>(
    inputs: &[*const E],
    start: usize,
    dst: &mut [f32],
    scratch: &mut [f32],
) {
    if inputs.len() == 1 {
        // SAFETY: the caller's contract.
        unsafe { load(inputs[0], start, dst) };
        return;
    }
    let (left, right) = inputs.split_at(pairwise_split(inputs.len()));
    // SAFETY: the caller's contract, for each half. The left half may use all of `scratch`: it
    // finishes before `tmp` (its first block) is written.
    unsafe { tree(left, start, dst, scratch) };
    let (tmp, rest) = scratch.split_at_mut(BLOCK);
    let tmp = &mut tmp[..dst.len()];
    // SAFETY: the caller's contract, for the right half.
    unsafe { tree(right, start, tmp, rest) };
    for (a, &v) in dst.iter_mut().zip(tmp.iter()) {
        *a += v;
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
        unsafe {
            reduce(
                &ins,
                out.as_mut_ptr(),
                3000,
                ReduceOp::Sum,
                ReduceOrder::RankSequential,
            )
        };
        assert!(out.iter().all(|&x| x == (1.0 + e) + e));
        // bf16 accumulates in f32: 3 × bf16(1 + 2^-8) rounds once.
        let x = [bf16::from_f32(1.0 + 1.0 / 128.0); 5];
        let ins = [x.as_ptr(), x.as_ptr(), x.as_ptr()];
        let mut out = vec![bf16::ZERO; 5];
        // SAFETY: as above.
        unsafe {
            reduce(
                &ins,
                out.as_mut_ptr(),
                5,
                ReduceOp::Mean,
                ReduceOrder::RankSequential,
            )
        };
        assert_eq!(out[4], x[0]);
    }

    #[test]
    fn reduce_in_place_over_one_input() {
        let mut a: Vec<f32> = (0..5000).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..5000).map(|i| 2.0 * i as f32).collect();
        let out = a.as_mut_ptr();
        let ins = [out.cast_const(), b.as_ptr()];
        // SAFETY: `out` is exactly input 0; lengths match; single-threaded.
        unsafe { reduce(&ins, out, 5000, ReduceOp::Sum, ReduceOrder::RankSequential) };
        assert!(a.iter().enumerate().all(|(i, &x)| x == 3.0 * i as f32));
    }

    #[test]
    fn tree_matches_a_hand_written_tree_across_blocks() {
        // Values whose sums depend on the order; 2 blocks and a bit, so block edges are crossed.
        let len = 2 * BLOCK + 7;
        let ins: Vec<Vec<f32>> = (0..7)
            .map(|k| {
                (0..len)
                    .map(|i| [1.0, f32::EPSILON / 2.0, -1.0, 3.0e-8][(i + k) % 4] * (k + 1) as f32)
                    .collect()
            })
            .collect();
        let ptrs: Vec<*const f32> = ins.iter().map(|v| v.as_ptr()).collect();
        let mut out = vec![0f32; len];
        // SAFETY: every buffer holds `len` elements; single-threaded.
        unsafe {
            reduce(
                &ptrs,
                out.as_mut_ptr(),
                len,
                ReduceOp::Sum,
                ReduceOrder::PairwiseTree,
            )
        };
        for (i, &o) in out.iter().enumerate() {
            let x: Vec<f32> = ins.iter().map(|v| v[i]).collect();
            // 7 leaves: ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + x6).
            let want = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + x[6]);
            assert_eq!(o.to_bits(), want.to_bits(), "element {i}");
        }
    }
}
