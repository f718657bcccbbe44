//! The simulator against the plan it rests on, hand-computed values, monotonicity properties
//! and a snapshot of a sweep table.

use proptest::prelude::*;
use zero_core::sim::cluster::Protocol;
use zero_core::sim::sweep::{VARIANTS, sweep};
use zero_core::sim::{
    Cluster, ModelShape, Overlap, SimOptions, SweepAxis, Variant, compute, simulate,
};
use zero_core::{ModelDesc, Placement, Plan, Precision, ZeroConfig};

fn opts(tokens: u64, shape: Option<ModelShape>) -> SimOptions {
    SimOptions {
        tokens_per_gpu: tokens,
        shape,
        recompute: true,
        overlap: Some(Overlap::Full),
    }
}

fn config(name: &str, precision: Precision, gpus_per_node: usize) -> ZeroConfig {
    let base = ZeroConfig {
        precision,
        ..Default::default()
    };
    Variant::named(name, &base, gpus_per_node).unwrap().config
}

#[test]
fn the_bytes_simulated_are_the_plans() {
    let (gpt, shape) = compute::gpt(4, 256, 128).unwrap();
    for preset in ["dgx2-v100", "dgx-a100"] {
        let cluster = Cluster::preset(preset).unwrap();
        // Every named variant but "config" (the base itself).
        for name in &VARIANTS[1..] {
            for (nodes, accum, clip) in [(1, 1, 0.0), (3, 2, 1.0), (4, 3, 0.0)] {
                let mut c = config(name, Precision::Fp16, cluster.gpus_per_node);
                c.gradient_accumulation_steps = accum;
                c.gradient_clipping = clip;
                let plan = Plan::new(&gpt, cluster.topology(nodes).unwrap(), &c).unwrap();
                let r = simulate(&plan, &cluster, &opts(256, Some(shape))).unwrap();
                assert_eq!(
                    r.plan_traffic,
                    plan.comm(0).by_collective,
                    "{preset} {name} {nodes}"
                );
                let rows: u64 = r.comm.by_phase.iter().map(|p| p.plan_sent.total()).sum();
                let comm = plan.comm(0);
                assert_eq!(rows, comm.intra_node_bytes + comm.inter_node_bytes);
                assert_eq!(
                    r.comm.by_phase.iter().map(|p| p.calls).sum::<u64>(),
                    comm.calls
                );
            }
        }
    }
}

mod collective;

/// One protocol and round numbers, so a whole step can be computed by hand: `gpus_per_node`
/// GPUs a node, 100 GB/s NVLink, 10 GB/s of NIC per node, base 10 µs, hops 1 µs intra and 5 µs
/// inter.
fn toy(gpus_per_node: usize) -> Cluster {
    let mut c = Cluster::preset("dgx-a100").unwrap();
    c.gpus_per_node = gpus_per_node;
    c.gpu.peak_tflops.fp32 = 10.0;
    c.gpu.compute_efficiency = 0.5;
    c.gpu.hbm_gbytes_per_s = 1000.0;
    c.intra.gbytes_per_s = 100.0;
    c.intra.efficiency = 1.0;
    c.inter.nics_per_node = 1;
    c.inter.nic_gbps = 80.0;
    c.inter.efficiency = 1.0;
    c.protocols = vec![Protocol {
        name: "simple".into(),
        bw_efficiency: 1.0,
        base_us: 10.0,
        intra_hop_us: 1.0,
        inter_hop_us: 5.0,
    }];
    c
}

#[test]
fn a_stage_1_step_by_hand() {
    // 1e8 fp32 parameters in one bucket, 2 nodes of 2 GPUs, 1,000 tokens, no recompute, no
    // overlap. Compute: 6·1e8·1e3 FLOPs at 5 TFLOP/s = 0.12 s (forward 0.04, backward 0.08).
    // Reduce-scatter and post-step all-gather of S = 4e8 B over 4 ranks on 2 nodes: NIC bytes
    // per node (3/4)·4e8 = 3e8 at 10 GB/s = 30 ms; NVLink (3/4)·(1/2)·4e8 at 100 GB/s = 1.5 ms
    // hidden under it; latency 10 + 2·1 + 1·5 = 17 µs. Optimizer: the shard 2.5e7 elements ×
    // (2·8 + 4 + 4) B at 1 TB/s = 0.6 ms.
    let c = toy(2);
    let m = ModelDesc::synthetic(100_000_000, 1).unwrap();
    let plan = Plan::new(&m, c.topology(2).unwrap(), &ZeroConfig::stage(1)).unwrap();
    let o = SimOptions {
        tokens_per_gpu: 1000,
        shape: None,
        recompute: false,
        overlap: Some(Overlap::None),
    };
    let r = simulate(&plan, &c, &o).unwrap();
    let close = |a: f64, b: f64| assert!((a - b).abs() < 1e-9 * b.max(1.0), "{a} vs {b}");
    close(r.compute.forward_seconds, 0.04);
    close(r.compute.backward_seconds, 0.08);
    close(r.compute.optimizer_seconds, 2.5e7 * 24.0 / 1e12);
    let op = 17e-6 + 0.03;
    close(r.comm.seconds, 2.0 * op);
    close(r.comm.inter_node_seconds, 0.06);
    close(r.comm.intra_node_seconds, 2.0 * 1.5e-3);
    close(r.step_seconds, 0.12 + 2.0 * op + 6e-4);
    close(r.tokens_per_sec, 4000.0 / r.step_seconds);
    close(r.tflops_per_gpu, 6e11 / r.step_seconds / 1e12);
    // Full overlap hides the reduce-scatter under the backward (30 ms < 80 ms), not the
    // post-step gather.
    let full = simulate(
        &plan,
        &c,
        &SimOptions {
            overlap: Some(Overlap::Full),
            ..o
        },
    )
    .unwrap();
    close(full.comm.exposed_seconds, op);
    close(full.step_seconds, 0.12 + op + 6e-4);
    let half = simulate(
        &plan,
        &c,
        &SimOptions {
            overlap: Some(Overlap::Fraction(0.5)),
            ..o
        },
    )
    .unwrap();
    close(half.comm.exposed_seconds, op + op / 2.0);
}

#[test]
fn codecs_cost_what_the_hbm_fraction_says() {
    // qwZ on one node of 2: every gather unit's all-gather encodes its chunk and decodes the
    // whole unit; the codec time of a run equals that sum over units and calls.
    let c = toy(2);
    let m = ModelDesc::synthetic(4_000_000, 4).unwrap();
    let mut cfg = ZeroConfig::stage(3);
    cfg.quantized_weights = true;
    let plan = Plan::new(&m, c.topology(1).unwrap(), &cfg).unwrap();
    let r = simulate(&plan, &c, &opts(10, None)).unwrap();
    let rate = |f: f64| f * 1000e9 / 4.0; // fp32: 4 B per element
    let want: f64 = plan
        .units()
        .iter()
        .map(|u| {
            2.0 * (u.len as f64 / 2.0 / rate(c.codec.int8_encode)
                + u.len as f64 / rate(c.codec.int8_decode))
        })
        .sum();
    assert!(
        (r.comm.codec_seconds - want).abs() < 1e-12,
        "{} {want}",
        r.comm.codec_seconds
    );
}

#[test]
fn bad_inputs_are_errors() {
    let c = Cluster::preset("dgx2-v100").unwrap();
    let m = ModelDesc::synthetic(1_000_000, 4).unwrap();
    let refused = |plan: &Plan, tokens, shape| {
        let e = simulate(plan, &c, &opts(tokens, shape)).unwrap_err();
        e.to_string()
    };
    let wrong = Plan::new(
        &m,
        zero_core::Topology::new(16, 8).unwrap(),
        &ZeroConfig::stage(3),
    );
    let e = refused(&wrong.unwrap(), 1024, None);
    assert!(e.contains("gpus_per_node (16)"), "{e}");
    let on_two = |precision| {
        let cfg = config("zero-3", precision, 16);
        Plan::new(&m, c.topology(2).unwrap(), &cfg).unwrap()
    };
    let e = refused(&on_two(Precision::Bf16), 1024, None);
    assert!(e.contains("no bf16 peak"), "{e}");
    let plan = on_two(Precision::Fp16);
    let shape = ModelShape {
        layers: 2,
        hidden: 8,
        seq_len: 512,
    };
    let e = refused(&plan, 1000, Some(shape));
    assert!(e.contains("multiple of the sequence length 512"), "{e}");
    // A shape beyond the bounds is refused, not computed into overflowed figures.
    let huge = ModelShape {
        layers: u64::MAX,
        hidden: u64::MAX,
        seq_len: 512,
    };
    let e = refused(&plan, 1024, Some(huge));
    assert!(e.contains("at most 100000 layers"), "{e}");
    assert!(simulate(&plan, &c, &opts(0, None)).is_err());
    // A cluster without a `host` table describes no CPU, PCIe or disk: offloaded state is
    // refused, naming the field.
    let c = Cluster {
        host: None,
        ..c.clone()
    };
    for (field, placed) in [
        (
            "optimizer_placement",
            ZeroConfig {
                optimizer_placement: Placement::Host,
                ..ZeroConfig::stage(3)
            },
        ),
        (
            "param_placement",
            ZeroConfig {
                param_placement: Placement::Nvme,
                nvme_path: Some("/nvme".into()),
                ..ZeroConfig::stage(3)
            },
        ),
    ] {
        let plan = Plan::new(&m, c.topology(2).unwrap(), &placed).unwrap();
        let e = simulate(&plan, &c, &opts(1024, None))
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("invalid {field}")), "{e}");
    }
    // Values that would only give an infinite or a zero step time are refused.
    for (k, v) in [
        ("gpu.memory_gib", "1e308"),
        ("inter.nic_gbps", "1e308"),
        ("gpu.peak_tflops.fp32", "5e-324"),
    ] {
        let e = c.set(k, v).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("1e-6 to 1e9"), "{k}={v}: {e}");
    }
    assert!(c.set("gpu.peak_tflops.fp32", "0").is_ok());
    assert!(c.topology(0).is_err());
    assert!(Overlap::parse("1.5").is_err());
    assert_eq!(Overlap::parse("0.25").unwrap().fraction(), 0.25);
}

fn arb_case() -> impl Strategy<Value = (String, u64, usize, usize, f64, f64)> {
    (
        prop::sample::select(vec!["dgx2-v100", "dgx-a100", "dgx-h100"]),
        1_000_000u64..2_000_000_000,
        1usize..48,
        prop::sample::select(vec![256usize, 1024, 4096]),
        10.0f64..1000.0,
        1.01f64..8.0,
    )
        .prop_map(|(c, p, n, t, g, k)| (c.to_string(), p, n, t, g, k))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn more_nic_bandwidth_never_slows_a_step((cluster, params, nodes, tokens, gbps, k) in arb_case(),
        variant in prop::sample::select(vec!["zero-1", "zero-2", "zero-3", "zero++", "zero-3+qgz"])) {
        let c = Cluster::preset(&cluster).unwrap();
        let m = ModelDesc::synthetic(params, 24).unwrap();
        let plan = Plan::new(&m, c.topology(nodes).unwrap(), &config(variant, Precision::Fp16, c.gpus_per_node)).unwrap();
        let slow = simulate(&plan, &c.with_nic_gbps_per_node(gbps).unwrap(), &opts(tokens as u64, None)).unwrap();
        let fast = simulate(&plan, &c.with_nic_gbps_per_node(gbps * k).unwrap(), &opts(tokens as u64, None)).unwrap();
        prop_assert!(fast.step_seconds <= slow.step_seconds);
        // The total, not the inter-node share: each collective takes its fastest algorithm, and
        // more bandwidth can make one with more (but faster) inter-node time the fastest.
        prop_assert!(fast.comm.seconds <= slow.comm.seconds);
    }

    #[test]
    fn zeropp_never_sends_more_cross_node_bytes_than_zero3((cluster, params, nodes, _t, _g, _k) in arb_case()) {
        let c = Cluster::preset(&cluster).unwrap();
        let m = ModelDesc::synthetic(params, 24).unwrap();
        let topo = c.topology(nodes).unwrap();
        let z3 = Plan::new(&m, topo, &config("zero-3", Precision::Fp16, c.gpus_per_node)).unwrap();
        let zpp = Plan::new(&m, topo, &config("zero++", Precision::Fp16, c.gpus_per_node)).unwrap();
        let a = simulate(&z3, &c, &opts(1024, None)).unwrap();
        let b = simulate(&zpp, &c, &opts(1024, None)).unwrap();
        prop_assert!(b.plan_traffic.sent().inter_node <= a.plan_traffic.sent().inter_node);
        prop_assert!(b.comm.inter_wire_bytes_per_node <= a.comm.inter_wire_bytes_per_node);
    }

    #[test]
    fn more_nodes_never_lower_total_communication((cluster, params, nodes, tokens, _g, _k) in arb_case(),
        more in 1usize..16,
        variant in prop::sample::select(vec!["zero-0", "zero-1", "zero-2", "zero-3", "zero++"])) {
        let c = Cluster::preset(&cluster).unwrap();
        let m = ModelDesc::synthetic(params, 24).unwrap();
        let cfg = config(variant, Precision::Fp16, c.gpus_per_node);
        let at = |k: usize| {
            let plan = Plan::new(&m, c.topology(k).unwrap(), &cfg).unwrap();
            simulate(&plan, &c, &opts(tokens as u64, None)).unwrap()
        };
        let (a, b) = (at(nodes), at(nodes + more));
        // The cluster's total: per rank, qwZ/qgZ block scales and unit padding round with N, so
        // one rank's bytes may dip by a few blocks' scales when N grows.
        let total = |r: &zero_core::sim::SimReport| r.world_size as u64 * r.plan_traffic.sent().total();
        prop_assert!(total(&b) >= total(&a));
        prop_assert!(b.comm.seconds >= a.comm.seconds, "{} < {}", b.comm.seconds, a.comm.seconds);
    }
}

#[test]
fn sweep_table_llama_7b_on_the_presets() {
    let m = ModelDesc::preset("llama-7b").unwrap();
    // Llama-7B at 2,048-token sequences, one per GPU, nothing overlapped (every term shows).
    let shape = ModelShape {
        seq_len: 2048,
        ..ModelShape::of_preset("llama-7b").unwrap()
    };
    let o = SimOptions {
        overlap: Some(Overlap::None),
        ..opts(2048, Some(shape))
    };
    let mut text = String::new();
    for (preset, precision) in [
        ("dgx2-v100", Precision::Fp16),
        ("dgx-a100", Precision::Bf16),
        ("dgx-h100", Precision::Bf16),
    ] {
        let c = Cluster::preset(preset).unwrap();
        let variants: Vec<Variant> = ["zero-3", "zero++"]
            .iter()
            .map(|v| Variant {
                name: v.to_string(),
                config: config(v, precision, c.gpus_per_node),
            })
            .collect();
        let t = sweep(&m, &c, 8, &SweepAxis::Nodes(vec![1, 8, 64]), &variants, &o).unwrap();
        text.push_str(&format!(
            "{preset} ({precision:?}, 2048 tokens/GPU, no overlap)\n{t}\n"
        ));
    }
    insta::assert_snapshot!(text);
}

/// The ZeRO++ paper's 18B shape (40 layers × 6144, sequence 512) on 24 DGX-2 nodes in fp16,
/// ZeRO-3 against ZeRO++ over the NIC's line rate, at 1024 and 2048 tokens per GPU, with full
/// overlap and none: the table BENCHMARKS.md quotes, which `cargo xtask simulate --gpt 40x6144
/// --seq-len 512 --stage 3 --precision fp16 --cluster dgx2-v100 --nodes 24 --sweep
/// nic-gbps=100,200,400,800` prints.
#[test]
fn sweep_table_gpt_18b_over_nic_bandwidth() {
    let (m, shape) = compute::gpt(40, 6144, 512).unwrap();
    let c = Cluster::preset("dgx2-v100").unwrap();
    let base = ZeroConfig {
        stage: 3,
        precision: Precision::Fp16,
        ..Default::default()
    };
    let variants: Vec<Variant> = ["zero-3", "zero++"]
        .iter()
        .map(|v| Variant::named(v, &base, c.gpus_per_node).unwrap())
        .collect();
    let axis = SweepAxis::NicGbpsPerNode(vec![100.0, 200.0, 400.0, 800.0]);
    let mut text = String::new();
    for tokens in [1024u64, 2048] {
        for overlap in [Overlap::Full, Overlap::None] {
            let o = SimOptions {
                overlap: Some(overlap),
                ..opts(tokens, Some(shape))
            };
            let t = sweep(&m, &c, 24, &axis, &variants, &o).unwrap();
            text.push_str(&format!("{tokens} tokens/GPU, overlap {overlap:?}\n{t}\n"));
        }
    }
    insta::assert_snapshot!(text);
}
