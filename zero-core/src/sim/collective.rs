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
