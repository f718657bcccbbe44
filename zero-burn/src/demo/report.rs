//! The run report of a job: loss, throughput, and bytes measured against planned, merged from
//! every rank's summary.

use std::sync::Arc;

use serde::Serialize;
use zero_core::{MemoryModel, Plan, TrafficTable, ZeroConfig};

use crate::demo::config::JobConfig;
use crate::demo::data::Corpus;
use crate::demo::gpt::GptConfig;
use crate::demo::run::{RankSummary, SaveRecord};
use crate::engine::MeasuredMemory;
use crate::error::{Error, Result};

/// Measured next to planned.
#[derive(Clone, Debug, Serialize)]
pub struct Compared<M, P> {
    /// Measured, per rank.
    pub measured: Vec<M>,
    /// Planned, per rank (communication: for all steps; a skipped fp16 step without its post-step
    /// all-gathers).
    pub planned: Vec<P>,
}

/// The result of a job.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    /// The job.
    pub job: JobConfig,
    /// Mean loss over ranks, one value per step (nats per token).
    pub loss: Vec<f32>,
    /// The data's entropy rate if known: the loss floor.
    pub loss_floor: Option<f64>,
    /// Steps (0-based) skipped because fp16 gradients overflowed: every rank skipped them
    /// together, leaving weights and optimizer state unchanged. Empty in fp32 and bf16.
    pub skipped_steps: Vec<u64>,
    /// The loss scale each step's backward used (1 in fp32 and bf16).
    pub loss_scale: Vec<f32>,
    /// Wall time of the training loop.
    pub wall_secs: f64,
    /// Global tokens per second.
    pub tokens_per_sec: f64,
    /// Global tokens per second of each step, from the slowest rank's wall time of that step
    /// (the step ends when every rank's does).
    pub step_tokens_per_sec: Vec<f64>,
    /// Bytes moved per rank over all steps: counted where the communicator hands them to its
    /// transport (`measured`), and planned.
    pub comm: Compared<TrafficTable, TrafficTable>,
    /// Peak bytes per rank by category: booked by the engine's own accounting of its buffers
    /// (`measured`; the process's RSS and the device's pools are the outside measurements), and
    /// planned.
    pub memory: Compared<MeasuredMemory, MemoryModel>,
    /// Whether the counted traffic equals the plan on every rank.
    pub comm_matches_plan: bool,
    /// Whether the booked model-state bytes equal the plan on every rank.
    pub memory_matches_plan: bool,
    /// The optimizer step the run started from: 0, or the resumed checkpoint's step. `loss`
    /// holds the steps from there on.
    pub first_step: u64,
    /// The checkpoints saved (rank 0's bytes and seconds).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub saves: Vec<SaveRecord>,
    /// Each rank's process peak resident set, when every rank is a process of its own
    /// ([`run_job_rank`](crate::demo::job::run_job_rank)); empty (and not written) when ranks are threads of one process.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub peak_rss_per_rank: Vec<u64>,
    /// Each rank's peak bytes in use on its device, counted by the device's own memory pools
    /// (burn's `Device::memory_pool_usage`); for in-process ranks sharing one device, each
    /// rank's figure is the whole device's. Empty (and not written) on flex.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub device_peak_per_rank: Vec<u64>,
    /// With `optimizer_placement = nvme`, each rank's NVMe store: bytes read and written, the
    /// time its steps waited for IO, the ring's peak. Empty (and not written) otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub nvme_io_per_rank: Vec<crate::IoReport>,
    /// The parameters several segments read (the tied head's token embedding), from the plan.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shared: Vec<zero_core::SharedParam>,
}

/// What a job's report describes besides its ranks' numbers: its data, its model's shape, its
/// ZeRO configuration and its plan.
pub(crate) struct Described {
    pub(crate) corpus: Box<dyn Corpus>,
    pub(crate) model_cfg: GptConfig,
    pub(crate) zero: ZeroConfig,
    pub(crate) plan: Arc<Plan>,
}

/// The run report of `job` from every rank's summary.
pub(crate) fn report(
    job: &JobConfig,
    described: &Described,
    results: &[RankSummary],
    wall: f64,
) -> Result<RunReport> {
    let Described {
        corpus,
        model_cfg,
        zero,
        plan,
    } = described;
    // A resumed run reports the steps it ran.
    let first = &results[0];
    let steps = first.losses.len();
    let first_step = first.first_step;
    let loss = (0..steps)
        .map(|s| results.iter().map(|r| r.losses[s]).sum::<f32>() / results.len() as f32)
        .collect();
    // A skipped fp16 step issues no post-step all-gathers (the weights did not change).
    let planned_comm: Vec<TrafficTable> = results
        .iter()
        .map(|r| {
            let per_step = plan.comm(r.rank).by_collective;
            let skipped = plan.comm_skipped_step(r.rank).by_collective;
            let mut t = TrafficTable::new();
            for info in &r.step_info {
                t.merge(if info.skipped { &skipped } else { &per_step });
            }
            t
        })
        .collect();
    for r in &results[1..] {
        if r.step_info != first.step_info {
            return Err(Error::RunSummary {
                rank: r.rank,
                detail: "it skipped other steps or used other loss scales than rank 0".into(),
            });
        }
    }
    let skipped_steps = (0..steps)
        .filter(|&s| first.step_info[s].skipped)
        .map(|s| first_step + s as u64)
        .collect();
    let loss_scale = first.step_info.iter().map(|i| i.loss_scale).collect();
    let measured_comm: Vec<TrafficTable> = results.iter().map(|r| r.traffic.clone()).collect();
    let planned_mem = plan.memory();
    let measured_mem: Vec<MeasuredMemory> = results.iter().map(|r| r.memory).collect();
    let comm_matches_plan = measured_comm == planned_comm;
    let memory_matches_plan = measured_mem
        .iter()
        .all(|m| m.model_states() == MeasuredMemory::planned_model_states(&planned_mem));
    Ok(RunReport {
        loss,
        loss_floor: corpus.entropy_floor(),
        skipped_steps,
        loss_scale,
        wall_secs: wall,
        tokens_per_sec: (job.tokens_per_step() * steps as u64) as f64 / wall.max(1e-9),
        step_tokens_per_sec: (0..steps)
            .map(|s| {
                let slowest = results
                    .iter()
                    .filter_map(|r| r.step_seconds.get(s).copied())
                    .fold(0.0f64, f64::max);
                job.tokens_per_step() as f64 / slowest.max(1e-9)
            })
            .collect(),
        first_step,
        saves: first.saves.clone(),
        comm: Compared {
            measured: measured_comm,
            planned: planned_comm,
        },
        memory: Compared {
            measured: measured_mem,
            planned: vec![planned_mem; results.len()],
        },
        comm_matches_plan,
        memory_matches_plan,
        peak_rss_per_rank: results
            .iter()
            .map(|r| r.peak_rss_bytes)
            .collect::<Option<Vec<u64>>>()
            .unwrap_or_default(),
        device_peak_per_rank: results
            .iter()
            .map(|r| r.device_peak_bytes)
            .collect::<Option<Vec<u64>>>()
            .unwrap_or_default(),
        nvme_io_per_rank: results
            .iter()
            .map(|r| r.nvme_io)
            .collect::<Option<Vec<_>>>()
            .unwrap_or_default(),
        shared: plan.shared_params(),
        job: JobConfig {
            model: *model_cfg,
            zero: zero.clone(),
            ..job.clone()
        },
    })
}
