//! [`RankReport`]: what one rank measured next to what its plan said, and the consolidated model.

use serde::Serialize;
use zero_comm::Communicator;
use zero_core::{MemoryModel, TrafficTable};

use super::{MeasuredMemory, ZeroEngine};
use crate::error::Result;
use crate::segmented::Segmented;

/// What one rank counted and booked next to what its plan predicted.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankReport {
    /// The rank.
    pub rank: usize,
    /// Optimizer steps taken, skipped fp16 steps included.
    pub steps: u64,
    /// Steps skipped because fp16 gradients overflowed.
    pub skipped_steps: u64,
    /// Bytes moved by training steps since the engine was built, per collective and link class,
    /// counted where the communicator hands them to its transport.
    pub traffic: TrafficTable,
    /// What the plan predicts for those steps (a skipped step issues no post-step gathers).
    pub planned_traffic: TrafficTable,
    /// Bytes moved by [`ZeroEngine::eval`] and [`ZeroEngine::consolidated_model`] (not in the
    /// plan, which counts training steps).
    pub other_traffic: TrafficTable,
    /// Peak bytes by category, booked by the engine's accounting of its buffers (the device's
    /// pools, [`Self::device_peak_bytes`], and an allocator or the process's RSS measure).
    pub memory: MeasuredMemory,
    /// The plan's bytes by category.
    pub planned_memory: MemoryModel,
    /// Gradient bytes a [`DeviceTensors`](crate::DeviceTensors) hook packed in the
    /// communicator's memory (bytes that never passed through host memory).
    pub device_grad_bytes: u64,
    /// Weight bytes a [`DeviceTensors`](crate::DeviceTensors) hook installed straight from the
    /// communicator's memory.
    pub device_weight_bytes: u64,
    /// The device holding the optimizer's state (moments, bf16/fp16 master weights), as burn
    /// names it; `None` for host memory (a model on a CPU backend, or
    /// `optimizer_placement = host`).
    pub optimizer_device: Option<String>,
    /// The peak bytes in use on the model's device, counted by the device's own memory pools
    /// (burn's `Device::memory_pool_usage`, CubeCL's statistics) where the engine samples its
    /// memory: after every micro-step and optimizer step. For the whole device: ranks that share
    /// it (in-process ranks on one GPU or wgpu adapter) each see their sum, and memory that
    /// burn's pools do not manage (a communicator's own buffers) is not in it. `None` on flex,
    /// whose memory is the process's.
    pub device_peak_bytes: Option<u64>,
    /// With `optimizer_placement = nvme`: what the NVMe store read and wrote, and the time the
    /// steps waited for it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvme_io: Option<crate::IoReport>,
}

impl RankReport {
    /// Whether the counted training traffic equals the plan's.
    pub fn traffic_matches_plan(&self) -> bool {
        self.traffic == self.planned_traffic
    }

    /// Whether the booked model-state bytes (parameters, gradients, optimizer states, master
    /// weights) equal the plan's.
    pub fn model_states_match_plan(&self) -> bool {
        self.memory.model_states() == MeasuredMemory::planned_model_states(&self.planned_memory)
    }
}

impl<C: Communicator, M: Segmented> ZeroEngine<C, M> {
    /// Traffic counted, memory booked (and measured by the device where it can), and the plan's.
    pub fn report(&self) -> RankReport {
        let plan = self.plan();
        // Planned for the steps this engine ran (after a load, since the checkpoint's step).
        let (base, base_skipped) = self.core.meter.steps_base;
        let skipped = self.skipped_steps() - base_skipped;
        let mut planned_traffic = TrafficTable::new();
        let clean = plan.comm(self.rank()).by_collective;
        let skip = plan.comm_skipped_step(self.rank()).by_collective;
        for _ in 0..self.steps() - base - skipped {
            planned_traffic.merge(&clean);
        }
        for _ in 0..skipped {
            planned_traffic.merge(&skip);
        }
        RankReport {
            rank: self.rank(),
            steps: self.steps(),
            skipped_steps: skipped,
            traffic: self.traffic(),
            planned_traffic,
            other_traffic: self.other_traffic().clone(),
            memory: self.measured_memory(),
            planned_memory: plan.memory(),
            device_grad_bytes: self.device_grad_bytes(),
            device_weight_bytes: self.device_weight_bytes(),
            optimizer_device: self.optimizer_device().map(|d| format!("{d:?}")),
            device_peak_bytes: self.device_memory_peak(),
            nvme_io: self.nvme_io(),
        }
    }

    /// The full model with its current weights, on every rank (collective: every rank must call
    /// it). At stage 3 each unit is all-gathered once; the engine's own model keeps its shards.
    /// In bf16/fp16 the weights are the 16-bit working weights (widened to f32).
    pub fn consolidated_model(&mut self) -> Result<M> {
        let values = self.untracked(|e| e.gather_all_params())?;
        let fresh = self.params_with(values);
        // A deep copy: the caller's model shares no buffer with the engine's.
        let model = crate::launch::deep_copy(self.model());
        Ok(crate::params::write_values(model, fresh))
    }
}
