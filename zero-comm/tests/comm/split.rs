//! `split`: membership and order, collectives inside sub-groups, nested splits.

use zero_comm::Communicator;

use crate::bodies::groups::{self as shared, nested_pairs, world_or_node_step};
use crate::bodies::{host, stamp};
use crate::common::*;

stamp! { host, shared:
    intra_and_cross_node_groups_have_the_topology_s_members(&[(8, 4), (8, 2), (6, 3), (4, 4), (4, 1)]);
    collectives_inside_sub_groups(&[(8, 4), (8, 2)]);
}

#[test]
fn split_orders_by_key_then_rank() {
    run_ranks(host_world(topo(7, 7)), |mut comm| {
        let r = comm.rank();
        // Colors 0,1,2 by r % 3; keys reverse the order, with ties (r / 4) broken by old rank.
        let sub = comm.split(r % 3, 10 - r / 4).unwrap();
        let mut want: Vec<usize> = (0..7).filter(|k| k % 3 == r % 3).collect();
        want.sort_by_key(|&k| (10 - k / 4, k));
        assert_eq!(sub.members(), want.as_slice());
        assert_eq!(sub.members()[sub.rank()], r);
        // The sub-group works and sees only its members.
        let mut sub = sub;
        let gathered = sub.all_gather_host(&[r as u8]).unwrap();
        assert_eq!(gathered, want.iter().map(|&k| k as u8).collect::<Vec<_>>());
    });
}

#[test]
fn nested_splits_and_repeated_splits() {
    run_ranks(host_world(topo(8, 4)), |mut comm| {
        let g = comm.global_rank();
        let (_intra, _pairs, _) = nested_pairs(&mut comm);
        // Splitting is cheap and repeatable; each split is an independent group.
        for i in 0..20 {
            let mut sub = comm.split((g + i) % 2, 0).unwrap();
            sub.barrier().unwrap();
        }
    });
}

/// Many small ops interleaved over the world and two overlapping families of sub-groups, with
/// uneven thread timing: every result must still be exact (shakes the rendezvous).
#[test]
fn interleaved_groups_stress() {
    run_ranks(host_world(topo(8, 4)), |mut comm| {
        let t = *comm.topology();
        let g = comm.global_rank();
        let mut intra = comm.split(t.node_of(g), t.local_rank(g)).unwrap();
        let mut cross = comm.split(t.local_rank(g), t.node_of(g)).unwrap();
        for i in 0..300usize {
            if (i * 7 + g) % 13 == 0 {
                std::thread::yield_now();
            }
            if !world_or_node_step(&mut comm, &mut intra, i) {
                let v = cross.all_gather_host(&[g as u8]).unwrap();
                assert_eq!(
                    v,
                    t.cross_node_ranks(t.local_rank(g))
                        .iter()
                        .map(|&r| r as u8)
                        .collect::<Vec<_>>()
                );
            }
        }
    });
}
