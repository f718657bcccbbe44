//! The lengths every backend's collective tests run, and the collective bodies that run whole.

use half::{bf16, f16};
use zero_comm::{Communicator, ReduceOp};
use zero_core::Topology;

use super::World;
use crate::common::*;

/// Chunk lengths (per rank). Odd ones misalign 16-bit and byte chunks; 2049 crosses the host
/// reduction block of 2048.
pub(crate) const COUNTS: &[usize] = &[0, 1, 3, 7, 64, 2049];
/// Buffer lengths for ops that take any length.
pub(crate) const LENS: &[usize] = &[0, 1, 2, 5, 13, 100, 4099];
pub(crate) const OPS: [ReduceOp; 2] = [ReduceOp::Sum, ReduceOp::Mean];

/// `upload_into` on worlds of 1 to 3 ranks, every dtype.
pub(crate) fn upload_into_rewrites_existing_buffers<C: Communicator>(world: World<C>) {
    for n in [1, 2, 3] {
        let t = Topology::single_node(n).unwrap();
        run_ranks(world(t, SAFE_TIMEOUT), |mut c| {
            upload_into_body::<_, f32>(&mut c);
            upload_into_body::<_, bf16>(&mut c);
            upload_into_body::<_, f16>(&mut c);
            upload_into_body::<_, u8>(&mut c);
        });
    }
}
