//! The wgpu loopback part of the `host_loopback` bench (feature `wgpu`): the same ops, sizes and
//! nccl-tests figures, on the default adapter (lavapipe on a CPU-only machine), next to one
//! `copy_buffer_to_buffer` of the same size on the same device.
//!
//! The time is the best of the iterations, measured on rank 0 from a barrier until the device has
//! executed the op: ops return once every rank has *submitted* its commands, so rank 0 then waits
//! for the queue (`WgpuComm::synchronize`). Each result is checked against its exact value after the
//! timed loop; a wrong result panics.

use std::time::{Duration, Instant};

use zero_comm::wgpu_loopback::{REQUIRED_USAGES, WgpuComm, WgpuDevice, WgpuWorld, wgpu};
use zero_comm::{Communicator, ReduceOp};
use zero_core::Topology;

use super::{Op, gib_s};

/// Best time of one device-side copy of `bytes` (submit + wait).
fn device_copy_best(device: &WgpuDevice, bytes: usize, iters: usize) -> Duration {
    let make = || {
        device.device().create_buffer(&wgpu::BufferDescriptor {
            label: Some("bench copy"),
            size: bytes as u64,
            usage: REQUIRED_USAGES,
            mapped_at_creation: false,
        })
    };
    let (src, dst) = (make(), make());
    let mut best = Duration::MAX;
    for _ in 0..iters + 1 {
        let t = Instant::now();
        let mut enc = device.device().create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(&src, 0, &dst, 0, bytes as u64);
        device.queue().submit([enc.finish()]);
        device.synchronize(Duration::from_secs(600)).unwrap();
        best = best.min(t.elapsed());
    }
    best
}

/// Times `op` on rank 0 (barrier, op, wait for the device), best of `iters + 1`.
fn timed(comm: &mut WgpuComm, iters: usize, mut op: impl FnMut(&mut WgpuComm)) -> Duration {
    let mut best = Duration::MAX;
    for _ in 0..iters + 1 {
        comm.barrier().unwrap();
        let t = Instant::now();
        op(comm);
        comm.synchronize().unwrap();
        best = best.min(t.elapsed());
    }
    best
}

fn bench_op(
    device: &std::sync::Arc<WgpuDevice>,
    op: Op,
    n: usize,
    bytes: usize,
    iters: usize,
) -> Duration {
    let len = bytes / 4;
    let c = len / n;
    let topo = Topology::single_node(n).unwrap();
    let world = WgpuWorld::with_device(device.clone(), topo, Duration::from_secs(600));
    let times = world.launch(|mut comm| {
        let me = comm.rank() as f32;
        let sum = (n * (n - 1) / 2) as f32;
        match op {
            Op::AllGather => {
                let send = comm.upload(&vec![me; c]).unwrap();
                let mut recv = comm.alloc::<f32>(c * n).unwrap();
                let t = timed(&mut comm, iters, |comm| {
                    comm.all_gather(&send, &mut recv).unwrap()
                });
                let got = comm.download_vec(&recv).unwrap();
                assert!((0..n).all(|k| got[k * c..(k + 1) * c].iter().all(|&x| x == k as f32)));
                t
            }
            Op::ReduceScatter => {
                let send = comm.upload(&vec![me; c * n]).unwrap();
                let mut recv = comm.alloc::<f32>(c).unwrap();
                let t = timed(&mut comm, iters, |comm| {
                    comm.reduce_scatter(&send, &mut recv, ReduceOp::Sum)
                        .unwrap()
                });
                assert!(comm.download_vec(&recv).unwrap().iter().all(|&x| x == sum));
                t
            }
            Op::AllReduce => {
                // Mean keeps the buffer at the mean of the ranks' values, iteration after iteration.
                let mut buf = comm.upload(&vec![me; c * n]).unwrap();
                let t = timed(&mut comm, iters, |comm| {
                    comm.all_reduce(&mut buf, ReduceOp::Mean).unwrap()
                });
                let mean = sum / n as f32;
                assert!(comm.download_vec(&buf).unwrap().iter().all(|&x| x == mean));
                t
            }
        }
    });
    times.into_iter().map(|t| t.unwrap()).next().unwrap()
}

fn name(op: Op) -> &'static str {
    match op {
        Op::AllGather => "all_gather",
        Op::ReduceScatter => "reduce_scatter",
        Op::AllReduce => "all_reduce",
    }
}

pub(crate) fn run(mib: usize, iters: usize) {
    let bytes = mib << 20;
    println!();
    let device = match WgpuDevice::new() {
        Ok(d) => d,
        Err(e) => {
            println!("wgpu loopback: skipped, {e}");
            return;
        }
    };
    let info = device.adapter_info();
    let copy = device_copy_best(&device, bytes, iters);
    let copy_bw = gib_s(bytes, copy);
    println!(
        "wgpu loopback on {} ({:?}, {}), {mib} MiB f32, best of {iters}",
        info.name, info.backend, info.driver_info
    );
    println!(
        "copy_buffer_to_buffer + wait: {:.2} ms, {copy_bw:.2} GiB/s",
        copy.as_secs_f64() * 1e3
    );
    println!();
    println!("| op | n | time (ms) | algbw (GiB/s) | busbw (GiB/s) | busbw / device copy |");
    println!("|---|---|---|---|---|---|");
    for op in [Op::AllGather, Op::ReduceScatter, Op::AllReduce] {
        for n in [2usize, 4] {
            let t = bench_op(&device, op, n, bytes, iters);
            let alg = gib_s(bytes, t);
            let f = (n - 1) as f64 / n as f64;
            let bus = match op {
                Op::AllReduce => alg * 2.0 * f,
                _ => alg * f,
            };
            println!(
                "| {} | {n} | {:.2} | {alg:.2} | {bus:.2} | {:.2} |",
                name(op),
                t.as_secs_f64() * 1e3,
                bus / copy_bw
            );
        }
    }
}
