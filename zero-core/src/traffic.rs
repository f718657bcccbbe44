//! Traffic accounting shared by the plan (prediction) and the communicators (measurement).
//!
//! # The accounting
//!
//! Bytes are counted **per rank, per collective, per link class, as logical point-to-point
//! exchange**: for every peer `j` of rank `r` in the group, the bytes of `r`'s data that end up on
//! `j` count as *sent* by `r` over `link_class(r, j)`, and the bytes of `j`'s data that end up on
//! `r` count as *received*. A rank's own chunk is never counted. This is what a ring (or any
//! bandwidth-optimal) algorithm moves per rank in total: `(n−1)/n` of the buffer for an all-gather
//! or reduce-scatter over `n` ranks, `2(n−1)/n` for an all-reduce. Unlike a ring's hop-by-hop view,
//! it is the same for every rank and does not depend on which ranks happen to be ring neighbours,
//! so per-rank predictions can be compared with measurements exactly.
//!
//! | collective | rank `r` sends to each peer `j` | rank `r` receives from each peer `j` |
//! |---|---|---|
//! | all-gather (`c` elements per rank) | `c` | `c` |
//! | reduce-scatter (`c` elements per rank out, `n·c` in) | `c` | `c` |
//! | all-reduce (`len` elements, chunks `k` of `len/n` plus one for `k < len mod n`) | `chunk(j) + chunk(r)` | `chunk(r) + chunk(j)` |
//! | broadcast (`len`, from `root`) | `len` if `r` is root | `len` from root |
//! | all-to-all (`len` per rank, equal splits `len/n`) | `len/n` | `len/n` |
//! | barrier | 0 (one call) | 0 |
//!
//! times the element size in bytes. All-reduce is counted as a reduce-scatter followed by an
//! all-gather over the same chunks, which is how the loopbacks run it.

use std::collections::BTreeMap;
use std::ops::{Add, AddAssign};

use serde::{Deserialize, Serialize};

use crate::topology::{LinkClass, Topology};

/// A collective operation, the key of a [`TrafficTable`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Collective {
    /// All-gather of equal chunks.
    AllGather,
    /// Reduce-scatter (sum or mean) into equal chunks.
    ReduceScatter,
    /// All-reduce (sum or mean).
    AllReduce,
    /// Broadcast from one root.
    Broadcast,
    /// All-to-all with equal splits.
    AllToAll,
    /// Barrier (no payload).
    Barrier,
}

impl Collective {
    /// Every collective, in a fixed order.
    pub const ALL: [Collective; 6] = [
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::AllReduce,
        Collective::Broadcast,
        Collective::AllToAll,
        Collective::Barrier,
    ];

    /// Lower-case name used in tables and JSON keys.
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllReduce => "all_reduce",
            Collective::Broadcast => "broadcast",
            Collective::AllToAll => "all_to_all",
            Collective::Barrier => "barrier",
        }
    }
}

/// Bytes split by link class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkBytes {
    /// Bytes between ranks of the same node.
    pub intra_node: u64,
    /// Bytes between ranks of different nodes.
    pub inter_node: u64,
}

impl LinkBytes {
    /// Intra plus inter.
    pub fn total(&self) -> u64 {
        self.intra_node + self.inter_node
    }

    /// Adds `bytes` under `class`.
    pub fn add_class(&mut self, class: LinkClass, bytes: u64) {
        match class {
            LinkClass::IntraNode => self.intra_node += bytes,
            LinkClass::InterNode => self.inter_node += bytes,
        }
    }

    /// The bytes of one class.
    pub fn get(&self, class: LinkClass) -> u64 {
        match class {
            LinkClass::IntraNode => self.intra_node,
            LinkClass::InterNode => self.inter_node,
        }
    }

    /// Every count multiplied by `k`.
    pub fn scaled(self, k: u64) -> LinkBytes {
        LinkBytes {
            intra_node: self.intra_node * k,
            inter_node: self.inter_node * k,
        }
    }
}

impl Add for LinkBytes {
    type Output = LinkBytes;
    fn add(self, o: LinkBytes) -> LinkBytes {
        LinkBytes {
            intra_node: self.intra_node + o.intra_node,
            inter_node: self.inter_node + o.inter_node,
        }
    }
}

impl AddAssign for LinkBytes {
    fn add_assign(&mut self, o: LinkBytes) {
        *self = *self + o;
    }
}

/// Calls and bytes of one collective on one rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectiveTraffic {
    /// Number of calls.
    pub calls: u64,
    /// Bytes this rank sent, by link class.
    pub sent: LinkBytes,
    /// Bytes this rank received, by link class.
    pub received: LinkBytes,
}

impl AddAssign for CollectiveTraffic {
    fn add_assign(&mut self, o: CollectiveTraffic) {
        self.calls += o.calls;
        self.sent += o.sent;
        self.received += o.received;
    }
}

impl CollectiveTraffic {
    /// Every count multiplied by `k` (e.g. per micro-step traffic times the accumulation steps).
    pub fn scaled(self, k: u64) -> CollectiveTraffic {
        CollectiveTraffic {
            calls: self.calls * k,
            sent: self.sent.scaled(k),
            received: self.received.scaled(k),
        }
    }
}

/// Traffic per collective, for one rank. Used both for predictions and for measurements, so the
/// two compare with `==`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TrafficTable {
    /// Per-collective totals. Collectives never called are absent.
    pub by_collective: BTreeMap<Collective, CollectiveTraffic>,
}

impl TrafficTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one entry.
    pub fn record(&mut self, op: Collective, t: CollectiveTraffic) {
        *self.by_collective.entry(op).or_default() += t;
    }

    /// Adds every entry of `other`.
    pub fn merge(&mut self, other: &TrafficTable) {
        for (op, t) in &other.by_collective {
            self.record(*op, *t);
        }
    }

    /// Total bytes sent, by link class.
    pub fn sent(&self) -> LinkBytes {
        self.by_collective
            .values()
            .fold(LinkBytes::default(), |a, t| a + t.sent)
    }

    /// Total bytes received, by link class.
    pub fn received(&self) -> LinkBytes {
        self.by_collective
            .values()
            .fold(LinkBytes::default(), |a, t| a + t.received)
    }

    /// Total calls.
    pub fn calls(&self) -> u64 {
        self.by_collective.values().map(|t| t.calls).sum()
    }

    /// The table minus `earlier` (a measurement window). Saturates at zero.
    pub fn since(&self, earlier: &TrafficTable) -> TrafficTable {
        let mut out = TrafficTable::new();
        for (op, t) in &self.by_collective {
            let e = earlier.by_collective.get(op).copied().unwrap_or_default();
            let d = CollectiveTraffic {
                calls: t.calls.saturating_sub(e.calls),
                sent: LinkBytes {
                    intra_node: t.sent.intra_node.saturating_sub(e.sent.intra_node),
                    inter_node: t.sent.inter_node.saturating_sub(e.sent.inter_node),
                },
                received: LinkBytes {
                    intra_node: t.received.intra_node.saturating_sub(e.received.intra_node),
                    inter_node: t.received.inter_node.saturating_sub(e.received.inter_node),
                },
            };
            if d != CollectiveTraffic::default() {
                out.by_collective.insert(*op, d);
            }
        }
        out
    }
}

/// A group of ranks seen from one member: the global ranks of the group in group-rank order, and
/// this member's index. Link classes come from the global topology.
#[derive(Clone, Copy, Debug)]
pub struct GroupView<'a> {
    /// The global topology.
    pub topology: &'a Topology,
    /// Global rank of each group member, indexed by group rank.
    pub members: &'a [usize],
    /// This rank's index in `members`.
    pub me: usize,
}

impl GroupView<'_> {
    fn per_peer(&self, mut f: impl FnMut(usize) -> (u64, u64)) -> (LinkBytes, LinkBytes) {
        let me_g = self.members[self.me];
        let (mut sent, mut recv) = (LinkBytes::default(), LinkBytes::default());
        for (j, &g) in self.members.iter().enumerate() {
            if j == self.me {
                continue;
            }
            let class = self.topology.link_class(me_g, g);
            let (s, r) = f(j);
            sent.add_class(class, s);
            recv.add_class(class, r);
        }
        (sent, recv)
    }

    fn one_call(&self, (sent, received): (LinkBytes, LinkBytes)) -> CollectiveTraffic {
        CollectiveTraffic {
            calls: 1,
            sent,
            received,
        }
    }

    /// One all-gather of `count` elements per rank of `elem_bytes` each.
    pub fn all_gather(&self, count: u64, elem_bytes: u64) -> CollectiveTraffic {
        let b = count * elem_bytes;
        self.one_call(self.per_peer(|_| (b, b)))
    }

    /// One reduce-scatter producing `count` elements per rank.
    pub fn reduce_scatter(&self, count: u64, elem_bytes: u64) -> CollectiveTraffic {
        self.all_gather(count, elem_bytes)
    }

    /// One all-reduce of `len` elements.
    pub fn all_reduce(&self, len: u64, elem_bytes: u64) -> CollectiveTraffic {
        let n = self.members.len() as u64;
        let chunk = |k: u64| len / n + u64::from(k < len % n);
        let mine = chunk(self.me as u64);
        self.one_call(self.per_peer(|j| {
            let b = (chunk(j as u64) + mine) * elem_bytes;
            (b, b)
        }))
    }

    /// One broadcast of `len` elements from group rank `root`.
    pub fn broadcast(&self, len: u64, elem_bytes: u64, root: usize) -> CollectiveTraffic {
        let b = len * elem_bytes;
        let me = self.me;
        self.one_call(self.per_peer(|j| {
            let s = if me == root { b } else { 0 };
            let r = if j == root { b } else { 0 };
            (s, r)
        }))
    }

    /// One all-to-all of `len` elements per rank, split equally.
    pub fn all_to_all(&self, len: u64, elem_bytes: u64) -> CollectiveTraffic {
        let n = self.members.len() as u64;
        let b = len / n * elem_bytes;
        self.one_call(self.per_peer(|_| (b, b)))
    }

    /// One barrier.
    pub fn barrier(&self) -> CollectiveTraffic {
        CollectiveTraffic {
            calls: 1,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_gather_splits_by_node() {
        let t = Topology::new(8, 4).unwrap();
        let members: Vec<usize> = (0..8).collect();
        let v = GroupView {
            topology: &t,
            members: &members,
            me: 1,
        };
        let ag = v.all_gather(10, 2);
        assert_eq!(
            ag.sent,
            LinkBytes {
                intra_node: 3 * 20,
                inter_node: 4 * 20
            }
        );
        assert_eq!(ag.received, ag.sent);
    }

    #[test]
    fn all_reduce_is_rs_plus_ag() {
        let t = Topology::single_node(4).unwrap();
        let members: Vec<usize> = (0..4).collect();
        // len 10 over 4 ranks: chunks 3,3,2,2; rank 3 owns 2.
        let v = GroupView {
            topology: &t,
            members: &members,
            me: 3,
        };
        let ar = v.all_reduce(10, 4);
        assert_eq!(ar.sent.total(), ((3 + 2) + (3 + 2) + (2 + 2)) * 4);
        assert_eq!(ar.calls, 1);
    }

    #[test]
    fn since_subtracts() {
        let mut a = TrafficTable::new();
        let t = Topology::single_node(2).unwrap();
        let m = [0, 1];
        let v = GroupView {
            topology: &t,
            members: &m,
            me: 0,
        };
        a.record(Collective::AllGather, v.all_gather(4, 4));
        let before = a.clone();
        a.record(Collective::AllGather, v.all_gather(4, 4));
        a.record(Collective::Barrier, v.barrier());
        let d = a.since(&before);
        assert_eq!(d.by_collective[&Collective::AllGather].sent.intra_node, 16);
        assert_eq!(d.calls(), 2);
    }
}
