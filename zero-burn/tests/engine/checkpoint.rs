//! Checkpoints: same-plan resume is bit-exact (losses, every parameter, optimizer
//! state and loss-scaler bit) at stages 0–3, ZeRO++, bf16 and fp16 with a skipped step; every
//! kind of corruption is detected before any state changes, naming the file; a crash at every
//! write step of the save protocol leaves `LATEST` loadable.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use serde_json::json;
use zero_burn::checkpoint::{COMMIT, DirStorage, LoadOptions, Loaded, MemStorage, Storage};
use zero_burn::demo::gpt::Gpt;
use zero_burn::demo::run::{corpus_step, engine_builder};
use zero_burn::{Launch, ZeroEngine, plan_for};
use zero_comm::host::HostComm;
use zero_core::{LossScaleConfig, Plan, Precision, Topology, ZeroConfig};

/// Everything a rank's continuation depends on, as bits.
#[derive(Debug, PartialEq)]
struct State {
    losses: Vec<u32>,
    params: Vec<Vec<u32>>,
    master: Vec<u32>,
    m: Vec<u32>,
    v: Vec<u32>,
    scale: Option<u64>,
    steps: u64,
    skipped: u64,
}

fn to_bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn state(e: &mut ZeroEngine<HostComm, Gpt>, losses: Vec<f32>) -> State {
    let params = bits(&e.gather_all_params().unwrap());
    let (m, v) = e.optimizer_state().unwrap();
    State {
        losses: to_bits(&losses),
        params,
        master: to_bits(&e.master_weights().unwrap()),
        m: to_bits(&m),
        v: to_bits(&v),
        scale: e.loss_scale().map(f64::to_bits),
        steps: e.steps(),
        skipped: e.skipped_steps(),
    }
}

/// What one world does with its engine.
enum Act<'a> {
    /// Train `from..to` (injecting an fp16 overflow on rank 1 at step `overflow`), then save.
    TrainSave {
        to: u64,
        save: Option<&'a dyn Storage>,
    },
    /// Load, then train up to `to`.
    LoadTrain {
        store: &'a dyn Storage,
        tag: Option<&'a str>,
        to: u64,
    },
}

const OVERFLOW_AT: u64 = 1;

fn plan_of(topo: Topology, cfg: &ZeroConfig) -> Arc<Plan> {
    let (model, _) = tiny();
    Arc::new(plan_for(&model, topo, cfg).unwrap())
}

/// Runs one fresh world of `plan` and returns every rank's state and load result.
fn world(plan: &Arc<Plan>, act: Act<'_>) -> Vec<(State, Option<Loaded>)> {
    let (model, corpus) = tiny();
    let fp16 = plan.config().precision == Precision::Fp16;
    Launch::new(*plan.topology())
        .timeout(Duration::from_secs(30))
        .run_with(&model, |comm, model| {
            let mut e = engine_builder(plan, comm, model, options()).build()?;
            let (to, loaded) = match &act {
                Act::TrainSave { to, .. } => (*to, None),
                Act::LoadTrain { store, tag, to } => {
                    let opts = LoadOptions {
                        tag: tag.map(str::to_owned),
                        reshard: false,
                    };
                    (*to, Some(e.load_with(*store, &opts)?))
                }
            };
            let mut losses = Vec::new();
            while e.steps() < to {
                // Rank 1 overflows; at stage 0 (no norm partials exchanged: each rank sums its
                // own all-reduced copy) every rank must see it, as a real overflow would.
                if fp16 && e.steps() == OVERFLOW_AT && (e.rank() == 1 || plan.stage() == 0) {
                    e.inject_overflow_next_step();
                }
                losses.push(corpus_step(&mut e, &corpus, &options())?.loss);
            }
            // Measured against planned traffic counts the steps this engine ran (after a load,
            // from the checkpoint's step on), skipped fp16 steps included.
            let report = e.report();
            assert_traffic_as_planned("train", &report);
            if let Act::TrainSave { save: Some(s), .. } = &act {
                let r = e.save(*s, json!({ "next_step": e.steps(), "epoch": 7 }))?;
                assert_eq!(r.tag, format!("step-{:08}", e.steps()));
            }
            Ok((state(&mut e, losses), loaded))
        })
        .unwrap()
}

/// N steps uninterrupted equal K steps, save, a fresh world, load, N−K steps: losses and every
/// bit of parameters, master weights, optimizer state and loss scale, on every rank.
fn assert_resume_is_bit_exact(topo: Topology, cfg: &ZeroConfig, store: &dyn Storage) {
    let (n, k) = (4, 2);
    let plan = plan_of(topo, cfg);
    let full = world(&plan, Act::TrainSave { to: n, save: None });
    let first = world(
        &plan,
        Act::TrainSave {
            to: k,
            save: Some(store),
        },
    );
    let second = world(
        &plan,
        Act::LoadTrain {
            store,
            tag: None,
            to: n,
        },
    );
    for (r, ((f, (a, _)), (b, loaded))) in full.iter().zip(&first).zip(&second).enumerate() {
        let f = &f.0;
        let loaded = loaded.as_ref().unwrap();
        assert_eq!(loaded.step, k);
        assert_eq!(loaded.client_state, json!({ "next_step": k, "epoch": 7 }));
        let mut losses = a.losses.clone();
        losses.extend(&b.losses);
        assert_eq!(losses, f.losses, "rank {r} losses, {cfg:?}");
        assert!(b.params == f.params, "rank {r} parameters differ, {cfg:?}");
        assert!(
            b.master == f.master,
            "rank {r} master weights differ, {cfg:?}"
        );
        assert!(
            b.m == f.m && b.v == f.v,
            "rank {r} optimizer state differs, {cfg:?}"
        );
        assert_eq!(
            (b.scale, b.steps, b.skipped),
            (f.scale, f.steps, f.skipped),
            "rank {r}"
        );
    }
    if cfg.precision == Precision::Fp16 {
        assert_eq!(full[0].0.skipped, 1, "the injected overflow was skipped");
    }
}

#[test]
fn same_plan_resume_is_bit_exact_at_every_stage() {
    for stage in 0..=3u8 {
        assert_resume_is_bit_exact(
            Topology::new(2, 2).unwrap(),
            &small_units(stage),
            &MemStorage::new(),
        );
    }
    // Gradient accumulation, and ZeRO++ (qwZ + hpZ + qgZ) on 2 nodes of 2.
    let ga = ZeroConfig {
        gradient_accumulation_steps: 2,
        ..small_units(2)
    };
    assert_resume_is_bit_exact(Topology::new(2, 2).unwrap(), &ga, &MemStorage::new());
    let zpp = ZeroConfig {
        quantized_weights: true,
        hpz_partition_size: 2,
        quantized_gradients: true,
        ..small_units(3)
    };
    assert_resume_is_bit_exact(Topology::new(4, 2).unwrap(), &zpp, &MemStorage::new());
}

#[test]
fn same_plan_resume_is_bit_exact_in_bf16_and_fp16() {
    for stage in [0u8, 1, 3] {
        let bf16 = ZeroConfig {
            precision: Precision::Bf16,
            ..small_units(stage)
        };
        assert_resume_is_bit_exact(Topology::new(2, 2).unwrap(), &bf16, &MemStorage::new());
        // fp16 with a skipped step (rank 1 overflows at step 1) and a short window, so the
        // scale both drops and grows inside the run.
        let fp16 = ZeroConfig {
            precision: Precision::Fp16,
            loss_scaler: LossScaleConfig {
                loss_scale_window: 2,
                hysteresis: 1,
                ..Default::default()
            },
            ..small_units(stage)
        };
        assert_resume_is_bit_exact(Topology::new(2, 2).unwrap(), &fp16, &MemStorage::new());
    }
}

#[test]
fn resume_through_a_posix_directory_is_bit_exact() {
    let tmp = tempfile::Builder::new()
        .prefix("zero-ckpt-test-")
        .tempdir()
        .expect("a temp dir");
    let dir = tmp.path().to_path_buf();
    let store = DirStorage::new(&dir).unwrap();
    assert_resume_is_bit_exact(Topology::new(2, 2).unwrap(), &small_units(3), &store);
    let names = store.list("").unwrap();
    assert_eq!(
        names,
        vec!["LATEST".to_string(), "step-00000002".into()],
        "no staging or temp left"
    );
    let files = store.list("step-00000002").unwrap();
    assert_eq!(
        files,
        vec![
            COMMIT,
            "MANIFEST.json",
            "rank-00000-of-00002.zrs",
            "rank-00001-of-00002.zrs"
        ]
    );
}

/// An older tag resumes bit-exactly after `LATEST` has moved on (verified against the `COMMIT`
/// record it was saved with), and a tag whose record is missing or damaged, or that was never
/// saved, is refused naming the file, before any state changes.
#[test]
fn an_older_tag_resumes_bit_exactly_after_latest_moves_on() {
    let plan = plan_of(Topology::new(2, 2).unwrap(), &small_units(3));
    let store = MemStorage::new();
    let full = world(&plan, Act::TrainSave { to: 4, save: None });
    for to in [2, 4] {
        world(
            &plan,
            Act::TrainSave {
                to,
                save: Some(&store),
            },
        );
    }
    let latest = String::from_utf8(store.read("LATEST").unwrap().unwrap()).unwrap();
    assert!(latest.starts_with("step-00000004 "), "{latest}");
    let tag = Some("step-00000002");
    let resumed = world(
        &plan,
        Act::LoadTrain {
            store: &store,
            tag,
            to: 4,
        },
    );
    for (r, ((f, _), (b, loaded))) in full.iter().zip(&resumed).enumerate() {
        assert_eq!(loaded.as_ref().unwrap().tag, "step-00000002");
        assert_eq!(loaded.as_ref().unwrap().step, 2);
        assert_eq!(b.losses, f.losses[2..], "rank {r} losses");
        assert!(
            b.params == f.params && b.m == f.m && b.v == f.v,
            "rank {r} state"
        );
    }
    let load = |store: &MemStorage, tag: &str| {
        let (model, _) = tiny();
        let plan = plan.clone();
        let tag = tag.to_owned();
        Launch::new(*plan.topology())
            .timeout(Duration::from_secs(30))
            .run_with(&model, move |comm, model| {
                let mut e = engine_builder(&plan, comm, model, options()).build()?;
                let opts = LoadOptions {
                    tag: Some(tag.clone()),
                    reshard: false,
                };
                Ok(e.load_with(store, &opts)
                    .map(|l| l.tag)
                    .map_err(|e| e.to_string()))
            })
            .unwrap()
    };
    // Every rank fails to load `tag` from `store`, naming `text`.
    let refused = |store: &MemStorage, tag: &str, text: &str| {
        let e = load(store, tag);
        let named = |r: &Result<String, String>| matches!(r, Err(m) if m.contains(text));
        assert!(e.iter().all(named), "{tag}: {e:?}");
    };
    refused(&store, "step-00000009", "step-00000009/COMMIT is missing");
    let flipped = store.fork();
    flipped.flip("step-00000002/COMMIT", 15, 0).unwrap();
    refused(&flipped, "step-00000002", "step-00000002/");
    let removed = store.fork();
    removed.remove("step-00000002/COMMIT").unwrap();
    refused(&removed, "step-00000002", "step-00000002/COMMIT is missing");
    // The latest tag still loads by name without its COMMIT (LATEST is its record).
    let removed = store.fork();
    removed.remove("step-00000004/COMMIT").unwrap();
    let ok = load(&removed, "step-00000004");
    assert!(
        ok.iter().all(|r| r.as_deref() == Ok("step-00000004")),
        "{ok:?}"
    );
}
