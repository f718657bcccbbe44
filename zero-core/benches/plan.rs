//! Planning at cluster scale: time and peak heap of `Plan::new` + the memory and communication
//! models for one rank.
//!
//! Run: `cargo bench -p zero-core --bench plan`. Target: 100,000 tensors at 16,384 ranks in under
//! 1 s and under 256 MiB.

use std::sync::atomic::Ordering;
use std::time::Instant;

use zero_core::{ModelDesc, ParamDesc, Plan, Topology, ZeroConfig};
use zero_testkit::alloc::{LIVE, PEAK};

#[global_allocator]
static GLOBAL: zero_testkit::alloc::Counting = zero_testkit::alloc::Counting;

fn model(tensors: usize) -> ModelDesc {
    // A transformer-like mix: per block, 4 large matrices and 4 small vectors, 1000 blocks per
    // 8000 tensors; modules of 2 tensors each.
    let params = (0..tensors)
        .map(|i| {
            let shape: Vec<usize> = if i % 2 == 0 {
                vec![1024, 1024 + (i % 7)]
            } else {
                vec![1024 + (i % 5)]
            };
            ParamDesc::new(
                format!("blocks.{}.p{}", i / 8, i % 8),
                &shape,
                format!("blocks.{}.m{}", i / 8, (i % 8) / 2),
            )
        })
        .collect();
    ModelDesc::new(params)
}

fn main() {
    println!(
        "{:>8} {:>7} {:>6} {:>12} {:>12} {:>10}",
        "tensors", "ranks", "stage", "best ms", "peak MiB", "units"
    );
    for (tensors, n, l) in [(1_000usize, 64usize, 8usize), (100_000, 16_384, 8)] {
        let m = model(tensors);
        for stage in [1u8, 3] {
            let cfg = ZeroConfig {
                stage,
                hpz_partition_size: if stage == 3 { 8 } else { 1 },
                quantized_weights: stage == 3,
                quantized_gradients: stage == 3,
                reduce_bucket_size: 50_000_000,
                ..Default::default()
            };
            let topo = Topology::new(n, l).unwrap();
            let mut best = f64::INFINITY;
            let mut peak = 0;
            let mut units = 0;
            for _ in 0..5 {
                let base = LIVE.load(Ordering::Relaxed);
                PEAK.store(base, Ordering::Relaxed);
                let t = Instant::now();
                let plan = Plan::new(&m, topo, &cfg).unwrap();
                let report = plan.report(n - 1);
                let frags = plan.fragments(n / 2).len();
                let dt = t.elapsed().as_secs_f64() * 1e3;
                std::hint::black_box((&report, frags));
                units = plan.units().len();
                best = best.min(dt);
                peak = peak.max(PEAK.load(Ordering::Relaxed) - base);
            }
            println!(
                "{tensors:>8} {n:>7} {stage:>6} {best:>12.1} {:>12.1} {units:>10}",
                peak as f64 / (1 << 20) as f64
            );
        }
    }
}
