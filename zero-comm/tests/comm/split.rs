//! `split`: membership and order, collectives inside sub-groups, nested splits.

use half::bf16;
use zero_comm::{Communicator, ReduceOp};

use crate::common::*;

#[test]
fn intra_and_cross_node_groups_have_the_topology_s_members() {
    for (w, l) in [(8, 4), (8, 2), (6, 3), (4, 4), (4, 1)] {
        run_ranks(host_world(topo(w, l)), |mut comm| {
            let t = *comm.topology();
            let g = comm.global_rank();
            let (node, local) = (t.node_of(g), t.local_rank(g));
            let intra = comm.split(node, local).unwrap();
            let cross = comm.split(local, node).unwrap();
            assert_eq!(
                intra.members(),
                t.node_ranks(node).collect::<Vec<_>>().as_slice()
            );
            assert_eq!(
                (intra.rank(), intra.world_size(), intra.global_rank()),
                (local, l, g)
            );
            assert_eq!(cross.members(), t.cross_node_ranks(local).as_slice());
            assert_eq!(
                (cross.rank(), cross.world_size(), cross.global_rank()),
                (node, w / l, g)
            );
            assert_eq!(intra.topology(), &t);
        });
    }
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
fn collectives_inside_sub_groups() {
    for (w, l) in [(8, 4), (8, 2)] {
        run_ranks(host_world(topo(w, l)), |mut comm| {
            let t = *comm.topology();
            let g = comm.global_rank();
            let mut intra = comm.split(t.node_of(g), t.local_rank(g)).unwrap();
            let mut cross = comm.split(t.local_rank(g), t.node_of(g)).unwrap();
            for sub in [&mut intra, &mut cross] {
                all_gather_body::<_, bf16>(sub, &[0, 3, 17]);
                reduce_scatter_body::<_, f32>(sub, &[0, 5, 33], ReduceOp::Mean);
                all_reduce_body::<_, bf16>(sub, &[0, 1, 11, 100], ReduceOp::Sum);
                all_reduce_is_rs_ag_body::<_, f32>(sub, &[4, 9], ReduceOp::Mean);
                broadcast_body::<_, u8>(sub, &[0, 9]);
                all_to_all_body::<_, f32>(sub, &[0, 2, 7]);
            }
            // The world communicator still works after (and between) sub-group use.
            let mut x = vec![1.0f32; 3];
            comm.all_reduce_host(&mut x, ReduceOp::Sum).unwrap();
            assert_eq!(x, vec![w as f32; 3]);
        });
    }
}

#[test]
fn nested_splits_and_repeated_splits() {
    run_ranks(host_world(topo(8, 4)), |mut comm| {
        let t = *comm.topology();
        let g = comm.global_rank();
        let mut intra = comm.split(t.node_of(g), t.local_rank(g)).unwrap();
        let mut pairs = intra.split(intra.rank() / 2, 0).unwrap();
        let want: Vec<usize> = (0..8).filter(|k| k / 2 == g / 2).collect();
        assert_eq!(pairs.members(), want.as_slice());
        let mut s = vec![g as f32];
        pairs.all_reduce_host(&mut s, ReduceOp::Sum).unwrap();
        assert_eq!(s[0], want.iter().sum::<usize>() as f32);
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
            let mut x = [g as f32, i as f32];
            match i % 3 {
                0 => {
                    comm.all_reduce_host(&mut x, ReduceOp::Sum).unwrap();
                    assert_eq!(x, [28.0, 8.0 * i as f32]);
                }
                1 => {
                    intra.all_reduce_host(&mut x, ReduceOp::Sum).unwrap();
                    let base = 4 * t.node_of(g);
                    assert_eq!(x[0], (base..base + 4).sum::<usize>() as f32);
                }
                _ => {
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
        }
    });
}
