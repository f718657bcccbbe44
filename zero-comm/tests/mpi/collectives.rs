//! Every collective on MPI, bit for bit against the canonical reduction and the host loopback, in
//! world sizes 1 to 6 with 1 to 3 ranks per node, in the world and in its intra- and cross-node
//! sub-groups, for f32, bf16 and f16 (u8 where nothing is reduced); measured bytes equal the plan
//! formulas.

use std::time::Duration;

use half::{bf16, f16};
use zero_comm::host::HostWorld;
use zero_comm::mpi::{MpiComm, MpiOptions};
use zero_comm::{Communicator, ReduceOp, ReduceOrder};
use zero_core::Topology;

use crate::common::*;
use crate::harness::{self, is_rank, launch, rank_ok};

const LIMIT: Duration = Duration::from_secs(120);

fn bodies<C: Communicator>(comm: &mut C) {
    all_gather_body::<_, f32>(comm, &[0, 1, 5, 33]);
    all_gather_body::<_, bf16>(comm, &[3, 17]);
    all_gather_body::<_, u8>(comm, &[0, 7]);
    upload_into_body::<_, f16>(comm);
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        reduce_scatter_body::<_, f32>(comm, &[0, 1, 5, 2049], op);
        reduce_scatter_body::<_, bf16>(comm, &[3, 33], op);
        reduce_scatter_body::<_, f16>(comm, &[3, 33], op);
        all_reduce_body::<_, f32>(comm, &[0, 1, 7, 19, 100], op);
        all_reduce_body::<_, bf16>(comm, &[1, 11, 100], op);
        all_reduce_body::<_, f16>(comm, &[7, 64], op);
        all_reduce_is_rs_ag_body::<_, bf16>(comm, &[4, 9], op);
    }
    broadcast_body::<_, f32>(comm, &[0, 1, 9]);
    broadcast_body::<_, u8>(comm, &[9]);
    all_to_all_body::<_, f32>(comm, &[0, 2, 7]);
    all_to_all_body::<_, f16>(comm, &[3]);
    comm.barrier().unwrap();
}

/// The host loopback's reduce-scatter and all-reduce of `values(rank, len)` for every rank, in
/// `order`, computed in this process: the oracle for the MPI results.
fn host_oracle(n: usize, c: usize, order: ReduceOrder) -> Vec<(Vec<f32>, Vec<f32>)> {
    let world = HostWorld::new(Topology::single_node(n).unwrap(), SAFE_TIMEOUT)
        .with_reduce_order(order)
        .into_comms();
    run_ranks(world, |mut comm| {
        let x = values::<f32>(comm.rank(), n * c + 1, 7);
        let rs = comm
            .reduce_scatter_host(&x[..n * c], ReduceOp::Sum)
            .unwrap();
        let mut ar = x.clone();
        comm.all_reduce_host(&mut ar, ReduceOp::Mean).unwrap();
        (rs, ar)
    })
}

fn equals_host_loopback(comm: &mut MpiComm, order: ReduceOrder) {
    let (n, me) = (comm.world_size(), comm.rank());
    let c = 2049;
    let want = &host_oracle(n, c, order)[me];
    let x = values::<f32>(me, n * c + 1, 7);
    let rs = comm
        .reduce_scatter_host(&x[..n * c], ReduceOp::Sum)
        .unwrap();
    let mut ar = x.clone();
    comm.all_reduce_host(&mut ar, ReduceOp::Mean).unwrap();
    assert_bits(&rs, &want.0, &format!("reduce_scatter {order:?} vs host"));
    assert_bits(&ar, &want.1, &format!("all_reduce {order:?} vs host"));
}

fn rank_body() {
    let mut comm = harness::world();
    let (n, me) = (comm.world_size(), comm.rank());
    let t = *comm.topology();
    assert_eq!(comm.reduce_order(), Some(ReduceOrder::RankSequential));
    // Traffic first: it checks the table from empty.
    exercise_and_check_traffic(&mut comm);
    bodies(&mut comm);
    equals_host_loopback(&mut comm, ReduceOrder::RankSequential);

    let g = comm.global_rank();
    let (node, local) = (t.node_of(g), t.local_rank(g));
    let mut intra = comm.split(node, local).unwrap();
    let mut cross = comm.split(local, node).unwrap();
    assert_eq!(
        intra.members(),
        t.node_ranks(node).collect::<Vec<_>>().as_slice()
    );
    assert_eq!(cross.members(), t.cross_node_ranks(local).as_slice());
    assert_eq!((cross.rank(), cross.world_size()), (node, t.num_nodes()));
    for sub in [&mut intra, &mut cross] {
        exercise_and_check_traffic(sub);
        bodies(sub);
    }
    // Reversed keys reorder the group.
    let mut rev = comm.split(0, n - me).unwrap();
    assert_eq!(rev.rank(), n - 1 - me);
    all_reduce_body::<_, f32>(&mut rev, &[5, 33], ReduceOp::Sum);

    drop((intra, cross, rev));
    let opts = MpiOptions {
        reduce_order: ReduceOrder::PairwiseTree,
        ..MpiOptions::from_env().unwrap()
    };
    let mut tree = MpiComm::world(opts).unwrap();
    assert_eq!(tree.reduce_order(), Some(ReduceOrder::PairwiseTree));
    equals_host_loopback(&mut tree, ReduceOrder::PairwiseTree);
    rank_ok(me, n);
}

#[test]
fn collectives_match_the_host_loopback_in_every_layout() {
    if is_rank() {
        return rank_body();
    }
    // 1 to 6 ranks, 1 to 3 per node.
    for (n, l) in layouts(6, 3) {
        let name = "collectives::collectives_match_the_host_loopback_in_every_layout";
        let Some(job) = launch(name, n, l, Duration::from_secs(60), &[], LIMIT) else {
            return;
        };
        eprintln!("world {n}, {l} per node: {:?}", job.elapsed);
        job.assert_ranks_ok(n);
    }
}
