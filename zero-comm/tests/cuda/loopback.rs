//! The CUDA loopback (`zero_comm::nccl::CudaWorld`): N ranks on one GPU, collectives in device
//! memory without NCCL. The shared bodies of `tests/comm/common.rs` at world sizes 1 to 8, the
//! adversarial script of `tests/comm/bits.rs` against the host loopback bit for bit, and
//! sub-groups with their byte accounting, and qwZ/qgZ with the CUDA codecs against the host path
//! (`tests/comm/quant_common.rs`). GPU tests: see the rules in `tests/nccl.rs`.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use half::{bf16, f16};
use zero_comm::nccl::{CudaComm, CudaDevice, CudaWorld};
use zero_comm::{Communicator, ReduceOp};
use zero_core::Topology;
use zero_quant::{Codec, CudaQuantizer, Int4Block, Int8Block};

use super::bits::same_bits;
use super::common::*;
use super::quant_common::{compare_qgz, compare_qwz};
use super::{gpu, passed};

const COUNTS: &[usize] = &[0, 1, 3, 7, 64, 2049];
const LENS: &[usize] = &[0, 1, 2, 5, 13, 100, 4099];

/// The process's device (GPU 0), opened once: every world shares its stream, as a quantizer must.
fn device() -> Arc<CudaDevice> {
    static DEVICE: OnceLock<Arc<CudaDevice>> = OnceLock::new();
    DEVICE
        .get_or_init(|| {
            CudaDevice::new(0).expect("ZERO_GPU_TESTS=1 but the CUDA loopback cannot open GPU 0")
        })
        .clone()
}

fn cuda_world(t: Topology) -> Vec<CudaComm> {
    CudaWorld::with_device(device(), t, Duration::from_secs(60)).into_comms()
}

#[test]
fn gpu_cuda_loopback_every_collective_at_worlds_1_to_8() {
    let name = "gpu_cuda_loopback_every_collective_at_worlds_1_to_8";
    let Some(_g) = gpu(name) else {
        return;
    };
    for n in 1..=8 {
        let t = Topology::single_node(n).unwrap();
        check_all_gather::<_, f32>(cuda_world(t), COUNTS);
        check_all_gather::<_, u8>(cuda_world(t), COUNTS);
        for op in [ReduceOp::Sum, ReduceOp::Mean] {
            check_reduce_scatter::<_, f32>(cuda_world(t), COUNTS, op);
            check_all_reduce::<_, f32>(cuda_world(t), LENS, op);
            check_all_reduce_is_rs_ag::<_, f32>(cuda_world(t), COUNTS, op);
        }
        check_broadcast::<_, f32>(cuda_world(t), LENS);
        check_all_to_all::<_, f32>(cuda_world(t), COUNTS);
        check_barrier(cuda_world(t));
    }
    for n in [1, 2, 3, 7] {
        let t = Topology::single_node(n).unwrap();
        for op in [ReduceOp::Sum, ReduceOp::Mean] {
            check_reduce_scatter::<_, bf16>(cuda_world(t), COUNTS, op);
            check_reduce_scatter::<_, f16>(cuda_world(t), COUNTS, op);
            check_all_reduce::<_, bf16>(cuda_world(t), LENS, op);
            check_all_reduce::<_, f16>(cuda_world(t), LENS, op);
        }
        check_all_gather::<_, bf16>(cuda_world(t), COUNTS);
        check_all_to_all::<_, f16>(cuda_world(t), COUNTS);
        check_broadcast::<_, u8>(cuda_world(t), LENS);
        run_ranks(cuda_world(t), |mut c| {
            upload_into_body::<_, f32>(&mut c);
            upload_into_body::<_, bf16>(&mut c);
            upload_into_body::<_, u8>(&mut c);
        });
    }
    passed(name);
}

#[test]
fn gpu_cuda_loopback_bits_equal_the_host_loopback() {
    let name = "gpu_cuda_loopback_bits_equal_the_host_loopback";
    let Some(_g) = gpu(name) else {
        return;
    };
    let counts = &[1, 2, 5, 300, 1027];
    for n in [1, 2, 3, 5, 8] {
        same_bits::<_, f32>("cuda", cuda_world, n, counts);
        same_bits::<_, bf16>("cuda", cuda_world, n, counts);
        same_bits::<_, f16>("cuda", cuda_world, n, counts);
    }
    passed(name);
}

#[test]
fn gpu_cuda_loopback_groups_count_their_bytes() {
    let name = "gpu_cuda_loopback_groups_count_their_bytes";
    let Some(_g) = gpu(name) else {
        return;
    };
    for (w, l) in [(8, 4), (6, 3), (4, 1)] {
        run_ranks(cuda_world(topo(w, l)), |mut comm| {
            let t = *comm.topology();
            let g = comm.global_rank();
            let (node, local) = (t.node_of(g), t.local_rank(g));
            let mut intra = comm.split(node, local).unwrap();
            let mut cross = comm.split(local, node).unwrap();
            assert_eq!((intra.rank(), intra.world_size()), (local, l));
            assert_eq!((cross.rank(), cross.world_size()), (node, w / l));
            exercise_and_check_traffic(&mut intra);
            exercise_and_check_traffic(&mut cross);
            all_reduce_body::<_, bf16>(&mut intra, &[9], ReduceOp::Mean);
            reduce_scatter_body::<_, f32>(&mut cross, &[5], ReduceOp::Sum);
            exercise_and_check_traffic(&mut comm);
        });
    }
    passed(name);
}

#[test]
fn gpu_cuda_loopback_qwz_and_qgz_match_the_host_path() {
    let name = "gpu_cuda_loopback_qwz_and_qgz_match_the_host_path";
    let Some(_g) = gpu(name) else {
        return;
    };
    let codecs: [Codec; 3] = [
        Int8Block::default().into(),
        Int8Block::new(7).unwrap().into(),
        Int4Block::new(6).unwrap().into(),
    ];
    let place = |comm: &CudaComm, x: &[f32]| comm.upload(x).unwrap();
    let q = CudaQuantizer::new(device().stream().clone()).unwrap();
    for codec in codecs {
        for (n, l) in [(1, 1), (2, 2), (3, 3), (4, 2), (6, 3), (3, 1)] {
            for c in [0, 1, 5, 100] {
                let input = |r: usize| values::<f32>(r, c, c as u64);
                compare_qwz(cuda_world(topo(n, l)), &q, c, codec, place, input);
                let input = |r: usize| values::<f32>(r, n * c, 3 + c as u64);
                compare_qgz(cuda_world(topo(n, l)), &q, (l, c), codec, place, input);
            }
        }
        // Rank 1's non-finite element: every rank fails naming rank 1, as on the host.
        let input = |r: usize| {
            let mut x = values::<f32>(r, 100, 9);
            if r == 1 {
                x[37] = f32::NAN;
            }
            x
        };
        compare_qwz(cuda_world(topo(3, 3)), &q, 100, codec, place, input);
    }
    passed(name);
}
