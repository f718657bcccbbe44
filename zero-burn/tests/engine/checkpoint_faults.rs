//! Checkpoint faults: truncated, extended, flipped, foreign and missing files, a
//! different model or plan are each refused before any state changes, with an error naming the
//! file; a simulated crash at every write step of the save protocol leaves `LATEST` loadable
//! and the continuation bit-exact; a committed tag is never rewritten; another rank's file that
//! changes after the load verified it (the load reads those blocks again as it restores them)
//! fails the load naming the file.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::Device;
use common::small_units;
use common::store::Hooked;
use common::*;
use serde_json::json;
use zero_burn::checkpoint::{MemStorage, Storage};
use zero_burn::demo::gpt::{Gpt, GptConfig};
use zero_burn::demo::run::{corpus_step, engine_builder};
use zero_burn::{Error, Launch, ZeroEngine, plan_for};
use zero_comm::host::HostComm;
use zero_core::{CheckpointError, Plan, Topology};

/// Parameters, optimizer state and step count, as bits.
fn snapshot(e: &mut ZeroEngine<HostComm, Gpt>) -> (Vec<Vec<u32>>, Vec<u32>, Vec<u32>, u64) {
    let p = bits(&e.gather_all_params().unwrap());
    let (m, v) = e.optimizer_state().unwrap();
    let b = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    (p, b(&m), b(&v), e.steps())
}

fn topo() -> Topology {
    Topology::new(2, 2).unwrap()
}

fn plan_for_model(model: &Gpt, stage: u8) -> Arc<Plan> {
    Arc::new(plan_for(model, topo(), &small_units(stage)).unwrap())
}

/// Trains a fresh world up to `to`, saving into `store` at each step of `saves`; returns each
/// rank's save results, final snapshot and losses.
#[allow(clippy::type_complexity)]
fn train(
    store: &dyn Storage,
    saves: &[u64],
    to: u64,
) -> Vec<(
    Vec<bool>,
    (Vec<Vec<u32>>, Vec<u32>, Vec<u32>, u64),
    Vec<u32>,
)> {
    let (model, corpus) = tiny();
    let plan = plan_for_model(&model, 1);
    Launch::new(topo())
        .timeout(Duration::from_secs(30))
        .run_with(&model, |comm, model| {
            let mut e = engine_builder(&plan, comm, model, options()).build()?;
            let mut ok = Vec::new();
            let mut losses = Vec::new();
            loop {
                if saves.contains(&e.steps()) {
                    ok.push(e.save(store, json!({ "at": e.steps() })).is_ok());
                }
                if e.steps() == to {
                    break;
                }
                losses.push(corpus_step(&mut e, &corpus, &options())?.loss.to_bits());
            }
            Ok((ok, snapshot(&mut e), losses))
        })
        .unwrap()
}

/// A fresh world (of `model`, planned at `stage`) tries to load `store`; per rank: the load's
/// error, and whether the engine's state is what it was before.
fn try_load(store: &dyn Storage, model: &Gpt, stage: u8) -> Vec<(Option<Error>, bool)> {
    let plan = plan_for_model(model, stage);
    Launch::new(topo())
        .timeout(Duration::from_secs(30))
        .run_with(model, |comm, model| {
            let mut e = engine_builder(&plan, comm, model, options()).build()?;
            let before = snapshot(&mut e);
            let r = e.load(store);
            let unchanged = snapshot(&mut e) == before;
            Ok((r.err(), unchanged))
        })
        .unwrap()
}

const DIR: &str = "step-00000002";
const R0: &str = "step-00000002/rank-00000-of-00002.zrs";
const R1: &str = "step-00000002/rank-00001-of-00002.zrs";
const MANIFEST: &str = "step-00000002/MANIFEST.json";

/// Every rank fails without touching its state; some rank's error is `want`'s kind and names
/// `file`.
fn assert_refused(
    case: &str,
    got: &[(Option<Error>, bool)],
    want: fn(&CheckpointError) -> bool,
    file: &str,
) {
    let mut named = false;
    for (r, (err, unchanged)) in got.iter().enumerate() {
        let err = err
            .as_ref()
            .unwrap_or_else(|| panic!("{case}: rank {r} loaded"));
        assert!(unchanged, "{case}: rank {r}'s state changed");
        if let Error::Checkpoint(c) = err {
            named |= want(c) && err.to_string().contains(file);
        } else {
            assert!(
                matches!(err, Error::CheckpointFailed { action: "load", .. }),
                "{case}: {err}"
            );
        }
    }
    assert!(
        named,
        "{case}: no rank named {file}: {:?}",
        got.iter()
            .map(|g| g.0.as_ref().map(|e| e.to_string()))
            .collect::<Vec<_>>()
    );
}

#[test]
fn corrupt_foreign_and_missing_files_are_refused_naming_the_file() {
    let base = MemStorage::new();
    let res = train(&base, &[2, 3], 3);
    assert!(res.iter().all(|r| r.0 == [true, true]));
    // Point LATEST back at step 2 (whose files the cases corrupt); step 3 provides foreign files.
    let m2 = base.read(MANIFEST).unwrap().unwrap();
    let ptr = format!("{DIR} {:08x} {}\n", crc32c_of(&m2), m2.len());
    base.edit("LATEST", |d| *d = ptr.clone().into_bytes())
        .unwrap();
    let wrong_crc = format!("{DIR} {:08x} {}\n", crc32c_of(&m2) ^ 1, m2.len());
    let (model, _) = tiny();
    assert!(
        try_load(&base, &model, 1).iter().all(|(e, _)| e.is_none()),
        "the intact checkpoint loads"
    );

    type Case = (
        &'static str,
        Box<dyn Fn(&MemStorage)>,
        fn(&CheckpointError) -> bool,
        &'static str,
    );
    let step3 = |name: &str| {
        base.read(&format!("step-00000003/{name}"))
            .unwrap()
            .unwrap()
    };
    let r1_of_3 = step3("rank-00001-of-00002.zrs");
    let r0 = base.read(R0).unwrap().unwrap();
    let cases: Vec<Case> = vec![
        (
            "truncated by 1 byte",
            Box::new(|s| {
                s.edit(R1, |d| {
                    d.pop();
                })
                .unwrap()
            }),
            |c| matches!(c, CheckpointError::Size { .. }),
            R1,
        ),
        (
            "truncated to 0",
            Box::new(|s| s.edit(R1, |d| d.clear()).unwrap()),
            |c| matches!(c, CheckpointError::Size { .. }),
            R1,
        ),
        (
            "extended by 1 byte",
            Box::new(|s| s.edit(R0, |d| d.push(0)).unwrap()),
            |c| matches!(c, CheckpointError::Size { .. }),
            R0,
        ),
        (
            "a flipped data bit",
            Box::new(|s| {
                let n = s.size(R0).unwrap().unwrap() as usize;
                s.flip(R0, n - 3, 5).unwrap()
            }),
            |c| matches!(c, CheckpointError::Checksum { block: 0, .. }),
            R0,
        ),
        (
            "a flipped header bit",
            Box::new(|s| s.flip(R1, 40, 0).unwrap()),
            |c| {
                matches!(
                    c,
                    CheckpointError::Checksum { .. } | CheckpointError::Foreign { .. }
                )
            },
            R1,
        ),
        (
            "a flipped manifest bit",
            Box::new(|s| s.flip(MANIFEST, 100, 2).unwrap()),
            |c| matches!(c, CheckpointError::Checksum { .. }),
            MANIFEST,
        ),
        (
            "LATEST with another manifest checksum",
            Box::new(move |s| {
                s.edit("LATEST", |d| *d = wrong_crc.clone().into_bytes())
                    .unwrap()
            }),
            |c| matches!(c, CheckpointError::Checksum { .. }),
            MANIFEST,
        ),
        (
            "a garbled LATEST",
            Box::new(|s| s.edit("LATEST", |d| d[4] = b' ').unwrap()),
            |c| matches!(c, CheckpointError::Parse { .. }),
            "LATEST",
        ),
        (
            "a missing rank file",
            Box::new(|s| s.remove(R1).unwrap()),
            |c| matches!(c, CheckpointError::Missing { .. }),
            R1,
        ),
        (
            "a missing manifest",
            Box::new(|s| s.remove(MANIFEST).unwrap()),
            |c| matches!(c, CheckpointError::Missing { .. }),
            MANIFEST,
        ),
        (
            "no LATEST",
            Box::new(|s| s.remove("LATEST").unwrap()),
            |c| matches!(c, CheckpointError::Missing { .. }),
            "LATEST",
        ),
        (
            "another save's rank file",
            Box::new(move |s| s.edit(R1, |d| *d = r1_of_3.clone()).unwrap()),
            |c| matches!(c, CheckpointError::Foreign { field, .. } if field == "save_id"),
            R1,
        ),
        (
            "another rank's file",
            Box::new(move |s| s.edit(R1, |d| *d = r0.clone()).unwrap()),
            |c| {
                matches!(c, CheckpointError::Foreign { field, .. } if field == "rank")
                    || matches!(c, CheckpointError::Size { .. })
            },
            R1,
        ),
    ];
    for (case, corrupt, want, file) in cases {
        let s = base.fork();
        corrupt(&s);
        assert_refused(case, &try_load(&s, &model, 1), want, file);
    }

    // A model whose parameters differ, and the same model under another plan.
    let other = GptConfig {
        vocab: 16,
        context: 8,
        d_model: 8,
        heads: 2,
        layers: 2,
    }
    .init(&Device::flex().autodiff(), 42);
    assert_refused(
        "another model",
        &try_load(&base, &other, 1),
        |c| matches!(c, CheckpointError::ModelMismatch { .. }),
        MANIFEST,
    );
    assert_refused(
        "another plan",
        &try_load(&base, &model, 2),
        |c| matches!(c, CheckpointError::PlanMismatch { .. }),
        MANIFEST,
    );
}

fn crc32c_of(b: &[u8]) -> u32 {
    // The manifest's checksum as `LATEST` records it (CRC-32C, Castagnoli), bitwise.
    let mut c = !0u32;
    for &x in b {
        c ^= u32::from(x);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82f6_3b78
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// A crash (power loss after the failing step) at every mutating storage operation of a save
/// leaves a `LATEST` that loads (the previous checkpoint or the new one, never a partial one),
/// every rank's save fails together, and the continuation from what loads is bit-exact.
#[test]
fn a_crash_at_every_write_step_of_a_save_leaves_latest_loadable() {
    let probe = MemStorage::new();
    train(&probe, &[2], 2);
    let first = probe.ops();
    let probe2 = MemStorage::new();
    train(&probe2, &[2, 3], 3);
    let total = probe2.ops();
    assert!(
        total > first + 10,
        "a save is many steps: {first} then {total}"
    );
    let reference = train(&MemStorage::new(), &[], 4);
    let (model, corpus) = tiny();
    let plan = plan_for_model(&model, 1);
    let mut loaded_steps = Vec::new();
    for k in first..=total {
        let store = MemStorage::new();
        store.fail_at(Some(k));
        let res = train(&store, &[2, 3], 3);
        for r in &res {
            assert!(r.0[0], "the first save (before the fault) succeeds");
            assert_eq!(
                r.0[1],
                k == total,
                "fault at {k}: the second save fails on every rank"
            );
        }
        store.crash();
        let resumed = Launch::new(topo())
            .timeout(Duration::from_secs(30))
            .run_with(&model, |comm, model| {
                let mut e = engine_builder(&plan, comm, model, options()).build()?;
                let l = e.load(&store)?;
                let mut losses = Vec::new();
                while e.steps() < 4 {
                    losses.push(corpus_step(&mut e, &corpus, &options())?.loss.to_bits());
                }
                Ok((l.step, snapshot(&mut e), losses))
            })
            .unwrap_or_else(|e| panic!("crash at operation {k}: LATEST does not load: {e}"));
        for ((step, snap, losses), want) in resumed.iter().zip(&reference) {
            assert!(*step == 2 || *step == 3, "crash at {k}: loaded step {step}");
            assert!(*snap == want.1, "crash at {k}: the continuation differs");
            assert_eq!(losses[..], want.2[*step as usize..], "crash at {k}: losses");
        }
        loaded_steps.push(resumed[0].0);
    }
    assert_eq!(
        loaded_steps.last(),
        Some(&3),
        "without a fault the new checkpoint is LATEST"
    );
    assert_eq!(
        loaded_steps[0], 2,
        "a crash at the first step keeps the previous one"
    );
}

#[test]
fn a_committed_tag_is_never_rewritten() {
    let store = MemStorage::new();
    let res = train(&store, &[2], 2);
    assert!(res.iter().all(|r| r.0 == [true]));
    let before = store.read(MANIFEST).unwrap();
    // A second world at the same step: every rank refuses.
    let (model, corpus) = tiny();
    let plan = plan_for_model(&model, 1);
    let errs = Launch::new(topo())
        .run_with(&model, |comm, model| {
            let mut e = engine_builder(&plan, comm, model, options()).build()?;
            while e.steps() < 2 {
                corpus_step(&mut e, &corpus, &options())?;
            }
            Ok(e.save(&store, json!(null)).err())
        })
        .unwrap();
    for e in &errs {
        let e = e.as_ref().expect("refused");
        assert!(
            matches!(e, Error::TagExists { tag } if tag == DIR)
                || matches!(e, Error::CheckpointFailed { .. }),
            "{e}"
        );
    }
    assert_eq!(store.read(MANIFEST).unwrap(), before);
}

#[test]
fn another_ranks_file_changed_after_it_was_verified_fails_the_load_naming_it() {
    // On the same plan at stage 1 each rank verifies the other rank's blocks it needs, lets
    // them go, and reads them again as it restores them: the third read of a block is the
    // restore's, which this store corrupts.
    let store = MemStorage::new();
    train(&store, &[2], 2);
    let (model, _) = tiny();
    let changing = changing_after_verify(&store, "rank-");
    let got = try_load(&changing, &model, 1);
    for (r, (err, _)) in got.iter().enumerate() {
        let other = [R1, R0][r];
        let msg = err.as_ref().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            msg.contains(other) && msg.contains("corrupt"),
            "rank {r}: {msg:?}"
        );
    }
    // The same store unchanged loads.
    assert!(try_load(&store, &model, 1).iter().all(|(e, _)| e.is_none()));
}

/// `store` with the last byte of every ranged read of a file whose path contains `which` flipped
/// from the third time the same range start is read: a rank file that changes after the load
/// verified it (the header read and the verification are the first two).
fn changing_after_verify(store: &MemStorage, which: &'static str) -> Hooked {
    let reads = std::sync::Mutex::new(std::collections::HashMap::<(String, u64), u32>::new());
    Hooked::new(
        store.fork(),
        Box::new(move |path, offset, got| {
            let Some(offset) = offset else { return };
            let mut reads = reads.lock().unwrap();
            let n = reads.entry((path.to_string(), offset)).or_default();
            *n += 1;
            if *n >= 3
                && path.contains(which)
                && let Some(b) = got.as_mut().and_then(|b| b.last_mut())
            {
                *b ^= 0x10;
            }
        }),
    )
}

#[test]
fn a_load_that_fails_part_way_fails_every_rank_and_refuses_steps_until_a_load_succeeds() {
    // Rank 1's file changes after rank 0 verified the blocks it needs of it: rank 0's restore
    // fails part-way, rank 1's (its own file, read whole) succeeds. Rank 1 must fail the load
    // too, naming rank 0, rather than step into a collective rank 0 never joins; both refuse
    // steps and saves until a load succeeds, and one from the unchanged store then continues
    // bit-identically to the uninterrupted run.
    let store = MemStorage::new();
    let whole = train(&store, &[2], 4);
    let changing = changing_after_verify(&store, R1);
    let (model, corpus) = tiny();
    let plan = plan_for_model(&model, 1);
    let elsewhere = MemStorage::new();
    let got = Launch::new(topo())
        .timeout(Duration::from_secs(30))
        .run_with(&model, |comm, model| {
            let mut e = engine_builder(&plan, comm, model, options()).build()?;
            let text = |r: Result<(), Error>| r.err().map(|x| x.to_string()).unwrap_or_default();
            let load = text(e.load(&changing).map(|_| ()));
            let step = text(corpus_step(&mut e, &corpus, &options()).map(|_| ()));
            let save = text(e.save(&elsewhere, json!(null)).map(|_| ()));
            e.load(&store)?;
            let mut losses = Vec::new();
            while e.steps() < 4 {
                losses.push(corpus_step(&mut e, &corpus, &options())?.loss.to_bits());
            }
            Ok(([load, step, save], snapshot(&mut e), losses))
        })
        .unwrap();
    let [load0, _, _] = &got[0].0;
    assert!(
        load0.contains(R1) && load0.contains("corrupt"),
        "rank 0: {load0:?}"
    );
    let [load1, _, _] = &got[1].0;
    assert!(
        load1.contains("load failed on rank 0") && load1.contains(R1),
        "rank 1: {load1:?}"
    );
    for (r, ((errs, snap, losses), (_, want, all))) in got.iter().zip(&whole).enumerate() {
        for (what, msg) in [("step", &errs[1]), ("save", &errs[2])] {
            assert!(
                msg.contains("partly restored") && msg.contains(&format!("rank {r}")),
                "rank {r}: the {what} after the failed load: {msg:?}"
            );
        }
        assert_eq!(
            snap, want,
            "rank {r}: the state after the second load's steps"
        );
        assert_eq!(
            losses[..],
            all[2..],
            "rank {r}: the losses after the second load"
        );
    }
    assert!(
        elsewhere.list("").unwrap().is_empty(),
        "the refused save wrote {:?}",
        elsewhere.list("").unwrap()
    );
}
