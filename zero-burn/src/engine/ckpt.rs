//! The engine's checkpoint access: the only internals [`crate::checkpoint`] reaches.

use std::collections::HashMap;
use std::ops::Range;

use zero_comm::Communicator;
use zero_core::UnitKind;

use super::{Core, Part, ZeroEngine};
use crate::error::Result;
use crate::optim::Optimizer;
use crate::params;
use crate::precision::LossScaler;
use crate::reduction::Reduction;
use crate::segmented::Segmented;

/// The engine's step counters and fp16 loss-scaler state (scale, hysteresis, iter, last
/// overflow), as the engine hands them out and takes them back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Scalars {
    pub(crate) step: u64,
    pub(crate) opt_steps: u64,
    pub(crate) skipped: u64,
    pub(crate) scaler: Option<(f64, u32, i64, i64)>,
}

impl<C: Communicator, M: Segmented> ZeroEngine<C, M> {
    /// The world communicator, for the checkpoint's own collectives.
    pub(crate) fn ckpt_world(&mut self) -> &mut C {
        &mut self.comms.world
    }
}

/// Checkpoint access (see [`crate::checkpoint`]): what a rank saves, what it needs back, and the
/// restore. Kept in one block so the checkpoint code needs nothing else of the engine's internals.
impl<C: Communicator, M: Segmented> Core<C, M> {
    /// Micro-steps run since the last optimizer step (0 at a step boundary).
    pub(crate) fn ckpt_micro(&self) -> u32 {
        self.clock.micro
    }

    /// The step counters and the loss scaler's state.
    pub(crate) fn ckpt_scalars(&self) -> Scalars {
        Scalars {
            step: self.clock.step,
            opt_steps: self.opt.steps,
            skipped: self.meter.skipped,
            scaler: self.opt.scaler.as_ref().map(LossScaler::state),
        }
    }

    /// The engine's options: the optimizer and the reduction order.
    pub(crate) fn ckpt_options(&self) -> (Optimizer, Reduction) {
        (self.options.optimizer, self.options.reduction)
    }

    /// Marks the state partly restored by a failed load (`Some(why)`), or whole again (`None`).
    pub(crate) fn ckpt_partly_restored(&mut self, why: Option<String>) {
        self.clock.partly_restored = why;
    }

    /// [`Error::PartlyRestored`] while a failed load left the state partly restored.
    pub(crate) fn check_restored(&self) -> Result<()> {
        match &self.clock.partly_restored {
            None => Ok(()),
            Some(cause) => Err(crate::Error::PartlyRestored {
                rank: self.rank,
                cause: cause.clone(),
            }),
        }
    }

    /// The lengths of what [`Self::ckpt_unit_state`] returns for unit `u`, without copying it.
    pub(crate) fn ckpt_unit_lens(&self, u: usize) -> [usize; 3] {
        let real = self.plan.real_in_chunk(u, self.rank) as usize;
        let state = |part| match self.layout.opt_offset[u] {
            Some(_) if self.opt.has(part) => real,
            _ => 0,
        };
        [real, state(Part::M), state(Part::V)]
    }

    /// This rank's saved state `s` of unit `u` (0: weights, 1: `m`, 2: `v`): the real elements
    /// of its chunk of the fp32 weights (the master in bf16/fp16; the widened 16-bit shard for a
    /// frozen stage-3 unit in bf16/fp16), or of the optimizer's `m` or `v` (empty when absent or
    /// frozen). One at a time, so a save holds one copy.
    pub(crate) fn ckpt_unit_state(&self, u: usize, s: usize) -> Result<Vec<f32>> {
        let plan = &self.plan;
        let c = plan.chunk_len(u) as usize;
        let real = plan.real_in_chunk(u, self.rank) as usize;
        let stage = plan.stage();
        // Start of this rank's chunk in the unit's optimizer slot.
        let at = if stage == 0 { self.rank * c } else { 0 };
        let state = |part| match self.layout.opt_offset[u] {
            Some(_) => self.opt.read(u, part, at..at + real),
            None => Ok(Vec::new()),
        };
        Ok(match s {
            1 => state(Part::M)?,
            2 => state(Part::V)?,
            _ => match (self.layout.opt_offset[u], self.half()) {
                (Some(_), Some(_)) => state(Part::Master)?,
                _ if stage == 3 => self.sharded.read_f32(u, real)?,
                _ => self.read_unit_range(u, self.rank * c..self.rank * c + real)?,
            },
        })
    }

    /// The parts of unit `u` (as element ranges of the unit) this rank needs back: the weights
    /// (the whole unit where the model holds it, else the rank's chunk) and the optimizer state
    /// (the whole unit at stage 0, else the chunk; `None` when frozen).
    pub(crate) fn ckpt_needs(
        &self,
        u: usize,
    ) -> (std::ops::Range<u64>, Option<std::ops::Range<u64>>) {
        let plan = &self.plan;
        let unit = &plan.units()[u];
        let c = plan.chunk_len(u);
        let chunk = self.rank as u64 * c..(self.rank as u64 + 1) * c;
        let in_model = plan.stage() < 3 || unit.kind == UnitKind::Persistent;
        let w = if in_model { 0..unit.len } else { chunk.clone() };
        let opt = self.layout.opt_offset[u].map(|_| {
            if plan.stage() == 0 {
                0..unit.len
            } else {
                chunk
            }
        });
        (w, opt)
    }

    /// The values of parameter `param`, which is in no unit (frozen, stages 0–2), as the model
    /// holds them (in bf16/fp16 the working weights, widened).
    pub(crate) fn ckpt_loose(&self, param: usize) -> Result<Vec<f32>> {
        let want = HashMap::from([(self.params[param].id, 0)]);
        Ok(params::read_values(&self.model, &want)?
            .pop()
            .unwrap_or_default())
    }

    /// Restores parameter `param`, which is in no unit, into the model from `values` (rounded to
    /// the working precision in bf16/fp16, as the build does: values saved by a run of that
    /// precision come back bit for bit).
    pub(crate) fn ckpt_restore_loose(&mut self, param: usize, mut values: Vec<f32>) {
        if let Some(h) = self.half() {
            values.iter_mut().for_each(|x| *x = h.quantize(*x));
        }
        let p = &self.params[param];
        let update = HashMap::from([(p.id, (values, p.shape.clone(), p.trainable))]);
        self.set_params(update);
    }

    /// Restores the state [`Self::ckpt_needs`] asked for, which `fill(u, state, range, dst)`
    /// decodes: elements `range` (offsets in unit `u`) of `state` (0: weights, 1: `m`, 2: `v`)
    /// into `dst`, of the range's length (padding stays as `dst` holds it, zero). `m`, `v` and a
    /// stage-3 fp32 shard are filled in place; the weights the model holds a few parameters at a
    /// time (up to the largest parameter's size, then written into the model), so besides the
    /// engine's own state the restore holds about two parameters' values (state on a device
    /// takes one unit's moment or shard chunk through host memory). Only
    /// called after everything was read and verified. Derived state (16-bit working weights, the
    /// model's resident tensors, stage-3 16-bit shards) is recomputed from the fp32 values.
    pub(crate) fn ckpt_restore(
        &mut self,
        mut fill: impl FnMut(usize, usize, Range<u64>, &mut [f32]) -> Result<()>,
        scalars: Scalars,
    ) -> Result<()> {
        let plan = self.plan.clone();
        let stage = plan.stage();
        // New model values wait in `pending` until they reach the largest parameter's size, so
        // the model is mapped about once per that many bytes, never holding more.
        let budget = plan
            .model()
            .params
            .iter()
            .map(|p| 4 * p.numel())
            .max()
            .unwrap_or(0);
        let mut pending: params::NewValues = HashMap::new();
        let mut pending_bytes = 0u64;
        for (u, unit) in plan.units().iter().enumerate() {
            let (wr, or) = self.ckpt_needs(u);
            let in_model = stage < 3 || unit.kind == UnitKind::Persistent;
            let c = plan.chunk_len(u) as usize;
            let chunk = self.rank as u64 * c as u64..(self.rank as u64 + 1) * c as u64;
            // The optimizer's moments of the range in place (an optimizer without a moment
            // keeps that buffer empty).
            if let Some(or) = or.clone() {
                for (state, part) in [(1, Part::M), (2, Part::V)] {
                    self.opt
                        .fill(u, part, |dst| fill(u, state, or.clone(), dst))?;
                }
            }
            if !in_model {
                // A stage-3 gather unit: the rank's chunk is the shard (the fp32 master).
                match self.half() {
                    None => self
                        .sharded
                        .f32_mut(u, None)?
                        .fill(|w| fill(u, 0, chunk.clone(), w))?,
                    Some(_) => {
                        let mut w = vec![0.0; c];
                        fill(u, 0, chunk.clone(), &mut w)?;
                        // A frozen unit keeps no master: nothing is written.
                        self.opt.write(u, Part::Master, 0, &w)?;
                        self.sharded.write(u, 0, &w)?;
                    }
                }
                continue;
            }
            // The weights the model holds, one parameter at a time: into the model, and where
            // the parameter overlaps them, the fp32 master (bf16/fp16; zeroed first) and the
            // stage-3 shard.
            let master = or.clone().filter(|_| self.half().is_some());
            if master.is_some() {
                self.opt.fill(u, Part::Master, |_| Ok(()))?;
            }
            if stage == 3 {
                self.sharded.zero(u)?;
            }
            for e in plan.unit_entries(u) {
                let range = e.offset..e.offset + e.numel;
                debug_assert!(wr.start <= range.start && range.end <= wr.end);
                let mut w = vec![0.0; e.numel as usize];
                fill(u, 0, range.clone(), &mut w)?;
                let overlap = |r: &Range<u64>| {
                    let (a, b) = (range.start.max(r.start), range.end.min(r.end));
                    (a < b).then(|| ((a - range.start) as usize, (b - range.start) as usize, a))
                };
                if let Some(or) = master.as_ref()
                    && let Some((a, b, at)) = overlap(or)
                {
                    self.opt
                        .write(u, Part::Master, (at - or.start) as usize, &w[a..b])?;
                }
                if stage == 3
                    && let Some((a, b, at)) = overlap(&chunk)
                {
                    let at = (at - chunk.start) as usize;
                    self.sharded.write(u, at, &w[a..b])?;
                }
                if let Some(h) = self.half() {
                    w.iter_mut().for_each(|x| *x = h.quantize(*x));
                }
                let p = &self.params[e.param];
                pending_bytes += 4 * e.numel;
                pending.insert(p.id, (w, p.shape.clone(), p.trainable));
                if pending_bytes >= budget {
                    self.set_params(std::mem::take(&mut pending));
                    pending_bytes = 0;
                }
            }
        }
        if !pending.is_empty() {
            self.set_params(pending);
        }
        // NVMe placement: the restored state is in the store before the load reports success.
        self.opt.settle()?;
        self.sharded.settle()?;
        self.clock.step = scalars.step;
        self.opt.steps = scalars.opt_steps;
        self.meter.skipped = scalars.skipped;
        // The measured traffic counts from the engine's build: so does the planned.
        self.meter.steps_base = (scalars.step, scalars.skipped);
        if let (Some(s), Some(state)) = (self.opt.scaler.as_mut(), scalars.scaler) {
            s.set_state(state);
        }
        self.sharded.clear_secondaries();
        Ok(())
    }
}
