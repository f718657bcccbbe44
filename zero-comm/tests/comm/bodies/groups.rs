//! Sub-groups (`split`), measured traffic, and the `Group` guard, generic over the backend.

use half::{bf16, f16};
use zero_comm::{Communicator, Error, ReduceOp};
use zero_core::{Collective, LinkBytes};

use super::World;
use crate::common::*;

/// Runs `f` on every rank of each world shaped `(w, l)` in `shapes`, with the rank's world
/// communicator, its node group and its cross-node group.
fn in_sub_groups<C: Communicator>(
    world: World<C>,
    shapes: &[(usize, usize)],
    f: impl Fn(&mut C, &mut C, &mut C) + Sync,
) {
    for &(w, l) in shapes {
        run_ranks(world(topo(w, l), SAFE_TIMEOUT), |mut comm| {
            let t = *comm.topology();
            let g = comm.global_rank();
            let mut intra = comm.split(t.node_of(g), t.local_rank(g)).unwrap();
            let mut cross = comm.split(t.local_rank(g), t.node_of(g)).unwrap();
            f(&mut comm, &mut intra, &mut cross);
        });
    }
}

/// The members, rank and size of a node group and a cross-node group, in worlds shaped `(w, l)`.
pub(crate) fn intra_and_cross_node_groups_have_the_topology_s_members<C: Communicator>(
    world: World<C>,
    shapes: &[(usize, usize)],
) {
    in_sub_groups(world, shapes, |comm, intra, cross| {
        let t = *comm.topology();
        let g = comm.global_rank();
        let (node, local) = (t.node_of(g), t.local_rank(g));
        let (w, l) = (t.world_size(), t.ranks_per_node());
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

/// Every collective inside node and cross-node groups, in worlds shaped `(w, l)`.
pub(crate) fn collectives_inside_sub_groups<C: Communicator>(
    world: World<C>,
    shapes: &[(usize, usize)],
) {
    in_sub_groups(world, shapes, |comm, intra, cross| {
        for sub in [intra, cross] {
            all_gather_body::<_, bf16>(sub, &[0, 3, 17]);
            reduce_scatter_body::<_, f32>(sub, &[0, 5, 33], ReduceOp::Mean);
            all_reduce_body::<_, bf16>(sub, &[0, 1, 11, 100], ReduceOp::Sum);
            all_reduce_body::<_, f16>(sub, &[7, 64], ReduceOp::Mean);
            all_reduce_is_rs_ag_body::<_, f32>(sub, &[4, 9], ReduceOp::Mean);
            broadcast_body::<_, u8>(sub, &[0, 9]);
            all_to_all_body::<_, f32>(sub, &[0, 2, 7]);
        }
        // The world communicator still works after (and between) sub-group use.
        let mut x = vec![1.0f32; 3];
        comm.all_reduce_host(&mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x, vec![comm.world_size() as f32; 3]);
    });
}

/// On a rank of 8 as 2 × 4: splits its node group into pairs, checks the pairs' members and an
/// all-reduce inside them. Returns the node group, the pair and the pair's members.
pub(crate) fn nested_pairs<C: Communicator>(comm: &mut C) -> (C, C, Vec<usize>) {
    let t = *comm.topology();
    let g = comm.global_rank();
    let mut intra = comm.split(t.node_of(g), t.local_rank(g)).unwrap();
    let mut pairs = intra.split(intra.rank() / 2, 0).unwrap();
    let want: Vec<usize> = (0..8).filter(|k| k / 2 == g / 2).collect();
    assert_eq!(pairs.members(), want.as_slice());
    let mut s = vec![g as f32];
    pairs.all_reduce_host(&mut s, ReduceOp::Sum).unwrap();
    assert_eq!(s[0], want.iter().sum::<usize>() as f32);
    (intra, pairs, want)
}

/// Step `i` of an interleaving over the world and its node group (8 ranks as 2 × 4), when `i % 3`
/// is 0 or 1: an exact all-reduce on the one or the other. Returns whether it took the step.
pub(crate) fn world_or_node_step<C: Communicator>(comm: &mut C, intra: &mut C, i: usize) -> bool {
    let t = *comm.topology();
    let g = comm.global_rank();
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
        _ => return false,
    }
    true
}

/// Measured traffic equals the formula for every collective, in worlds shaped `(w, l)`.
pub(crate) fn measured_traffic_equals_formula_in_every_topology<C: Communicator>(
    world: World<C>,
    shapes: &[(usize, usize)],
) {
    for &(w, l) in shapes {
        run_ranks(world(topo(w, l), SAFE_TIMEOUT), |mut comm| {
            exercise_and_check_traffic(&mut comm)
        });
    }
}

/// The same inside node and cross-node groups, whose traffic stays on its own link class.
pub(crate) fn measured_traffic_equals_formula_in_sub_groups<C: Communicator>(
    world: World<C>,
    shapes: &[(usize, usize)],
) {
    in_sub_groups(world, shapes, |comm, intra, cross| {
        let t = *comm.topology();
        exercise_and_check_traffic(intra);
        exercise_and_check_traffic(cross);
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

/// A concrete number, so the formula itself is pinned: 8 ranks as 2 × 4, all-gather of 10 f32
/// per rank. Rank 1 exchanges 40 bytes with each of 3 node peers and 4 remote ranks.
pub(crate) fn all_gather_bytes_by_link_class<C: Communicator>(world: World<C>) {
    let traffic = run_ranks(world(topo(8, 4), SAFE_TIMEOUT), |mut comm| {
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

/// A group's ops run when it finishes, each counted.
pub(crate) fn a_group_runs_its_ops_when_it_finishes<C: Communicator>(world: World<C>) {
    run_ranks(world(topo(4, 2), SAFE_TIMEOUT), |mut comm| {
        let (n, me) = (comm.world_size(), comm.rank());
        let send = comm.upload(&[me as f32; 2]).unwrap();
        let mut gathered = comm.alloc::<f32>(2 * n).unwrap();
        let big = comm.upload(&vec![1.0f32; 3 * n]).unwrap();
        let mut shard = comm.alloc::<f32>(3).unwrap();
        let mut b = comm.upload(&[me as u8; 5]).unwrap();
        let mut g = comm.group();
        g.all_gather(&send, &mut gathered)
            .reduce_scatter(&big, &mut shard, ReduceOp::Sum)
            .broadcast(&mut b, 3);
        assert_eq!(g.len(), 3);
        g.finish().unwrap();
        let want: Vec<f32> = (0..n).flat_map(|k| [k as f32; 2]).collect();
        assert_eq!(comm.download_vec(&gathered).unwrap(), want);
        assert_eq!(comm.download_vec(&shard).unwrap(), vec![n as f32; 3]);
        assert_eq!(comm.download_vec(&b).unwrap(), vec![3u8; 5]);
        assert_eq!(comm.traffic().calls(), 3);
    });
}

/// A group dropped without `finish()` still runs its ops; when one fails, the communicator is
/// aborted, saying why.
pub(crate) fn an_error_in_a_dropped_group_aborts_the_communicator<C: Communicator>(
    world: World<C>,
) {
    run_ranks(world(topo(2, 2), SAFE_TIMEOUT), |mut comm| {
        let len = if comm.rank() == 0 { 3 } else { 4 };
        let mut buf = comm.alloc::<f32>(len).unwrap();
        {
            let mut g = comm.group();
            g.all_reduce(&mut buf, ReduceOp::Mean);
        }
        let e = comm.barrier().unwrap_err();
        assert!(matches!(e, Error::Aborted { .. }), "{e}");
        assert!(
            e.to_string()
                .contains("a group dropped without finish() failed"),
            "{e}"
        );
    });
}
