//! The host loopback's reduction orders: [`ReduceOrder::PairwiseTree`] sums exactly the canonical
//! tree (written out by hand here), for world sizes 1 to 8, and differs from the rank-sequential
//! default where the two trees differ.

use half::bf16;
use zero_comm::host::{HostComm, HostWorld};
use zero_comm::{Communicator, ReduceOp, ReduceOrder};
use zero_core::Topology;

use crate::common::*;

fn world(n: usize, order: ReduceOrder) -> Vec<HostComm> {
    HostWorld::new(Topology::single_node(n).unwrap(), SAFE_TIMEOUT)
        .with_reduce_order(order)
        .into_comms()
}

/// The canonical tree over `x[lo..hi]`, written independently of `zero_comm::pairwise_split`:
/// the left part is the largest power of two strictly below the length.
fn tree(x: &[f32]) -> f32 {
    if x.len() == 1 {
        return x[0];
    }
    let mut p = 1;
    while 2 * p < x.len() {
        p *= 2;
    }
    tree(&x[..p]) + tree(&x[p..])
}

fn sequential(x: &[f32]) -> f32 {
    x[1..].iter().fold(x[0], |a, &b| a + b)
}

/// Values where the order matters: big values that cancel and small ones that get absorbed, so
/// `((1 + ε) + ε)` and `(1 + (ε + ε))` round differently.
fn adversarial(rank: usize, len: usize) -> Vec<f32> {
    let e = f32::EPSILON / 2.0;
    let pattern = [
        [1.0, e, e, e, -1.0, 3.0, e, 1.0e8],
        [e, 1.0, e, -1.0, e, -3.0, 2.0 * e, -1.0e8],
    ];
    (0..len)
        .map(|i| pattern[i % 2][(rank + i) % 8] * (1.0 + (i % 5) as f32))
        .collect()
}

fn expected(inputs: &[Vec<f32>], order: ReduceOrder, op: ReduceOp) -> Vec<f32> {
    let n = inputs.len();
    (0..inputs[0].len())
        .map(|i| {
            let x: Vec<f32> = inputs.iter().map(|v| v[i]).collect();
            let s = match order {
                ReduceOrder::PairwiseTree => tree(&x),
                ReduceOrder::RankSequential => sequential(&x),
            };
            match op {
                ReduceOp::Sum => s,
                ReduceOp::Mean => s / n as f32,
            }
        })
        .collect()
}

/// Runs a reduce-scatter and an all-reduce of the adversarial inputs; returns, per rank, the
/// reduce-scatter chunk and the all-reduced buffer, after checking the communicator reports
/// `order` (and so does one split from it).
fn reduce_both(n: usize, c: usize, order: ReduceOrder, op: ReduceOp) -> Vec<(Vec<f32>, Vec<f32>)> {
    run_ranks(world(n, order), |mut comm| {
        assert_eq!(comm.reduce_order(), Some(order));
        let split = comm.split(0, comm.rank()).unwrap();
        assert_eq!(split.reduce_order(), Some(order));
        let me = comm.rank();
        let send = adversarial(me, n * c);
        let chunk = comm.reduce_scatter_host(&send, op).unwrap();
        let mut all = send.clone();
        comm.all_reduce_host(&mut all, op).unwrap();
        (chunk, all)
    })
}

#[test]
fn pairwise_tree_equals_the_hand_written_tree() {
    // 2049 per chunk crosses the host's reduction block.
    for n in 1..=8 {
        for c in [1usize, 5, 2049] {
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| adversarial(r, n * c)).collect();
            for op in [ReduceOp::Sum, ReduceOp::Mean] {
                let want = expected(&inputs, ReduceOrder::PairwiseTree, op);
                for (r, (chunk, all)) in reduce_both(n, c, ReduceOrder::PairwiseTree, op)
                    .iter()
                    .enumerate()
                {
                    let what = format!("n={n} c={c} {op} rank {r}");
                    assert_bits(
                        chunk,
                        &want[r * c..(r + 1) * c],
                        &format!("{what} reduce-scatter"),
                    );
                    assert_bits(all, &want, &format!("{what} all-reduce"));
                }
            }
        }
    }
}

#[test]
fn the_orders_differ_exactly_where_the_trees_do() {
    // n ≤ 2: one tree. n = 3: (x0 + x1) + x2 either way. n ≥ 4: different trees, and the
    // adversarial values make some element round differently.
    let c = 16;
    for n in 1..=8 {
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| adversarial(r, n * c)).collect();
        let tree_want = expected(&inputs, ReduceOrder::PairwiseTree, ReduceOp::Sum);
        let seq_want = expected(&inputs, ReduceOrder::RankSequential, ReduceOp::Sum);
        let seq = reduce_both(n, c, ReduceOrder::RankSequential, ReduceOp::Sum);
        let tree = reduce_both(n, c, ReduceOrder::PairwiseTree, ReduceOp::Sum);
        // The default order is still the sequential one.
        for (r, (chunk, all)) in seq.iter().enumerate() {
            assert_bits(
                chunk,
                &seq_want[r * c..(r + 1) * c],
                &format!("n={n} sequential"),
            );
            assert_bits(all, &seq_want, &format!("n={n} sequential all-reduce"));
        }
        let differs = tree[0]
            .1
            .iter()
            .zip(&seq[0].1)
            .any(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(differs, n >= 4, "n={n}: tree and sequential differ");
        assert_eq!(tree[0].1, tree_want);
    }
    // The default world is rank-sequential.
    let comms = HostWorld::new(Topology::single_node(2).unwrap(), SAFE_TIMEOUT).into_comms();
    assert_eq!(comms[0].reduce_order(), Some(ReduceOrder::RankSequential));
}

#[test]
fn pairwise_tree_accumulates_bf16_in_f32_and_rounds_once() {
    // Four ranks of bf16(1 + 2^-8): (a + b) + (c + d) in f32 is exact, then one rounding.
    let x = bf16::from_f32(1.0 + 1.0 / 256.0);
    let out = run_ranks(world(4, ReduceOrder::PairwiseTree), |mut comm| {
        let mut v = vec![x; 3];
        comm.all_reduce_host(&mut v, ReduceOp::Sum).unwrap();
        v
    });
    for v in out {
        assert_eq!(v, vec![bf16::from_f32(4.0 * (1.0 + 1.0 / 256.0)); 3]);
    }
}
