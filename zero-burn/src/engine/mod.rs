//! The engine: one rank's [`ZeroEngine`] executes a [`Plan`] over one communicator.
//!
//! With activation checkpointing (`ZeroConfig::checkpoint_activations`, by default on at stage 3
//! only) one micro-step runs the model segment by segment (see [`crate::segmented`]):
//!
//! 1. **Forward.** For each segment: at stage 3, all-gather its gather units (prefetching the next
//!    unit when the plan allows), run it, keep only its output activation, release the units
//!    (keeping the hpZ secondary slice).
//! 2. **Backward**, segments in reverse: at stage 3 gather again (from the hpZ group when hpZ is
//!    on), recompute the segment under autodiff from its saved input, backpropagate the incoming
//!    activation gradient, add the parameter gradients into their units, release. Every unit whose
//!    gradients are now complete is reduced right away: an all-reduce (stage 0) or a reduce-scatter
//!    (stages 1–3) with the mean over ranks, and the result is added into the gradient accumulator.
//!
//! Without it, one autodiff graph spans every segment (stage 3: each segment's units gathered
//! before it runs and kept until the backward is done), one backward computes every gradient, and
//! the units are then reduced in the same order, last segment first.
//!
//! 3. After the last micro-step: the global norm (if clipping), the optimizer on the local shard,
//!    and the post-step all-gathers (stages 1–2: every bucket; stage 3: persistent units).
//!
//! In bf16/fp16 (see [`crate::precision`]) the gathered and reduced elements are 16-bit, the
//! accumulator is 16-bit (or f32 with `grad_accum_dtype = fp32`, the reduced words widened into
//! it), and step 3 widens the gradients, unscales them (fp16), checks for overflow (fp16: every
//! rank skips the step together) and steps the fp32 master, whose rounding is the new working
//! weights.
//!
//! With the same checkpointing choice every stage performs the same floating-point operations in
//! the same order; only where the bytes live changes. With fp32 and the host loopback's
//! rank-ordered reduction, stages 0–3 are bit-identical (invariant I1). With
//! [`Reduction::CanonicalTree`] the micro-step gradients are summed unscaled over the canonical
//! pairwise tree instead, and divided once by `N·A` before step 3, which makes the bits
//! independent of the world size too (see [`crate::reduction`]).
//!
//! # Files
//!
//! - `mod.rs`: `ZeroEngine` (the rank's communicators beside its `Core`, everything else), its
//!   accessors, `step`, `eval`; `Clock` (steps, micro-steps, the last step's losses, a failed
//!   load).
//! - `builder.rs`: `EngineBuilder`, the public way to build an engine.
//! - `report.rs`: `RankReport` (measured and booked against the plan), `consolidated_model`.
//! - `build.rs`: every check, once; the cross-rank agreement; the initial shards and master.
//! - `layout.rs`: `RankLayout`: each parameter's segment, each segment's units, the accumulator
//!   and optimizer offsets, each unit's reduction (all-reduce, reduce-scatter or qgZ) and
//!   backward gather group, read from `Plan::schedule()`. Pure and immutable once built.
//! - `micro.rs`: the micro-step driver (forward and backward over the segments).
//! - `submit.rs`: what the micro-step submits to the executor (reductions, gathers and prefetch)
//!   and the results applied; with `micro.rs`, the only code that talks to the executor.
//! - `step.rs`: one optimizer step for fp32, bf16 and fp16: finish the gradients, the global
//!   norm, the update of each unit's fp32 master wherever it lives, publish.
//! - `grads.rs`: a segment's gradients into the units' buffers (shared ones summed), on the
//!   device where a unit's are packed there; `step_grads`.
//! - `guard.rs`: the recompute guard and the read guard around the user's forwards.
//! - `grad_acc.rs`: `GradAcc`, the one owner of the reduced gradients (a variant per precision
//!   and reduction), and `GradView`, what the optimizer step reads of it.
//! - `weights.rs`: reading, writing, installing and releasing units of the model.
//! - `train_mode.rs`: the seeded forwards and the model's buffers (snapshot, restore, sync).
//! - `opt_state.rs`, `opt_unit.rs`: the optimizer's state of the rank, and of one unit.
//! - `slab.rs`: `Place` (host memory or a device: where a buffer lives), `Buf<T>`, the one flat
//!   buffer at a place, and `Slab = Buf<f32>` (optimizer state, stage 3's fp32 `Shard` and hpZ
//!   slices, the fp32 accumulator).
//! - `words.rs`: `Words = Buf<u16>`, a 16-bit type's words (stage 3's shard and hpZ slices,
//!   accumulator).
//! - `sharded.rs`, `shard_disk.rs`: `Stage3Weights`, the one owner of stage 3's weights between
//!   uses, and their NVMe store.
//! - `memory.rs`: `Meter`, the one owner of every counter, and `MeasuredMemory`.
//! - `ckpt.rs`: the `ckpt_*` methods, the only internals `checkpoint` reaches.

use std::sync::Arc;

use serde::Serialize;
use zero_comm::Communicator;
use zero_core::{Plan, TrafficTable};

use crate::comms::{self, Comms, Exec};
use crate::device::{DeviceQuant, DeviceTensors};
use crate::error::{Error, Result};
use crate::optim::Optimizer;
use crate::params::{self, ParamInfo};
use crate::precision::{Half, LossScaler, StepInfo};
use crate::reduction::Reduction;
use crate::segmented::Segmented;
use grad_acc::GradAcc;
use layout::RankLayout;
use opt_state::{OptState, Part};
use sharded::Stage3Weights;

mod build;
mod builder;
mod ckpt;
mod grad_acc;
mod grads;
mod guard;
mod layout;
mod memory;
mod micro;
mod opt_state;
mod opt_unit;
mod report;
mod shard_disk;
mod sharded;
mod slab;
mod step;
mod submit;
mod train_mode;
mod weights;
mod words;

pub use builder::EngineBuilder;
pub(crate) use ckpt::Scalars;
pub use memory::MeasuredMemory;
use memory::Meter;
pub use report::RankReport;
pub use train_mode::BufferSync;

/// The engine's options that are not part of the ZeRO plan (set through
/// [`EngineBuilder`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct EngineOptions {
    /// Optimizer.
    pub(crate) optimizer: Optimizer,
    /// How gradients are summed over micro-steps and ranks.
    pub(crate) reduction: Reduction,
    /// The base seed of the segments' forwards (see [`crate::rng`]).
    pub(crate) seed: u64,
    /// How buffers are kept equal across ranks.
    pub(crate) buffers: BufferSync,
    /// Whether recomputes are compared with their forwards (see `guard`).
    pub(crate) recompute_check: bool,
}

/// What one optimizer step did.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepOutput {
    /// This rank's mean loss over its micro-batches (unscaled).
    pub loss: f32,
    /// This rank's loss of each micro-batch, in order (unscaled): what
    /// [`crate::demo::run::global_losses`] sums over the canonical tree.
    pub micro_losses: Vec<f32>,
    /// Skipped or not (fp16 overflow), the loss scale, and the global gradient norm.
    pub info: StepInfo,
}

/// A unit's gradients collected during the backward: in host memory, packed in the
/// communicator's memory by a [`DeviceTensors`] hook (fp32), or in bf16/fp16 an f32 tensor on
/// the model's device, rounded there and handed to the hook when the unit is complete.
enum Pending<B> {
    Host(Vec<f32>),
    Device(B),
    Tensor(Half, Box<burn::tensor::Tensor<1>>),
}

/// Where a stage-3 unit's full weights are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UnitStatus {
    /// Only this rank's shard is kept; the model holds placeholders.
    Released,
    /// Its all-gather is submitted, not yet installed.
    Fetching,
    /// Installed in the model.
    Installed,
}

/// A collective in flight during a micro-step: what to do with its result.
#[derive(Clone, Copy, Debug)]
enum Ticket {
    /// Install gathered unit `u` (keeping the hpZ secondary slice after a forward gather).
    Gather { u: usize, backward: bool },
    /// Reduced gradients for the accumulator at `off`: added (or pushed into the canonical
    /// tree), or written over the slot's start (`accumulate_before_reduce`). `bytes`: the
    /// gradient buffer in flight.
    Reduce {
        off: usize,
        overwrite: bool,
        bytes: u64,
    },
}

/// One rank's engine: executes a [`Plan`] for a [`Segmented`] burn model over one communicator.
/// Built by [`EngineBuilder`]; the caller owns the loop and the data and calls
/// [`ZeroEngine::step`] once per optimizer step.
#[derive(Debug)]
pub struct ZeroEngine<C: Communicator, M: Segmented> {
    /// The rank's communicators: borrowed by the executor during a micro-step (by the
    /// communication thread when overlapped), by the optimizer step for its collectives.
    comms: Comms<C>,
    /// Everything else: what a micro-step works on while the executor holds the communicators.
    pub(crate) core: Core<C, M>,
}

/// A rank's engine less its communicators: the model and every part of its sharded state.
#[derive(Debug)]
pub(crate) struct Core<C: Communicator, M: Segmented> {
    plan: Arc<Plan>,
    rank: usize,
    /// Packs gradients in, and installs gathered weights from, the communicator's memory (the
    /// wgpu path's zero-copy bridge, or burn-cuda's `cuda::CudaTensors`).
    device_tensors: Option<Box<dyn DeviceTensors<C>>>,
    model: M,
    /// The model's device: the one whose generator the segments' forwards seed.
    device: burn::tensor::Device,
    options: EngineOptions,
    /// Parameter infos, indexed like the plan's model.
    params: Vec<ParamInfo>,
    /// Where the rank's state lives (immutable after build).
    layout: RankLayout,
    /// Stage 3: the rank's shard of every unit and the hpZ secondary slices, in the working
    /// precision.
    sharded: Stage3Weights,
    /// The reduced gradients, in the plan's precision and where the plan puts them.
    acc: GradAcc,
    /// The optimizer's state (master weights, moments), the loss scaler and the step count.
    opt: OptState,
    /// Stage 3: where each unit's full weights are (every unit of stages 0–2 stays `Released`:
    /// there the model always holds them).
    status: Vec<UnitStatus>,
    /// Where the rank is: steps, micro-steps, the last step's losses, a failed load.
    clock: Clock,
    /// Which segments' forwards draw random numbers (they are seeded under a lock).
    draws: crate::rng::Draws,
    /// What the rank counts: peak memory, traffic bases, skipped steps, device-hook bytes.
    pub(crate) meter: Meter,
}

impl<C: Communicator, M: Segmented> ZeroEngine<C, M> {
    /// Moves gradients and gathered weights (fp32, and 16-bit words where the hook moves them)
    /// between burn and the communicator's memory through `hook` (see [`DeviceTensors`]) instead
    /// of through host memory. The arithmetic is the same, so are the bits.
    pub(crate) fn with_device_tensors(mut self, hook: Box<dyn DeviceTensors<C>>) -> Self {
        self.core.device_tensors = Some(hook);
        self
    }

    /// Runs qwZ and qgZ on the communicator's memory through `quant` (see [`DeviceQuant`]) where
    /// a [`DeviceTensors`] hook keeps the tensors there. The same bits as the host codecs.
    pub(crate) fn with_device_quant(mut self, quant: Arc<dyn DeviceQuant<C>>) -> Self {
        self.comms.quant = Some(quant);
        self
    }

    /// Gradient bytes packed in the communicator's memory by the [`DeviceTensors`] hook so far
    /// (bytes that never passed through host memory).
    pub(crate) fn device_grad_bytes(&self) -> u64 {
        self.core.meter.device_grad_bytes
    }

    /// Weight bytes the [`DeviceTensors`] hook installed in the model straight from the
    /// communicator's memory so far.
    pub(crate) fn device_weight_bytes(&self) -> u64 {
        self.core.meter.device_weight_bytes
    }

    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.core.rank
    }

    /// The model (stage 3: gather units are released between steps; see
    /// [`Self::consolidated_model`] for the full one).
    pub fn model(&self) -> &M {
        &self.core.model
    }

    /// The plan this engine executes.
    pub fn plan(&self) -> &Arc<Plan> {
        &self.core.plan
    }

    /// Testing aid (hidden from the docs): steps skipped because fp16 gradients overflowed, since
    /// the first step (restored by a load); [`RankReport`] counts those since the build.
    #[doc(hidden)]
    pub fn skipped_steps(&self) -> u64 {
        self.core.meter.skipped
    }

    /// Traffic of collectives outside the plan's schedule: [`Self::eval`], consolidation,
    /// checkpoints and the buffer sync.
    pub(crate) fn other_traffic(&self) -> &TrafficTable {
        &self.core.meter.other_traffic
    }

    pub(crate) fn has_device_tensors(&self) -> bool {
        self.core.device_tensors.is_some()
    }

    /// Runs `f` and books its traffic as [`RankReport::other_traffic`] rather than training
    /// traffic.
    pub(crate) fn untracked<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let before = self.traffic();
        let r = f(self);
        let delta = self.traffic().since(&before);
        self.core.meter.other_traffic.merge(&delta);
        self.core.meter.traffic_base.merge(&delta);
        r
    }

    /// New values for every parameter, indexed like the plan's model.
    pub(crate) fn params_with(&self, values: Vec<Vec<f32>>) -> params::NewValues {
        self.core
            .params
            .iter()
            .zip(values)
            .map(|(p, v)| (p.id, (v, p.shape.clone(), p.trainable)))
            .collect()
    }

    /// The mean loss of `batch` with the current weights: a forward pass only, no gradients and no
    /// optimizer state touched (stage 3 gathers each segment's units and releases them). Its
    /// traffic is booked as [`RankReport::other_traffic`]. Collective at stage 3: every rank must
    /// call it.
    pub fn eval(&mut self, batch: &M::Batch) -> Result<f32> {
        self.eval_output(batch).map(|(loss, _)| loss)
    }

    /// [`Self::eval`] with the model's output for `batch` (what its last segment returned with
    /// [`SegmentOut::LossAnd`](crate::SegmentOut::LossAnd); `None` when it returned only the
    /// loss), computed without autodiff: logits for an accuracy, predictions for a metric.
    pub fn eval_output(&mut self, batch: &M::Batch) -> Result<(f32, Option<M::Output>)> {
        self.untracked(|e| {
            let r = e.with_exec(false, |core, exec| {
                core.forward(exec, batch, false).map(|f| (f.loss, f.output))
            });
            // Nothing of an eval's gathers outlives it: no hpZ secondary (kept for a backward).
            e.core.sharded.clear_secondaries();
            r
        })
    }

    /// Training traffic measured on every communicator of this rank: what moved since the
    /// engine was built, less the build's own collectives and [`RankReport::other_traffic`] (eval,
    /// consolidation, checkpoints, buffer sync).
    pub fn traffic(&self) -> TrafficTable {
        let c = &self.comms;
        let mut t = c.world.traffic().clone();
        if let Some(h) = &c.hpz {
            t.merge(h.traffic());
        }
        if let Some(q) = &c.qgroups {
            t.merge(&q.traffic());
        }
        t.since(&self.core.meter.traffic_base)
    }

    /// Steps taken (skipped fp16 steps included).
    pub fn steps(&self) -> u64 {
        self.core.clock.step
    }

    /// What happened at the last optimizer step: skipped (fp16 overflow) or not, and the loss
    /// scale its backward used.
    pub fn last_step(&self) -> StepInfo {
        self.core.opt.last
    }

    /// fp16: the loss scale the next step will use.
    pub fn loss_scale(&self) -> Option<f64> {
        self.core.opt.scaler.as_ref().map(LossScaler::scale)
    }

    /// Testing aid (hidden from the docs): bf16/fp16: a host copy of this rank's fp32 master
    /// weights (its part of every trainable unit, laid out like the optimizer state); empty in
    /// fp32.
    #[doc(hidden)]
    pub fn master_weights(&self) -> Result<Vec<f32>> {
        let l = &self.core.layout;
        self.core.opt.flat(Part::Master, &l.opt_offset, l.opt_len)
    }

    /// Testing aid (fp16): makes the first element of this rank's reduced gradient shard inf at
    /// the next optimizer step, as an overflow confined to one rank would. Every rank must then
    /// skip that step together. Hidden from the docs.
    #[doc(hidden)]
    pub fn inject_overflow_next_step(&mut self) {
        self.core.opt.inject_overflow = true;
    }

    /// Where this rank's optimizer state (moments, bf16/fp16 master weights) lives: the model's
    /// device, or `None` for host memory (a model on a CPU backend, or
    /// `optimizer_placement = host`).
    pub(crate) fn optimizer_device(&self) -> Option<&burn::tensor::Device> {
        self.core.opt.device()
    }

    /// Testing aid (hidden from the docs): a host copy of this rank's optimizer state: first and
    /// second moment (empty when the optimizer has none), laid out like the master weights.
    #[doc(hidden)]
    pub fn optimizer_state(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let l = &self.core.layout;
        Ok((
            self.core.opt.flat(Part::M, &l.opt_offset, l.opt_len)?,
            self.core.opt.flat(Part::V, &l.opt_offset, l.opt_len)?,
        ))
    }

    /// One optimizer step at learning rate `lr` over this rank's `gradient_accumulation_steps`
    /// micro-batches, in order. Every rank must call it with the same number of batches.
    pub fn step(&mut self, lr: f32, batches: &[M::Batch]) -> Result<StepOutput> {
        let a = self.core.plan.config().gradient_accumulation_steps as usize;
        if batches.len() != a {
            return Err(Error::Invalid {
                field: "batches",
                got: format!("{} micro-batches", batches.len()),
                expected: format!("{a}, the plan's gradient_accumulation_steps"),
            });
        }
        self.core.check_restored()?;
        check_lr(lr)?;
        let mut loss = 0.0f64;
        self.core.clock.micro_losses.clear();
        for batch in batches {
            let l = self.micro_step(batch)?;
            if !l.is_finite() {
                // The other ranks learn of it from this rank's dropped communicator (PeerFailed).
                return Err(Error::Diverged {
                    step: self.core.clock.step + 1,
                    rank: self.core.rank,
                    what: format!("the loss is not finite ({l})"),
                });
            }
            loss += f64::from(l);
            self.core.clock.micro_losses.push(l);
        }
        self.core.optimizer_step(&mut self.comms, lr)?;
        Ok(StepOutput {
            loss: (loss / a as f64) as f32,
            micro_losses: self.core.clock.micro_losses.clone(),
            info: self.core.opt.last,
        })
    }

    /// Runs `f` with the communicators lent to an executor (inline, or on the communication
    /// thread with `overlap`), then applies what is still in flight, or after a failure drops
    /// it with the executor.
    fn with_exec<T>(
        &mut self,
        overlap: bool,
        f: impl FnOnce(&mut Core<C, M>, &mut Exec<'_, C, Ticket>) -> Result<T>,
    ) -> Result<T> {
        let Self { comms, core } = self;
        let r = comms::with_exec(comms, overlap, core.rank, |exec| {
            let v = f(core, exec)?;
            core.settle_all(exec).map(|()| v)
        });
        if r.is_err() {
            for s in &mut core.status {
                if *s == UnitStatus::Fetching {
                    *s = UnitStatus::Released;
                }
            }
        }
        r
    }
}

impl<C: Communicator, M: Segmented> Core<C, M> {
    /// bf16/fp16: the 16-bit working type, as the plan's precision says.
    fn half(&self) -> Option<Half> {
        Half::of(self.plan.config().precision)
    }
}

/// Where a rank is in its training.
#[derive(Debug, Default)]
struct Clock {
    /// Optimizer steps taken (skipped fp16 steps included).
    step: u64,
    /// Micro-steps run since the last optimizer step.
    micro: u32,
    /// The unscaled loss of each micro-step of the last step.
    micro_losses: Vec<f32>,
    /// Why the state is partly restored (a load failed after it began restoring): steps and
    /// saves are refused until a load succeeds.
    partly_restored: Option<String>,
}

/// A learning rate the optimizer step accepts: finite and not negative.
pub(super) fn check_lr(lr: f32) -> Result<()> {
    if lr.is_finite() && lr >= 0.0 {
        return Ok(());
    }
    Err(Error::Invalid {
        field: "lr",
        got: lr.to_string(),
        expected: "a finite learning rate >= 0".into(),
    })
}
