use half::bf16;
use zero_comm::ReduceOp;

use crate::common::*;
use crate::device::{or_skip, wgpu_world};

#[test]
fn smoke() {
    if or_skip().is_none() {
        return;
    }
    let t = topo(3, 3);
    check_all_gather::<_, f32>(wgpu_world(t), &[0, 1, 3, 64]);
    check_all_gather::<_, bf16>(wgpu_world(t), &[0, 1, 3, 64]);
    check_all_gather::<_, u8>(wgpu_world(t), &[0, 1, 3, 64]);
    check_reduce_scatter::<_, f32>(wgpu_world(t), &[0, 1, 3, 64], ReduceOp::Mean);
    check_reduce_scatter::<_, bf16>(wgpu_world(t), &[0, 1, 3, 64], ReduceOp::Mean);
    check_all_reduce::<_, f32>(wgpu_world(t), &[0, 1, 5, 100], ReduceOp::Sum);
}
