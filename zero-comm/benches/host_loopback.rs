//! Host loopback bandwidth, reported like nccl-tests, next to single-thread memcpy.
//!
//! `cargo bench -p zero-comm --bench host_loopback` (env `ZERO_COMM_BENCH_MIB`, default 64, and
//! `ZERO_COMM_BENCH_ITERS`, default 5). For each op and world size the time is the best of the
//! iterations, measured on rank 0 from a barrier to the op's return (the op returns only after every
//! rank has finished its part). `algbw = S / t` with `S` the full buffer (the all-gather output, the
//! reduce-scatter input, the all-reduce buffer); `busbw = algbw · (n−1)/n` for all-gather and
//! reduce-scatter and `algbw · 2(n−1)/n` for all-reduce, as nccl-tests define them.
//!
//! With `--features wgpu`, the wgpu loopback follows at n = 2 and 4 (`support/wgpu.rs`); with
//! `--features mpi`, the MPI communicator at n = 2 and 4, one process per rank under `mpirun`
//! (`support/mpi.rs`), timed by the same code in the same run.

use std::hint::black_box;
use std::time::{Duration, Instant};

use zero_comm::host::{HostWorld, probe};
use zero_comm::{Communicator, ReduceOp};
use zero_core::Topology;

#[cfg(feature = "mpi")]
#[path = "support/mpi.rs"]
mod mpi;
#[cfg(feature = "wgpu")]
#[path = "support/wgpu.rs"]
mod wgpu_loopback;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn gib_s(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / (1u64 << 30) as f64
}

fn memcpy_best(bytes: usize, iters: usize) -> Duration {
    let n = bytes / 4;
    let src: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut dst = vec![1.0f32; n];
    let mut best = Duration::MAX;
    for _ in 0..iters + 1 {
        let t = Instant::now();
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
        best = best.min(t.elapsed());
    }
    best
}

/// Aggregate bandwidth of `threads` threads each copying `bytes / threads` at once.
fn memcpy_parallel_best(bytes: usize, threads: usize, iters: usize) -> Duration {
    let n = bytes / 4 / threads;
    let mut bufs: Vec<(Vec<f32>, Vec<f32>)> =
        (0..threads).map(|_| (vec![2.0; n], vec![1.0; n])).collect();
    let mut best = Duration::MAX;
    for _ in 0..iters + 1 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for (src, dst) in bufs.iter_mut() {
                s.spawn(move || dst.copy_from_slice(black_box(src)));
            }
        });
        best = best.min(t.elapsed());
    }
    best
}

#[derive(Clone, Copy, Debug)]
enum Op {
    AllGather,
    ReduceScatter,
    AllReduce,
}

const OPS: [Op; 3] = [Op::AllGather, Op::ReduceScatter, Op::AllReduce];

/// The best of `iters` (after one warm-up) of `op` over `bytes` of f32 on this rank, each timed
/// from a barrier to the op's return.
fn time_op<C: Communicator>(comm: &mut C, op: Op, bytes: usize, iters: usize) -> Duration {
    let n = comm.world_size();
    let c = bytes / 4 / n;
    let me = comm.rank() as f32;
    let mut best = Duration::MAX;
    let mut timed = |comm: &mut C, f: &mut dyn FnMut(&mut C)| {
        for _ in 0..iters + 1 {
            comm.barrier().unwrap();
            let t = Instant::now();
            f(comm);
            best = best.min(t.elapsed());
        }
    };
    match op {
        Op::AllGather => {
            let send = comm.upload(&vec![me; c]).unwrap();
            let mut recv = comm.upload(&vec![0.0f32; c * n]).unwrap();
            timed(comm, &mut |comm| comm.all_gather(&send, &mut recv).unwrap());
        }
        Op::ReduceScatter => {
            let send = comm.upload(&vec![me; c * n]).unwrap();
            let mut recv = comm.upload(&vec![0.0f32; c]).unwrap();
            timed(comm, &mut |comm| {
                comm.reduce_scatter(&send, &mut recv, ReduceOp::Sum)
                    .unwrap()
            });
        }
        Op::AllReduce => {
            let mut buf = comm.upload(&vec![me; c * n]).unwrap();
            timed(comm, &mut |comm| {
                comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap()
            });
        }
    }
    best
}

fn bench_op(op: Op, n: usize, bytes: usize, iters: usize) -> Duration {
    let topo = Topology::single_node(n).unwrap();
    let times = HostWorld::new(topo, Duration::from_secs(600))
        .launch(|mut comm| time_op(&mut comm, op, bytes, iters));
    times.into_iter().map(|t| t.unwrap()).next().unwrap()
}

/// One row of the table: `op` at world size `n` took `t` for `bytes`.
fn row(op: Op, n: usize, bytes: usize, t: Duration, copy_bw: f64) -> String {
    let alg = gib_s(bytes, t);
    let f = (n - 1) as f64 / n as f64;
    let bus = match op {
        Op::AllReduce => alg * 2.0 * f,
        _ => alg * f,
    };
    let name = match op {
        Op::AllGather => "all_gather",
        Op::ReduceScatter => "reduce_scatter",
        Op::AllReduce => "all_reduce",
    };
    format!(
        "| {name} | {n} | {:.2} | {alg:.2} | {bus:.2} | {:.2} |",
        t.as_secs_f64() * 1e3,
        bus / copy_bw
    )
}

const HEADER: &str = "| op | n | time (ms) | algbw (GiB/s) | busbw (GiB/s) | busbw / memcpy |\n\
                      |---|---|---|---|---|---|";

fn main() {
    // `cargo bench` passes `--bench`; a filter argument, if any, is ignored.
    let mib = env("ZERO_COMM_BENCH_MIB", 64);
    let iters = env("ZERO_COMM_BENCH_ITERS", 5);
    let bytes = mib << 20;
    #[cfg(feature = "mpi")]
    if mpi::is_rank() {
        return mpi::rank(bytes, iters);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let copy = memcpy_best(bytes, iters);
    let copy_bw = gib_s(bytes, copy);
    println!("host loopback, {mib} MiB f32, best of {iters}, {cores} cores");
    println!(
        "memcpy (1 thread): {:.2} ms, {copy_bw:.2} GiB/s",
        copy.as_secs_f64() * 1e3
    );
    let par = memcpy_parallel_best(bytes, cores, iters);
    println!(
        "memcpy ({cores} threads, {mib} MiB in all): {:.2} ms, {:.2} GiB/s aggregate \
         (with n ranks on {cores} cores, an all-gather's busbw cannot exceed aggregate / n)",
        par.as_secs_f64() * 1e3,
        gib_s(bytes, par)
    );
    println!();
    println!("{HEADER}");
    for op in OPS {
        for n in [2usize, 4, 8] {
            println!(
                "{}",
                row(op, n, bytes, bench_op(op, n, bytes, iters), copy_bw)
            );
        }
    }
    host_path_probe();
    #[cfg(feature = "mpi")]
    mpi::run(mib, iters, copy_bw);
    #[cfg(feature = "wgpu")]
    wgpu_loopback::run(mib, iters);
}

/// The trainer's path on the default job's topology (4 ranks as 2 nodes of 2): medians of
/// `all_gather_host` over the world and over both node pairs at once, of 0 B and 1 MiB
/// ([`probe::all_gather_medians`], what `simulate --validate-host` measures in-process), and the
/// α-β values of the simulator's `host-loopback` cluster fitted to them
/// ([`probe::AllGatherMedians::fit`]).
fn host_path_probe() {
    let reps = env("ZERO_COMM_BENCH_PROBE_REPS", 200);
    let topo = Topology::new(4, 2).unwrap();
    let m = probe::all_gather_medians(topo, 1 << 20, reps, Duration::from_secs(600)).unwrap();
    let us = |s: f64| s * 1e6;
    println!();
    println!("host path probe: all_gather_host, 4 ranks as 2 x 2, median of {reps}, rank 0 (µs)");
    println!("| group | 0 B | 1 MiB |");
    println!("|---|---|---|");
    println!(
        "| world (4) | {:.1} | {:.1} |",
        us(m.world_empty),
        us(m.world_full)
    );
    println!(
        "| both node pairs at once | {:.1} | {:.1} |",
        us(m.node_empty),
        us(m.node_full)
    );
    let f = m.fit(topo);
    println!(
        "host-loopback.toml: base_us = {:.1}, intra_hop_us = inter_hop_us = {:.1}, \
         inter nic_gbps = {:.1}, intra gbytes_per_s = {:.2}",
        f.base_us,
        f.hop_us,
        f.world_bytes_per_s * 8.0 / 1e9,
        f.node_bytes_per_s / 1e9
    );
}
