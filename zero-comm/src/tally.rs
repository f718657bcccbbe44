//! The bytes a backend hands to MPI or NCCL, per group peer, counted from the buffers and the
//! counts of each call as it is made: an all-gather sends this rank's buffer to every peer, an
//! all-to-all its chunk `j` to peer `j`, a send or receive what its count says, and a broadcast the
//! root's buffer. What the library's own algorithms then put on the wire (rings, trees) is not
//! visible; these are the logical per-peer deliveries, the convention of [`zero_core::traffic`].
//! A call whose algorithm is the library's (NCCL's all-reduce, reduce-scatter) is split per peer
//! as that convention does, from the count handed to it. The plan's closed forms are computed
//! elsewhere: the tests compare the two.

use zero_core::{CollectiveTraffic, LinkBytes, Topology};

/// One collective's bytes to and from each peer (this rank's own slot stays 0).
pub(crate) struct Tally {
    me: usize,
    sent: Vec<u64>,
    received: Vec<u64>,
}

impl Tally {
    /// Nothing counted, in a group of `n` ranks where this one is `me`.
    pub(crate) fn new(n: usize, me: usize) -> Tally {
        Tally {
            me,
            sent: vec![0; n],
            received: vec![0; n],
        }
    }

    /// `sent` bytes to group rank `j` and `received` from it (nothing for this rank itself).
    pub(crate) fn add(&mut self, j: usize, sent: u64, received: u64) {
        if j != self.me {
            self.sent[j] += sent;
            self.received[j] += received;
        }
    }

    /// An all-gather of `send` bytes into `recv` bytes (`n` equal chunks).
    pub(crate) fn all_gather(&mut self, send: usize, recv: usize) {
        let n = self.sent.len();
        for j in 0..n {
            self.add(j, send as u64, (recv / n) as u64);
        }
    }

    /// An all-to-all of `send` bytes into `recv` bytes (`n` equal chunks each).
    pub(crate) fn all_to_all(&mut self, send: usize, recv: usize) {
        let n = self.sent.len();
        for j in 0..n {
            self.add(j, (send / n) as u64, (recv / n) as u64);
        }
    }

    /// A reduce-scatter into `chunk` bytes: chunk `j` of the input to peer `j`, and each peer's
    /// part of this rank's chunk back. (NCCL's; MPI's varcount calls count their own.)
    #[cfg(any(feature = "nccl", test))]
    pub(crate) fn reduce_scatter(&mut self, chunk: usize) {
        let n = self.sent.len();
        self.all_to_all(n * chunk, n * chunk);
    }

    /// An all-reduce of `len` elements of `elem` bytes, as a reduce-scatter of the chunks of
    /// [`ar_chunk`](crate::validate::ar_chunk) and an all-gather of the reduced chunks: this rank's part of chunk `j` to peer
    /// `j` and its reduced chunk to every peer, and the same back.
    #[cfg(any(feature = "nccl", test))]
    pub(crate) fn all_reduce(&mut self, len: usize, elem: usize) {
        let n = self.sent.len();
        use crate::validate::ar_chunk;
        let (_, mine) = ar_chunk(len, n, self.me);
        for j in 0..n {
            let (_, theirs) = ar_chunk(len, n, j);
            let bytes = ((theirs + mine) * elem) as u64;
            self.add(j, bytes, bytes);
        }
    }

    /// A varcount call: `sent[j]` bytes to peer `j`, `received[j]` from it (MPI's).
    #[cfg(any(test, feature = "mpi"))]
    pub(crate) fn counts(&mut self, sent: &[i32], received: &[i32]) {
        for (j, (&s, &r)) in sent.iter().zip(received).enumerate() {
            self.add(j, s.max(0) as u64, r.max(0) as u64);
        }
    }

    /// An all-gatherv of this rank's `send` bytes, receiving `received[j]` from peer `j` (MPI's).
    #[cfg(feature = "mpi")]
    pub(crate) fn all_gather_counts(&mut self, send: usize, received: &[i32]) {
        for (j, &r) in received.iter().enumerate() {
            self.add(j, send as u64, r.max(0) as u64);
        }
    }

    /// A broadcast of `bytes` from group rank `root`.
    pub(crate) fn broadcast(&mut self, root: usize, bytes: usize) {
        for j in 0..self.sent.len() {
            let sent = if self.me == root { bytes } else { 0 };
            let received = if j == root { bytes } else { 0 };
            self.add(j, sent as u64, received as u64);
        }
    }

    /// The counted call, by the link class between this rank and each peer (`members`: the
    /// group's global ranks).
    pub(crate) fn traffic(&self, topology: &Topology, members: &[usize]) -> CollectiveTraffic {
        let (mut sent, mut received) = (LinkBytes::default(), LinkBytes::default());
        for (j, &peer) in members.iter().enumerate() {
            let class = topology.link_class(members[self.me], peer);
            sent.add_class(class, self.sent[j]);
            received.add_class(class, self.received[j]);
        }
        CollectiveTraffic {
            calls: 1,
            sent,
            received,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zero_core::GroupView;

    /// What each call counts equals zero-core's closed forms in every layout and sub-group.
    #[test]
    fn counts_equal_group_view_formulas() {
        let layouts = [(1, 1), (2, 1), (3, 3), (4, 2), (6, 3), (8, 2), (8, 4)];
        for (w, l) in layouts {
            let topo = Topology::new(w, l).unwrap();
            let world: Vec<usize> = (0..w).collect();
            let odd: Vec<usize> = (0..w).rev().step_by(2).collect();
            for members in [&world, &odd] {
                let n = members.len();
                for me in 0..n {
                    let view = GroupView {
                        topology: &topo,
                        members,
                        me,
                    };
                    let counted = |f: &dyn Fn(&mut Tally)| {
                        let mut t = Tally::new(n, me);
                        f(&mut t);
                        t.traffic(&topo, members)
                    };
                    for c in [0usize, 1, 5, 33] {
                        let ag = counted(&|t| t.all_gather(4 * c, 4 * n * c));
                        assert_eq!(ag, view.all_gather(c as u64, 4));
                        let rs = counted(&|t| t.reduce_scatter(2 * c));
                        assert_eq!(rs, view.reduce_scatter(c as u64, 2));
                        let a2a = counted(&|t| t.all_to_all(n * c, n * c));
                        assert_eq!(a2a, view.all_to_all((n * c) as u64, 1));
                        // An all-to-all as NCCL's sends and receives, one pair per peer.
                        let pairs = counted(&|t| {
                            for j in 0..n {
                                t.add(j, c as u64, c as u64);
                            }
                        });
                        assert_eq!(pairs, view.all_to_all((n * c) as u64, 1));
                    }
                    for len in [0usize, 1, 7, 19, 64] {
                        let ar = counted(&|t| t.all_reduce(len, 4));
                        assert_eq!(ar, view.all_reduce(len as u64, 4));
                        for root in 0..n {
                            let bc = counted(&|t| t.broadcast(root, 2 * len));
                            assert_eq!(bc, view.broadcast(len as u64, 2, root));
                        }
                    }
                    assert_eq!(counted(&|_| {}), view.barrier());
                }
            }
        }
    }

    #[test]
    fn each_call_counts_its_buffers_per_peer_and_never_this_rank() {
        let topo = Topology::new(4, 2).unwrap();
        let members = [0, 1, 2, 3];
        // Rank 1 all-gathers 8 bytes into 32: 8 to and from each of 3 peers, 1 of them intra.
        let mut t = Tally::new(4, 1);
        t.all_gather(8, 32);
        let c = t.traffic(&topo, &members);
        assert_eq!((c.sent.intra_node, c.sent.inter_node), (8, 16));
        assert_eq!((c.received.intra_node, c.received.inter_node), (8, 16));
        // A varcount call: the counts, self excluded.
        let mut t = Tally::new(4, 0);
        t.counts(&[5, 6, 7, 8], &[1, 2, 3, 4]);
        let c = t.traffic(&topo, &members);
        assert_eq!((c.sent.intra_node, c.sent.inter_node), (6, 15));
        assert_eq!((c.received.intra_node, c.received.inter_node), (2, 7));
        // A broadcast from rank 2, seen by rank 3 (same node) and by rank 2.
        let mut t = Tally::new(4, 3);
        t.broadcast(2, 10);
        let c = t.traffic(&topo, &members);
        assert_eq!((c.sent.total(), c.received.intra_node), (0, 10));
        let mut t = Tally::new(4, 2);
        t.broadcast(2, 10);
        let c = t.traffic(&topo, &members);
        assert_eq!(
            (c.sent.intra_node, c.sent.inter_node, c.received.total()),
            (10, 20, 0)
        );
    }
}
