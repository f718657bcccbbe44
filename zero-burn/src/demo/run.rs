//! One rank's run of the demo: a token model trained on a [`Corpus`], with optional checkpoints,
//! for [`crate::demo::train::train`]'s in-process ranks and for one rank of a job whose ranks are
//! processes ([`train_rank`]). Built on the public API ([`crate::EngineBuilder`],
//! [`crate::ZeroEngine::step`]).

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use zero_comm::Communicator;
use zero_core::{Plan, TrafficTable};

use crate::checkpoint::{LoadOptions, Storage};
use crate::demo::data::{Corpus, Draw, TokenBatch};
use crate::engine::EngineBuilder;
use crate::engine::{MeasuredMemory, ZeroEngine};
use crate::error::Result;
use crate::optim::Optimizer;
use crate::reduction::{Reduction, canonical_sum};
use crate::segmented::Segmented;

/// What rank 0 reports after each step, for a progress bar.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tick {
    /// The step just taken (counted from 0).
    pub step: u64,
    /// Rank 0's loss of the step (the mean over its micro-batches).
    pub loss: f32,
    /// With state on NVMe: what rank 0's stores have read and written so far, and the time its
    /// steps waited for them.
    pub nvme_io: Option<crate::IoReport>,
}

/// The demo's training options that are not part of the ZeRO plan.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct TrainOptions {
    /// Learning rate.
    pub lr: f32,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Sequences per rank per micro-step.
    pub micro_batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// How gradients are summed over micro-steps and ranks.
    pub reduction: Reduction,
}

/// What one rank reports after training.
#[derive(Debug)]
pub struct RankResult<M> {
    /// The rank.
    pub rank: usize,
    /// This rank's mean loss per step.
    pub losses: Vec<f32>,
    /// This rank's unscaled loss of each micro-step, per step (for [`global_losses`]).
    pub micro_losses: Vec<Vec<f32>>,
    /// Per step: skipped (fp16 overflow) or not, and the loss scale.
    pub step_info: Vec<crate::StepInfo>,
    /// Per step: this rank's wall time of the optimizer step, its batches' preparation included
    /// and checkpoint saves excluded, in seconds.
    pub step_seconds: Vec<f64>,
    /// Traffic measured over all steps.
    pub traffic: TrafficTable,
    /// Peak measured memory.
    pub memory: MeasuredMemory,
    /// The final model (stage 3: gather units released).
    pub model: M,
    /// Every parameter's final values, indexed like the plan's model (for equivalence checks);
    /// empty unless [`HostRun::keep_final_params`].
    pub final_params: Vec<Vec<f32>>,
    /// Gradient bytes a [`DeviceTensors`](crate::device::DeviceTensors) hook packed in the
    /// communicator's memory (never read back to the host); 0 on the host path.
    pub device_grad_bytes: u64,
    /// Weight bytes a [`DeviceTensors`](crate::device::DeviceTensors) hook installed in the
    /// model straight from the communicator's memory; 0 on the host path.
    pub device_weight_bytes: u64,
    /// The device holding the optimizer's state; `None` for host memory.
    pub optimizer_device: Option<String>,
    /// The peak bytes in use on the model's device, counted by its own memory pools (the whole
    /// device: in-process ranks sharing it see their sum); `None` on flex.
    pub device_peak_bytes: Option<u64>,
    /// With `optimizer_placement = nvme`: the NVMe store's reads, writes and waits.
    pub nvme_io: Option<crate::IoReport>,
    /// The step training started from: 0, or the step of the checkpoint it resumed.
    pub first_step: u64,
    /// The checkpoints saved.
    pub saves: Vec<SaveRecord>,
}

/// How long to run and what to keep.
#[derive(Clone, Debug)]
pub struct HostRun {
    /// Optimizer steps in all: a resumed run continues up to this step.
    pub steps: u64,
    /// Timeout of every collective.
    pub timeout: Duration,
    /// Gather every parameter at the end into [`RankResult::final_params`].
    pub keep_final_params: bool,
    /// Save and resume checkpoints; `None`: neither.
    pub checkpoint: Option<Checkpointing>,
}

impl HostRun {
    /// `steps` steps with timeout `timeout`, keeping nothing, no checkpoints.
    pub fn new(steps: u64, timeout: Duration) -> HostRun {
        HostRun {
            steps,
            timeout,
            keep_final_params: false,
            checkpoint: None,
        }
    }
}

/// What every rank of a run does: train on `corpus` with `options` for `run`'s steps, rank 0
/// calling `on_step` after each step.
#[derive(Clone, Copy)]
pub struct Work<'a> {
    /// The token stream every rank draws its micro-batches from.
    pub corpus: &'a dyn Corpus,
    /// Learning rate, optimizer, batch shape and reduction.
    pub options: TrainOptions,
    /// How long to run and what to keep.
    pub run: &'a HostRun,
    /// Called by rank 0 after each step.
    pub on_step: &'a (dyn Fn(Tick) + Sync),
}

impl std::fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("options", &self.options)
            .field("run", self.run)
            .finish_non_exhaustive()
    }
}

impl<'a> Work<'a> {
    /// `run` on `corpus` with `options`, reporting no progress.
    pub fn new(corpus: &'a dyn Corpus, options: TrainOptions, run: &'a HostRun) -> Work<'a> {
        Work {
            corpus,
            options,
            run,
            on_step: &|_| {},
        }
    }

    /// Rank 0 calls `on_step` after each step.
    pub fn on_step(self, on_step: &'a (dyn Fn(Tick) + Sync)) -> Work<'a> {
        Work { on_step, ..self }
    }
}

/// Checkpoints of a run ([`crate::checkpoint`]): where, how often, and whether to start from one.
#[derive(Clone, Debug)]
pub struct Checkpointing {
    /// Where checkpoints are saved (new tags `step-NNNNNNNN`, `LATEST` updated).
    pub save: Option<Arc<dyn Storage>>,
    /// Save after every this many optimizer steps (0: never in between); a run that saves also
    /// saves after its last step.
    pub save_every: u64,
    /// Load a checkpoint from here before training and continue from its step: the one
    /// `resume_tag` names, or `LATEST`'s.
    pub resume: Option<Arc<dyn Storage>>,
    /// The tag to resume (`None`: the one `LATEST` names).
    pub resume_tag: Option<String>,
    /// Resume from a checkpoint of another plan (world size, stage, ...): resharded on load.
    /// Without it another plan's checkpoint is refused.
    pub reshard: bool,
}

/// One save of a run, as rank 0 saw it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SaveRecord {
    /// The optimizer step saved (steps done).
    pub step: u64,
    /// The committed tag.
    pub tag: String,
    /// Bytes this rank wrote.
    pub bytes: u64,
    /// Wall time of the collective save on this rank.
    pub seconds: f64,
}

/// The builder of one rank's engine for the demo's plan and options.
pub fn engine_builder<C: Communicator, M: Segmented>(
    plan: &Arc<Plan>,
    comm: C,
    model: M,
    options: TrainOptions,
) -> EngineBuilder<C, M> {
    ZeroEngine::builder(comm, model)
        .plan(plan.clone())
        .optimizer(options.optimizer)
        .reduction(options.reduction)
}

/// One optimizer step of the demo: this rank's micro-batches of `corpus` at the engine's next
/// step (numbered by [`crate::demo::data::global_index`]).
pub fn corpus_step<C: Communicator, M: Segmented<Batch = TokenBatch>>(
    engine: &mut ZeroEngine<C, M>,
    corpus: &dyn Corpus,
    options: &TrainOptions,
) -> Result<crate::StepOutput> {
    let plan = engine.plan().clone();
    let batches = corpus.rank_batches(Draw {
        step: engine.steps(),
        rank: engine.rank(),
        ranks: plan.world_size(),
        micro_steps: plan.config().gradient_accumulation_steps,
        micro_batch: options.micro_batch,
        seq: options.seq,
    });
    engine.step(options.lr, &batches)
}

/// What every rank of a job whose ranks are processes learns of every other rank after training
/// ([`train_rank`]): the numbers of [`RankResult`] that the run report needs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankSummary {
    /// The rank.
    pub rank: usize,
    /// Its mean loss per step.
    pub losses: Vec<f32>,
    /// Per step: skipped or not, and the loss scale.
    pub step_info: Vec<crate::StepInfo>,
    /// Per step: its wall time in seconds (see [`RankResult::step_seconds`]).
    pub step_seconds: Vec<f64>,
    /// Traffic measured over all steps.
    pub traffic: TrafficTable,
    /// Peak measured memory.
    pub memory: MeasuredMemory,
    /// The process's peak resident set (Linux `VmHWM`) when its ranks are processes; `None` for
    /// ranks that are threads (they share one process) or where `/proc` is missing.
    pub peak_rss_bytes: Option<u64>,
    /// The peak bytes in use on the rank's device, counted by its own memory pools; `None` on
    /// flex (see [`RankResult::device_peak_bytes`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_peak_bytes: Option<u64>,
    /// With `optimizer_placement = nvme`: the NVMe store's reads, writes and waits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvme_io: Option<crate::IoReport>,
    /// The step training started from.
    pub first_step: u64,
    /// The checkpoints saved.
    pub saves: Vec<SaveRecord>,
}

impl RankSummary {
    /// The summary of a rank that ran in this process.
    pub fn of<M>(r: &RankResult<M>) -> RankSummary {
        RankSummary {
            rank: r.rank,
            losses: r.losses.clone(),
            step_info: r.step_info.clone(),
            step_seconds: r.step_seconds.clone(),
            traffic: r.traffic.clone(),
            memory: r.memory,
            peak_rss_bytes: None,
            device_peak_bytes: r.device_peak_bytes,
            nvme_io: r.nvme_io,
            first_step: r.first_step,
            saves: r.saves.clone(),
        }
    }
}

/// The process's peak resident set (`VmHWM`), where `/proc` has it.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// One rank of a job whose ranks are processes (MPI, NCCL): does `work` on `comm` from `model`
/// (every rank must pass the same) and returns this rank's result and every rank's
/// [`RankSummary`] in rank order, gathered over `comm` (so every rank can write the report).
pub fn train_rank<C: Communicator, M: Segmented<Batch = TokenBatch>>(
    comm: C,
    plan: Arc<Plan>,
    model: M,
    work: Work<'_>,
) -> Result<(RankResult<M>, Vec<RankSummary>)> {
    train_built(engine_builder(&plan, comm, model, work.options), work)
}

/// [`train_rank`] from a rank's engine builder (with device hooks attached, say).
pub(crate) fn train_built<C: Communicator, M: Segmented<Batch = TokenBatch>>(
    builder: EngineBuilder<C, M>,
    work: Work<'_>,
) -> Result<(RankResult<M>, Vec<RankSummary>)> {
    let mut t = builder.build()?;
    let result = run_engine(&mut t, work)?;
    let mine = RankSummary {
        peak_rss_bytes: peak_rss_bytes(),
        ..RankSummary::of(&result)
    };
    // Losses travel as bits: JSON has no NaN.
    #[derive(Serialize, Deserialize)]
    struct Wire {
        summary: RankSummary,
        loss_bits: Vec<u32>,
    }
    let wire = Wire {
        loss_bits: mine.losses.iter().map(|l| l.to_bits()).collect(),
        summary: RankSummary {
            losses: Vec::new(),
            ..mine
        },
    };
    let unreadable = |rank, e: serde_json::Error| crate::Error::RunSummary {
        rank,
        detail: format!("not carried as JSON: {e}"),
    };
    let json = serde_json::to_vec(&wire).map_err(|e| unreadable(wire.summary.rank, e))?;
    let all = crate::checkpoint::all_gather_bytes(t.ckpt_world(), &json)?
        .iter()
        .enumerate()
        .map(|(r, b)| {
            let w: Wire = serde_json::from_slice(b).map_err(|e| unreadable(r, e))?;
            Ok(RankSummary {
                losses: w.loss_bits.into_iter().map(f32::from_bits).collect(),
                ..w.summary
            })
        })
        .collect::<Result<Vec<RankSummary>>>()?;
    Ok((result, all))
}

/// One rank's whole run: `work`, then its report.
pub(super) fn run_rank<C: Communicator, M: Segmented<Batch = TokenBatch>>(
    builder: EngineBuilder<C, M>,
    work: Work<'_>,
) -> Result<RankResult<M>> {
    run_engine(&mut builder.build()?, work)
}

/// `run.steps` steps of a built engine, then its report.
fn run_engine<C: Communicator, M: Segmented<Batch = TokenBatch>>(
    t: &mut ZeroEngine<C, M>,
    work: Work<'_>,
) -> Result<RankResult<M>> {
    let Work {
        corpus,
        options,
        run,
        on_step,
    } = work;
    let ckpt = run.checkpoint.as_ref();
    let first_step = match ckpt.and_then(|c| c.resume.as_ref().map(|s| (c, s))) {
        Some((c, store)) => {
            let opts = LoadOptions {
                tag: c.resume_tag.clone(),
                reshard: c.reshard,
            };
            t.load_with(store.as_ref(), &opts)?.step
        }
        None => 0,
    };
    let todo = reserved_steps(run.steps, first_step);
    let mut losses = Vec::with_capacity(todo);
    let mut micro_losses = Vec::with_capacity(todo);
    let mut step_info = Vec::with_capacity(todo);
    let mut step_seconds = Vec::with_capacity(todo);
    let mut saves = Vec::new();
    for s in first_step..run.steps {
        let t0 = std::time::Instant::now();
        let out = corpus_step(t, corpus, &options)?;
        step_seconds.push(t0.elapsed().as_secs_f64());
        if t.rank() == 0 {
            on_step(Tick {
                step: s,
                loss: out.loss,
                nvme_io: t.nvme_io(),
            });
        }
        losses.push(out.loss);
        micro_losses.push(out.micro_losses);
        step_info.push(out.info);
        if let Some(c) = ckpt
            && let Some(store) = &c.save
        {
            let done = s + 1;
            if done == run.steps || (c.save_every > 0 && done.is_multiple_of(c.save_every)) {
                let state = serde_json::json!({ "step": done });
                let r = t.save(store.as_ref(), state)?;
                saves.push(SaveRecord {
                    step: done,
                    tag: r.tag,
                    bytes: r.bytes,
                    seconds: r.seconds,
                });
            }
        }
    }
    let report = t.report();
    // Gathering every parameter costs a full copy per rank: only on request.
    let final_params = if run.keep_final_params {
        t.gather_all_params()?
    } else {
        Vec::new()
    };
    Ok(RankResult {
        rank: t.rank(),
        losses,
        micro_losses,
        step_info,
        step_seconds,
        traffic: report.traffic,
        memory: report.memory,
        device_grad_bytes: report.device_grad_bytes,
        device_weight_bytes: report.device_weight_bytes,
        optimizer_device: report.optimizer_device,
        device_peak_bytes: report.device_peak_bytes,
        nvme_io: report.nvme_io,
        model: t.model().clone(),
        final_params,
        first_step,
        saves,
    })
}

/// The global loss of every step: the canonical pairwise-tree sum of all `N·A` micro-batch losses,
/// numbered `a·N + rank` like the data, divided once by `N·A`. With
/// [`Reduction::CanonicalTree`] it is bit-identical across the world sizes the gradients are (see
/// [`crate::reduction`]); ranks' [`RankResult::losses`] are per-rank means.
pub fn global_losses<M>(results: &[RankResult<M>]) -> Vec<f32> {
    let Some(first) = results.first() else {
        return Vec::new();
    };
    (0..first.micro_losses.len())
        .map(|s| {
            let a = first.micro_losses[s].len();
            let leaves: Vec<f32> = (0..a)
                .flat_map(|m| results.iter().map(move |r| r.micro_losses[s][m]))
                .collect();
            canonical_sum(&leaves) / leaves.len() as f32
        })
        .collect()
}

/// The steps whose records a run from `first` to `steps` reserves up front: at most 2^20 (a
/// longer run, up to `--steps u64::MAX`, grows them as it goes), none past its end.
fn reserved_steps(steps: u64, first: u64) -> usize {
    steps.saturating_sub(first).min(1 << 20) as usize
}

#[cfg(test)]
mod tests {
    use super::reserved_steps;

    #[test]
    fn a_run_reserves_at_most_a_million_steps_of_records() {
        assert_eq!(reserved_steps(u64::MAX, 0), 1 << 20);
        assert_eq!(reserved_steps(u64::MAX, u64::MAX - 3), 3);
        assert_eq!(reserved_steps(6, 4), 2);
        assert_eq!(
            reserved_steps(4, 6),
            0,
            "a resume past the end reserves nothing"
        );
    }
}
