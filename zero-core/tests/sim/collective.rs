//! [`collective::cost`] by hand: ring, tree and direct algorithms, NIC-bound cross-node groups
//! and the protocol choice.

use zero_core::Collective;
use zero_core::sim::Cluster;
use zero_core::sim::collective::{Algorithm, GroupShape, cost};

use super::toy;

/// `n` ranks on `nodes` nodes of `per_node`.
fn group(n: usize, nodes: usize, per_node: usize) -> GroupShape {
    GroupShape { n, nodes, per_node }
}

fn close(a: f64, b: f64) {
    assert!((a - b).abs() <= 1e-12 + 1e-9 * b.abs(), "{a} vs {b}");
}

#[test]
fn intra_node_ring_all_gather() {
    // 4 ranks, 1 node, 1 GB: (3/4)·1e9 / 100e9 = 7.5 ms, plus 10 µs + 3 hops · 1 µs.
    let g = group(4, 1, 4);
    let (a, c) = cost(&toy(4), g, Collective::AllGather, 1e9);
    assert_eq!(a, Algorithm::Ring);
    close(c.intra_bytes_per_gpu, 0.75e9);
    close(c.inter_bytes_per_node, 0.0);
    close(c.seconds, 13e-6 + 7.5e-3);
}

#[test]
fn cross_node_ring_is_bound_by_the_node_nics() {
    // 8 ranks on 2 nodes of 4, 1 GB: NIC bytes per node (7/8)·1e9 over 10 GB/s = 87.5 ms;
    // NVLink (7/8)·(3/4)·1e9 over 100 GB/s is hidden under it. Hops: 6 intra, 1 inter.
    let g = group(8, 2, 4);
    let (_, c) = cost(&toy(4), g, Collective::ReduceScatter, 1e9);
    close(c.inter_bytes_per_node, 0.875e9);
    close(c.intra_bytes_per_gpu, 0.875e9 * 0.75);
    close(c.latency_seconds, (10.0 + 6.0 + 5.0) * 1e-6);
    close(c.seconds, 21e-6 + 87.5e-3);
}

#[test]
fn all_reduce_takes_the_tree_when_latency_dominates() {
    // 64 nodes of 4, 1 KB: ring hops 2·(256−64) intra + 2·63 inter = 384 + 630 µs; tree
    // 2·3 + 2·6·5 = 66 µs. Bandwidth: 2·(255/256)·1e3 / 10e9 ≈ 0.2 µs.
    let g = group(256, 64, 4);
    let (a, c) = cost(&toy(4), g, Collective::AllReduce, 1e3);
    assert_eq!(a, Algorithm::Tree);
    close(c.latency_seconds, (10.0 + 6.0 + 60.0) * 1e-6);
    close(c.seconds, 76e-6 + 2.0 * 255.0 / 256.0 * 1e3 / 10e9);
    // At 1 GB ring and tree share the bandwidth term: NIC busy time is 2·(255/256)·1 GB / 10 GB/s.
    let (_, big) = cost(&toy(4), g, Collective::AllReduce, 1e9);
    close(big.inter_seconds, 2.0 * 255.0 / 256.0 * 0.1);
}

#[test]
fn cross_node_all_to_all_shares_the_nics_with_the_other_local_ranks() {
    // qgZ's cross-node group: 1 rank on each of 4 nodes; the node's 4 local ranks run their
    // groups at once, so each gets 10/4 = 2.5 GB/s. Buffer 1 MB per rank: 3/4 of it leaves.
    let g = group(4, 4, 1);
    let (a, c) = cost(&toy(4), g, Collective::AllToAll, 1e6);
    assert_eq!(a, Algorithm::Direct);
    close(c.inter_bytes_per_node, 0.75e6);
    close(c.seconds, (10.0 + 2.0 * 5.0) * 1e-6 + 0.75e6 / 2.5e9);
}

#[test]
fn small_messages_pick_the_low_latency_protocol() {
    let c = Cluster::preset("dgx-h100").unwrap();
    let g = group(8, 1, 8);
    let (_, small) = cost(&c, g, Collective::AllGather, 8e3);
    assert_eq!(c.protocols[small.protocol].name, "ll");
    // 6.6 µs + 7 · 0.6 µs, plus 7 KB at half of 360 GB/s.
    close(small.seconds, 10.8e-6 + 7e3 / 180e9);
    let (_, big) = cost(&c, g, Collective::AllGather, 1e9);
    assert_eq!(c.protocols[big.protocol].name, "simple");
    // A group of one moves nothing.
    let one = group(1, 1, 1);
    assert_eq!(cost(&c, one, Collective::AllGather, 1e9).1.seconds, 0.0);
}
