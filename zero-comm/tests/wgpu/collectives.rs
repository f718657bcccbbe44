//! Every collective through the shared bodies: f32 at world sizes 1 to 8, the 16-bit types and
//! `u8` at a representative subset (odd sizes and odd lengths hit the unaligned paths).

use half::{bf16, f16};
use zero_comm::ReduceOp;
use zero_core::Topology;

use crate::bodies::collectives::{self as shared, COUNTS, LENS, OPS};
use crate::bodies::stamp;
use crate::common::*;
use crate::device::{or_skip, wgpu, wgpu_world};

/// World sizes for the 16-bit types and `u8`: 1, even, odd, and a prime that makes `Mean`
/// divide inexactly.
const SUBSET: &[usize] = &[1, 2, 3, 7, 8];

#[track_caller]
fn worlds(sizes: impl IntoIterator<Item = usize>, f: impl Fn(Topology)) {
    if or_skip().is_none() {
        return;
    }
    for n in sizes {
        f(Topology::single_node(n).unwrap());
    }
}

#[test]
fn all_gather_f32_worlds_1_to_8() {
    worlds(1..=8, |t| check_all_gather::<_, f32>(wgpu_world(t), COUNTS));
}

#[test]
fn reduce_scatter_f32_worlds_1_to_8() {
    worlds(1..=8, |t| {
        for op in OPS {
            check_reduce_scatter::<_, f32>(wgpu_world(t), COUNTS, op);
        }
    });
}

#[test]
fn all_reduce_f32_worlds_1_to_8() {
    worlds(1..=8, |t| {
        for op in OPS {
            check_all_reduce::<_, f32>(wgpu_world(t), LENS, op);
            check_all_reduce_is_rs_ag::<_, f32>(wgpu_world(t), COUNTS, op);
        }
    });
}

#[test]
fn broadcast_f32_worlds_1_to_8() {
    worlds(1..=8, |t| check_broadcast::<_, f32>(wgpu_world(t), LENS));
}

#[test]
fn all_to_all_f32_worlds_1_to_8() {
    worlds(1..=8, |t| check_all_to_all::<_, f32>(wgpu_world(t), COUNTS));
}

#[test]
fn barrier_worlds_1_to_8() {
    worlds(1..=8, |t| check_barrier(wgpu_world(t)));
}

#[test]
fn sixteen_bit_reductions() {
    worlds(SUBSET.iter().copied(), |t| {
        for op in OPS {
            check_reduce_scatter::<_, bf16>(wgpu_world(t), COUNTS, op);
            check_reduce_scatter::<_, f16>(wgpu_world(t), COUNTS, op);
            check_all_reduce::<_, bf16>(wgpu_world(t), LENS, op);
            check_all_reduce::<_, f16>(wgpu_world(t), LENS, op);
        }
        check_all_reduce_is_rs_ag::<_, bf16>(wgpu_world(t), COUNTS, ReduceOp::Mean);
        check_all_reduce_is_rs_ag::<_, f16>(wgpu_world(t), COUNTS, ReduceOp::Sum);
    });
}

#[test]
fn sixteen_bit_and_byte_moves() {
    worlds(SUBSET.iter().copied(), |t| {
        check_all_gather::<_, bf16>(wgpu_world(t), COUNTS);
        check_all_gather::<_, f16>(wgpu_world(t), COUNTS);
        check_all_gather::<_, u8>(wgpu_world(t), COUNTS);
        check_broadcast::<_, bf16>(wgpu_world(t), LENS);
        check_broadcast::<_, u8>(wgpu_world(t), LENS);
        check_all_to_all::<_, f16>(wgpu_world(t), COUNTS);
        check_all_to_all::<_, u8>(wgpu_world(t), COUNTS);
    });
}

stamp! { wgpu, shared:
    upload_into_rewrites_existing_buffers();
}
