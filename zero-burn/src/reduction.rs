//! How gradients (and the reported loss) are summed over micro-batches and ranks.
//!
//! The default, [`Reduction::RankOrdered`], is DeepSpeed's arithmetic: each micro-step's loss is
//! scaled by `1/A`, every rank's gradients are averaged over ranks in rank order (`Mean`), and the
//! `A` averages are added up in micro-step order. Its summation tree depends on the world size, so
//! it is bit-identical across stages but not across world sizes.
//!
//! [`Reduction::CanonicalTree`] makes the arithmetic independent of how the global batch is split
//! into ranks × micro-steps. The `N·A` micro-batches of a step are numbered `m = a·N + rank` (the
//! trainer's data order: micro-step-major), each micro-batch's gradient is computed unscaled, and
//! they are summed over the canonical pairwise tree ([`zero_comm::ReduceOrder::PairwiseTree`]):
//!
//! 1. per micro-step, across ranks, by the communicator (`Sum` in the pairwise-tree order, which
//!    only the host loopback implements);
//! 2. across the `A` micro-steps, by a [`TreeAccumulator`] in the same tree order;
//! 3. then one division by `N·A`.
//!
//! Because aligned power-of-two blocks are subtrees of the canonical tree, steps 1–2 compute the
//! canonical tree over all `N·A` micro-batches whenever `N` is a power of two or `A = 1`. Two such
//! configurations with the same `N·A` (and the same micro-batch size, data and seeds) perform the
//! same floating-point operations on the same values: bit-identical parameters and losses
//! ([`crate::demo::run::global_losses`]). Not covered: gradient clipping (the f64 norm partials are
//! split at shard boundaries that depend on `N`), qwZ (its quantization blocks follow the shards)
//! and qgZ (rejected: its all-to-all has its own order).

use serde::Serialize;
use zero_comm::pairwise_split;

/// The summation order of gradients over micro-batches and ranks (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reduction {
    /// Loss scaled by `1/A`, a rank-ordered `Mean` per micro-step, micro-steps added in order.
    #[default]
    RankOrdered,
    /// Unscaled gradients summed over the canonical pairwise tree of all micro-batches, divided
    /// once by `N·A`: the same bits for every world size that is a power of two. Needs a
    /// communicator whose reductions follow [`zero_comm::ReduceOrder::PairwiseTree`] (the host
    /// loopback built with it; [`crate::demo::train::train`] does this).
    CanonicalTree,
}

/// The canonical pairwise-tree sum of `values`: `[lo, hi)` splits at
/// `lo + `[`pairwise_split`]`(hi - lo)`. The sum of nothing is `0.0`.
pub fn canonical_sum(values: &[f32]) -> f32 {
    match values.len() {
        0 => 0.0,
        1 => values[0],
        n => {
            let (l, r) = values.split_at(pairwise_split(n));
            canonical_sum(l) + canonical_sum(r)
        }
    }
}

/// Extra accumulator levels (beyond the accumulator itself) that streaming `a` leaves through the
/// canonical tree needs: the largest number of pending subtrees, minus one (⌊log₂(a+1)⌋ − 1).
pub fn extra_levels(a: u32) -> usize {
    (1..=a).map(u32::count_ones).max().unwrap_or(1) as usize - 1
}

/// A flat fp32 buffer that [`TreeAccumulator`] keeps its levels and leaves in: host memory
/// (`Vec<f32>`), or the engine's buffers on a device. Each addition is one IEEE addition per
/// element, wherever it runs.
pub trait TreeBuffer: Sized {
    /// Elements.
    fn len(&self) -> usize;
    /// Whether it holds no element.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// `values` as a buffer where `self` lives.
    fn beside(&self, values: Vec<f32>) -> Self;
    /// `leaf[i] = leaf[i] + self[off + i]` for every element of `leaf`.
    fn add_into(&self, off: usize, leaf: &mut Self);
    /// `self[off + i] = leaf[i]` for every element of `leaf`.
    fn put(&mut self, off: usize, leaf: Self);
    /// `self[i] = self[i] + other[i]` for every element.
    fn add_all(&mut self, other: &Self);
}

impl TreeBuffer for Vec<f32> {
    fn len(&self) -> usize {
        <[f32]>::len(self)
    }

    fn beside(&self, values: Vec<f32>) -> Self {
        values
    }

    fn add_into(&self, off: usize, leaf: &mut Self) {
        for (c, &l) in leaf.iter_mut().zip(&self[off..]) {
            *c += l;
        }
    }

    fn put(&mut self, off: usize, leaf: Self) {
        self[off..off + leaf.len()].copy_from_slice(&leaf);
    }

    fn add_all(&mut self, other: &Self) {
        for (l, &r) in self.iter_mut().zip(other) {
            *l += r;
        }
    }
}

/// Streams leaves `0, 1, …, A-1` (one per micro-step) through the canonical pairwise tree,
/// element-wise over a flat buffer, like a binary counter: before leaf `a` the pending subtrees
/// are the set bits of `a` (largest first), leaf `a` merges with the `trailing_ones(a)` smallest
/// of them (left operand first), and [`finish`](Self::finish) folds what is left from the right,
/// which is exactly the tree's right spine.
///
/// Level 0 is the caller's accumulator; the extra levels live here, in buffers of the same kind
/// (host memory by default).
#[derive(Clone, Debug, Default)]
pub struct TreeAccumulator<B = Vec<f32>> {
    levels: Vec<B>,
}

impl TreeAccumulator {
    /// Levels for `a` leaves over a buffer of `len` floats, in host memory.
    pub fn new(a: u32, len: usize) -> Self {
        Self::with(a, || vec![0.0; len])
    }
}

impl<B: TreeBuffer> TreeAccumulator<B> {
    /// Levels for `a` leaves, each a buffer `zeros` makes (the accumulator's length, where it
    /// lives).
    pub fn with(a: u32, zeros: impl FnMut() -> B) -> Self {
        TreeAccumulator {
            levels: std::iter::repeat_with(zeros)
                .take(extra_levels(a))
                .collect(),
        }
    }

    /// Floats held beyond the caller's accumulator.
    pub fn len(&self) -> usize {
        self.levels.iter().map(B::len).sum()
    }

    /// Whether no extra level is needed.
    pub fn is_empty(&self) -> bool {
        self.levels.is_empty()
    }

    fn level<'a>(&'a self, acc: &'a B, k: usize) -> &'a B {
        if k == 0 { acc } else { &self.levels[k - 1] }
    }

    /// Adds leaf number `a` (0-based; its values `leaf`, for `acc[off..off + leaf.len()]`). Every
    /// range of the buffer must receive leaves `0, 1, …` in order, each exactly once.
    pub fn push(&mut self, acc: &mut B, a: u32, off: usize, leaf: Vec<f32>) {
        let depth = a.count_ones() as usize;
        let merges = a.trailing_ones() as usize;
        let mut leaf = acc.beside(leaf);
        for k in 0..merges {
            // left + right; IEEE addition commutes, so this is that sum's bits.
            self.level(acc, depth - 1 - k).add_into(off, &mut leaf);
        }
        match depth - merges {
            0 => acc.put(off, leaf),
            k => self.levels[k - 1].put(off, leaf),
        }
    }

    /// After `a` leaves: folds the pending subtrees into `acc` (the tree's root).
    pub fn finish(&mut self, acc: &mut B, a: u32) {
        let depth = a.count_ones() as usize;
        for k in (1..depth).rev() {
            let (lo, hi) = self.levels.split_at_mut(k - 1);
            let right = &hi[0];
            let left = if k == 1 { &mut *acc } else { &mut lo[k - 2] };
            left.add_all(right);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Leaves whose sums depend on the order.
    fn leaf(i: usize) -> f32 {
        let e = f32::EPSILON / 2.0;
        [1.0, e, e, -1.0, 3.0, e, 1.0e8, -1.0e8, e, 7.0, e][i % 11] * (1.0 + (i % 3) as f32)
    }

    #[test]
    fn canonical_sum_follows_the_rule() {
        let x: Vec<f32> = (0..7).map(leaf).collect();
        let want = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + x[6]);
        assert_eq!(canonical_sum(&x).to_bits(), want.to_bits());
        let x: Vec<f32> = (0..6).map(leaf).collect();
        let want = ((x[0] + x[1]) + (x[2] + x[3])) + (x[4] + x[5]);
        assert_eq!(canonical_sum(&x).to_bits(), want.to_bits());
    }

    #[test]
    fn the_streaming_tree_is_the_canonical_tree() {
        for a in 1..=17u32 {
            // Two elements, pushed in two ranges, with different leaves each.
            let mut acc = vec![0.0f32; 2];
            let mut t = TreeAccumulator::new(a, 2);
            for i in 0..a {
                t.push(&mut acc, i, 0, vec![leaf(i as usize)]);
                t.push(&mut acc, i, 1, vec![leaf(i as usize + 5)]);
            }
            t.finish(&mut acc, a);
            let w0: Vec<f32> = (0..a as usize).map(leaf).collect();
            let w1: Vec<f32> = (0..a as usize).map(|i| leaf(i + 5)).collect();
            assert_eq!(acc[0].to_bits(), canonical_sum(&w0).to_bits(), "a={a}");
            assert_eq!(acc[1].to_bits(), canonical_sum(&w1).to_bits(), "a={a}");
        }
        assert_eq!([1, 2, 3, 4, 7, 8].map(extra_levels), [0, 0, 1, 1, 2, 2]);
    }

    #[test]
    fn blocks_of_a_power_of_two_compose_into_the_canonical_tree() {
        // n ranks (a power of two, or 1 micro-step) summed by the tree, then a micro-steps:
        // the canonical tree over a·n leaves numbered micro-step-major.
        for (n, a) in [
            (1, 4),
            (2, 2),
            (4, 1),
            (2, 3),
            (4, 3),
            (1, 3),
            (3, 1),
            (8, 5),
        ] {
            let leaves: Vec<f32> = (0..n * a).map(leaf).collect();
            let per_micro: Vec<f32> = leaves.chunks(n).map(canonical_sum).collect();
            let mut acc = vec![0.0f32];
            let mut t = TreeAccumulator::new(a as u32, 1);
            for (i, &s) in per_micro.iter().enumerate() {
                t.push(&mut acc, i as u32, 0, vec![s]);
            }
            t.finish(&mut acc, a as u32);
            assert_eq!(
                acc[0].to_bits(),
                canonical_sum(&leaves).to_bits(),
                "n={n} a={a}"
            );
        }
    }
}
