//! Measured traffic equals zero-core's `GroupView` formulas, per collective, per link class.

use zero_comm::{Communicator, ReduceOp};
use zero_core::{Collective, LinkBytes};

use crate::common::*;

/// `(world_size, ranks_per_node)`: single node, one rank per node, and mixed layouts.
const TOPOLOGIES: &[(usize, usize)] = &[
    (1, 1),
    (2, 1),
    (2, 2),
    (3, 1),
    (3, 3),
    (4, 1),
    (4, 2),
    (4, 4),
    (5, 5),
    (6, 2),
    (6, 3),
    (7, 7),
    (8, 1),
    (8, 2),
    (8, 4),
    (8, 8),
];

#[test]
fn measured_traffic_equals_formula_in_every_topology() {
    for &(w, l) in TOPOLOGIES {
        run_ranks(host_world(topo(w, l)), |mut comm| {
            exercise_and_check_traffic(&mut comm)
        });
    }
}

#[test]
fn measured_traffic_equals_formula_in_sub_groups() {
    for &(w, l) in &[(8, 4), (8, 2), (6, 3), (4, 2)] {
        run_ranks(host_world(topo(w, l)), |mut comm| {
            let t = *comm.topology();
            let g = comm.global_rank();
            let mut intra = comm.split(t.node_of(g), t.local_rank(g)).unwrap();
            let mut cross = comm.split(t.local_rank(g), t.node_of(g)).unwrap();
            exercise_and_check_traffic(&mut intra);
            exercise_and_check_traffic(&mut cross);
            // Nothing inside a node group crosses a node; a cross-node group is all inter-node.
            assert_eq!(intra.traffic().sent().inter_node, 0);
            assert_eq!(intra.traffic().received().inter_node, 0);
            assert_eq!(cross.traffic().sent().intra_node, 0);
            assert_eq!(cross.traffic().received().intra_node, 0);
            if t.ranks_per_node() > 1 {
                assert!(intra.traffic().sent().intra_node > 0);
            }
            if t.num_nodes() > 1 {
                assert!(cross.traffic().received().inter_node > 0);
            }
            // Sub-groups count their own traffic; the world saw none of it.
            assert_eq!(comm.traffic().calls(), 0);
        });
    }
}

/// A concrete number, so the formula itself is pinned: 8 ranks as 2 × 4, all-gather of 10 f32
/// per rank. Rank 1 exchanges 40 bytes with each of 3 node peers and 4 remote ranks.
#[test]
fn all_gather_bytes_by_link_class() {
    let traffic = run_ranks(host_world(topo(8, 4)), |mut comm| {
        let r = comm.all_gather_host(&[1.0f32; 10]).unwrap();
        assert_eq!(r.len(), 80);
        comm.traffic().by_collective[&Collective::AllGather]
    });
    for t in &traffic {
        assert_eq!(t.calls, 1);
        assert_eq!(
            t.sent,
            LinkBytes {
                intra_node: 3 * 40,
                inter_node: 4 * 40
            }
        );
        assert_eq!(t.received, t.sent);
    }
}

/// Failed calls are not counted.
#[test]
fn errors_record_no_traffic() {
    run_ranks(host_world(topo(2, 1)), |mut comm| {
        let len = if comm.rank() == 0 { 4 } else { 6 };
        let mut b = comm.alloc::<f32>(len).unwrap();
        assert!(comm.all_reduce(&mut b, ReduceOp::Sum).is_err());
        assert_eq!(comm.traffic().calls(), 0);
    });
}
