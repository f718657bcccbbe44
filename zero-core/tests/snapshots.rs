//! Readable snapshots of plans: a few models × world sizes × stages.

use zero_core::{ModelDesc, ParamDesc, Plan, Precision, Topology, ZeroConfig};

fn small_gpt() -> ModelDesc {
    // A two-block decoder small enough to read: embeddings, per-block attention and MLP, and a
    // frozen positional table.
    let mut p = vec![
        ParamDesc::new("wte.weight", &[64, 16], "wte"),
        ParamDesc::new("wpe.weight", &[8, 16], "wpe").frozen(),
    ];
    for l in 0..2 {
        for (module, weight, bias) in [
            ("ln", &[16][..], 16),
            ("attn", &[16, 48], 48),
            ("mlp", &[16, 64], 64),
        ] {
            let m = format!("h.{l}.{module}");
            p.push(ParamDesc::new(format!("{m}.weight"), weight, m.clone()));
            p.push(ParamDesc::new(format!("{m}.bias"), &[bias], m));
        }
    }
    ModelDesc::new(p)
}

#[track_caller]
fn check_plan(name: &str, model: &ModelDesc, n: usize, l: usize, cfg: ZeroConfig) {
    let plan = Plan::new(model, Topology::new(n, l).unwrap(), &cfg).unwrap();
    let text = format!("{plan}\n{}", plan.report(0));
    insta::with_settings!({ snapshot_suffix => format!("{name}_n{n}_s{}", cfg.stage), omit_expression => true }, {
        insta::assert_snapshot!(text);
    });
}

#[test]
fn small_gpt_plans() {
    let m = small_gpt();
    for (n, l) in [(1, 1), (2, 2), (4, 2)] {
        for stage in 0..=3u8 {
            let cfg = ZeroConfig {
                stage,
                reduce_bucket_size: 1200,
                param_persistence_threshold: 64,
                ..Default::default()
            };
            check_plan("small_gpt", &m, n, l, cfg);
        }
    }
}

#[test]
fn zeropp_plan() {
    let cfg = ZeroConfig {
        stage: 3,
        precision: Precision::Bf16,
        quantized_weights: true,
        hpz_partition_size: 2,
        quantized_gradients: true,
        qwz_block_size: 64,
        qgz_block_size: 32,
        param_persistence_threshold: 64,
        gradient_accumulation_steps: 2,
        gradient_clipping: 1.0,
        ..Default::default()
    };
    check_plan("small_gpt_zeropp", &small_gpt(), 4, 2, cfg);
}

#[test]
fn gpt2_small_summary() {
    let m = ModelDesc::preset("gpt2-small").unwrap();
    for stage in [1u8, 3] {
        let cfg = ZeroConfig {
            stage,
            precision: Precision::Bf16,
            reduce_bucket_size: 20_000_000,
            ..Default::default()
        };
        let plan = Plan::new(&m, Topology::new(16, 8).unwrap(), &cfg).unwrap();
        insta::with_settings!({ snapshot_suffix => format!("gpt2_small_n16_s{stage}"), omit_expression => true }, {
            insta::assert_snapshot!(plan.report(0).to_string());
        });
    }
}
