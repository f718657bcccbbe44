//! Activation checkpointing in the plan: stage 3 without it keeps every gathered unit from the
//! forward to the backward (no backward gathers, every gather unit in the working set); with it
//! (the default at stage 3) each unit is gathered again for the backward.

use zero_core::{ModelDesc, Phase, Plan, Topology, UnitKind, ZeroConfig};

fn plan(cfg: &ZeroConfig) -> zero_core::Result<Plan> {
    let model = ModelDesc::synthetic(1_000_000, 8)?;
    Plan::new(&model, Topology::new(8, 4)?, cfg)
}

fn stage3(checkpoint: Option<bool>) -> ZeroConfig {
    ZeroConfig {
        stage: 3,
        param_persistence_threshold: 0,
        checkpoint_activations: checkpoint,
        ..Default::default()
    }
}

#[test]
fn stage_3_recomputes_by_default_and_stages_0_to_2_do_not() {
    for stage in 0..=3u8 {
        assert_eq!(ZeroConfig::stage(stage).recompute(), stage == 3);
    }
    assert!(stage3(Some(true)).recompute());
    assert!(!stage3(Some(false)).recompute());
}

#[test]
fn keeping_gathered_weights_drops_the_backward_gathers_and_grows_the_working_set() {
    let with = plan(&stage3(None)).unwrap();
    let without = plan(&stage3(Some(false))).unwrap();
    let backward = |p: &Plan| {
        p.schedule()
            .iter()
            .filter(|o| o.phase == Phase::Backward)
            .count()
    };
    let gather_units = with
        .units()
        .iter()
        .filter(|u| u.kind == UnitKind::Gather)
        .count();
    assert!(gather_units > 1);
    assert_eq!(backward(&with), gather_units);
    assert_eq!(backward(&without), 0);
    // One all-gather of every gather unit fewer per micro-step: a third less than 3Ψ's gathers.
    let (a, b) = (with.comm(0), without.comm(0));
    assert!(b.intra_node_bytes + b.inter_node_bytes < a.intra_node_bytes + a.inter_node_bytes);
    assert_eq!(b.calls + gather_units as u64, a.calls);
    let all: u64 = with
        .units()
        .iter()
        .filter(|u| u.kind == UnitKind::Gather)
        .map(|u| u.len)
        .sum();
    assert_eq!(without.peak_gathered(), all);
    assert!(with.peak_gathered() < all);
    assert_eq!(without.memory().gathered_working_set, all * 4);
    // Nothing else in the memory model moves.
    assert_eq!(
        without.memory().model_states_bytes,
        with.memory().model_states_bytes
    );
}

#[test]
fn hpz_needs_the_backward_regather() {
    let err = plan(&ZeroConfig {
        hpz_partition_size: 2,
        ..stage3(Some(false))
    })
    .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("checkpoint_activations"), "{msg}");
    assert!(
        plan(&ZeroConfig {
            hpz_partition_size: 2,
            ..stage3(None)
        })
        .is_ok()
    );
}
