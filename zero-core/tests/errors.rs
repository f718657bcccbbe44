//! One test per invalid input: each error says what is wrong and what would be valid.

use zero_core::{Error, ModelDesc, ParamDesc, Plan, Precision, Topology, ZeroConfig};

fn model() -> ModelDesc {
    ModelDesc::new(vec![
        ParamDesc::new("w", &[4, 4], "m"),
        ParamDesc::new("b", &[4], "m"),
    ])
}

#[track_caller]
fn check(cfg: ZeroConfig, topo: (usize, usize), needles: &[&str]) {
    let e = match Topology::new(topo.0, topo.1) {
        Err(e) => e,
        Ok(t) => Plan::new(&model(), t, &cfg).expect_err("must be rejected"),
    };
    let msg = e.to_string();
    for n in needles {
        assert!(msg.contains(n), "message {msg:?} lacks {n:?}");
    }
}

#[test]
fn world_size_zero() {
    check(ZeroConfig::default(), (0, 1), &["world_size", "at least 1"]);
}

#[test]
fn ranks_per_node_must_divide_world_size() {
    check(
        ZeroConfig::default(),
        (6, 4),
        &["ranks_per_node", "divisor of world_size 6", "[1, 2, 3, 6]"],
    );
}

#[test]
fn ranks_per_node_zero() {
    check(
        ZeroConfig::default(),
        (4, 0),
        &["ranks_per_node", "at least 1"],
    );
}

#[test]
fn hpz_must_divide_ranks_per_node() {
    let c = ZeroConfig {
        stage: 3,
        hpz_partition_size: 3,
        ..Default::default()
    };
    check(
        c,
        (8, 4),
        &[
            "hpz_partition_size",
            "divisor of ranks_per_node 4",
            "[1, 2, 4]",
        ],
    );
}

#[test]
fn hpz_zero() {
    let c = ZeroConfig {
        stage: 3,
        hpz_partition_size: 0,
        ..Default::default()
    };
    check(c, (4, 4), &["hpz_partition_size", "got 0"]);
}

#[test]
fn zeropp_switches_need_stage_3() {
    for c in [
        ZeroConfig {
            stage: 2,
            quantized_weights: true,
            ..Default::default()
        },
        ZeroConfig {
            stage: 1,
            hpz_partition_size: 2,
            ..Default::default()
        },
        ZeroConfig {
            stage: 0,
            quantized_gradients: true,
            ..Default::default()
        },
    ] {
        check(c, (4, 2), &["stage 3"]);
    }
}

#[test]
fn stage_out_of_range() {
    check(
        ZeroConfig {
            stage: 4,
            ..Default::default()
        },
        (2, 2),
        &["stage", "0, 1, 2 or 3"],
    );
}

#[test]
fn bucket_sizes_zero() {
    check(
        ZeroConfig {
            reduce_bucket_size: 0,
            ..Default::default()
        },
        (2, 2),
        &["reduce_bucket_size"],
    );
    check(
        ZeroConfig {
            allgather_bucket_size: 0,
            ..Default::default()
        },
        (2, 2),
        &["allgather_bucket_size"],
    );
}

#[test]
fn block_sizes() {
    check(
        ZeroConfig {
            stage: 3,
            qwz_block_size: 0,
            ..Default::default()
        },
        (2, 2),
        &["qwz_block_size"],
    );
    check(
        ZeroConfig {
            stage: 3,
            qgz_block_size: 0,
            ..Default::default()
        },
        (2, 2),
        &["qgz_block_size", "even"],
    );
    check(
        ZeroConfig {
            stage: 3,
            qgz_block_size: 7,
            ..Default::default()
        },
        (2, 2),
        &["qgz_block_size", "even"],
    );
}

#[test]
fn accumulation_steps_zero() {
    check(
        ZeroConfig {
            gradient_accumulation_steps: 0,
            ..Default::default()
        },
        (2, 2),
        &["gradient_accumulation_steps"],
    );
}

#[test]
fn clipping_must_be_finite_and_non_negative() {
    check(
        ZeroConfig {
            gradient_clipping: -1.0,
            ..Default::default()
        },
        (2, 2),
        &["gradient_clipping"],
    );
    check(
        ZeroConfig {
            gradient_clipping: f64::NAN,
            ..Default::default()
        },
        (2, 2),
        &["gradient_clipping"],
    );
}

#[test]
fn accumulate_before_reduce_only_at_stages_0_and_1() {
    let c = ZeroConfig {
        stage: 2,
        accumulate_before_reduce: true,
        ..Default::default()
    };
    check(c, (2, 2), &["accumulate_before_reduce", "stages 2 and 3"]);
}

#[test]
fn grad_accum_dtype_is_fp32_or_the_working_precision() {
    let c = ZeroConfig {
        precision: Precision::Bf16,
        grad_accum_dtype: Some(Precision::Fp16),
        ..Default::default()
    };
    check(
        c,
        (2, 2),
        &["grad_accum_dtype", "fp32, or the working precision"],
    );
}

#[test]
fn empty_model() {
    let e = Plan::new(
        &ModelDesc::default(),
        Topology::single_node(2).unwrap(),
        &ZeroConfig::default(),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Model(_)));
    assert!(e.to_string().contains("no parameters"));
}

#[test]
fn duplicate_names() {
    let m = ModelDesc::new(vec![
        ParamDesc::new("w", &[2], "a"),
        ParamDesc::new("w", &[3], "b"),
    ]);
    let e = Plan::new(
        &m,
        Topology::single_node(1).unwrap(),
        &ZeroConfig::default(),
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("duplicate parameter name `w`"),
        "{e}"
    );
}

#[test]
fn zero_sized_tensor() {
    let m = ModelDesc::new(vec![ParamDesc::new("w", &[2, 0], "a")]);
    let e = Plan::new(
        &m,
        Topology::single_node(1).unwrap(),
        &ZeroConfig::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("zero dimension"), "{e}");
    let m = ModelDesc::new(vec![ParamDesc::new("s", &[], "a")]);
    let e = Plan::new(
        &m,
        Topology::single_node(1).unwrap(),
        &ZeroConfig::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("empty shape"), "{e}");
}

#[test]
fn everything_frozen() {
    let m = ModelDesc::new(vec![ParamDesc::new("w", &[2], "a").frozen()]);
    for stage in 0..=3 {
        let e = Plan::new(
            &m,
            Topology::single_node(1).unwrap(),
            &ZeroConfig::stage(stage),
        )
        .unwrap_err();
        assert!(e.to_string().contains("no trainable parameters"), "{e}");
    }
}

#[test]
fn bad_precision_name() {
    let e = Precision::parse("fp8").unwrap_err().to_string();
    assert!(e.contains("fp32, bf16, fp16"), "{e}");
}

#[test]
fn unknown_preset() {
    let e = ModelDesc::preset("gpt-5").unwrap_err().to_string();
    assert!(e.contains("llama-70b"), "{e}");
}

#[test]
fn a_model_beyond_2_pow_50_parameters_is_refused_and_one_below_it_has_exact_bytes() {
    let topo = Topology::single_node(1).unwrap();
    let huge = ModelDesc::new(vec![ParamDesc::new("w", &[1 << 50, 2], "a")]);
    let e = Plan::new(&huge, topo, &ZeroConfig::default()).unwrap_err();
    assert!(matches!(e, Error::Model(_)));
    assert!(e.to_string().contains("at most 2^50"), "{e}");
    // Two tensors whose sum overflows u64 are refused, not wrapped.
    let wrap = ModelDesc::new(vec![
        ParamDesc::new("a", &[1 << 32, 1 << 31], "a"),
        ParamDesc::new("b", &[1 << 32, 1 << 31], "b"),
    ]);
    let e = Plan::new(&wrap, topo, &ZeroConfig::default()).unwrap_err();
    assert!(e.to_string().contains("over 2^64"), "{e}");
    // At the cap, stage 0 fp32 AdamW is 16 bytes per parameter, exactly (no wrap-around).
    let max = ModelDesc::new(vec![ParamDesc::new("w", &[1 << 50], "a")]);
    let m = Plan::new(&max, topo, &ZeroConfig::default())
        .unwrap()
        .memory();
    let states = m.parameters + m.gradients + m.optimizer_states + m.master_weights;
    assert_eq!(states, 16 << 50);
}
