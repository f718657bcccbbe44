//! The tiny model, data and options the trainer tests share.
#![allow(dead_code)]

pub(crate) mod points;
pub(crate) mod store;
pub(crate) mod train_mode;

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::Device;
use zero_burn::checkpoint::Storage;
use zero_burn::demo::data::MarkovLanguage;
use zero_burn::demo::gpt::{Gpt, GptConfig};
use zero_burn::demo::run::{Checkpointing, HostRun, RankResult, TrainOptions, Work};
use zero_burn::demo::train::{On, train};
use zero_burn::optim::Optimizer;
use zero_burn::{MeasuredMemory, Reduction, Segmented, ZeroEngine, plan_for};
use zero_comm::Communicator;
use zero_comm::host::HostComm;
use zero_core::{Placement, Plan, Precision, Topology, TrafficTable, ZeroConfig};

/// The tiny model's configuration at `stage`: buckets of 3000 elements and a persistence
/// threshold of 64, so that it has several buckets and both kinds of stage-3 unit.
pub(crate) fn small_units(stage: u8) -> ZeroConfig {
    ZeroConfig {
        stage,
        reduce_bucket_size: 3000,
        param_persistence_threshold: 64,
        ..Default::default()
    }
}

/// `comm`'s rank, and its engine of `model` with `cfg` and `optimizer` (else the builder's).
pub(crate) fn rank_engine<M: Segmented>(
    comm: HostComm,
    model: M,
    cfg: &ZeroConfig,
    optimizer: Option<Optimizer>,
) -> zero_burn::Result<(usize, ZeroEngine<HostComm, M>)> {
    let rank = comm.rank();
    let mut builder = ZeroEngine::builder(comm, model).config(cfg.clone());
    if let Some(o) = optimizer {
        builder = builder.optimizer(o);
    }
    Ok((rank, builder.build()?))
}

/// `cfg` at `stage`.
pub(crate) fn at_stage(cfg: &ZeroConfig, stage: u8) -> ZeroConfig {
    ZeroConfig {
        stage,
        ..cfg.clone()
    }
}

/// The placement tests' configuration: the optimizer's state at `placement`, 2 micro-steps, and
/// a persistence threshold of 16.
pub(crate) fn placed(stage: u8, precision: Precision, placement: Placement) -> ZeroConfig {
    ZeroConfig {
        stage,
        precision,
        gradient_accumulation_steps: 2,
        param_persistence_threshold: 16,
        optimizer_placement: placement,
        ..ZeroConfig::default()
    }
}

/// Every rank of run `a` has run `b`'s losses and final parameters, bit for bit.
pub(crate) fn assert_same(a: &[RankResult<Gpt>], b: &[RankResult<Gpt>], what: &str) {
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.losses, y.losses, "losses, {what}");
        assert!(
            bits(&x.final_params) == bits(&y.final_params),
            "params, {what}: rank {}",
            x.rank
        );
    }
}

/// A 2-block GPT with d_model 16 on flex, and a 16-token Markov language.
pub(crate) fn tiny() -> (Gpt, MarkovLanguage) {
    tiny_seeded(42)
}

/// [`tiny`] with its weights drawn from `seed`.
pub(crate) fn tiny_seeded(seed: u64) -> (Gpt, MarkovLanguage) {
    let device = Device::flex().autodiff();
    (
        tiny_config().init(&device, seed),
        MarkovLanguage::new(16, 3).unwrap(),
    )
}

/// The `wide` GPT of the memory tests (`cargo xtask train --model wide`): d_model 384, 8 blocks,
/// 4 heads, context 16, vocabulary 64, 14.3M parameters: model states dominate memory.
pub(crate) fn wide_config() -> GptConfig {
    GptConfig {
        vocab: 64,
        context: 16,
        d_model: 384,
        heads: 4,
        layers: 8,
    }
}

/// [`tiny`]'s shape: 2 blocks, d_model 16, 2 heads, context 8, vocabulary 16.
pub(crate) fn tiny_config() -> GptConfig {
    GptConfig {
        vocab: 16,
        context: 8,
        d_model: 16,
        heads: 2,
        layers: 2,
    }
}

/// AdamW at 1e-2, micro-batch 2 of 8 tokens, with the given reduction.
pub(crate) fn options_with(reduction: Reduction) -> TrainOptions {
    TrainOptions {
        lr: 1e-2,
        optimizer: Optimizer::default(),
        micro_batch: 2,
        seq: 8,
        reduction,
    }
}

/// [`options_with`] rank-ordered reduction.
pub(crate) fn options() -> TrainOptions {
    options_with(Reduction::RankOrdered)
}

/// The plan's traffic for `rank` over `steps` optimizer steps (none skipped).
pub(crate) fn planned_traffic(plan: &Plan, rank: usize, steps: u64) -> TrafficTable {
    let per_step = plan.comm(rank).by_collective;
    let mut t = TrafficTable::new();
    for _ in 0..steps {
        t.merge(&per_step);
    }
    t
}

/// Every parameter's values as bits, for bit-exact comparisons.
pub(crate) fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|p| p.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// Trains [`tiny`] for `steps` on the host loopback and checks every rank's measured traffic
/// against the plan (I8), and with synchronous collectives its communication buffers, gathered
/// working set and hpZ secondary too. The
/// model-state bytes are the caller's to check ([`assert_model_states`]; the canonical tree adds
/// its pending subtrees).
pub(crate) fn train_tiny(
    topo: Topology,
    cfg: &ZeroConfig,
    options: TrainOptions,
    steps: u64,
) -> (Arc<Plan>, Vec<RankResult<Gpt>>) {
    let (model, corpus) = tiny();
    let plan = Arc::new(plan_for(&model, topo, cfg).unwrap());
    let res = train(
        On::Host,
        plan.clone(),
        model,
        Work::new(
            &corpus,
            options,
            &HostRun {
                steps,
                timeout: Duration::from_secs(30),
                keep_final_params: true,
                checkpoint: None,
            },
        ),
    )
    .unwrap();
    for r in &res {
        let want = planned_traffic(&plan, r.rank, steps);
        assert_eq!(r.traffic, want, "rank {} traffic, {cfg:?}", r.rank);
        if !cfg.overlap_comm {
            // The largest unit's gradient buffer in reduction, plus the qwZ/qgZ wires at their
            // largest, exactly as planned.
            assert_eq!(
                r.memory.communication_buffers,
                plan.memory().communication_buffers,
                "rank {} communication buffers, {cfg:?}",
                r.rank
            );
            // The stage-3 working set (gathered units) and hpZ's secondary shards, likewise.
            assert_eq!(
                r.memory.gathered_working_set,
                plan.memory().gathered_working_set,
                "rank {} gathered working set, {cfg:?}",
                r.rank
            );
            assert_eq!(
                r.memory.hpz_secondary,
                plan.memory().hpz_secondary,
                "rank {} hpZ secondary, {cfg:?}",
                r.rank
            );
        }
    }
    (plan, res)
}

/// Every rank's measured model-state bytes equal the plan's.
pub(crate) fn assert_model_states(plan: &Plan, res: &[RankResult<Gpt>]) {
    let planned = MeasuredMemory::planned_model_states(&plan.memory());
    for r in res {
        assert_eq!(
            r.memory.model_states(),
            planned,
            "rank {} model-state bytes, {:?}",
            r.rank,
            plan.config()
        );
    }
}

/// The process's shared wgpu device, or `None` when there is no wgpu adapter: the test then
/// records that it did not run (`$ZERO_SKIP_LOG`, counted by `cargo xtask test`), or fails with
/// `ZERO_REQUIRE_WGPU=1` (the default of `cargo xtask test`, and CI). Only a missing adapter
/// skips: when there is one, an error opening burn's runtime or the loopback's device (kernel
/// compilation included) fails the test. `ZERO_SIMULATE_NO_ADAPTER=1` behaves as a machine
/// without an adapter.
#[cfg(feature = "wgpu")]
pub(crate) fn shared(test: &str) -> Option<zero_burn::WgpuShared> {
    static NO_ADAPTER: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    use zero_testkit::gate::Device;
    let no_adapter = NO_ADAPTER.get_or_init(|| {
        if let Some(why) = Device::Wgpu.simulated() {
            Some(why)
        } else {
            zero_comm::wgpu_loopback::WgpuDevice::default_adapter()
                .err()
                .map(|e| e.to_string())
        }
    });
    match no_adapter {
        None => Some(
            zero_burn::WgpuShared::get()
                .unwrap_or_else(|e| panic!("there is a wgpu adapter but the device failed: {e}")),
        ),
        Some(why) => {
            Device::Wgpu.missing(zero_testkit::binary!(), test, why);
            None
        }
    }
}

/// Saves a checkpoint into `store` at the end of the run (`save`), or resumes from its latest.
pub(crate) fn checkpointing(store: &Arc<dyn Storage>, save: bool) -> Checkpointing {
    Checkpointing {
        save: save.then(|| store.clone()),
        save_every: 0,
        resume: (!save).then(|| store.clone()),
        resume_tag: None,
        reshard: false,
    }
}

/// `first` (saved at step 2) then `rest` (resumed from it) give `whole`'s losses and final
/// parameters bit for bit on every rank.
pub(crate) fn assert_resumes<M>(
    whole: &[RankResult<M>],
    first: &[RankResult<M>],
    rest: &[RankResult<M>],
    what: &str,
) {
    for ((w, a), b) in whole.iter().zip(first).zip(rest) {
        assert_eq!(b.first_step, 2, "{what}: resumed at step 2");
        let resumed: Vec<f32> = a.losses.iter().chain(&b.losses).copied().collect();
        assert_eq!(resumed, w.losses, "{what}: rank {} losses", w.rank);
        assert!(
            bits(&b.final_params) == bits(&w.final_params),
            "{what}: rank {} parameters after the resume",
            w.rank
        );
    }
}

/// Asserts that `report`'s step traffic is the traffic its plan books, naming `what`, the rank and
/// both tables when it is not.
pub(crate) fn assert_traffic_as_planned(what: &str, report: &zero_burn::RankReport) {
    assert!(
        report.traffic_matches_plan(),
        "{what}: rank {}'s step traffic {:?} vs the plan's {:?}",
        report.rank,
        report.traffic,
        report.planned_traffic
    );
}

/// Rank 0's loss after the last step is below its loss after the first.
pub(crate) fn assert_learns(runs: &[RankResult<Gpt>]) {
    let losses = &runs[0].losses;
    assert!(losses.last() < losses.first(), "it learns: {losses:?}");
}
