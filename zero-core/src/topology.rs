//! Cluster topology: how many ranks, how they are packed into nodes, and which link a pair of ranks
//! talks over.
//!
//! Ranks are placed on nodes in contiguous blocks, as torchrun and DeepSpeed assume:
//! node `k` holds global ranks `[k·L, (k+1)·L)` where `L = ranks_per_node`.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The class of link between two ranks. Every byte a communicator moves is counted under one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkClass {
    /// Both ranks live on the same node (NVLink, PCIe, shared memory).
    IntraNode,
    /// The ranks live on different nodes (InfiniBand, Ethernet).
    InterNode,
}

impl LinkClass {
    /// Both classes, in a fixed order (for tables and reports).
    pub const ALL: [LinkClass; 2] = [LinkClass::IntraNode, LinkClass::InterNode];

    /// Short lower-case name used in tables and JSON keys.
    pub fn name(self) -> &'static str {
        match self {
            LinkClass::IntraNode => "intra_node",
            LinkClass::InterNode => "inter_node",
        }
    }
}

/// A validated data-parallel topology: `world_size` ranks, `ranks_per_node` per node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawTopology", into = "RawTopology")]
pub struct Topology {
    world_size: usize,
    ranks_per_node: usize,
}

#[derive(Serialize, Deserialize)]
struct RawTopology {
    world_size: usize,
    ranks_per_node: usize,
}

impl TryFrom<RawTopology> for Topology {
    type Error = Error;
    fn try_from(raw: RawTopology) -> Result<Self> {
        Topology::new(raw.world_size, raw.ranks_per_node)
    }
}

impl From<Topology> for RawTopology {
    fn from(t: Topology) -> Self {
        RawTopology {
            world_size: t.world_size,
            ranks_per_node: t.ranks_per_node,
        }
    }
}

/// The largest world size a plan is made for: 2^20 ranks, far beyond any ZeRO run so far (the
/// largest published are in the tens of thousands of GPUs), and small enough that per-rank views
/// and the simulator's groups stay cheap.
pub const MAX_WORLD_SIZE: usize = 1 << 20;

impl Topology {
    /// Checks that `1 ≤ world_size ≤` [`MAX_WORLD_SIZE`], `ranks_per_node ≥ 1` and that nodes are
    /// full.
    pub fn new(world_size: usize, ranks_per_node: usize) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::invalid(
                "topology.world_size",
                "0",
                "a world size of at least 1",
            ));
        }
        if world_size > MAX_WORLD_SIZE {
            return Err(Error::invalid(
                "topology.world_size",
                world_size.to_string(),
                format!("at most {MAX_WORLD_SIZE} ranks (2^20)"),
            ));
        }
        if ranks_per_node == 0 {
            return Err(Error::invalid(
                "topology.ranks_per_node",
                "0",
                "at least 1 rank per node",
            ));
        }
        if !world_size.is_multiple_of(ranks_per_node) {
            return Err(Error::invalid(
                "topology.ranks_per_node",
                ranks_per_node.to_string(),
                format!(
                    "a divisor of world_size {world_size} (nodes must be full): one of {:?}",
                    divisors(world_size)
                ),
            ));
        }
        Ok(Topology {
            world_size,
            ranks_per_node,
        })
    }

    /// A single node holding every rank.
    pub fn single_node(world_size: usize) -> Result<Self> {
        Topology::new(world_size, world_size.max(1))
    }

    /// Number of data-parallel ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Ranks per node (`L`).
    pub fn ranks_per_node(&self) -> usize {
        self.ranks_per_node
    }

    /// Number of nodes.
    pub fn num_nodes(&self) -> usize {
        self.world_size / self.ranks_per_node
    }

    /// The node that holds global rank `rank`.
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.ranks_per_node
    }

    /// The index of `rank` inside its node.
    pub fn local_rank(&self, rank: usize) -> usize {
        rank % self.ranks_per_node
    }

    /// The link class between two global ranks. A rank talking to itself is intra-node.
    pub fn link_class(&self, a: usize, b: usize) -> LinkClass {
        if self.node_of(a) == self.node_of(b) {
            LinkClass::IntraNode
        } else {
            LinkClass::InterNode
        }
    }

    /// The global ranks of node `node`.
    pub fn node_ranks(&self, node: usize) -> std::ops::Range<usize> {
        node * self.ranks_per_node..(node + 1) * self.ranks_per_node
    }

    /// The global ranks that share local index `local` across all nodes (qgZ's inter-node group).
    pub fn cross_node_ranks(&self, local: usize) -> Vec<usize> {
        (0..self.num_nodes())
            .map(|n| n * self.ranks_per_node + local)
            .collect()
    }
}

pub(crate) fn divisors(n: usize) -> Vec<usize> {
    // Pairs (d, n / d) for d ≤ √n: O(√n), not O(n).
    let mut low = Vec::new();
    let mut high = Vec::new();
    let mut d = 1;
    while d <= n / d {
        if n.is_multiple_of(d) {
            low.push(d);
            if d != n / d {
                high.push(n / d);
            }
        }
        d += 1;
    }
    low.extend(high.into_iter().rev());
    low
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisors_are_every_divisor_in_order() {
        for n in 1..=400usize {
            let slow: Vec<usize> = (1..=n).filter(|d| n % d == 0).collect();
            assert_eq!(divisors(n), slow, "n = {n}");
        }
        // Fast for a large n (the old O(n) scan took minutes at 1e11).
        assert_eq!(divisors(99_999_999_999).len(), 12);
    }

    #[test]
    fn a_world_beyond_the_cap_is_refused_not_planned() {
        assert!(Topology::new(MAX_WORLD_SIZE, 8).is_ok());
        let e = Topology::new(MAX_WORLD_SIZE + 8, 8)
            .unwrap_err()
            .to_string();
        assert!(e.contains("at most 1048576 ranks"), "{e}");
        assert!(Topology::new(usize::MAX, 1).is_err());
    }

    #[test]
    fn link_classes_follow_contiguous_nodes() {
        let t = Topology::new(8, 4).unwrap();
        assert_eq!(t.num_nodes(), 2);
        assert_eq!(t.link_class(0, 3), LinkClass::IntraNode);
        assert_eq!(t.link_class(3, 4), LinkClass::InterNode);
        assert_eq!(t.cross_node_ranks(1), vec![1, 5]);
        assert_eq!(t.node_ranks(1), 4..8);
        assert_eq!(t.local_rank(6), 2);
    }

    #[test]
    fn rejects_partial_nodes() {
        let e = Topology::new(6, 4).unwrap_err().to_string();
        assert!(e.contains("divisor of world_size 6"), "{e}");
        assert!(Topology::new(0, 1).is_err());
        assert!(Topology::new(4, 0).is_err());
    }
}
