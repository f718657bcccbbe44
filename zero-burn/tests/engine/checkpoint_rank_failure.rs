//! A rank that panics or fails in the middle of a save fails the save on every rank fast (no
//! hang), and the previous checkpoint stays `LATEST` and loads.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::store::Hooked;
use common::*;
use serde_json::json;
use zero_burn::checkpoint::{MemStorage, Storage};
use zero_burn::demo::run::{corpus_step, engine_builder};
use zero_burn::{Error, Launch, plan_for};
use zero_core::{Topology, ZeroConfig};

/// The collective timeout: generous, so that a run that took it to fail shows in the time.
const TIMEOUT: Duration = Duration::from_secs(30);

#[test]
fn a_failing_or_panicking_rank_fails_the_save_everywhere_fast() {
    let (model, corpus) = tiny();
    let cfg = ZeroConfig {
        stage: 2,
        ..Default::default()
    };
    let plan = Arc::new(plan_for(&model, Topology::new(3, 3).unwrap(), &cfg).unwrap());
    // (needle, panic, nth): the `nth` write or append (from 0) of a path containing `needle`
    // fails: rank 1's file when it is created and in the middle of its stream (its first
    // append), rank 0's manifest, LATEST; by error and by panic.
    for (needle, panic, nth) in [
        ("rank-00001", false, 0),
        ("rank-00001", true, 0),
        ("rank-00001", false, 1),
        ("rank-00001", true, 1),
        ("MANIFEST", false, 0),
        ("MANIFEST", true, 0),
        ("LATEST", true, 0),
    ] {
        let store = MemStorage::new();
        let errs =
            Launch::new(*plan.topology())
                .timeout(TIMEOUT)
                .run_with(&model, |comm, model| {
                    let mut e = engine_builder(&plan, comm, model, options()).build()?;
                    while e.steps() < 1 {
                        corpus_step(&mut e, &corpus, &options())?;
                    }
                    e.save(&store, json!(1))?;
                    Ok(())
                });
        assert!(errs.is_ok(), "the first save succeeds: {errs:?}");
        // The second save, at step 2, is sabotaged.
        // Delegates to the store, but panics (or fails) when writing a path containing `needle`.
        let seen = std::sync::atomic::AtomicUsize::new(0);
        let bad =
            Hooked::new(store.clone(), Box::new(|_, _, _| {})).on_write(Box::new(move |path| {
                if !path.contains(needle)
                    || seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) != nth
                {
                    return Ok(());
                }
                if panic {
                    panic!("sabotaged write of {path}");
                }
                Err(Error::Storage {
                    op: "write",
                    path: path.into(),
                    source: std::io::Error::other("disk full"),
                })
            }));
        let before = bad.read("LATEST").unwrap();
        let t0 = Instant::now();
        let r = Launch::new(*plan.topology())
            .timeout(TIMEOUT)
            .run_with(&model, |comm, model| {
                let mut e = engine_builder(&plan, comm, model, options()).build()?;
                while e.steps() < 2 {
                    corpus_step(&mut e, &corpus, &options())?;
                }
                Ok(e.save(&bad, json!(2)).is_err())
            });
        let elapsed = t0.elapsed();
        match r {
            Ok(failed) => {
                assert!(!panic, "{needle}: a panicking rank is reported");
                assert!(
                    failed.iter().all(|&f| f),
                    "{needle}: every rank's save fails: {failed:?}"
                );
            }
            Err(e) => assert!(panic, "{needle}: {e}"),
        }
        // Failing fast, not waiting out the collective timeout: well under half of it.
        assert!(
            elapsed < TIMEOUT / 2,
            "{needle} #{nth} panic={panic}: took {elapsed:?} (the collective timeout is {TIMEOUT:?})"
        );
        assert_eq!(
            bad.read("LATEST").unwrap(),
            before,
            "{needle}: LATEST unchanged"
        );
        // What LATEST names still loads.
        let loaded = Launch::new(*plan.topology())
            .run_with(&model, |comm, model| {
                let mut e = engine_builder(&plan, comm, model, options()).build()?;
                Ok(e.load(&store)?.step)
            })
            .unwrap();
        assert_eq!(loaded, vec![1; 3], "{needle}");
    }
}
