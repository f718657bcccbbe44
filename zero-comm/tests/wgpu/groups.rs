//! Sub-groups (`split`), byte accounting, and the `Group` guard on the wgpu loopback.

use zero_comm::Communicator;

use crate::bodies::groups::{self as shared, nested_pairs, world_or_node_step};
use crate::bodies::stamp;
use crate::common::*;
use crate::device::{or_skip, wgpu, wgpu_world};

/// `(world_size, ranks_per_node)` of the traffic checks: a subset of the host binary's.
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

stamp! { wgpu, shared:
    intra_and_cross_node_groups_have_the_topology_s_members(&[(8, 4), (6, 3), (4, 1)]);
    collectives_inside_sub_groups(&[(8, 4), (6, 2)]);
    measured_traffic_equals_formula_in_every_topology(TOPOLOGIES);
    measured_traffic_equals_formula_in_sub_groups(&[(8, 4), (6, 3)]);
    all_gather_bytes_by_link_class();
    a_group_runs_its_ops_when_it_finishes();
    an_error_in_a_dropped_group_aborts_the_communicator();
}

#[test]
fn nested_and_interleaved_groups() {
    if or_skip().is_none() {
        return;
    }
    run_ranks(wgpu_world(topo(8, 4)), |mut comm| {
        let g = comm.global_rank();
        let (mut intra, mut pairs, want) = nested_pairs(&mut comm);
        for i in 0..60usize {
            if !world_or_node_step(&mut comm, &mut intra, i) {
                let v = pairs.all_gather_host(&[g as u8]).unwrap();
                assert_eq!(v, want.iter().map(|&r| r as u8).collect::<Vec<_>>());
            }
        }
    });
}
