//! `overlap_comm`: the collectives of a micro-step run on a per-rank communication thread,
//! overlapped with compute (reductions with the next segment's backward, stage-3 prefetches with
//! the current segment). The same collectives in the same order with the same operands, so the
//! bits, the traffic and the model-state bytes equal the synchronous trainer's; a failing rank
//! still fails its peers fast.

use crate::common;

use common::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

use zero_burn::demo::gpt::Gpt;
use zero_burn::demo::run::RankResult;
use zero_burn::demo::run::{corpus_step, engine_builder};
use zero_burn::{Error, plan_for};
use zero_comm::Communicator;
use zero_comm::host::HostWorld;
use zero_core::{Precision, Topology, ZeroConfig};

const STEPS: u64 = 3;

fn run(topo: Topology, cfg: &ZeroConfig) -> Vec<RankResult<Gpt>> {
    let (plan, res) = train_tiny(topo, cfg, options(), STEPS);
    assert_model_states(&plan, &res);
    let memory = plan.memory();
    for r in &res {
        // Reductions in flight never exceed the plan's (doubled, with overlap) buffer, nor
        // stage 3's gathered units its working set.
        let mut bounded = vec![(
            "reduction bytes in flight",
            r.memory.communication_buffers,
            memory.communication_buffers,
        )];
        if cfg.stage == 3 {
            bounded.push((
                "gathered bytes",
                r.memory.gathered_working_set,
                memory.gathered_working_set,
            ));
        }
        for (what, got, plan) in bounded {
            assert!(got <= plan, "rank {}: {got} {what}, plan {plan}", r.rank);
        }
    }
    res
}

#[test]
fn overlapped_collectives_are_bit_identical_to_synchronous_ones() {
    let topo = Topology::new(4, 2).unwrap();
    let mut cases = Vec::new();
    for stage in 0..=3u8 {
        for ga in [1u32, 2] {
            cases.push(ZeroConfig {
                gradient_accumulation_steps: ga,
                ..small_units(stage)
            });
        }
    }
    // DeepSpeed's accumulate-then-reduce at stages 0 and 1.
    for stage in 0..=1u8 {
        cases.push(ZeroConfig {
            stage,
            gradient_accumulation_steps: 2,
            accumulate_before_reduce: true,
            reduce_bucket_size: 3000,
            ..Default::default()
        });
    }
    // ZeRO++ (qwZ + hpZ + qgZ), with and without prefetching, and bf16.
    let zpp = ZeroConfig {
        stage: 3,
        quantized_weights: true,
        hpz_partition_size: 2,
        quantized_gradients: true,
        param_persistence_threshold: 64,
        ..Default::default()
    };
    cases.push(zpp.clone());
    cases.push(ZeroConfig {
        prefetch_bucket_size: 0,
        ..zpp.clone()
    });
    cases.push(ZeroConfig {
        precision: Precision::Bf16,
        gradient_accumulation_steps: 2,
        ..zpp
    });
    for cfg in cases {
        assert!(!cfg.overlap_comm, "the default is synchronous");
        let sync = run(topo, &cfg);
        let overlapped = run(
            topo,
            &ZeroConfig {
                overlap_comm: true,
                ..cfg.clone()
            },
        );
        assert_same(&overlapped, &sync, &format!("{cfg:?}"));
        assert_learns(&sync);
    }
}

#[test]
fn a_failing_rank_fails_its_overlapping_peers_fast() {
    let topo = Topology::new(4, 2).unwrap();
    let cfg = ZeroConfig {
        stage: 3,
        overlap_comm: true,
        hpz_partition_size: 2,
        param_persistence_threshold: 64,
        ..Default::default()
    };
    let (model, corpus) = tiny();
    let plan = Arc::new(plan_for(&model, topo, &cfg).unwrap());
    let timeout = Duration::from_secs(60);
    let started = Instant::now();
    let results = HostWorld::new(topo, timeout).launch(|comm| {
        let rank = comm.rank();
        let mut t = engine_builder(&plan, comm, model.clone(), options()).build()?;
        corpus_step(&mut t, &corpus, &options())?;
        if rank == 2 {
            // Rank 2 stops after one step; its communicators drop with it.
            return Err(Error::other("rank 2 stops"));
        }
        corpus_step(&mut t, &corpus, &options())?;
        Ok::<_, Error>(())
    });
    let elapsed = started.elapsed();
    for (rank, r) in results.into_iter().enumerate() {
        let err = r.expect("no rank panics").expect_err("every rank fails");
        let msg = err.to_string();
        if rank == 2 {
            assert_eq!(msg, "rank 2 stops");
        } else {
            assert!(
                matches!(err, Error::Comm(_)) && msg.contains("rank 2"),
                "rank {rank}: {msg}"
            );
        }
    }
    // Fail fast: the peers learn of rank 2's exit from its dropped communicators, not from the
    // collective timeout.
    assert!(elapsed < timeout / 2, "took {elapsed:?}");
}
