//! α-β cost of one collective: the algorithm NCCL would run (ring, tree, direct all-to-all), the
//! protocol it would pick (the fastest of the cluster's), and the bytes each link class carries.
//!
//! A group of `n` ranks spans `m` nodes with `l` ranks on each (`n = m·l`). `S` is the buffer
//! in nccl-tests' sense: the all-gather output or reduce-scatter input (`n` chunks), the
//! all-reduce buffer, the all-to-all buffer of one rank. With `f = (n−1)/n`:
//!
//! | collective | NVLink bytes per GPU | NIC bytes per node | hops intra / inter |
//! |---|---|---|---|
//! | all-gather, reduce-scatter (ring) | `f·S` (`m = 1`), `f·S·(l−1)/l` (`m > 1`) | `f·S` (`m > 1`) | `n−m` / `m−1` |
//! | all-reduce (ring) | twice that | twice that | `2(n−m)` / `2(m−1)` |
//! | all-reduce (tree, `m > 1`) | as the ring | as the ring | `2(l−1)` / `2⌈log₂ m⌉` |
//! | all-to-all (direct) | `S·(l−1)/n` | `l·S·(n−l)/n` | `⌈log₂ n⌉` of the slowest class |
//!
//! A ring forwards every chunk through every node once, so a node's NICs carry `f·S` however
//! many of its GPUs are in the ring; an all-to-all sends each piece straight to its peer, so a
//! node's NICs carry every remote piece of its `l` ranks. The node's NIC bandwidth `B_node` is
//! shared by the `L/l` groups that run at once on it (qgZ's cross-node groups: one per local
//! rank), so the group gets `B_node·l/L`.
//!
//! Time with protocol `p`: `base_p + hops_intra·hop_intra_p + hops_inter·hop_inter_p +
//! max(NVLink bytes / B_intra, NIC bytes / B_share) / eff_p`. The two link classes work at once
//! (the ring is pipelined), so the slower one bounds the transfer. The minimum over protocols
//! (and, for all-reduce across nodes, over ring and tree) is taken, as NCCL's tuner does.

use serde::Serialize;

use crate::sim::cluster::Cluster;
use crate::traffic::Collective;

/// How a group's ranks sit on nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct GroupShape {
    /// Ranks in the group.
    pub n: usize,
    /// Nodes it spans.
    pub nodes: usize,
    /// Ranks of the group on each of those nodes.
    pub per_node: usize,
}

/// The algorithm a collective runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Nothing moves (a group of one, or no bytes).
    None,
    /// A ring over the group.
    Ring,
    /// NCCL's tree all-reduce: a chain inside nodes, a binary tree across them.
    Tree,
    /// Point-to-point sends to every peer at once.
    Direct,
}

/// The cost of one collective call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct OpCost {
    /// Wall time of the call, s.
    pub seconds: f64,
    /// Its latency part (base plus hops), s.
    pub latency_seconds: f64,
    /// NVLink busy time, s.
    pub intra_seconds: f64,
    /// NIC busy time, s.
    pub inter_seconds: f64,
    /// Bytes one GPU sends over NVLink.
    pub intra_bytes_per_gpu: f64,
    /// Bytes one node sends over its NICs.
    pub inter_bytes_per_node: f64,
    /// Index of the protocol chosen in [`Cluster::protocols`].
    pub protocol: usize,
}

/// The cost of `collective` over `g` with buffer `s` bytes, and the algorithm that gives it.
pub fn cost(
    cluster: &Cluster,
    g: GroupShape,
    collective: Collective,
    s: f64,
) -> (Algorithm, OpCost) {
    let (n, m, l) = (g.n as f64, g.nodes as f64, g.per_node as f64);
    if g.n <= 1 || (s <= 0.0 && collective != Collective::Barrier) {
        return (Algorithm::None, OpCost::default());
    }
    let f = (n - 1.0) / n;
    let ring = |factor: f64| {
        let intra = if g.nodes == 1 {
            f * s
        } else {
            f * s * (l - 1.0) / l
        };
        let inter = if g.nodes == 1 { 0.0 } else { f * s };
        (
            factor * intra,
            factor * inter,
            factor * (n - m),
            factor * (m - 1.0),
        )
    };
    let mut candidates: Vec<(Algorithm, (f64, f64, f64, f64))> = Vec::new();
    match collective {
        Collective::AllGather | Collective::ReduceScatter | Collective::Broadcast => {
            candidates.push((Algorithm::Ring, ring(1.0)));
        }
        Collective::AllReduce | Collective::Barrier => {
            let r = ring(2.0);
            candidates.push((Algorithm::Ring, r));
            if g.nodes > 1 {
                let log_m = (g.nodes as f64).log2().ceil();
                candidates.push((Algorithm::Tree, (r.0, r.1, 2.0 * (l - 1.0), 2.0 * log_m)));
            }
        }
        Collective::AllToAll => {
            let intra = s * (l - 1.0) / n;
            let inter = l * s * (n - l) / n;
            let hops = n.log2().ceil().max(1.0);
            let (hi, he) = if g.nodes > 1 {
                (0.0, hops)
            } else {
                (hops, 0.0)
            };
            candidates.push((Algorithm::Direct, (intra, inter, hi, he)));
        }
    }
    let b_intra = cluster.intra_bytes_per_s();
    let b_share = cluster.node_nic_bytes_per_s() * l / cluster.gpus_per_node.max(g.per_node) as f64;
    let mut best = (
        Algorithm::None,
        OpCost {
            seconds: f64::INFINITY,
            ..OpCost::default()
        },
    );
    for (alg, (vi, ve, hi, he)) in candidates {
        for (pi, p) in cluster.protocols.iter().enumerate() {
            let lat = (p.base_us + hi * p.intra_hop_us + he * p.inter_hop_us) * 1e-6;
            let ti = vi / b_intra / p.bw_efficiency;
            let te = ve / b_share / p.bw_efficiency;
            let t = lat + ti.max(te);
            if t < best.1.seconds {
                best = (
                    alg,
                    OpCost {
                        seconds: t,
                        latency_seconds: lat,
                        intra_seconds: ti,
                        inter_seconds: te,
                        intra_bytes_per_gpu: vi,
                        inter_bytes_per_node: ve,
                        protocol: pi,
                    },
                );
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::cluster::Protocol;

    /// One protocol, round numbers: 100 GB/s NVLink, 10 GB/s of NIC per node, 4 GPUs per node,
    /// base 10 µs, hops 1 µs intra and 5 µs inter.
    fn toy() -> Cluster {
        let mut c = Cluster::preset("dgx-a100").unwrap();
        c.gpus_per_node = 4;
        c.intra.gbytes_per_s = 100.0;
        c.intra.efficiency = 1.0;
        c.inter.nics_per_node = 1;
        c.inter.nic_gbps = 80.0;
        c.inter.efficiency = 1.0;
        c.protocols = vec![Protocol {
            name: "simple".into(),
            bw_efficiency: 1.0,
            base_us: 10.0,
            intra_hop_us: 1.0,
            inter_hop_us: 5.0,
        }];
        c
    }

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() <= 1e-12 + 1e-9 * b.abs(), "{a} vs {b}");
    }

    #[test]
    fn intra_node_ring_all_gather() {
        // 4 ranks, 1 node, 1 GB: (3/4)·1e9 / 100e9 = 7.5 ms, plus 10 µs + 3 hops · 1 µs.
        let g = GroupShape {
            n: 4,
            nodes: 1,
            per_node: 4,
        };
        let (a, c) = cost(&toy(), g, Collective::AllGather, 1e9);
        assert_eq!(a, Algorithm::Ring);
        close(c.intra_bytes_per_gpu, 0.75e9);
        close(c.inter_bytes_per_node, 0.0);
        close(c.seconds, 13e-6 + 7.5e-3);
    }

    #[test]
    fn cross_node_ring_is_bound_by_the_node_nics() {
        // 8 ranks on 2 nodes of 4, 1 GB: NIC bytes per node (7/8)·1e9 over 10 GB/s = 87.5 ms;
        // NVLink (7/8)·(3/4)·1e9 over 100 GB/s is hidden under it. Hops: 6 intra, 1 inter.
        let g = GroupShape {
            n: 8,
            nodes: 2,
            per_node: 4,
        };
        let (_, c) = cost(&toy(), g, Collective::ReduceScatter, 1e9);
        close(c.inter_bytes_per_node, 0.875e9);
        close(c.intra_bytes_per_gpu, 0.875e9 * 0.75);
        close(c.latency_seconds, (10.0 + 6.0 + 5.0) * 1e-6);
        close(c.seconds, 21e-6 + 87.5e-3);
    }

    #[test]
    fn all_reduce_takes_the_tree_when_latency_dominates() {
        // 64 nodes of 4, 1 KB: ring hops 2·(256−64) intra + 2·63 inter = 384 + 630 µs; tree
        // 2·3 + 2·6·5 = 66 µs. Bandwidth: 2·(255/256)·1e3 / 10e9 ≈ 0.2 µs.
        let g = GroupShape {
            n: 256,
            nodes: 64,
            per_node: 4,
        };
        let (a, c) = cost(&toy(), g, Collective::AllReduce, 1e3);
        assert_eq!(a, Algorithm::Tree);
        close(c.latency_seconds, (10.0 + 6.0 + 60.0) * 1e-6);
        close(c.seconds, 76e-6 + 2.0 * 255.0 / 256.0 * 1e3 / 10e9);
        // At 1 GB ring and tree share the bandwidth term: NIC busy time is 2·(255/256)·1 GB / 10 GB/s.
        let (_, big) = cost(&toy(), g, Collective::AllReduce, 1e9);
        close(big.inter_seconds, 2.0 * 255.0 / 256.0 * 0.1);
    }

    #[test]
    fn cross_node_all_to_all_shares_the_nics_with_the_other_local_ranks() {
        // qgZ's cross-node group: 1 rank on each of 4 nodes; the node's 4 local ranks run their
        // groups at once, so each gets 10/4 = 2.5 GB/s. Buffer 1 MB per rank: 3/4 of it leaves.
        let g = GroupShape {
            n: 4,
            nodes: 4,
            per_node: 1,
        };
        let (a, c) = cost(&toy(), g, Collective::AllToAll, 1e6);
        assert_eq!(a, Algorithm::Direct);
        close(c.inter_bytes_per_node, 0.75e6);
        close(c.seconds, (10.0 + 2.0 * 5.0) * 1e-6 + 0.75e6 / 2.5e9);
    }

    #[test]
    fn small_messages_pick_the_low_latency_protocol() {
        let c = Cluster::preset("dgx-h100").unwrap();
        let g = GroupShape {
            n: 8,
            nodes: 1,
            per_node: 8,
        };
        let (_, small) = cost(&c, g, Collective::AllGather, 8e3);
        assert_eq!(c.protocols[small.protocol].name, "ll");
        // 6.6 µs + 7 · 0.6 µs, plus 7 KB at half of 360 GB/s.
        close(small.seconds, 10.8e-6 + 7e3 / 180e9);
        let (_, big) = cost(&c, g, Collective::AllGather, 1e9);
        assert_eq!(c.protocols[big.protocol].name, "simple");
        // A group of one moves nothing.
        let one = GroupShape {
            n: 1,
            nodes: 1,
            per_node: 1,
        };
        assert_eq!(cost(&c, one, Collective::AllGather, 1e9).1.seconds, 0.0);
    }
}
