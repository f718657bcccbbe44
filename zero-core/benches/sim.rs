//! The simulator at cluster scale: a sweep of 20 configurations at 4,096 GPUs (Llama-7B on
//! 512 DGX H100 nodes: 5 NIC bandwidths × ZeRO-3, ZeRO-3 + qwZ, ZeRO-3 + qgZ, ZeRO++), plans
//! included. Target: under 1 s.
//!
//! `cargo bench -p zero-core --bench sim`

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use zero_core::sim::sweep::sweep;
use zero_core::sim::{Cluster, ModelShape, Overlap, SimOptions, SweepAxis, Variant};
use zero_core::{ModelDesc, Precision, ZeroConfig};

fn bench(c: &mut Criterion) {
    let model = ModelDesc::preset("llama-7b").unwrap();
    let cluster = Cluster::preset("dgx-h100").unwrap();
    let base = ZeroConfig {
        precision: Precision::Bf16,
        ..ZeroConfig::stage(3)
    };
    let variants: Vec<Variant> = ["zero-3", "zero-3+qwz", "zero-3+qgz", "zero++"]
        .iter()
        .map(|v| Variant::named(v, &base, cluster.gpus_per_node).unwrap())
        .collect();
    let axis = SweepAxis::NicGbpsPerNode(vec![400.0, 800.0, 1600.0, 3200.0, 6400.0]);
    let opts = SimOptions {
        tokens_per_gpu: 4096,
        shape: ModelShape::of_preset("llama-7b"),
        recompute: true,
        overlap: Some(Overlap::Full),
    };
    let t = sweep(&model, &cluster, 512, &axis, &variants, &opts).unwrap();
    assert_eq!(t.rows.len(), 20);
    assert!(t.rows.iter().all(|r| r.report.world_size == 4096));
    let mut g = c.benchmark_group("sim");
    g.sample_size(10).measurement_time(Duration::from_secs(10));
    g.bench_function("sweep_20_configs_4096_gpus", |b| {
        b.iter(|| sweep(black_box(&model), &cluster, 512, &axis, &variants, &opts).unwrap())
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
