//! The bytes the MPI backend hands to MPI, per group peer, counted from the buffers and the
//! counts of each MPI call as it is made: an all-gather sends this rank's buffer to every peer,
//! an all-to-all its chunk `j` to peer `j`, the varcount forms what their counts say, and a
//! broadcast the root's buffer. What MPI's own algorithms then put on the wire is not visible;
//! these are the logical per-peer deliveries, the convention of [`zero_core::traffic`]. The plan's
//! closed forms are computed elsewhere: the tests compare the two.

use zero_core::{CollectiveTraffic, LinkBytes, Topology};

/// One collective's bytes to and from each peer (this rank's own slot stays 0).
pub(super) struct Tally {
    me: usize,
    sent: Vec<u64>,
    received: Vec<u64>,
}

impl Tally {
    /// Nothing counted, in a group of `n` ranks where this one is `me`.
    pub(super) fn new(n: usize, me: usize) -> Tally {
        Tally {
            me,
            sent: vec![0; n],
            received: vec![0; n],
        }
    }

    fn add(&mut self, j: usize, sent: u64, received: u64) {
        if j != self.me {
            self.sent[j] += sent;
            self.received[j] += received;
        }
    }

    /// An all-gather of `send` bytes into `recv` bytes (`n` equal chunks).
    pub(super) fn all_gather(&mut self, send: usize, recv: usize) {
        let n = self.sent.len();
        for j in 0..n {
            self.add(j, send as u64, (recv / n) as u64);
        }
    }

    /// An all-to-all of `send` bytes into `recv` bytes (`n` equal chunks each).
    pub(super) fn all_to_all(&mut self, send: usize, recv: usize) {
        let n = self.sent.len();
        for j in 0..n {
            self.add(j, (send / n) as u64, (recv / n) as u64);
        }
    }

    /// A varcount call: `sent[j]` bytes to peer `j`, `received[j]` from it.
    pub(super) fn counts(&mut self, sent: &[i32], received: &[i32]) {
        for (j, (&s, &r)) in sent.iter().zip(received).enumerate() {
            self.add(j, s.max(0) as u64, r.max(0) as u64);
        }
    }

    /// An all-gatherv of this rank's `send` bytes, receiving `received[j]` from peer `j`.
    pub(super) fn all_gather_counts(&mut self, send: usize, received: &[i32]) {
        for (j, &r) in received.iter().enumerate() {
            self.add(j, send as u64, r.max(0) as u64);
        }
    }

    /// A broadcast of `bytes` from group rank `root`.
    pub(super) fn broadcast(&mut self, root: usize, bytes: usize) {
        for j in 0..self.sent.len() {
            let sent = if self.me == root { bytes } else { 0 };
            let received = if j == root { bytes } else { 0 };
            self.add(j, sent as u64, received as u64);
        }
    }

    /// The counted call, by the link class between this rank and each peer (`members`: the
    /// group's global ranks).
    pub(super) fn traffic(&self, topology: &Topology, members: &[usize]) -> CollectiveTraffic {
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
