//! The memory model: bytes per rank by category.
//!
//! Categories (per rank, bytes):
//! - `parameters`: working-precision weights resident between steps. Stages 0–2: the whole model.
//!   Stage 3: the rank's shard, plus full copies of persistent parameters and of the buffers.
//! - `gradients`: the gradient accumulator, in the working precision (or fp32 with
//!   `grad_accum_dtype = fp32`). Stage 0 (and stage 1 with
//!   `accumulate_before_reduce`, DeepSpeed's behaviour): the whole flat buffer of trainable units.
//!   Otherwise the rank's trainable shard: reducing every micro-step, stage 1 needs no more.
//! - `optimizer_states`: fp32 optimizer state (Adam: m and v, 8 B/element). Stage 0: the whole
//!   flat buffer of trainable units; stages 1–3: the trainable shard.
//! - `master_weights`: fp32 master copy in mixed precision (4 B/element), sized like the optimizer
//!   state. Zero in fp32, where the weight is the master.
//! - `hpz_secondary`: stage 3 with hpZ: `len/hpz` elements of every gather unit (2Ψ/hpz for 16-bit
//!   weights).
//! - `gathered_working_set`: stage 3: the peak of gathered units alive at once: a module's units,
//!   the shared units (tied weights) still kept, and one prefetched unit when
//!   `prefetch_bucket_size` and `max_live_parameters` allow it (see [`crate::GatherOrder`]).
//! - `communication_buffers`: the flat gradient buffer a bucket or unit is reduced from (doubled
//!   with `overlap_comm`), and the int8/int4 wire buffers of qwZ/qgZ.
//! - `offload_buffers`: the NVMe ring in host memory: `offload_buffer_count` buffers (at most
//!   one per unit), each the largest unit's offloaded state (optimizer: its moments and masters;
//!   stage 3 parameters: its chunk). Zero without NVMe placement.
//!
//! `model_states_bytes` is the ZeRO paper's figure: parameters + gradients + optimizer states +
//! master weights. Activations are not modelled.
//!
//! Placement: every category is on the model's device except what the configuration offloads.
//! `optimizer_placement = host` puts `optimizer_states`, `master_weights` and the `gradients` the
//! optimizer reads in host memory (ZeRO-Offload); `nvme` puts the first two on disk and keeps the
//! gradients in host memory (ZeRO-Infinity). `param_placement` moves stage 3's parameter shard
//! (`shard_len` elements of `parameters`) to host memory or disk. `device_bytes`, `host_bytes` and
//! `disk_bytes` split `total_bytes`.

use serde::Serialize;

use crate::config::Placement;
use crate::plan::{Plan, UnitKind};
use crate::quant_wire::{int4_wire_len, int8_wire_len};

/// Bytes per rank by category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemoryModel {
    /// Working-precision weights.
    pub parameters: u64,
    /// Working-precision gradients.
    pub gradients: u64,
    /// Optimizer state.
    pub optimizer_states: u64,
    /// fp32 master weights (mixed precision).
    pub master_weights: u64,
    /// hpZ secondary shard.
    pub hpz_secondary: u64,
    /// Peak gathered parameters (stage 3).
    pub gathered_working_set: u64,
    /// Reduction and quantization buffers.
    pub communication_buffers: u64,
    /// The NVMe ring's host buffers.
    #[serde(skip_serializing_if = "is_zero")]
    pub offload_buffers: u64,
    /// parameters + gradients + optimizer states + master weights.
    pub model_states_bytes: u64,
    /// Sum of every category.
    pub total_bytes: u64,
    /// The part of `total_bytes` in host memory: what the placements offload there, and the NVMe
    /// ring; zero when nothing is offloaded.
    #[serde(skip_serializing_if = "is_zero")]
    pub host_bytes: u64,
    /// The part of `total_bytes` on NVMe; zero without NVMe placement.
    #[serde(skip_serializing_if = "is_zero")]
    pub disk_bytes: u64,
    /// The part of `total_bytes` on the model's device.
    pub device_bytes: u64,
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

impl MemoryModel {
    /// The categories as (name, bytes) rows, in a fixed order.
    pub fn rows(&self) -> [(&'static str, u64); 8] {
        [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer_states", self.optimizer_states),
            ("master_weights", self.master_weights),
            ("hpz_secondary", self.hpz_secondary),
            ("gathered_working_set", self.gathered_working_set),
            ("communication_buffers", self.communication_buffers),
            ("offload_buffers", self.offload_buffers),
        ]
    }
}

impl Plan {
    /// The memory model of one rank. Every rank allocates the same (chunks are equal).
    pub fn memory(&self) -> MemoryModel {
        let c = self.config();
        let w = self.working_bytes();
        // The gradient accumulator: 16-bit, or fp32 with `grad_accum_dtype = fp32`.
        let g = self.grad_accum_bytes();
        let k = c.optimizer.state_bytes();
        let master = if self.mixed_precision() { 4 } else { 0 };
        let n = self.world_size() as u64;
        let units = self.units();
        let psi = self.model().numel();
        let shard_t: u64 = units
            .iter()
            .filter(|u| u.trainable)
            .map(|u| u.len / n)
            .sum();
        // The flat (padded) length of the trainable units: full-size gradient buffers.
        let flat_t: u64 = units.iter().filter(|u| u.trainable).map(|u| u.len).sum();
        let mut m = MemoryModel::default();
        match c.stage {
            0 => {
                m.parameters = psi * w;
                m.gradients = flat_t * g;
                m.optimizer_states = flat_t * k;
                m.master_weights = flat_t * master;
            }
            1 | 2 => {
                m.parameters = psi * w;
                // Stage 1 keeps full gradients only when it accumulates before reducing
                // (DeepSpeed's behaviour); reducing every micro-step leaves just the shard.
                let full = c.stage == 1 && c.accumulate_before_reduce;
                m.gradients = if full { flat_t * g } else { shard_t * g };
                m.optimizer_states = shard_t * k;
                m.master_weights = shard_t * master;
            }
            _ => {
                let persistent: u64 = units
                    .iter()
                    .filter(|u| u.kind == UnitKind::Persistent)
                    .map(|u| u.numel)
                    .sum();
                // Buffers are in no unit: every rank holds them whole.
                m.parameters = (self.shard_len() + persistent + self.model().buffer_numel()) * w;
                m.gradients = shard_t * g;
                m.optimizer_states = shard_t * k;
                m.master_weights = shard_t * master;
                if let Some(h) = self.hpz() {
                    m.hpz_secondary = units
                        .iter()
                        .filter(|u| u.kind == UnitKind::Gather)
                        .map(|u| u.len / h.size as u64)
                        .sum::<u64>()
                        * w;
                }
                m.gathered_working_set = self.peak_gathered() * w;
            }
        }
        // Reduction buffer: the largest trainable unit's gradients, flattened.
        let max_t = units
            .iter()
            .filter(|u| u.trainable)
            .map(|u| u.len)
            .max()
            .unwrap_or(0);
        let copies = if c.overlap_comm { 2 } else { 1 };
        m.communication_buffers = max_t * w * copies;
        if c.stage == 3 {
            let max_g = units
                .iter()
                .filter(|u| u.kind == UnitKind::Gather)
                .map(|u| u.len / n)
                .max()
                .unwrap_or(0);
            if c.quantized_weights {
                // Own encoded chunk plus the gathered wire buffer: over the world (chunks of
                // len/N), or with hpZ over the group of h (the backward's secondary chunks of
                // len/h), whichever is larger.
                let b = c.qwz_block_size as u64;
                let mut wire = (n + 1) * int8_wire_len(max_g, b);
                if let Some(h) = self.hpz() {
                    let h = h.size as u64;
                    let max_s = units
                        .iter()
                        .filter(|u| u.kind == UnitKind::Gather)
                        .map(|u| u.len / h)
                        .max()
                        .unwrap_or(0);
                    wire = wire.max((h + 1) * int8_wire_len(max_s, b));
                }
                m.communication_buffers += wire;
            }
            if c.quantized_gradients {
                let max_tc = units
                    .iter()
                    .filter(|u| u.kind == UnitKind::Gather && u.trainable)
                    .map(|u| u.len / n)
                    .max()
                    .unwrap_or(0);
                // Send and receive buffers of the intra-node all-to-all (N chunks each).
                m.communication_buffers += 2 * n * int4_wire_len(max_tc, c.qgz_block_size as u64);
            }
        }
        m.offload_buffers = self.offload_ring();
        m.model_states_bytes = m.parameters + m.gradients + m.optimizer_states + m.master_weights;
        m.total_bytes = m.rows().iter().map(|(_, b)| b).sum();
        self.place(&mut m);
        m
    }

    /// Splits `m.total_bytes` into device, host and disk bytes by the configuration's placements.
    fn place(&self, m: &mut MemoryModel) {
        let c = self.config();
        let mut at = |p: Placement, bytes: u64| match p {
            Placement::Device => {}
            Placement::Host => m.host_bytes += bytes,
            Placement::Nvme => m.disk_bytes += bytes,
        };
        let opt = c.optimizer_placement;
        at(opt, m.optimizer_states + m.master_weights);
        if opt.is_offloaded() {
            // The optimizer reads the gradients where it runs: on the CPU.
            at(Placement::Host, m.gradients);
        }
        if c.stage == 3 {
            at(c.param_placement, self.shard_len() * self.working_bytes());
        }
        at(Placement::Host, m.offload_buffers);
        m.device_bytes = m.total_bytes - m.host_bytes - m.disk_bytes;
    }

    /// The NVMe ring: `offload_buffer_count` host buffers (no more than there are units to hold),
    /// each the largest unit's state that placement puts on NVMe.
    fn offload_ring(&self) -> u64 {
        let c = self.config();
        let n = self.world_size() as u64;
        let units = self.units();
        let mut unit = 0;
        let mut held = 0;
        if c.optimizer_placement == Placement::Nvme {
            held = units.iter().filter(|u| u.trainable).count();
            let master = if self.mixed_precision() { 4 } else { 0 };
            let per = c.optimizer.state_bytes() + master;
            // The rank's slot: the whole unit at stage 0, else its chunk.
            let slot = |len: u64| if c.stage == 0 { len } else { len / n };
            let max_t = units.iter().filter(|u| u.trainable).map(|u| slot(u.len));
            unit += max_t.max().unwrap_or(0) * per;
        }
        if c.stage == 3 && c.param_placement == Placement::Nvme {
            let max_c = units.iter().map(|u| u.len / n).max().unwrap_or(0);
            unit += max_c * self.working_bytes();
            held = units.len();
        }
        unit * u64::from(c.offload_buffer_count).min(held as u64)
    }

    /// Whether a gather unit of `next` elements may be prefetched while one of `current` is live.
    pub fn may_prefetch(&self, current: u64, next: u64) -> bool {
        let c = self.config();
        next <= c.prefetch_bucket_size && current + next <= c.max_live_parameters
    }
}
