//! Resharding at load: a checkpoint saved with one plan loads into another world
//! size, ranks per node, stage, bucket size or hpZ with every fp32 state element where the new
//! plan puts it (round trips A → B → A give back every bit of the optimizer state), and with
//! the canonical tree the continuation on the new world size is bit-identical to a run that used
//! it from the start.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use serde_json::json;
use zero_burn::checkpoint::{MemStorage, Storage};
use zero_burn::demo::run::{TrainOptions, corpus_step, engine_builder};
use zero_burn::{Error, Launch, Reduction, plan_for};
use zero_core::{CheckpointError, Plan, Topology, ZeroConfig};

fn cfg(stage: u8, bucket: u64) -> ZeroConfig {
    ZeroConfig {
        stage,
        reduce_bucket_size: bucket,
        param_persistence_threshold: 64,
        // Stage 3's default at every stage: a run that changes stage on resume compares like
        // with like.
        checkpoint_activations: Some(true),
        ..Default::default()
    }
}

fn plan(topo: Topology, cfg: &ZeroConfig) -> Arc<Plan> {
    let (model, _) = tiny();
    Arc::new(plan_for(&model, topo, cfg).unwrap())
}

/// Per rank: gathered parameters, m and v as bits, and losses.
type Out = (Vec<Vec<u32>>, Vec<u32>, Vec<u32>, Vec<u32>);

/// Per rank, in bits: what [`Out`] holds, and the fp32 master weights, the loss scale, and the
/// steps taken and skipped.
#[derive(Debug, PartialEq)]
struct Full {
    out: Out,
    master: Vec<u32>,
    scale: Option<u64>,
    steps: (u64, u64),
}

/// The runs' losses and parameters alone.
fn outs(full: Vec<Full>) -> Vec<Out> {
    full.into_iter().map(|f| f.out).collect()
}

/// A fresh world of `plan`: loads `from` (resharding) if given, trains up to `to`, saves into
/// `save` if given. With the master weights and the loss scaler; [`outs`] drops them.
fn world(
    plan: &Arc<Plan>,
    opts: TrainOptions,
    from: Option<&dyn Storage>,
    to: u64,
    save: Option<&dyn Storage>,
) -> zero_burn::Result<Vec<Full>> {
    let (model, corpus) = tiny();
    Launch::new(*plan.topology())
        .timeout(Duration::from_secs(30))
        .reduction(opts.reduction)
        .run_with(&model, |comm, model| {
            let mut e = engine_builder(plan, comm, model, opts).build()?;
            if let Some(s) = from {
                let l = e.load_resharded(s)?;
                assert_eq!(l.client_state, json!({ "k": 1 }));
            }
            let mut losses = Vec::new();
            while e.steps() < to {
                losses.push(corpus_step(&mut e, &corpus, &opts)?.loss.to_bits());
            }
            if let Some(s) = save {
                e.save(s, json!({ "k": 1 }))?;
            }
            let p = bits(&e.gather_all_params()?);
            let (m, v) = e.optimizer_state().unwrap();
            let b = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
            Ok(Full {
                master: b(&e.master_weights().unwrap()),
                scale: e.loss_scale().map(f64::to_bits),
                steps: (e.steps(), e.skipped_steps()),
                out: (p, b(&m), b(&v), losses),
            })
        })
}

/// Also across placements: the optimizer's state resharded into, and back out of, the NVMe store.
#[test]
fn reshard_round_trips_restore_every_state_bit() {
    let nvme = tempfile::tempdir().unwrap();
    let a = plan(Topology::new(4, 2).unwrap(), &cfg(2, 3000));
    let saved = MemStorage::new();
    let orig = outs(world(&a, options(), None, 2, Some(&saved)).unwrap());
    let targets = [
        (Topology::new(2, 2).unwrap(), cfg(3, 3000)),
        (Topology::new(3, 3).unwrap(), cfg(1, 3000)),
        (Topology::new(2, 1).unwrap(), cfg(0, 500)),
        (Topology::new(1, 1).unwrap(), cfg(2, 100_000)),
        (
            Topology::new(4, 2).unwrap(),
            ZeroConfig {
                hpz_partition_size: 2,
                ..cfg(3, 3000)
            },
        ),
        (
            Topology::new(2, 2).unwrap(),
            ZeroConfig {
                optimizer_placement: zero_core::Placement::Nvme,
                nvme_path: Some(nvme.path().display().to_string()),
                ..cfg(3, 3000)
            },
        ),
    ];
    for (topo, c) in targets {
        let b = plan(topo, &c);
        let there = MemStorage::new();
        let mid = outs(world(&b, options(), Some(&saved), 2, Some(&there)).unwrap());
        for r in &mid {
            assert!(
                r.0 == orig[0].0,
                "{topo:?} stage {}: parameters moved",
                c.stage
            );
        }
        let back = outs(world(&a, options(), Some(&there), 2, None).unwrap());
        for (r, (x, y)) in back.iter().zip(&orig).enumerate() {
            assert!(
                x.0 == y.0,
                "{topo:?} stage {}: parameters after the round trip",
                c.stage
            );
            assert!(
                x.1 == y.1 && x.2 == y.2,
                "{topo:?} stage {}: rank {r}'s m, v after the round trip",
                c.stage
            );
        }
    }
}

#[test]
fn another_plan_without_asking_to_reshard_is_refused() {
    let a = plan(Topology::new(4, 2).unwrap(), &cfg(2, 3000));
    let saved = MemStorage::new();
    world(&a, options(), None, 1, Some(&saved)).unwrap();
    let b = plan(Topology::new(2, 2).unwrap(), &cfg(2, 3000));
    let (model, _) = tiny();
    let errs = Launch::new(*b.topology())
        .run_with(&model, |comm, model| {
            let mut e = engine_builder(&b, comm, model, options()).build()?;
            Ok(e.load(&saved).err())
        })
        .unwrap();
    for e in errs {
        let e = e.expect("refused");
        assert!(
            matches!(&e, Error::Checkpoint(c) if matches!(**c, CheckpointError::PlanMismatch { .. })),
            "{e}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("world_size 4") && msg.contains("world_size 2"),
            "{msg}"
        );
    }
}

/// 4 ranks × 1 micro-batch, saved after 2 steps, continued on 2 ranks × 2 micro-batches (the
/// same global batch) with the canonical tree: every parameter bit equals a 2-rank run from the
/// start.
#[test]
fn canonical_tree_continuation_on_another_world_size_is_bit_exact() {
    let opts = options_with(Reduction::CanonicalTree);
    let four = plan(Topology::new(4, 4).unwrap(), &cfg(2, 3000));
    let two_cfg = ZeroConfig {
        gradient_accumulation_steps: 2,
        ..cfg(3, 3000)
    };
    let two = plan(Topology::new(2, 2).unwrap(), &two_cfg);
    let saved = MemStorage::new();
    world(&four, opts, None, 2, Some(&saved)).unwrap();
    let resumed = outs(world(&two, opts, Some(&saved), 4, None).unwrap());
    let straight = outs(world(&two, opts, None, 4, None).unwrap());
    for (x, y) in resumed.iter().zip(&straight) {
        assert!(x.0 == y.0, "parameters differ from the 2-rank run");
        assert!(
            x.1 == y.1 && x.2 == y.2,
            "optimizer state differs from the 2-rank run"
        );
        assert_eq!(x.3[..], y.3[2..], "losses of steps 3 and 4");
    }
}

/// bf16 and fp16 (a dynamic loss scale that starts high, so early steps overflow and skip):
/// saved on 4 ranks at stage 2, resharded onto 2 ranks at stage 3 and saved there, then back:
/// every bit of the master weights, m, v, the loss scale and the step counts returns, and the
/// continuation after the round trip is bit-identical to the uninterrupted run, so the loss
/// scaler's hysteresis and clean-step count came back too.
#[test]
fn half_precision_reshard_round_trips_restore_master_moments_and_scaler() {
    use zero_core::{LossScaleConfig, Precision};
    for precision in [Precision::Bf16, Precision::Fp16] {
        let half = |stage, topo| {
            let c = ZeroConfig {
                precision,
                loss_scaler: LossScaleConfig {
                    initial_scale_power: 24,
                    loss_scale_window: 2,
                    ..LossScaleConfig::default()
                },
                ..cfg(stage, 3000)
            };
            plan(topo, &c)
        };
        let a = half(2, Topology::new(4, 2).unwrap());
        let b = half(3, Topology::new(2, 2).unwrap());
        let what = format!("{precision:?}");
        let whole = world(&a, options(), None, 6, None).unwrap();
        let saved = MemStorage::new();
        let orig = world(&a, options(), None, 3, Some(&saved)).unwrap();
        if precision == Precision::Fp16 {
            assert!(
                orig[0].steps.1 > 0,
                "fp16: some early steps overflowed and were skipped"
            );
        }
        let there = MemStorage::new();
        world(&b, options(), Some(&saved), 3, Some(&there)).unwrap();
        let back = world(&a, options(), Some(&there), 3, None).unwrap();
        for (r, (x, y)) in back.iter().zip(&orig).enumerate() {
            assert!(x.out.0 == y.out.0, "{what}: rank {r}'s parameters");
            assert!(x.master == y.master, "{what}: rank {r}'s master weights");
            assert!(
                x.out.1 == y.out.1 && x.out.2 == y.out.2,
                "{what}: rank {r}'s m, v"
            );
            assert_eq!(
                (x.scale, x.steps),
                (y.scale, y.steps),
                "{what}: rank {r}'s scaler"
            );
        }
        let resumed = world(&a, options(), Some(&there), 6, None).unwrap();
        for (r, (x, y)) in resumed.iter().zip(&whole).enumerate() {
            assert_eq!(
                x.out.3[..],
                y.out.3[3..],
                "{what}: rank {r}'s losses after the resume"
            );
            assert!(
                x.out.0 == y.out.0,
                "{what}: rank {r}'s parameters after the resume"
            );
            assert!(
                x.master == y.master,
                "{what}: rank {r}'s master after the resume"
            );
            assert_eq!(
                (x.scale, x.steps),
                (y.scale, y.steps),
                "{what}: rank {r}'s scaler"
            );
        }
    }
}
