//! Sub-groups (`split`), byte accounting, and the `Group` guard on the wgpu loopback.

use half::{bf16, f16};
use zero_comm::{Communicator, Error, ReduceOp};
use zero_core::{Collective, LinkBytes};

use crate::common::*;
use crate::device::{or_skip, wgpu_world};

#[test]
fn intra_and_cross_node_groups_have_the_topology_s_members() {
    if or_skip().is_none() {
        return;
    }
    for (w, l) in [(8, 4), (6, 3), (4, 1)] {
        run_ranks(wgpu_world(topo(w, l)), |mut comm| {
            let t = *comm.topology();
            let g = comm.global_rank();
            let (node, local) = (t.node_of(g), t.local_rank(g));
            let intra = comm.split(node, local).unwrap();
            let cross = comm.split(local, node).unwrap();
            assert_eq!(
                intra.members(),
                t.node_ranks(node).collect::<Vec<_>>().as_slice()
            );
            assert_eq!((intra.rank(), intra.world_size()), (local, l));
            assert_eq!(cross.members(), t.cross_node_ranks(local).as_slice());
            assert_eq!((cross.rank(), cross.world_size()), (node, w / l));
        });
    }
}

#[test]
fn collectives_inside_sub_groups() {
    if or_skip().is_none() {
        return;
    }
    for (w, l) in [(8, 4), (6, 2)] {
        run_ranks(wgpu_world(topo(w, l)), |mut comm| {
            let t = *comm.topology();
            let g = comm.global_rank();
            let mut intra = comm.split(t.node_of(g), t.local_rank(g)).unwrap();
            let mut cross = comm.split(t.local_rank(g), t.node_of(g)).unwrap();
            for sub in [&mut intra, &mut cross] {
                all_gather_body::<_, bf16>(sub, &[0, 3, 17]);
                reduce_scatter_body::<_, f32>(sub, &[0, 5, 33], ReduceOp::Mean);
                all_reduce_body::<_, bf16>(sub, &[0, 1, 11, 100], ReduceOp::Sum);
                all_reduce_body::<_, f16>(sub, &[7, 64], ReduceOp::Mean);
                all_reduce_is_rs_ag_body::<_, f32>(sub, &[4, 9], ReduceOp::Mean);
                broadcast_body::<_, u8>(sub, &[0, 9]);
                all_to_all_body::<_, f32>(sub, &[0, 2, 7]);
            }
            let mut x = vec![1.0f32; 3];
            comm.all_reduce_host(&mut x, ReduceOp::Sum).unwrap();
            assert_eq!(x, vec![w as f32; 3]);
        });
    }
}

#[test]
fn nested_and_interleaved_groups() {
    if or_skip().is_none() {
        return;
    }
    run_ranks(wgpu_world(topo(8, 4)), |mut comm| {
        let t = *comm.topology();
        let g = comm.global_rank();
        let mut intra = comm.split(t.node_of(g), t.local_rank(g)).unwrap();
        let mut pairs = intra.split(intra.rank() / 2, 0).unwrap();
        let want: Vec<usize> = (0..8).filter(|k| k / 2 == g / 2).collect();
        assert_eq!(pairs.members(), want.as_slice());
        let mut s = vec![g as f32];
        pairs.all_reduce_host(&mut s, ReduceOp::Sum).unwrap();
        assert_eq!(s[0], want.iter().sum::<usize>() as f32);
        for i in 0..60usize {
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
                    let v = pairs.all_gather_host(&[g as u8]).unwrap();
                    assert_eq!(v, want.iter().map(|&r| r as u8).collect::<Vec<_>>());
                }
            }
        }
    });
}

const TOPOLOGIES: &[(usize, usize)] = &[
    (1, 1),
    (2, 1),
    (3, 3),
    (4, 2),
    (5, 5),
    (6, 3),
    (8, 1),
    (8, 4),
];

#[test]
fn measured_traffic_equals_formula_in_every_topology() {
    if or_skip().is_none() {
        return;
    }
    for &(w, l) in TOPOLOGIES {
        run_ranks(wgpu_world(topo(w, l)), |mut comm| {
            exercise_and_check_traffic(&mut comm)
        });
    }
}

#[test]
fn measured_traffic_equals_formula_in_sub_groups() {
    if or_skip().is_none() {
        return;
    }
    for &(w, l) in &[(8, 4), (6, 3)] {
        run_ranks(wgpu_world(topo(w, l)), |mut comm| {
            let t = *comm.topology();
            let g = comm.global_rank();
            let mut intra = comm.split(t.node_of(g), t.local_rank(g)).unwrap();
            let mut cross = comm.split(t.local_rank(g), t.node_of(g)).unwrap();
            exercise_and_check_traffic(&mut intra);
            exercise_and_check_traffic(&mut cross);
            assert_eq!(intra.traffic().sent().inter_node, 0);
            assert_eq!(cross.traffic().received().intra_node, 0);
            assert_eq!(comm.traffic().calls(), 0);
        });
    }
}

#[test]
fn all_gather_bytes_by_link_class() {
    if or_skip().is_none() {
        return;
    }
    let traffic = run_ranks(wgpu_world(topo(8, 4)), |mut comm| {
        assert_eq!(comm.all_gather_host(&[1.0f32; 10]).unwrap().len(), 80);
        comm.traffic().by_collective[&Collective::AllGather]
    });
    for t in &traffic {
        assert_eq!(t.calls, 1);
        let want = LinkBytes {
            intra_node: 3 * 40,
            inter_node: 4 * 40,
        };
        assert_eq!((t.sent, t.received), (want, want));
    }
}

#[test]
fn a_group_runs_its_ops_when_it_finishes() {
    if or_skip().is_none() {
        return;
    }
    run_ranks(wgpu_world(topo(4, 2)), |mut comm| {
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

#[test]
fn an_error_in_a_dropped_group_aborts_the_communicator() {
    if or_skip().is_none() {
        return;
    }
    run_ranks(wgpu_world(topo(2, 2)), |mut comm| {
        let len = if comm.rank() == 0 { 3 } else { 4 };
        let mut buf = comm.alloc::<f32>(len).unwrap();
        {
            let mut g = comm.group();
            g.all_reduce(&mut buf, ReduceOp::Mean);
        }
        let e = comm.barrier().unwrap_err();
        assert!(matches!(e, Error::Aborted { .. }), "{e}");
    });
}
