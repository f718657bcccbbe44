//! The host loopback's α-β probe: what `cargo bench -p zero-comm --bench host_loopback` prints to
//! calibrate the simulator's `host-loopback` cluster, and what `cargo xtask simulate
//! --validate-host` measures in-process. Both time the trainer's path (`all_gather_host`: upload,
//! gather, download), on a topology of nodes of `ranks_per_node`, over the world and over every
//! node's group at once (as hpZ's and qgZ's groups run), each call after a barrier, on rank 0.

use std::time::{Duration, Instant};

use zero_core::Topology;

use super::HostWorld;
use crate::communicator::Communicator;
use crate::error::Result;

/// Median seconds of one `all_gather_host` call, on rank 0.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AllGatherMedians {
    /// Over the world, 0 bytes per rank.
    pub world_empty: f64,
    /// Over the world, `bytes / world_size` per rank (a `bytes` output).
    pub world_full: f64,
    /// Over each node's group at once, 0 bytes per rank.
    pub node_empty: f64,
    /// Over each node's group at once, `bytes / ranks_per_node` per rank.
    pub node_full: f64,
    /// The output size timed, in bytes.
    pub bytes: usize,
}

/// The α-β values [`AllGatherMedians::fit`] derives, in the simulator's terms.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AlphaBeta {
    /// Latency of a call besides its hops, µs.
    pub base_us: f64,
    /// Latency per hop (intra- and inter-node alike), µs.
    pub hop_us: f64,
    /// The world ring's bandwidth, bytes/s (a node's NIC in the simulator).
    pub world_bytes_per_s: f64,
    /// A node group's bandwidth with every group busy at once, bytes/s.
    pub node_bytes_per_s: f64,
}

impl AllGatherMedians {
    /// The α-β fit on `topo`, with `f = (n−1)/n`: α_node = base + h, α_world = base + 3h (two
    /// intra-node hops, one inter-node), a hop costing at most the whole node latency (under load
    /// the world's latency can exceed three node latencies; the node's is then kept exact);
    /// B_world = f_world·S / (t_world − α_world), B_node = f_node·S / (t_node − α_node).
    pub fn fit(&self, topo: Topology) -> AlphaBeta {
        let s = self.bytes as f64;
        let (n, k) = (topo.world_size() as f64, topo.ranks_per_node() as f64);
        let h = ((self.world_empty - self.node_empty) / 2.0).clamp(0.0, self.node_empty);
        AlphaBeta {
            base_us: (self.node_empty - h) * 1e6,
            hop_us: h * 1e6,
            world_bytes_per_s: (n - 1.0) / n * s / (self.world_full - self.world_empty),
            node_bytes_per_s: (k - 1.0) / k * s / (self.node_full - self.node_empty),
        }
    }
}

/// Medians over `reps` calls of each kind (after one warm-up), with a `bytes` output; every
/// collective has `timeout`.
pub fn all_gather_medians(
    topo: Topology,
    bytes: usize,
    reps: usize,
    timeout: Duration,
) -> Result<AllGatherMedians> {
    let elems = bytes / 4;
    let results = HostWorld::new(topo, timeout).launch(|mut world| -> Result<Vec<f64>> {
        let rank = world.global_rank();
        let mut node = world.split(rank / topo.ranks_per_node(), rank)?;
        let (n, k) = (world.world_size(), node.world_size());
        let data: Vec<f32> = (0..elems).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut t: Vec<Vec<f64>> = (0..4).map(|_| Vec::with_capacity(reps)).collect();
        for rep in 0..=reps {
            let mut time = |i: usize, on_node: bool, len: usize| -> Result<()> {
                world.barrier()?;
                let s = Instant::now();
                if on_node {
                    node.all_gather_host(&data[..len])?;
                } else {
                    world.all_gather_host(&data[..len])?;
                }
                if rep > 0 {
                    t[i].push(s.elapsed().as_secs_f64());
                }
                Ok(())
            };
            time(0, false, 0)?;
            time(1, false, elems / n)?;
            time(2, true, 0)?;
            time(3, true, elems / k)?;
        }
        Ok(t.into_iter()
            .map(|mut v| {
                v.sort_by(f64::total_cmp);
                v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
            })
            .collect())
    });
    let mut med = Vec::new();
    for r in results {
        // Every rank's result is checked; rank 0's medians are the ones kept.
        let v = r.map_err(|_| crate::Error::Backend("a rank of the probe panicked".into()))??;
        if med.is_empty() {
            med = v;
        }
    }
    Ok(AllGatherMedians {
        world_empty: med[0],
        world_full: med[1],
        node_empty: med[2],
        node_full: med[3],
        bytes: elems * 4,
    })
}
