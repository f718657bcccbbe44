//! What a rank measured, in the plan's memory categories.

use serde::{Deserialize, Serialize};
use zero_core::MemoryModel;

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
