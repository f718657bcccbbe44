//! What a rank counts as it runs ([`Meter`]): its peak memory in the plan's categories
//! ([`MeasuredMemory`], the engine's own bookkeeping), the peak its device's own memory pools
//! count, its traffic bases, the steps it skipped, the bytes its device hooks moved, and stage
//! 3's gathered units.

use serde::{Deserialize, Serialize};
use zero_comm::Communicator;
use zero_core::{MemoryModel, TrafficTable};

use super::{Core, ZeroEngine};
use crate::params;
use crate::segmented::Segmented;

/// Measured bytes per rank, in the plan's categories.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeasuredMemory {
    /// Parameter storage held by the model plus the stage-3 shard.
    pub parameters: u64,
    /// Gradient accumulator.
    pub gradients: u64,
    /// Optimizer state.
    pub optimizer_states: u64,
    /// fp32 master weights (zero in fp32, where the shard is the master).
    pub master_weights: u64,
    /// Peak hpZ secondary shard.
    pub hpz_secondary: u64,
    /// Peak gathered parameters (stage 3).
    pub gathered_working_set: u64,
    /// Peak gradient buffers in reduction (with `overlap_comm`, those in flight together), plus
    /// the high-water marks of the qwZ and qgZ wire buffers.
    pub communication_buffers: u64,
    /// bf16/fp16 on the CPU backend: the bytes by which burn's f32 copies of the working weights
    /// exceed the 16-bit working weights counted in `parameters` and `gathered_working_set`
    /// (2 B per resident element; see [`crate::precision`]). Zero in fp32. Not in the plan.
    pub f32_compute_copies: u64,
    /// parameters + gradients + optimizer states + master weights.
    pub model_states_bytes: u64,
}

impl MeasuredMemory {
    /// The model-state categories of a plan's memory model, for comparison.
    pub fn planned_model_states(m: &MemoryModel) -> [u64; 4] {
        [
            m.parameters,
            m.gradients,
            m.optimizer_states,
            m.master_weights,
        ]
    }

    /// This measurement's model-state categories.
    pub fn model_states(&self) -> [u64; 4] {
        [
            self.parameters,
            self.gradients,
            self.optimizer_states,
            self.master_weights,
        ]
    }
}

/// What a rank counts (one owner for every counter; see the module docs).
#[derive(Debug)]
pub(crate) struct Meter {
    /// Peak bytes by category.
    pub(super) peak: MeasuredMemory,
    /// The traffic counters' values when the count started (see [`ZeroEngine::traffic`]).
    pub(super) traffic_base: TrafficTable,
    /// Traffic of collectives outside training steps (eval, consolidation).
    pub(super) other_traffic: TrafficTable,
    /// `(steps, skipped)` when the traffic count started: 0 at build, the checkpoint's after a
    /// load.
    pub(crate) steps_base: (u64, u64),
    /// Steps skipped (fp16 overflow).
    pub(super) skipped: u64,
    /// Gradient bytes packed by the `DeviceTensors` hook.
    pub(super) device_grad_bytes: u64,
    /// Weight bytes installed from the communicator's memory by the `DeviceTensors` hook.
    pub(super) device_weight_bytes: u64,
    /// Stage 3: real elements of the gathered units installed in the model.
    pub(super) gathered_elems: u64,
    /// Stage 3: bytes of the buffers the installed units were gathered into (their capacities).
    pub(super) gathered_bytes: u64,
    /// Stage 3: per unit, the bytes of the buffer it was installed from (0 when released).
    pub(super) unit_gathered_bytes: Vec<u64>,
    /// The peak bytes in use that the model's device's memory pools counted at the samples (`None`
    /// on flex; see [`RankReport::device_peak_bytes`](super::RankReport::device_peak_bytes)).
    pub(super) device_peak: Option<u64>,
}

impl Meter {
    /// Nothing counted yet, for a plan of `units` units.
    pub(super) fn new(units: usize) -> Self {
        Meter {
            peak: MeasuredMemory::default(),
            traffic_base: TrafficTable::new(),
            other_traffic: TrafficTable::new(),
            steps_base: (0, 0),
            skipped: 0,
            device_grad_bytes: 0,
            device_weight_bytes: 0,
            gathered_elems: 0,
            gathered_bytes: 0,
            unit_gathered_bytes: vec![0; units],
            device_peak: None,
        }
    }
}

impl<C: Communicator, M: Segmented> ZeroEngine<C, M> {
    /// Peak measured memory so far.
    pub(crate) fn measured_memory(&self) -> MeasuredMemory {
        let mut m = self.core.meter.peak;
        // The codecs' wire buffers keep their capacity: they coexist with the reduction buffers.
        let c = &self.comms;
        m.communication_buffers +=
            (c.qwz_scratch.peak_wire_bytes() + c.qgz_scratch.peak_wire_bytes()) as u64;
        m.model_states_bytes = m.parameters + m.gradients + m.optimizer_states + m.master_weights;
        m
    }

    /// The peak bytes in use on the model's device
    /// ([`RankReport::device_peak_bytes`](super::RankReport::device_peak_bytes)).
    pub(crate) fn device_memory_peak(&self) -> Option<u64> {
        self.core.meter.device_peak
    }

    /// With NVMe placement, what the NVMe stores (the optimizer's, the parameters') moved
    /// together (in [`Self::report`]).
    pub(crate) fn nvme_io(&self) -> Option<crate::IoReport> {
        match (self.core.opt.io(), self.core.sharded.io_report()) {
            (Some(a), Some(b)) => Some(a.plus(b)),
            (a, b) => a.or(b),
        }
    }
}

impl<C: Communicator, M: Segmented> Core<C, M> {
    pub(super) fn track_comm_buffer(&mut self, bytes: u64) {
        self.meter.peak.communication_buffers = self.meter.peak.communication_buffers.max(bytes);
    }

    pub(super) fn sample_memory(&mut self) {
        let stage3 = self.plan.stage() == 3;
        let gathered: u64 = if stage3 { self.meter.gathered_elems } else { 0 };
        let model_elems = params::resident_elems(&self.model);
        let resident = model_elems - gathered;
        // The working weights' bytes per element: 4 in fp32, 2 in bf16/fp16 (where burn's f32
        // copies hold 2 more, reported as `f32_compute_copies`).
        let half = self.half().is_some();
        let w = if half { 2 } else { 4 };
        if let Some(usage) = self.device.memory_pool_usage() {
            let peak = self.meter.device_peak.get_or_insert(0);
            *peak = (*peak).max(usage.bytes_in_use);
        }
        let p = &mut self.meter.peak;
        // The engine's own buffers count as allocated (capacities); burn's tensors by elements.
        let (shard, secondary) = self.sharded.bytes();
        p.parameters = p.parameters.max(resident * w + shard);
        // The canonical tree's pending subtrees are gradient accumulators too (not in the plan).
        p.gradients = p.gradients.max(self.acc.bytes());
        p.optimizer_states = p.optimizer_states.max(self.opt.bytes(false));
        p.master_weights = p.master_weights.max(self.opt.bytes(true));
        if half {
            p.f32_compute_copies = p.f32_compute_copies.max(model_elems * 2);
        }
        p.hpz_secondary = p.hpz_secondary.max(secondary);
    }
}
