//! Frozen parameters in checkpoints (invariant I14): a parameter with
//! `require_grad` off never moves, is saved whole by one rank at stages 0–2 (where it is in no
//! unit) and as shards at stage 3, comes back from the checkpoint whatever values the loading
//! model was built with, reshards both ways between replicated and sharded, and is in the
//! export.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Tensor;
use common::*;
use safetensors::SafeTensors;
use serde_json::json;
use zero_burn::checkpoint::{ExportDtype, MemStorage, Storage, export_safetensors, read_manifest};
use zero_burn::demo::gpt::Gpt;
use zero_burn::demo::run::{corpus_step, engine_builder};
use zero_burn::{Launch, plan_for};
use zero_core::checkpoint::Manifest;
use zero_core::{Plan, Precision, Topology, ZeroConfig};

/// The frozen parameters: the token embedding (the largest), two layer-norm vectors of the first
/// block, the second block's fc weight and the head's bias.
const FROZEN: [&str; 5] = [
    "wte.weight",
    "blocks.0.ln1.gamma",
    "blocks.0.ln1.beta",
    "blocks.1.fc.weight",
    "head.bias",
];

/// Turns `require_grad` off for the parameters whose path is in [`FROZEN`], after adding
/// `shift` to every parameter.
#[derive(Default)]
struct Freeze {
    path: Vec<String>,
    found: usize,
    shift: f32,
}

impl ModuleMapper for Freeze {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let shift = self.shift;
        let p = p.map(|t| Tensor::from_data((t.clone() + shift).into_data(), &t.device()));
        let frozen = FROZEN.contains(&self.path.join(".").as_str());
        self.found += usize::from(frozen);
        p.set_require_grad(!frozen)
    }
}

/// [`tiny_seeded`] with the [`FROZEN`] parameters frozen; any seed but 42 also shifts every
/// value by 0.25 (the layer norms' initial values do not depend on the seed).
fn frozen_tiny(seed: u64) -> Gpt {
    let mut f = Freeze {
        shift: if seed == 42 { 0.0 } else { 0.25 },
        ..Freeze::default()
    };
    let model = tiny_seeded(seed).0.map(&mut f);
    assert_eq!(f.found, FROZEN.len(), "every frozen path names a parameter");
    model
}

fn cfg(stage: u8) -> ZeroConfig {
    ZeroConfig {
        checkpoint_activations: Some(true),
        ..small_units(stage)
    }
}

fn plan(topo: Topology, cfg: &ZeroConfig) -> Arc<Plan> {
    Arc::new(plan_for(&frozen_tiny(42), topo, cfg).unwrap())
}

/// Indices of the frozen parameters in the plan's model.
fn frozen_indices(plan: &Plan) -> Vec<usize> {
    let p = &plan.model().params;
    let idx: Vec<usize> = (0..p.len()).filter(|&i| !p[i].trainable).collect();
    assert_eq!(idx.len(), FROZEN.len());
    idx
}

/// Per rank: gathered parameters, m and v as bits, and losses.
type Out = (Vec<Vec<u32>>, Vec<u32>, Vec<u32>, Vec<u32>);

/// A fresh world of `plan` on [`frozen_tiny`]`(seed)`: loads `from` if given (resharding when
/// `reshard`), trains up to `to`, saves into `save` if given.
fn world(
    plan: &Arc<Plan>,
    seed: u64,
    from: Option<(&dyn Storage, bool)>,
    to: u64,
    save: Option<&dyn Storage>,
) -> Vec<Out> {
    let model = frozen_tiny(seed);
    let (_, corpus) = tiny();
    Launch::new(*plan.topology())
        .timeout(Duration::from_secs(30))
        .run_with(&model, |comm, model| {
            let mut e = engine_builder(plan, comm, model, options()).build()?;
            match from {
                Some((s, true)) => e.load_resharded(s).map(|_| ())?,
                Some((s, false)) => e.load(s).map(|_| ())?,
                None => {}
            }
            let mut losses = Vec::new();
            while e.steps() < to {
                losses.push(corpus_step(&mut e, &corpus, &options())?.loss.to_bits());
            }
            if let Some(s) = save {
                e.save(s, json!(null))?;
            }
            let p = bits(&e.gather_all_params()?);
            let (m, v) = e.optimizer_state().unwrap();
            let b = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect();
            Ok((p, b(&m), b(&v), losses))
        })
        .unwrap()
}

/// The gathered initial values of [`frozen_tiny`]`(seed)` under `plan`, as bits.
fn initial(plan: &Arc<Plan>, seed: u64) -> Vec<Vec<u32>> {
    world(plan, seed, None, 0, None).swap_remove(0).0
}

#[test]
fn frozen_parameters_never_move_and_come_back_from_the_checkpoint() {
    for stage in [0u8, 1, 2, 3] {
        let a = plan(Topology::new(4, 2).unwrap(), &cfg(stage));
        let frozen = frozen_indices(&a);
        let start = initial(&a, 42);
        let straight = world(&a, 42, None, 4, None);
        let saved = MemStorage::new();
        let first = world(&a, 42, None, 2, Some(&saved));
        // The loading model's weights, frozen ones included, are another seed's: every value
        // the continuation uses comes from the checkpoint.
        let other = initial(&a, 7);
        assert!(frozen.iter().all(|&i| other[i] != start[i]));
        let resumed = world(&a, 7, Some((&saved, false)), 4, None);
        for (r, (x, y)) in resumed.iter().zip(&straight).enumerate() {
            assert!(
                x.0 == y.0,
                "stage {stage}: rank {r}'s parameters after the resume"
            );
            assert!(x.1 == y.1 && x.2 == y.2, "stage {stage}: rank {r}'s m, v");
            let losses: Vec<u32> = first[r].3.iter().chain(&x.3).copied().collect();
            assert_eq!(losses, y.3, "stage {stage}: rank {r}'s losses");
        }
        for (i, (now, then)) in straight[0].0.iter().zip(&start).enumerate() {
            let moved = now != then;
            assert_eq!(moved, !frozen.contains(&i), "stage {stage}: parameter {i}");
        }
        // At stages 0–2 the frozen parameters are in no unit: saved whole, spread over ranks.
        let (_, m) = read_manifest(&saved, None).unwrap();
        let loose: Vec<usize> = m.layout.loose.iter().map(|l| l.param).collect();
        if stage < 3 {
            assert_eq!(loose, frozen, "stage {stage}");
            let mut ranks: Vec<usize> = m.layout.loose.iter().map(|l| l.rank).collect();
            ranks.sort_unstable();
            ranks.dedup();
            assert!(
                ranks.len() > 1,
                "stage {stage}: one rank holds every loose parameter"
            );
        } else {
            assert!(loose.is_empty());
        }
    }
}

#[test]
fn frozen_parameters_reshard_between_replicated_and_sharded() {
    let a = plan(Topology::new(4, 2).unwrap(), &cfg(1));
    let saved = MemStorage::new();
    let orig = world(&a, 42, None, 2, Some(&saved));
    let targets = [
        (Topology::new(2, 2).unwrap(), cfg(3)),
        (
            Topology::new(4, 2).unwrap(),
            ZeroConfig {
                hpz_partition_size: 2,
                ..cfg(3)
            },
        ),
        (Topology::new(3, 3).unwrap(), cfg(0)),
        (
            Topology::new(2, 1).unwrap(),
            ZeroConfig {
                precision: Precision::Bf16,
                ..cfg(3)
            },
        ),
    ];
    for (topo, c) in targets {
        let b = plan(topo, &c);
        let there = MemStorage::new();
        let mid = world(&b, 7, Some((&saved, true)), 2, Some(&there));
        if c.precision == Precision::Fp32 {
            for r in &mid {
                assert!(
                    r.0 == orig[0].0,
                    "{topo:?} stage {}: parameters moved",
                    c.stage
                );
            }
        }
        let back = world(&a, 7, Some((&there, true)), 2, None);
        for (r, (x, y)) in back.iter().zip(&orig).enumerate() {
            if c.precision == Precision::Fp32 {
                assert!(x.0 == y.0, "{topo:?} stage {}: parameters back", c.stage);
                assert!(
                    x.1 == y.1 && x.2 == y.2,
                    "{topo:?} stage {}: rank {r}'s m, v",
                    c.stage
                );
            } else {
                // The bf16 plan keeps the trainable fp32 master; the frozen ones come back as
                // its working weights (rounded to bf16).
                for (i, p) in a.model().params.iter().enumerate() {
                    let want: Vec<u32> = if p.trainable {
                        y.0[i].clone()
                    } else {
                        y.0[i].iter().map(|&w| bf16_bits(w)).collect()
                    };
                    assert!(x.0[i] == want, "bf16 round trip: {}", p.name);
                }
            }
        }
    }
}

/// `w` (f32 bits) rounded to bf16 nearest-even and widened back, as bits.
fn bf16_bits(w: u32) -> u32 {
    let x = f32::from_bits(w);
    zero_burn::precision::Half::Bf16.quantize(x).to_bits()
}

#[test]
fn the_export_holds_the_frozen_parameters_saved_whole() {
    let a = plan(Topology::new(4, 2).unwrap(), &cfg(1));
    let saved = MemStorage::new();
    let orig = world(&a, 42, None, 2, Some(&saved));
    let out = MemStorage::new();
    let rep =
        export_safetensors(&saved, None, &out, "model.safetensors", ExportDtype::F32).unwrap();
    assert_eq!(rep.tensors, a.model().params.len());
    let bytes = out.read("model.safetensors").unwrap().expect("written");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for (i, p) in a.model().params.iter().enumerate() {
        let t = st.tensor(&p.name).unwrap();
        let got: Vec<u32> = t
            .data()
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert!(got == orig[0].0[i], "{}", p.name);
    }
}

#[test]
fn a_flipped_loose_parameter_in_another_ranks_file_fails_every_rank_naming_it() {
    let a = plan(Topology::new(4, 2).unwrap(), &cfg(1));
    let saved = MemStorage::new();
    world(&a, 42, None, 2, Some(&saved));
    let (tag, m) = read_manifest(&saved, None).unwrap();
    // A rank other than 0 holds a loose parameter; its tensors end its file.
    let k = m
        .layout
        .loose
        .iter()
        .map(|l| l.rank)
        .find(|&r| r != 0)
        .expect("a loose parameter outside rank 0's file");
    let file = format!("{tag}/{}", Manifest::rank_file(k, 4));
    let len = saved.read(&file).unwrap().unwrap().len();
    saved.flip(&file, len - 1, 3).unwrap();
    let model = frozen_tiny(42);
    let got = Launch::new(*a.topology())
        .timeout(Duration::from_secs(30))
        .run_with(&model, |comm, model| {
            let mut e = engine_builder(&a, comm, model, options()).build()?;
            Ok(e.load(&saved).map(|_| ()).map_err(|e| e.to_string()))
        })
        .unwrap();
    for (r, res) in got.iter().enumerate() {
        assert!(
            matches!(res, Err(msg) if msg.contains(&file) && msg.contains("corrupt")),
            "rank {r}: {res:?}"
        );
    }
}
