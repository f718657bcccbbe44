//! The trainer with one rank per process over MPI (feature `mpi`): 4 processes under `mpirun`
//! (2 nodes of 2) train the tiny GPT at stages 0–3, with hpZ, and with ZeRO++ (qwZ + hpZ + qgZ);
//! every rank's losses and final parameters are bit-identical to the same job on 4 in-process
//! ranks over the host loopback, and every rank's measured bytes equal the plan. Also: a rank
//! started with another model fails every rank before any data moves, and a rank killed in the
//! middle of a checkpoint save leaves the previous checkpoint whole and resumable, and so does one
//! killed at a step drawn from a seeded RNG (`mpi/kill.rs`); each process's peak resident memory
//! at stage 3 against plain data parallel (`mpi/memory.rs`).
//!
//! The test launches this binary under `mpirun` (the harness of `zero-comm/tests/mpi`); inside
//! the job each process runs the rank side and writes its numbers to a file the test reads.
#![cfg(feature = "mpi")]

mod common;
#[path = "../../zero-comm/tests/mpi/harness.rs"]
mod harness;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use zero_burn::Segmented;
use zero_burn::demo::data::{Corpus, TokenBatch};
use zero_burn::demo::run::{HostRun, RankResult, RankSummary, Work, train_rank};
use zero_burn::plan_for;
use zero_comm::Communicator;
use zero_core::{Plan, Topology, ZeroConfig};

use common::{bits, options, planned_traffic, small_units, tiny, train_tiny};
use harness::{is_rank, launch, rank_ok};

#[path = "mpi/kill.rs"]
mod kill;
#[path = "mpi/memory.rs"]
mod memory;
#[cfg(feature = "wgpu")]
#[path = "mpi/wgpu_per_process.rs"]
mod wgpu_per_process;

const STEPS: u64 = 3;
const OUT: &str = "ZERO_MPI_TEST_OUT";

fn topo() -> Topology {
    Topology::new(4, 2).unwrap()
}

/// The configurations every rank runs, in order.
fn configs() -> Vec<(&'static str, ZeroConfig)> {
    let base = small_units(0);
    let mut v: Vec<(&'static str, ZeroConfig)> = ["stage0", "stage1", "stage2", "stage3"]
        .into_iter()
        .zip(0u8..)
        .map(|(name, stage)| {
            (
                name,
                ZeroConfig {
                    stage,
                    ..base.clone()
                },
            )
        })
        .collect();
    v.push((
        "stage3-hpz",
        ZeroConfig {
            stage: 3,
            hpz_partition_size: 2,
            ..base.clone()
        },
    ));
    v.push((
        "zero++",
        ZeroConfig {
            stage: 3,
            hpz_partition_size: 2,
            quantized_weights: true,
            quantized_gradients: true,
            ..base
        },
    ));
    v
}

/// What one rank writes for one configuration.
#[derive(Serialize, Deserialize)]
struct RankOut {
    losses: Vec<u32>,
    params: Vec<Vec<u32>>,
    traffic_matches_plan: bool,
    summaries: usize,
}

fn out_file(dir: &str, name: &str, rank: usize) -> PathBuf {
    PathBuf::from(dir).join(format!("{name}-rank{rank}.json"))
}

/// [`STEPS`] steps within `timeout`, keeping the final parameters.
fn host_run(timeout: Duration) -> HostRun {
    HostRun {
        steps: STEPS,
        timeout,
        keep_final_params: true,
        checkpoint: None,
    }
}

/// A temporary folder for the ranks' outputs, removed when the first value drops, and its path.
fn scratch(prefix: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .expect("a temp dir");
    let dir = tmp.path().to_path_buf();
    (tmp, dir)
}

/// This rank process's part of `plan`, trained over MPI from `model` within `timeout`.
fn train_this_rank<M: Segmented<Batch = TokenBatch>>(
    plan: Arc<Plan>,
    model: M,
    corpus: &dyn Corpus,
    timeout: Duration,
) -> (RankResult<M>, Vec<RankSummary>) {
    let run = host_run(timeout);
    train_rank(
        harness::world(),
        plan,
        model,
        Work::new(corpus, options(), &run),
    )
    .unwrap()
}

fn rank_side() {
    let dir = std::env::var(OUT).unwrap();
    // Keeps MPI initialised between the engines (each owns a world of its own).
    let anchor = harness::world();
    let (n, me) = (anchor.world_size(), anchor.rank());
    for (name, cfg) in configs() {
        let (model, corpus) = tiny();
        let plan = Arc::new(plan_for(&model, topo(), &cfg).unwrap());
        let (res, summaries) =
            train_this_rank(plan.clone(), model, &corpus, Duration::from_secs(60));
        let out = RankOut {
            losses: res.losses.iter().map(|l| l.to_bits()).collect(),
            params: bits(&res.final_params),
            traffic_matches_plan: res.traffic == planned_traffic(&plan, me, STEPS),
            summaries: summaries.len(),
        };
        std::fs::write(out_file(&dir, name, me), serde_json::to_vec(&out).unwrap()).unwrap();
    }
    rank_ok(me, n);
}

#[test]
fn mpi_ranks_train_bit_identically_to_in_process_ranks() {
    if is_rank() {
        return rank_side();
    }
    let (_tmp, dir) = scratch("zero-burn-mpi-");
    let env = [(OUT, dir.display().to_string())];
    let name = "mpi_ranks_train_bit_identically_to_in_process_ranks";
    let limit = Duration::from_secs(300);
    let Some(job) = launch(name, 4, 2, Duration::from_secs(60), &env, limit) else {
        return;
    };
    job.assert_ranks_ok(4);
    eprintln!(
        "4 MPI ranks, {} configurations: {:?}",
        configs().len(),
        job.elapsed
    );
    for (name, cfg) in configs() {
        let (_, reference) = train_tiny(topo(), &cfg, options(), STEPS);
        for r in &reference {
            let got: RankOut = serde_json::from_slice(
                &std::fs::read(out_file(&dir.display().to_string(), name, r.rank)).unwrap(),
            )
            .unwrap();
            let what = format!("{name} rank {}", r.rank);
            let want: Vec<u32> = r.losses.iter().map(|l| l.to_bits()).collect();
            assert_eq!(got.losses, want, "{what}: losses");
            assert_eq!(
                got.params,
                bits(&r.final_params),
                "{what}: final parameters"
            );
            assert!(
                got.traffic_matches_plan,
                "{what}: measured traffic differs from the plan"
            );
            assert_eq!(got.summaries, 4, "{what}: gathered summaries");
        }
    }
}

#[test]
fn a_rank_started_with_another_model_or_config_fails_every_rank_before_data_moves() {
    if is_rank() {
        use zero_burn::{Error, ZeroEngine};
        let anchor = harness::world();
        let me = anchor.rank();
        // Rank 2 starts from other weights, then (with the same weights) with another stage.
        for (case, what) in [(0, "model (parameter values)"), (1, "plan or options")] {
            let (mut model, _) = tiny();
            if me == 2 && case == 0 {
                model = zero_burn::demo::gpt::GptConfig {
                    vocab: 16,
                    context: 8,
                    d_model: 16,
                    heads: 2,
                    layers: 2,
                }
                .init(&burn::tensor::Device::flex().autodiff(), 43);
            }
            let stage = if me == 2 && case == 1 { 2 } else { 3 };
            let cfg = ZeroConfig {
                stage,
                ..Default::default()
            };
            match ZeroEngine::builder(harness::world(), model)
                .config(cfg)
                .build()
            {
                Err(Error::RanksDisagree {
                    rank: 2, what: w, ..
                }) if w == what => {}
                Err(e) => panic!("rank {me}, case {case}: {e}"),
                Ok(_) => panic!("rank {me}, case {case}: the engine was built"),
            }
        }
        return rank_ok(me, anchor.world_size());
    }
    let name = "a_rank_started_with_another_model_or_config_fails_every_rank_before_data_moves";
    if let Some(job) = launch(
        name,
        4,
        2,
        Duration::from_secs(30),
        &[],
        Duration::from_secs(120),
    ) {
        job.assert_ranks_ok(4);
    }
}
