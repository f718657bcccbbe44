//! The per-rank trainer: executes a [`Plan`] with one communicator per rank.
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
//! accumulator is 16-bit, and step 3 widens the gradients, unscales them (fp16), checks for
//! overflow (fp16: every rank skips the step together) and steps the fp32 master, whose rounding
//! is the new working weights.
//!
//! With the same checkpointing choice every stage performs the same floating-point operations in
//! the same order; only where the bytes live changes. With fp32 and the host loopback's rank-ordered reduction, stages 0–3 are
//! bit-identical (invariant I1). With [`Reduction::CanonicalTree`] the micro-step gradients are
//! summed unscaled over the canonical pairwise tree instead, and divided once by `N·A` before
//! step 3, which makes the bits independent of the world size too (see [`crate::reduction`]).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use burn::module::ParamId;
use burn::optim::GradientsParams;
use serde::Serialize;
use zero_comm::quantized::{QuantGroups, QuantScratch};
use zero_comm::{Communicator, ReduceOp};
use zero_core::{Plan, TrafficTable, UnitKind};
use zero_quant::{Int4Block, Int8Block};

use crate::comms::{self, Comms, Exec, Job, Out, Words};
use crate::error::{Error, Result};
use crate::optim::{self, OptimState, Optimizer};
use crate::params::{self, ParamInfo};
use crate::precision::{Half, LossScaler, StepInfo};
use crate::reduction::{Reduction, TreeAccumulator};
use crate::segmented::{Activation, SegmentOut, Segmented};

mod ckpt;
mod device;
mod memory;

pub use device::{DeviceQuant, DeviceTensors};
pub use memory::MeasuredMemory;

/// The engine's options that are not part of the ZeRO plan (set through
/// [`crate::EngineBuilder`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct EngineOptions {
    /// Optimizer.
    pub(crate) optimizer: Optimizer,
    /// How gradients are summed over micro-steps and ranks.
    pub(crate) reduction: Reduction,
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

/// A unit's gradients collected during the backward: in host memory, or packed in the
/// communicator's memory by a [`DeviceTensors`] hook.
enum Pending<B> {
    Host(Vec<f32>),
    Device(B),
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

/// The communicators are away only inside [`ZeroEngine::micro_step`], which always takes them
/// back, so every other method finds them home.
const HOME: &str = "the communicators are home between micro-steps";

/// One rank's engine: executes a [`Plan`] for a [`Segmented`] burn model over one communicator.
/// Built by [`crate::EngineBuilder`]; the caller owns the loop and the data and calls
/// [`ZeroEngine::step`] once per optimizer step.
#[derive(Debug)]
pub struct ZeroEngine<C: Communicator, M: Segmented> {
    plan: Arc<Plan>,
    rank: usize,
    /// Packs gradients in, and installs gathered weights from, the communicator's memory (the
    /// wgpu path's zero-copy bridge).
    device_tensors: Option<Box<dyn DeviceTensors<C>>>,
    /// Whether the communicators have [`DeviceQuant`] codecs (so qwZ/qgZ stay on the device).
    device_quant: bool,
    /// Gradient bytes packed by `device_tensors`.
    device_grad_bytes: u64,
    /// Weight bytes installed from the communicator's memory by `device_tensors`.
    device_weight_bytes: u64,
    /// The rank's communicators: away on the communication thread during an overlapped
    /// micro-step, home otherwise (see [`crate::comms`]).
    comms: Option<Comms<C>>,
    model: M,
    options: EngineOptions,
    /// Parameter infos, indexed like the plan's model.
    params: Vec<ParamInfo>,
    /// Segment of every parameter.
    param_segment: Vec<usize>,
    /// Units completed by each segment's backward (min segment of their parameters).
    completes_at: Vec<Vec<usize>>,
    /// Stage-3 gather units used by each segment.
    seg_units: Vec<Vec<usize>>,
    /// Offset of each trainable unit in the gradient accumulator / optimizer state.
    acc_offset: Vec<Option<usize>>,
    /// Offset of each trainable unit in the optimizer state and the master weights (whole units
    /// at stage 0, the rank's chunk otherwise; unlike the accumulator, which stage 1 with
    /// `accumulate_before_reduce` keeps whole).
    opt_offset: Vec<Option<usize>>,
    /// Stage 3 in fp32: the rank's shard of every unit (the fp32 master).
    shard: Vec<f32>,
    /// bf16/fp16: the 16-bit working type.
    half: Option<Half>,
    /// Stage 3 in bf16/fp16: the rank's 16-bit working shard of every unit (what is gathered).
    shard16: Vec<u16>,
    /// bf16/fp16: the fp32 master weights of the rank's part of every trainable unit, laid out
    /// like the optimizer state.
    master: Vec<f32>,
    /// bf16/fp16: the 16-bit gradient accumulator (`acc` is empty).
    acc16: Vec<u16>,
    /// bf16/fp16 with `grad_accum_dtype = fp32`: the reduced 16-bit gradients accumulate in `acc`
    /// (f32) instead of `acc16`.
    acc32: bool,
    /// fp16: the loss scaler.
    scaler: Option<LossScaler>,
    /// Optimizer updates applied (a skipped step does not count: Adam's bias correction).
    opt_steps: u64,
    /// What happened at the last optimizer step.
    last_step: StepInfo,
    /// Testing aid: poison this rank's reduced gradients at the next optimizer step.
    inject_overflow: bool,
    /// Gradient accumulator: stage 0 full units (and stage 1 with accumulate_before_reduce),
    /// otherwise this rank's chunks of trainable units.
    acc: Vec<f32>,
    /// [`Reduction::CanonicalTree`]: the pending subtrees of the micro-step sum beyond `acc`.
    tree: TreeAccumulator,
    opt: OptimState,
    /// hpZ secondary slices per unit (valid between a unit's forward and the optimizer step).
    secondary: Vec<Option<Vec<f32>>>,
    /// bf16/fp16: the same, 16-bit.
    secondary16: Vec<Option<Vec<u16>>>,
    /// Stage 3: units installed in the model.
    gathered: Vec<bool>,
    /// Stage 3: units whose all-gather is submitted but not yet installed.
    fetching: Vec<bool>,
    /// Collectives submitted this micro-step whose results are not yet applied, oldest first.
    inflight: VecDeque<Ticket>,
    step: u64,
    micro: u32,
    /// The unscaled loss of each micro-step of the last step.
    micro_losses: Vec<f32>,
    peak: MeasuredMemory,
    live_gathered: u64,
    traffic_base: TrafficTable,
    /// `(steps, skipped)` when the traffic count started: 0 at build, the checkpoint's after a load.
    pub(crate) steps_base: (u64, u64),
    /// Steps skipped (fp16 overflow).
    skipped: u64,
    /// Traffic of collectives outside training steps (eval, consolidation).
    other_traffic: TrafficTable,
}

/// The global sum of squared gradients, identical on every rank and at every stage: an f64
/// partial per rank over the chunks it owns (`sq(s, at, len)` adds to the running sum `s` the
/// squares of `len` gradient elements from `at` in the accumulator, one by one), summed in rank
/// order. At stage 0 every rank holds every
/// chunk and sums all partials itself; otherwise the partials travel in the plan's 8-byte
/// all-gather.
fn global_sum_sq<C: Communicator>(
    world: &mut C,
    plan: &Plan,
    acc_offset: &[Option<usize>],
    rank: usize,
    sq: impl Fn(f64, usize, usize) -> f64,
) -> Result<f64> {
    let stage = plan.stage();
    let partial = |r: usize| -> f64 {
        let mut s = 0.0f64;
        for (u, unit) in plan.units().iter().enumerate() {
            if !unit.trainable {
                continue;
            }
            let cl = plan.chunk_len(u) as usize;
            let off = acc_offset[u].expect("trainable");
            // Where the unit's reduced chunk r lives in the accumulator.
            let at = if stage == 0 { off + r * cl } else { off };
            s = sq(s, at, cl);
        }
        s
    };
    if stage == 0 {
        return Ok((0..plan.world_size()).map(partial).fold(0.0, |a, b| a + b));
    }
    let all = world.all_gather_host(&partial(rank).to_le_bytes())?;
    Ok(all
        .chunks_exact(8)
        .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
        .fold(0.0, |a, b| a + b))
}

impl<C: Communicator, M: Segmented> ZeroEngine<C, M> {
    /// The engine of this rank. `model` must hold the same initial values on every rank; the
    /// plan must describe it (see [`crate::plan_for`]).
    pub(crate) fn new(
        plan: Arc<Plan>,
        mut world: C,
        model: M,
        options: EngineOptions,
    ) -> Result<Self> {
        let rank = world.rank();
        if world.world_size() != plan.world_size() {
            return Err(Error::Model(format!(
                "the communicator has {} ranks but the plan {}",
                world.world_size(),
                plan.world_size()
            )));
        }
        let half = Half::of(plan.config().precision);
        let acc32 =
            half.is_some() && plan.config().grad_accum_dtype == Some(zero_core::Precision::Fp32);
        if half.is_some() && options.reduction == Reduction::CanonicalTree {
            return Err(Error::Invalid {
                field: "reduction",
                got: format!("canonical_tree with {:?}", plan.config().precision),
                expected: "rank_ordered (the canonical tree is built for fp32 only), or fp32"
                    .into(),
            });
        }
        if plan.config().optimizer != options.optimizer.kind() {
            return Err(Error::Invalid {
                field: "optimizer",
                got: format!("{:?} in the plan", plan.config().optimizer),
                expected: format!("{:?}, the trainer's optimizer", options.optimizer.kind()),
            });
        }
        if options.reduction == Reduction::CanonicalTree {
            check_canonical_tree(&plan, &world)?;
        }
        let params = params::describe(&model);

        let desc = &plan.model().params;
        if desc.len() != params.len()
            || desc
                .iter()
                .zip(&params)
                .any(|(d, p)| d.name != p.path || d.shape != p.shape || d.trainable != p.trainable)
        {
            return Err(Error::Model(
                "the plan was made for a different model (names, shapes or trainable flags differ)"
                    .into(),
            ));
        }
        let segments = model.num_segments();
        let param_segment = crate::segmented::param_segments(&model, &params)?;
        // Every local check is done: now every rank must agree before anything moves.
        crate::engine::check_ranks_agree(&mut world, &plan, &options, &model)?;
        let units = plan.units();
        let mut completes_at = vec![Vec::new(); segments];
        let mut seg_units = vec![Vec::new(); segments];
        let mut acc_offset = vec![None; units.len()];
        let stage = plan.stage();
        let full_acc = stage == 0 || (stage == 1 && plan.config().accumulate_before_reduce);
        let n = plan.world_size();
        let mut acc_len = 0usize;
        let mut opt_offset = vec![None; units.len()];
        let mut opt_len = 0usize;
        for (u, unit) in units.iter().enumerate() {
            let segs: Vec<usize> = plan
                .unit_entries(u)
                .iter()
                .map(|e| param_segment[e.param])
                .collect();
            let lo = *segs.iter().min().expect("units are never empty");
            if unit.trainable {
                completes_at[lo].push(u);
                acc_offset[u] = Some(acc_len);
                acc_len += if full_acc {
                    unit.len as usize
                } else {
                    unit.len as usize / n
                };
                // Optimizer state and master weights: whole units at stage 0, else the chunk.
                opt_offset[u] = Some(opt_len);
                opt_len += if stage == 0 {
                    unit.len as usize
                } else {
                    unit.len as usize / n
                };
            }
            if unit.kind == UnitKind::Gather {
                let hi = *segs.iter().max().expect("units are never empty");
                if lo != hi {
                    return Err(Error::Model(format!(
                        "gather unit {u} spans segments {lo}..={hi}; group parameters by segment"
                    )));
                }
                seg_units[lo].push(u);
            }
        }
        let hpz = if plan.config().hpz() {
            let h = plan.config().hpz_partition_size;
            Some(world.split(rank / h, rank)?)
        } else {
            None
        };
        let qgroups = if plan.config().quantized_gradients {
            Some(QuantGroups::new(&mut world)?)
        } else {
            None
        };
        let qwz = if plan.config().quantized_weights {
            Some(Int8Block::new(plan.config().qwz_block_size)?)
        } else {
            None
        };
        let qgz = if plan.config().quantized_gradients {
            Some(Int4Block::new(plan.config().qgz_block_size)?)
        } else {
            None
        };
        let mut t = ZeroEngine {
            plan: plan.clone(),
            rank,
            device_tensors: None,
            device_quant: false,
            device_grad_bytes: 0,
            device_weight_bytes: 0,
            comms: Some(Comms {
                world,
                hpz,
                qgroups,
                qwz,
                qgz,
                half,
                quant: None,
                qwz_scratch: QuantScratch::new(),
                qgz_scratch: QuantScratch::new(),
            }),
            model,
            options,
            params,
            param_segment,
            completes_at,
            seg_units,
            acc_offset,
            opt_offset,
            shard: Vec::new(),
            half,
            shard16: Vec::new(),
            master: Vec::new(),
            acc16: if half.is_some() && !acc32 {
                vec![0; acc_len]
            } else {
                Vec::new()
            },
            acc32,
            scaler: (plan.config().precision == zero_core::Precision::Fp16)
                .then(|| LossScaler::new(plan.config().loss_scaler)),
            opt_steps: 0,
            last_step: StepInfo::default(),
            inject_overflow: false,
            acc: if half.is_some() && !acc32 {
                Vec::new()
            } else {
                vec![0.0; acc_len]
            },
            tree: match options.reduction {
                Reduction::RankOrdered => TreeAccumulator::default(),
                Reduction::CanonicalTree => {
                    TreeAccumulator::new(plan.config().gradient_accumulation_steps, acc_len)
                }
            },
            opt: OptimState::new(&options.optimizer, opt_len),
            secondary: vec![None; units.len()],
            secondary16: vec![None; units.len()],
            gathered: vec![false; units.len()],
            fetching: vec![false; units.len()],
            inflight: VecDeque::new(),
            step: 0,
            micro: 0,
            micro_losses: Vec::new(),
            peak: MeasuredMemory::default(),
            live_gathered: 0,
            traffic_base: TrafficTable::new(),
            steps_base: (0, 0),
            skipped: 0,
            other_traffic: TrafficTable::new(),
        };
        if half.is_some() {
            // The fp32 master of this rank's part of every trainable unit, from the initial
            // values (stage 0: whole units; otherwise the rank's chunk).
            t.master = vec![0.0; opt_len];
            for u in 0..units.len() {
                let Some(off) = t.opt_offset[u] else { continue };
                let full = t.read_unit(u)?;
                let c = plan.chunk_len(u) as usize;
                let mine = if stage == 0 {
                    &full[..]
                } else {
                    &full[rank * c..(rank + 1) * c]
                };
                t.master[off..off + mine.len()].copy_from_slice(mine);
            }
        }
        if stage == 3 {
            // The shard of every unit, from the initial full values; then release gather units.
            match half {
                None => t.shard = vec![0.0; plan.shard_len() as usize],
                Some(_) => t.shard16 = vec![0; plan.shard_len() as usize],
            }
            for (u, unit) in units.iter().enumerate() {
                let full = t.read_unit(u)?;
                let c = plan.chunk_len(u) as usize;
                let off = unit.shard_offset as usize;
                let mine = &full[rank * c..(rank + 1) * c];
                match half {
                    None => t.shard[off..off + c].copy_from_slice(mine),
                    Some(h) => {
                        for (d, &x) in t.shard16[off..off + c].iter_mut().zip(mine) {
                            *d = h.round(x);
                        }
                    }
                }
                if unit.kind == UnitKind::Gather {
                    t.release(u);
                }
            }
        }
        // Fresh autodiff leaves for the parameters this rank keeps resident. Clones of one module
        // share their tensors (so the clones cost nothing until here, and stage 3 never holds a
        // full copy), and burn's autodiff graph must not be shared between threads: it
        // deadlocks on merge.
        let slots: Vec<usize> = (0..t.params.len())
            .filter(|&i| !(stage == 3 && t.is_gathered_param(i)))
            .collect();
        let want: HashMap<ParamId, usize> = slots
            .iter()
            .enumerate()
            .map(|(k, &i)| (t.params[i].id, k))
            .collect();
        let mut values = params::read_values(&t.model, &want)?;
        if let Some(h) = half {
            // The working weights: the initial values rounded to 16 bits (widened for burn).
            for v in &mut values {
                for x in v.iter_mut() {
                    *x = h.quantize(*x);
                }
            }
        }
        let fresh = slots
            .iter()
            .zip(values)
            .map(|(&i, v)| {
                (
                    t.params[i].id,
                    (v, t.params[i].shape.clone(), t.params[i].trainable),
                )
            })
            .collect();
        t.set_params(fresh);
        t.traffic_base = t.traffic();
        Ok(t)
    }

    /// Whether parameter `i` lives in a stage-3 gather unit (released between uses).
    fn is_gathered_param(&self, i: usize) -> bool {
        self.plan
            .locate(i)
            .is_some_and(|(u, _)| self.plan.units()[u].kind == UnitKind::Gather)
    }

    /// Moves fp32 gradients and gathered weights between burn and the communicator's memory
    /// through `hook` (see [`DeviceTensors`]) instead of through host memory. The arithmetic is
    /// the same, so are the bits.
    pub fn with_device_tensors(mut self, hook: Box<dyn DeviceTensors<C>>) -> Self {
        self.device_tensors = Some(hook);
        self
    }

    /// Runs qwZ and qgZ on the communicator's memory through `quant` (see [`DeviceQuant`]) where
    /// a [`DeviceTensors`] hook keeps the tensors there. The same bits as the host codecs.
    pub fn with_device_quant(mut self, quant: Box<dyn DeviceQuant<C>>) -> Self {
        self.comms().quant = Some(quant);
        self.device_quant = true;
        self
    }

    /// Gradient bytes packed in the communicator's memory by the [`DeviceTensors`] hook so far
    /// (bytes that never passed through host memory).
    pub fn device_grad_bytes(&self) -> u64 {
        self.device_grad_bytes
    }

    /// Weight bytes the [`DeviceTensors`] hook installed in the model straight from the
    /// communicator's memory so far.
    pub fn device_weight_bytes(&self) -> u64 {
        self.device_weight_bytes
    }

    /// Whether unit `u`'s gradients are packed on the device (see [`Self::with_device_tensors`]).
    fn device_unit(&self, u: usize) -> bool {
        let plan = &self.plan;
        let c = plan.config();
        self.device_tensors.is_some()
            && self.half.is_none()
            && !(plan.stage() <= 1 && c.accumulate_before_reduce)
            && (self.device_quant
                || !(c.quantized_gradients && plan.units()[u].kind == UnitKind::Gather))
    }

    fn comms(&mut self) -> &mut Comms<C> {
        self.comms.as_mut().expect(HOME)
    }

    fn comms_ref(&self) -> &Comms<C> {
        self.comms.as_ref().expect(HOME)
    }

    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The model (stage 3: gather units are released between steps; see
    /// [`Self::consolidated_model`] for the full one).
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The plan this engine executes.
    pub fn plan(&self) -> &Arc<Plan> {
        &self.plan
    }

    /// Steps skipped because fp16 gradients overflowed.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped
    }

    /// Traffic of collectives outside training steps ([`Self::eval`], consolidation).
    pub fn other_traffic(&self) -> &TrafficTable {
        &self.other_traffic
    }

    pub(crate) fn has_device_tensors(&self) -> bool {
        self.device_tensors.is_some()
    }

    /// Runs `f` and books its traffic as [`Self::other_traffic`] rather than training traffic.
    pub(crate) fn untracked<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let before = self.traffic();
        let r = f(self);
        let delta = self.traffic().since(&before);
        self.other_traffic.merge(&delta);
        self.traffic_base.merge(&delta);
        r
    }

    /// New values for every parameter, indexed like the plan's model.
    pub(crate) fn params_with(&self, values: Vec<Vec<f32>>) -> params::NewValues {
        self.params
            .iter()
            .zip(values)
            .map(|(p, v)| (p.id, (v, p.shape.clone(), p.trainable)))
            .collect()
    }

    /// The mean loss of `batch` with the current weights: a forward pass only, no gradients and
    /// no optimizer state touched (stage 3 gathers each segment's units and releases them). Its
    /// traffic is booked as [`Self::other_traffic`]. Collective at stage 3: every rank must call it.
    pub fn eval(&mut self, batch: &M::Batch) -> Result<f32> {
        self.untracked(|e| {
            let r = e.with_exec(false, |e, exec| {
                e.forward(exec, batch).map(|(loss, _)| loss)
            });
            // Nothing of an eval's gathers outlives it: no hpZ secondary (kept for a backward).
            e.secondary.iter_mut().for_each(|s| *s = None);
            e.secondary16.iter_mut().for_each(|s| *s = None);
            r
        })
    }

    /// Traffic measured on every communicator of this rank since the trainer was built.
    pub fn traffic(&self) -> TrafficTable {
        let c = self.comms_ref();
        let mut t = c.world.traffic().clone();
        if let Some(h) = &c.hpz {
            t.merge(h.traffic());
        }
        if let Some(q) = &c.qgroups {
            t.merge(&q.traffic());
        }
        t.since(&self.traffic_base)
    }

    /// Peak measured memory so far.
    pub fn measured_memory(&self) -> MeasuredMemory {
        let mut m = self.peak;
        // The codecs' wire buffers keep their capacity: they coexist with the reduction buffers.
        let c = self.comms_ref();
        m.communication_buffers +=
            (c.qwz_scratch.peak_wire_bytes() + c.qgz_scratch.peak_wire_bytes()) as u64;
        m.model_states_bytes = m.parameters + m.gradients + m.optimizer_states + m.master_weights;
        m
    }

    /// Steps taken (skipped fp16 steps included).
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// What happened at the last optimizer step: skipped (fp16 overflow) or not, and the loss
    /// scale its backward used.
    pub fn last_step(&self) -> StepInfo {
        self.last_step
    }

    /// fp16: the loss scale the next step will use.
    pub fn loss_scale(&self) -> Option<f64> {
        self.scaler.as_ref().map(LossScaler::scale)
    }

    /// bf16/fp16: this rank's fp32 master weights (its part of every trainable unit, laid out
    /// like the optimizer state); empty in fp32.
    pub fn master_weights(&self) -> &[f32] {
        &self.master
    }

    /// Testing aid (fp16): makes the first element of this rank's reduced gradient shard inf at
    /// the next optimizer step, as an overflow confined to one rank would. Every rank must then
    /// skip that step together.
    pub fn inject_overflow_next_step(&mut self) {
        self.inject_overflow = true;
    }

    /// This rank's optimizer state: first and second moment (empty when the optimizer has none).
    pub fn optimizer_state(&self) -> (&[f32], &[f32]) {
        (&self.opt.m, &self.opt.v)
    }

    /// The loss of each micro-step of the last optimizer step (this rank's micro-batches, in
    /// order), unscaled: what [`crate::demo::run::global_losses`] sums over the canonical tree.
    pub fn last_micro_losses(&self) -> &[f32] {
        &self.micro_losses
    }

    /// One optimizer step at learning rate `lr` over this rank's `gradient_accumulation_steps`
    /// micro-batches, in order. Every rank must call it with the same number of batches.
    pub fn step(&mut self, lr: f32, batches: &[M::Batch]) -> Result<StepOutput> {
        let a = self.plan.config().gradient_accumulation_steps as usize;
        if batches.len() != a {
            return Err(Error::Invalid {
                field: "batches",
                got: format!("{} micro-batches", batches.len()),
                expected: format!("{a}, the plan's gradient_accumulation_steps"),
            });
        }
        if !lr.is_finite() || lr < 0.0 {
            return Err(Error::Invalid {
                field: "lr",
                got: lr.to_string(),
                expected: "a finite learning rate >= 0".into(),
            });
        }
        let mut loss = 0.0f64;
        self.micro_losses.clear();
        for batch in batches {
            let l = self.micro_step(batch)?;
            if !l.is_finite() {
                // The other ranks learn of it from this rank's dropped communicator (PeerFailed).
                return Err(Error::Model(format!(
                    "the loss is not finite ({l}) at step {} on rank {}: the run diverged",
                    self.step, self.rank
                )));
            }
            loss += f64::from(l);
            self.micro_losses.push(l);
        }
        self.optimizer_step(lr)?;
        Ok(StepOutput {
            loss: (loss / a as f64) as f32,
            micro_losses: self.micro_losses.clone(),
            info: self.last_step,
        })
    }

    /// Runs `f` with the communicators lent to an executor (inline, or on the communication
    /// thread with `overlap`), then applies what is still in flight, or after a failure forgets
    /// it; the communicators are home again afterwards.
    fn with_exec<T>(
        &mut self,
        overlap: bool,
        f: impl FnOnce(&mut Self, &mut Exec<C>) -> Result<T>,
    ) -> Result<T> {
        let comms = self.comms.take().expect(HOME);
        let (comms, r) = comms::with_exec(comms, overlap, self.rank, |exec| match f(self, exec) {
            Ok(v) => self.settle_all(exec).map(|()| v),
            Err(e) => {
                self.inflight.clear();
                Err(e)
            }
        });
        self.comms = Some(comms);
        if r.is_err() {
            self.fetching.iter_mut().for_each(|f| *f = false);
        }
        r
    }

    fn micro_step(&mut self, batch: &M::Batch) -> Result<f32> {
        let overlap = self.plan.config().overlap_comm;
        let r = self.with_exec(overlap, |t, exec| t.micro_step_with(exec, batch));
        let loss = r?;
        self.micro += 1;
        self.sample_memory();
        Ok(loss)
    }

    fn micro_step_with(&mut self, exec: &mut Exec<C>, batch: &M::Batch) -> Result<f32> {
        let plan = self.plan.clone();
        let stage3 = plan.stage() == 3;
        let segments = self.model.num_segments();
        // Rank-ordered: each micro-step's loss is scaled by 1/A. Canonical tree: unscaled (so a
        // micro-batch's gradient does not depend on A), divided once by N·A after the sum.
        let scale = match self.options.reduction {
            Reduction::RankOrdered => 1.0 / plan.config().gradient_accumulation_steps as f32,
            Reduction::CanonicalTree => 1.0,
        };
        // fp16: the loss scale multiplies the loss before the backward (1 otherwise: exact).
        let scale = scale * self.scaler.as_ref().map_or(1.0, |s| s.scale() as f32);
        // With overlap, one reduction may be in flight while the next bucket fills (the plan's
        // doubled reduction buffer); inline, each is applied as soon as it is submitted.
        let max_reduces = usize::from(plan.config().overlap_comm);
        if !plan.config().recompute() {
            return self.micro_step_one_graph(exec, batch, scale, max_reduces);
        }
        let (loss, acts) = self.forward(exec, batch)?;
        // Backward, recomputing each segment.
        let mut pending: Vec<Option<Pending<C::Buffer<f32>>>> =
            (0..plan.units().len()).map(|_| None).collect();
        let mut grad_out: Option<M::Act> = None;
        for i in (0..segments).rev() {
            if stage3 {
                self.gather_segment(exec, i, true)?;
            }
            let x = (i > 0).then(|| acts[i - 1].leaf());
            let surrogate = match (self.model.forward_segment(i, batch, x.clone()), &grad_out) {
                (SegmentOut::Loss(l), None) => l.mul_scalar(scale).sum(),
                (SegmentOut::Next(y), Some(g)) => y.dot(g),
                (_, g) => return Err(crate::segmented::wrong_output(i, segments, g.is_none())),
            };
            let grads = surrogate.backward();
            grad_out = x.as_ref().and_then(|x| x.grad(&grads));
            if i > 0 && grad_out.is_none() {
                return Err(Error::Model(format!(
                    "segment {i} produced no gradient for its input"
                )));
            }
            let gp = GradientsParams::from_grads(grads, &self.model);
            self.collect_grads(i, &gp, &mut pending)?;
            drop(gp);
            if stage3 {
                self.release_segment(i);
            }
            self.reduce_completed(exec, i, &mut pending, max_reduces)?;
        }
        Ok(loss)
    }

    /// Submits the reductions of the units segment `i`'s backward completed, keeping at most
    /// `max_reduces` in flight.
    fn reduce_completed(
        &mut self,
        exec: &mut Exec<C>,
        i: usize,
        pending: &mut [Option<Pending<C::Buffer<f32>>>],
        max_reduces: usize,
    ) -> Result<()> {
        for u in self.completes_at[i].clone() {
            let g = pending[u]
                .take()
                .unwrap_or_else(|| Pending::Host(vec![0.0; self.plan.units()[u].len as usize]));
            self.submit_reduce(exec, u, g)?;
            while self.reductions_in_flight().0 > max_reduces {
                self.complete_one(exec)?;
            }
        }
        Ok(())
    }

    /// A micro-step without activation checkpointing: one autodiff graph over every segment
    /// (stage 3: each segment's units gathered before it runs and kept until the backward is
    /// done), one backward, then every unit's reduction in the order the segment-wise backward
    /// issues them (last segment first).
    fn micro_step_one_graph(
        &mut self,
        exec: &mut Exec<C>,
        batch: &M::Batch,
        scale: f32,
        max_reduces: usize,
    ) -> Result<f32> {
        let plan = self.plan.clone();
        let stage3 = plan.stage() == 3;
        let segments = self.model.num_segments();
        let mut x: Option<M::Act> = None;
        let mut loss = None;
        for i in 0..segments {
            if stage3 {
                self.gather_segment(exec, i, false)?;
            }
            match (
                self.model.forward_segment(i, batch, x.take()),
                i + 1 == segments,
            ) {
                (SegmentOut::Loss(l), true) => loss = Some(l),
                (SegmentOut::Next(y), false) => x = Some(y),
                (_, last) => return Err(crate::segmented::wrong_output(i, segments, last)),
            }
        }
        let loss = loss.ok_or_else(|| crate::segmented::wrong_output(0, segments, true))?;
        let value = crate::segmented::loss_value(loss.clone())?;
        let grads = loss.mul_scalar(scale).sum().backward();
        let gp = GradientsParams::from_grads(grads, &self.model);
        let mut pending: Vec<Option<Pending<C::Buffer<f32>>>> =
            (0..plan.units().len()).map(|_| None).collect();
        for i in (0..segments).rev() {
            self.collect_grads(i, &gp, &mut pending)?;
        }
        drop(gp);
        for i in (0..segments).rev() {
            if stage3 {
                self.release_segment(i);
            }
            self.reduce_completed(exec, i, &mut pending, max_reduces)?;
        }
        Ok(value)
    }

    /// The forward pass: each segment without autodiff (stage 3: gathered before, released
    /// after), keeping only the activations between segments. Returns the loss and those
    /// activations.
    fn forward(&mut self, exec: &mut Exec<C>, batch: &M::Batch) -> Result<(f32, Vec<M::Act>)> {
        let stage3 = self.plan.stage() == 3;
        let segments = self.model.num_segments();
        let mut acts: Vec<M::Act> = Vec::with_capacity(segments);
        let mut loss = 0.0f32;
        for i in 0..segments {
            if stage3 {
                self.gather_segment(exec, i, false)?;
            }
            // Without autodiff: a graph recorded here would never be consumed, and it would keep
            // the released weights alive. The backward recomputes the segment under autodiff.
            let x = (i > 0).then(|| acts[i - 1].clone());
            match (
                self.model.valid().forward_segment(i, batch, x),
                i + 1 == segments,
            ) {
                (SegmentOut::Loss(l), true) => loss = crate::segmented::loss_value(l)?,
                (SegmentOut::Next(y), false) => acts.push(y),
                (_, last) => return Err(crate::segmented::wrong_output(i, segments, last)),
            }
            if stage3 {
                self.release_segment(i);
            }
        }
        Ok((loss, acts))
    }

    fn collect_grads(
        &mut self,
        seg: usize,
        gp: &GradientsParams,
        pending: &mut [Option<Pending<C::Buffer<f32>>>],
    ) -> Result<()> {
        let plan = self.plan.clone();
        let mut want = HashMap::new();
        let mut slots = Vec::new();
        for (i, p) in self.params.iter().enumerate() {
            if self.param_segment[i] == seg && p.trainable {
                want.insert(p.id, slots.len());
                slots.push(i);
            }
        }
        let device: Vec<bool> = (0..plan.units().len())
            .map(|u| self.device_unit(u))
            .collect();
        let hook = self.device_tensors.as_deref();
        let mut failed = None;
        let mut packed = 0u64;
        params::for_each_grad_tensor(&self.model, gp, &want, |slot, g| {
            let Some((u, off)) = plan.locate(slots[slot]) else {
                return;
            };
            let (len, off) = (plan.units()[u].len as usize, off as usize);
            let r = match (hook, device[u]) {
                // Each parameter lives in one segment, so its slot is written once: a copy.
                (Some(hook), true) => (|| {
                    if pending[u].is_none() {
                        pending[u] = Some(Pending::Device(hook.zeros(len)?));
                    }
                    packed += 4 * g.shape().num_elements() as u64;
                    match &mut pending[u] {
                        Some(Pending::Device(buf)) => hook.copy_in(buf, off, &g),
                        _ => Ok(()),
                    }
                })(),
                _ => match g.into_data().try_into_vec_as::<f32>() {
                    Ok(g) => {
                        let p = pending[u].get_or_insert_with(|| Pending::Host(vec![0.0; len]));
                        if let Pending::Host(buf) = p {
                            add_into(&mut buf[off..off + g.len()], &g);
                        }
                        Ok(())
                    }
                    Err(e) => Err(Error::Model(format!("gradient: {e:?}"))),
                },
            };
            if let Err(e) = r {
                failed.get_or_insert(e);
            }
        });
        self.device_grad_bytes += packed;
        failed.map_or(Ok(()), Err)
    }

    /// Submits the reduction of unit `u`'s gradients `g` of this micro-step (stage 0: an
    /// all-reduce; 1–3: a reduce-scatter, through qgZ for gather units when it is on; with
    /// `accumulate_before_reduce` at stages 0–1, only after the last micro-step). The result is
    /// applied to the accumulator by [`Self::complete_one`].
    fn submit_reduce(
        &mut self,
        exec: &mut Exec<C>,
        u: usize,
        g: Pending<C::Buffer<f32>>,
    ) -> Result<()> {
        let plan = self.plan.clone();
        let unit = &plan.units()[u];
        let off = self.acc_offset[u].expect("only trainable units are reduced");
        let len = unit.len as usize;
        let stage = plan.stage();
        let defer = stage <= 1 && plan.config().accumulate_before_reduce;
        let last_micro = self.micro + 1 == plan.config().gradient_accumulation_steps;
        let w = if self.half.is_some() { 2 } else { 4 };
        let bytes = len as u64 * w;
        self.track_comm_buffer(self.reductions_in_flight().1 + bytes);
        // The canonical tree sums across ranks and divides once, after the last micro-step;
        // bf16/fp16 always take the mean.
        let op = match (self.options.reduction, self.half) {
            (Reduction::CanonicalTree, None) => ReduceOp::Sum,
            _ => ReduceOp::Mean,
        };
        let g = match g {
            Pending::Host(g) => g,
            // Packed on the device (fp32, reduced every micro-step, no qgZ): reduce it there.
            Pending::Device(data) => {
                exec.submit(if stage == 0 {
                    Job::AllReduceDevice { data, op }
                } else {
                    Job::ReduceScatterDevice {
                        data,
                        op,
                        qgz: unit.kind == UnitKind::Gather,
                    }
                })?;
                self.reduce_submitted(off, false, bytes);
                return Ok(());
            }
        };
        let data = if defer {
            // Add into the full-unit accumulator; reduce it (once) after the last micro-step,
            // written over the slot's start.
            match self.half {
                Some(h) if !self.acc32 => h.add_f32_into(&mut self.acc16[off..off + len], &g),
                _ => add_into(&mut self.acc[off..off + len], &g),
            }
            if !last_micro {
                return Ok(());
            }
            match self.half {
                None => Words::F32(self.acc[off..off + len].to_vec()),
                Some(h) if self.acc32 => Words::U16(h.round_all(&self.acc[off..off + len])),
                Some(_) => Words::U16(self.acc16[off..off + len].to_vec()),
            }
        } else {
            match self.half {
                None => Words::F32(g),
                Some(h) => Words::U16(h.round_all(&g)),
            }
        };
        exec.submit(if stage == 0 {
            Job::AllReduce { data, op }
        } else {
            Job::ReduceScatter {
                data,
                op,
                qgz: !defer && unit.kind == UnitKind::Gather,
            }
        })?;
        self.reduce_submitted(off, defer, bytes);
        Ok(())
    }

    /// The reductions in flight: how many, and the bytes of their gradient buffers.
    fn reductions_in_flight(&self) -> (usize, u64) {
        self.inflight
            .iter()
            .filter_map(|t| match t {
                Ticket::Reduce { bytes, .. } => Some(*bytes),
                Ticket::Gather { .. } => None,
            })
            .fold((0, 0), |(n, b), x| (n + 1, b + x))
    }

    /// Books a submitted reduction (its ticket also records its gradient buffer in flight).
    fn reduce_submitted(&mut self, off: usize, overwrite: bool, bytes: u64) {
        self.inflight.push_back(Ticket::Reduce {
            off,
            overwrite,
            bytes,
        });
    }

    /// Waits for the oldest collective in flight and applies its result: a gathered unit is
    /// installed in the model, a reduced gradient goes into the accumulator.
    fn complete_one(&mut self, exec: &mut Exec<C>) -> Result<()> {
        let Some(ticket) = self.inflight.pop_front() else {
            return Ok(());
        };
        let words = exec.wait()?;
        match ticket {
            Ticket::Gather { u, backward } => self.install(u, backward, words)?,
            Ticket::Reduce { off, overwrite, .. } => match (words, self.half) {
                (Words::F32(r), _) if overwrite => self.acc[off..off + r.len()].copy_from_slice(&r),
                (Words::F32(r), _) => self.accumulate(off, r),
                (Words::U16(r), Some(h)) if self.acc32 => {
                    let acc = &mut self.acc[off..off + r.len()];
                    for (a, &b) in acc.iter_mut().zip(&r) {
                        *a = if overwrite {
                            h.widen(b)
                        } else {
                            *a + h.widen(b)
                        };
                    }
                }
                (Words::U16(r), _) if overwrite => {
                    self.acc16[off..off + r.len()].copy_from_slice(&r)
                }
                (Words::U16(r), Some(h)) => h.add_into(&mut self.acc16[off..off + r.len()], &r),
                (Words::U16(_), None) => unreachable!("fp32 trainers submit f32 gradients"),
                (Words::Device(_), _) => {
                    unreachable!("reductions download the rank's chunk")
                }
            },
        }
        Ok(())
    }

    /// Applies everything in flight.
    fn settle_all(&mut self, exec: &mut Exec<C>) -> Result<()> {
        while !self.inflight.is_empty() {
            self.complete_one(exec)?;
        }
        Ok(())
    }

    /// Adds this micro-step's reduced values for `acc[off..off + reduced.len()]`.
    fn accumulate(&mut self, off: usize, reduced: Vec<f32>) {
        match self.options.reduction {
            Reduction::RankOrdered => add_into(&mut self.acc[off..off + reduced.len()], &reduced),
            Reduction::CanonicalTree => self.tree.push(&mut self.acc, self.micro, off, reduced),
        }
    }

    fn optimizer_step(&mut self, lr: f32) -> Result<()> {
        if let Some(h) = self.half {
            return self.optimizer_step16(h, lr);
        }
        self.last_step = StepInfo {
            skipped: false,
            loss_scale: 1.0,
            grad_norm: None,
        };
        let plan = self.plan.clone();
        let c = plan.config();
        let n = plan.world_size();
        let stage = plan.stage();
        self.step += 1;
        if self.options.reduction == Reduction::CanonicalTree {
            // The root of the tree over all N·A micro-batches, then the one division.
            let a = c.gradient_accumulation_steps;
            self.tree.finish(&mut self.acc, a);
            let total = (n as u64 * u64::from(a)) as f32;
            for g in &mut self.acc {
                *g /= total;
            }
        }
        // Global norm: rank-ordered f64 partial sums, identical arithmetic at every stage.
        let mut coef = 1.0f32;
        if c.gradient_clipping > 0.0 {
            let acc = &self.acc;
            let total = global_sum_sq(
                &mut self.comms.as_mut().expect(HOME).world,
                &plan,
                &self.acc_offset,
                self.rank,
                |mut s, at, len| {
                    for &g in &acc[at..at + len] {
                        s += f64::from(g) * f64::from(g);
                    }
                    s
                },
            )?;
            // Every rank sums the same partials in the same order, so all see the same total
            // and fail together (fp32 has no loss scaler whose step could be skipped).
            if !total.is_finite() {
                return Err(Error::Model(format!(
                    "the global gradient norm is not finite at step {} (rank {}): the loss diverged",
                    self.step, self.rank
                )));
            }
            let norm = total.sqrt();
            self.last_step.grad_norm = Some(norm as f32);
            let k = c.gradient_clipping / (norm + 1e-6);
            if k < 1.0 {
                coef = k as f32;
            }
        }
        if coef != 1.0 {
            for g in &mut self.acc {
                *g *= coef;
            }
        }
        // The update, on this rank's part.
        let opt = self.options.optimizer;
        let mut updates: Vec<(usize, Out<C>)> = Vec::new();
        for (u, unit) in plan.units().iter().enumerate() {
            if !unit.trainable {
                continue;
            }
            let off = self.acc_offset[u].expect("trainable");
            let oo = self.opt_offset[u].expect("trainable");
            let cl = plan.chunk_len(u) as usize;
            match stage {
                0 => {
                    let mut w = self.read_unit(u)?;
                    let len = w.len();
                    optim::step(
                        &opt,
                        lr,
                        self.step,
                        &mut w,
                        &self.acc[off..off + len],
                        &mut self.opt,
                        oo,
                    );
                    updates.push((u, Words::F32(w)));
                }
                1 | 2 => {
                    let full = self.read_unit(u)?;
                    let mut w = full[self.rank * cl..(self.rank + 1) * cl].to_vec();
                    // With accumulate_before_reduce the reduced chunk sits at the slot's start too.
                    optim::step(
                        &opt,
                        lr,
                        self.step,
                        &mut w,
                        &self.acc[off..off + cl],
                        &mut self.opt,
                        oo,
                    );
                    let gathered = self.post_step_gather(w)?;
                    updates.push((u, gathered));
                }
                _ => {
                    let so = unit.shard_offset as usize;
                    optim::step(
                        &opt,
                        lr,
                        self.step,
                        &mut self.shard[so..so + cl],
                        &self.acc[off..off + cl],
                        &mut self.opt,
                        oo,
                    );
                }
            }
        }
        if stage == 3 {
            // Persistent units stay gathered: all-gather them after the step.
            for (u, unit) in plan.units().iter().enumerate() {
                if unit.kind == UnitKind::Persistent && unit.trainable {
                    let cl = plan.chunk_len(u) as usize;
                    let so = unit.shard_offset as usize;
                    let gathered = self.post_step_gather(self.shard[so..so + cl].to_vec())?;
                    updates.push((u, gathered));
                }
            }
            // hpZ secondary shards never outlive a weight update.
            for s in &mut self.secondary {
                *s = None;
            }
        }
        for (u, full) in updates {
            match full {
                Words::Device(buf) => self.install_tensors(u, &buf)?,
                Words::F32(full) => self.write_unit(u, &full),
                Words::U16(_) => unreachable!("fp32 steps gather f32 weights"),
            }
        }
        self.sample_memory();
        self.acc.iter_mut().for_each(|g| *g = 0.0);
        self.micro = 0;
        Ok(())
    }

    /// [`Self::optimizer_step`] in bf16/fp16: widen the 16-bit reduced gradients to fp32, unscale
    /// (fp16), check for overflow (fp16: every rank sees the same total and skips together),
    /// clip, step the fp32 master, and round it to the 16-bit working weights.
    fn optimizer_step16(&mut self, h: Half, lr: f32) -> Result<()> {
        let plan = self.plan.clone();
        let c = plan.config();
        let stage = plan.stage();
        self.step += 1;
        let loss_scale = self.scaler.as_ref().map_or(1.0, LossScaler::scale);
        // A power of two: unscaling is exact (barring subnormals).
        let inv = (1.0 / loss_scale) as f32;
        let fp16 = self.scaler.is_some();
        if std::mem::take(&mut self.inject_overflow) {
            if let Some(g) = self.acc16.first_mut() {
                *g = h.round(f32::INFINITY);
            }
            if let Some(g) = self.acc.first_mut() {
                *g = f32::INFINITY;
            }
        }
        // The accumulated gradient element `i` (16-bit widened, or fp32).
        let (acc16, acc32) = (&self.acc16, &self.acc);
        let grad = |i: usize| {
            if self.acc32 {
                acc32[i]
            } else {
                h.widen(acc16[i])
            }
        };
        let mut coef = 1.0f32;
        let mut overflow = false;
        let mut grad_norm = None;
        // fp16 always checks (the plan schedules the 8-byte partial for it); bf16 only to clip.
        if c.gradient_clipping > 0.0 || fp16 {
            // A non-finite element makes its rank's partial, and so every rank's total,
            // non-finite: the partials are the overflow flag.
            let total = global_sum_sq(
                &mut self.comms.as_mut().expect(HOME).world,
                &plan,
                &self.acc_offset,
                self.rank,
                |mut s, at, len| {
                    for i in at..at + len {
                        let g = f64::from(grad(i) * inv);
                        s += g * g;
                    }
                    s
                },
            )?;
            if !total.is_finite() {
                if !fp16 {
                    return Err(Error::Model(format!(
                        "the global gradient norm is not finite at step {} (rank {}): the loss \
                         diverged",
                        self.step, self.rank
                    )));
                }
                overflow = true;
            } else if c.gradient_clipping > 0.0 {
                grad_norm = Some(total.sqrt() as f32);
                let k = c.gradient_clipping / (total.sqrt() + 1e-6);
                if k < 1.0 {
                    coef = k as f32;
                }
            }
        }
        if let Some(s) = &mut self.scaler {
            s.update(overflow)?;
        }
        self.last_step = StepInfo {
            skipped: overflow,
            loss_scale: loss_scale as f32,
            grad_norm,
        };
        if overflow {
            self.skipped += 1;
            // Skip: master, working weights and optimizer state stay as they are.
            self.sample_memory();
            self.acc16.iter_mut().for_each(|g| *g = 0);
            self.acc.iter_mut().for_each(|g| *g = 0.0);
            self.micro = 0;
            return Ok(());
        }
        self.opt_steps += 1;
        let grads = |off: usize, len: usize| -> Vec<f32> {
            (off..off + len)
                .map(|i| {
                    let g = grad(i) * inv;
                    if coef != 1.0 { g * coef } else { g }
                })
                .collect()
        };
        let opt = self.options.optimizer;
        let mut updates: Vec<(usize, Vec<f32>)> = Vec::new();
        for (u, unit) in plan.units().iter().enumerate() {
            if !unit.trainable {
                continue;
            }
            let off = self.acc_offset[u].expect("trainable");
            let len = if stage == 0 {
                unit.len as usize
            } else {
                plan.chunk_len(u) as usize
            };
            let oo = self.opt_offset[u].expect("trainable");
            let g = grads(off, len);
            let master = &mut self.master[oo..oo + len];
            optim::step(&opt, lr, self.opt_steps, master, &g, &mut self.opt, oo);
            let w16 = h.round_all(master);
            match stage {
                0 => updates.push((u, h.widen_all(&w16))),
                1 | 2 => {
                    let gathered =
                        h.all_gather(&mut self.comms.as_mut().expect(HOME).world, &w16)?;
                    updates.push((u, h.widen_all(&gathered)));
                }
                _ => {
                    let so = unit.shard_offset as usize;
                    self.shard16[so..so + len].copy_from_slice(&w16);
                }
            }
        }
        if stage == 3 {
            for (u, unit) in plan.units().iter().enumerate() {
                if unit.kind == UnitKind::Persistent && unit.trainable {
                    let cl = plan.chunk_len(u) as usize;
                    let so = unit.shard_offset as usize;
                    let gathered = h.all_gather(
                        &mut self.comms.as_mut().expect(HOME).world,
                        &self.shard16[so..so + cl],
                    )?;
                    updates.push((u, h.widen_all(&gathered)));
                }
            }
            for s in &mut self.secondary16 {
                *s = None;
            }
        }
        for (u, full) in updates {
            self.write_unit(u, &full);
        }
        self.sample_memory();
        self.acc16.iter_mut().for_each(|g| *g = 0);
        self.acc.iter_mut().for_each(|g| *g = 0.0);
        self.micro = 0;
        Ok(())
    }

    /// Every parameter's current values, indexed like the plan's model (stage 3 gathers each unit
    /// with one all-gather; call it after reading [`Self::traffic`]).
    pub fn gather_all_params(&mut self) -> Result<Vec<Vec<f32>>> {
        let plan = self.plan.clone();
        let mut out = vec![Vec::new(); self.params.len()];
        if plan.stage() == 3 {
            for (u, unit) in plan.units().iter().enumerate() {
                let cl = plan.chunk_len(u) as usize;
                let so = unit.shard_offset as usize;
                let full = match self.half {
                    None => self
                        .comms
                        .as_mut()
                        .expect(HOME)
                        .world
                        .all_gather_host(&self.shard[so..so + cl])?,
                    Some(h) => h.widen_all(&h.all_gather(
                        &mut self.comms.as_mut().expect(HOME).world,
                        &self.shard16[so..so + cl],
                    )?),
                };
                for e in plan.unit_entries(u) {
                    out[e.param] = full[e.offset as usize..(e.offset + e.numel) as usize].to_vec();
                }
            }
        } else {
            let want: HashMap<ParamId, usize> = self
                .params
                .iter()
                .enumerate()
                .map(|(i, p)| (p.id, i))
                .collect();
            out = params::read_values(&self.model, &want)?;
        }
        Ok(out)
    }

    /// Reads unit `u`'s parameters from the model into a zero-padded flat buffer of its length.
    fn read_unit(&self, u: usize) -> Result<Vec<f32>> {
        let entries = self.plan.unit_entries(u);
        let want: HashMap<ParamId, usize> = entries
            .iter()
            .enumerate()
            .map(|(k, e)| (self.params[e.param].id, k))
            .collect();
        let values = params::read_values(&self.model, &want)?;
        let mut full = vec![0.0; self.plan.units()[u].len as usize];
        for (e, v) in entries.iter().zip(values) {
            full[e.offset as usize..e.offset as usize + v.len()].copy_from_slice(&v);
        }
        Ok(full)
    }

    fn write_unit(&mut self, u: usize, full: &[f32]) {
        let mut values = HashMap::new();
        for e in self.plan.unit_entries(u) {
            let p = &self.params[e.param];
            let o = e.offset as usize;
            values.insert(
                p.id,
                (
                    full[o..o + e.numel as usize].to_vec(),
                    p.shape.clone(),
                    p.trainable,
                ),
            );
        }
        self.set_params(values);
    }

    /// Replaces the values of the parameters in `values` (burn's mapper consumes the module, so
    /// it maps a clone, which shares every other tensor).
    fn set_params(&mut self, values: params::NewValues) {
        let model = self.model.clone();
        self.model = params::write_values(model, values);
    }

    fn release(&mut self, u: usize) {
        let mut values = HashMap::new();
        for e in self.plan.unit_entries(u) {
            let p = &self.params[e.param];
            values.insert(p.id, (Vec::new(), vec![0; p.rank], false));
        }
        self.set_params(values);
    }

    /// Submits the all-gather of stage-3 unit `u` unless it is installed or already on its way:
    /// from the rank's shard over the world, or for the backward from the hpZ secondary shard
    /// within the hpZ group. Its elements count as gathered from here on.
    fn submit_gather(&mut self, exec: &mut Exec<C>, u: usize, backward: bool) -> Result<()> {
        if self.gathered[u] || self.fetching[u] {
            return Ok(());
        }
        let plan = self.plan.clone();
        let unit = &plan.units()[u];
        let cl = plan.chunk_len(u) as usize;
        let so = unit.shard_offset as usize;
        let hpz = backward && (self.secondary[u].is_some() || self.secondary16[u].is_some());
        let piece = match (self.half, hpz) {
            (None, true) => Words::F32(self.secondary[u].clone().unwrap_or_default()),
            (None, false) => Words::F32(self.shard[so..so + cl].to_vec()),
            (Some(_), true) => Words::U16(self.secondary16[u].clone().unwrap_or_default()),
            (Some(_), false) => Words::U16(self.shard16[so..so + cl].to_vec()),
        };
        // fp32 (qwZ only with device codecs): gathered into the communicator's memory, installed
        // from there.
        let device = self.device_tensors.is_some()
            && (self.device_quant || !plan.config().quantized_weights);
        exec.submit(match piece {
            Words::F32(piece) if device => Job::GatherDevice {
                piece,
                hpz,
                qwz: true,
            },
            piece => Job::Gather { piece, hpz },
        })?;
        self.inflight.push_back(Ticket::Gather { u, backward });
        self.fetching[u] = true;
        let w = if self.half.is_some() { 2 } else { 4 };
        let fetching: u64 = self
            .inflight
            .iter()
            .map(|t| match t {
                Ticket::Gather { u, .. } => plan.units()[*u].len,
                Ticket::Reduce { .. } => 0,
            })
            .sum();
        let live = self.live_gathered + fetching;
        self.peak.gathered_working_set = self.peak.gathered_working_set.max(live * w);
        Ok(())
    }

    /// Installs a gathered unit in the model (in bf16/fp16 widened to f32); a forward gather
    /// keeps the hpZ secondary slice.
    fn install(&mut self, u: usize, backward: bool, full: Words<C::Buffer<f32>>) -> Result<()> {
        let plan = self.plan.clone();
        let len = plan.units()[u].len as usize;
        let slice = plan.hpz().filter(|_| !backward).map(|layout| {
            let s = len / layout.size;
            let g = self.rank % layout.size;
            g * s..(g + 1) * s
        });
        match (full, self.half) {
            (Words::Device(buf), _) => self.install_device(u, &buf, slice)?,
            (Words::F32(full), _) => {
                if let Some(r) = slice {
                    self.secondary[u] = Some(full[r].to_vec());
                }
                self.write_unit(u, &full);
            }
            (Words::U16(full), Some(h)) => {
                if let Some(r) = slice {
                    self.secondary16[u] = Some(full[r].to_vec());
                }
                self.write_unit(u, &h.widen_all(&full));
            }
            (Words::U16(_), None) => unreachable!("fp32 trainers gather f32 weights"),
        }
        self.fetching[u] = false;
        self.gathered[u] = true;
        self.live_gathered += len as u64;
        Ok(())
    }

    /// [`Self::install`] from the communicator's memory through the [`DeviceTensors`] hook: each
    /// parameter becomes a tensor on the model's device, with no host round trip (the hpZ
    /// secondary slice, kept in host memory like the shard, is read back).
    fn install_device(
        &mut self,
        u: usize,
        buf: &C::Buffer<f32>,
        slice: Option<std::ops::Range<usize>>,
    ) -> Result<()> {
        let hook = self.hook()?;
        if let Some(r) = slice {
            let sec = hook.tensor_at(buf, r.start, r.len())?.into_data();
            let sec = sec
                .try_into_vec_as::<f32>()
                .map_err(|e| Error::Model(format!("hpZ secondary slice: {e:?}")))?;
            self.secondary[u] = Some(sec);
        }
        self.install_tensors(u, buf)
    }

    fn hook(&self) -> Result<&dyn DeviceTensors<C>> {
        self.device_tensors
            .as_deref()
            .ok_or_else(|| Error::Model("internal: a device gather without a device hook".into()))
    }

    /// Makes unit `u`'s parameters tensors of the model from `buf`, a gathered unit in the
    /// communicator's memory, through the [`DeviceTensors`] hook (one device copy each).
    fn install_tensors(&mut self, u: usize, buf: &C::Buffer<f32>) -> Result<()> {
        let hook = self.hook()?;
        let mut tensors = params::NewTensors::new();
        for e in self.plan.unit_entries(u) {
            let p = &self.params[e.param];
            let t = hook.tensor_at(buf, e.offset as usize, e.numel as usize)?;
            tensors.insert(p.id, (t, p.shape.clone(), p.trainable));
        }
        let model = self.model.clone();
        self.model = params::write_tensors(model, tensors);
        self.device_weight_bytes += 4 * self.plan.units()[u].len;
        Ok(())
    }

    /// The all-gather of an updated fp32 chunk after the optimizer step (stages 1–2, stage-3
    /// persistent units): into the communicator's memory when a [`DeviceTensors`] hook installs
    /// weights from there, else into host memory.
    fn post_step_gather(&mut self, piece: Vec<f32>) -> Result<Out<C>> {
        let device = self.device_tensors.is_some();
        let comms = self.comms();
        if device {
            comms.run(Job::GatherDevice {
                piece,
                hpz: false,
                qwz: false,
            })
        } else {
            Ok(Words::F32(comms.world.all_gather_host(&piece)?))
        }
    }

    /// Makes segment `seg`'s gather units resident, then submits the prefetch of the next gather
    /// unit in execution order when the plan allows it (with `overlap_comm` it arrives while the
    /// segment computes).
    fn gather_segment(&mut self, exec: &mut Exec<C>, seg: usize, backward: bool) -> Result<()> {
        let units = self.seg_units[seg].clone();
        for &u in &units {
            self.submit_gather(exec, u, backward)?;
        }
        for &u in &units {
            while self.fetching[u] {
                self.complete_one(exec)?;
            }
        }
        let next_seg = if backward {
            seg.checked_sub(1)
        } else {
            Some(seg + 1)
        };
        if let (Some(&last), Some(ns)) = (units.last(), next_seg) {
            let next = self
                .seg_units
                .get(ns)
                .and_then(|v| if backward { v.last() } else { v.first() })
                .copied();
            if let Some(v) = next {
                let plan = self.plan.clone();
                if plan.may_prefetch(plan.units()[last].len, plan.units()[v].len) {
                    self.submit_gather(exec, v, backward)?;
                }
            }
        }
        self.sample_memory();
        Ok(())
    }

    fn release_segment(&mut self, seg: usize) {
        for u in self.seg_units[seg].clone() {
            if self.gathered[u] {
                self.release(u);
                self.gathered[u] = false;
                self.live_gathered -= self.plan.units()[u].len;
            }
        }
    }

    fn track_comm_buffer(&mut self, bytes: u64) {
        self.peak.communication_buffers = self.peak.communication_buffers.max(bytes);
    }

    fn sample_memory(&mut self) {
        let stage3 = self.plan.stage() == 3;
        let gathered: u64 = if stage3 { self.live_gathered } else { 0 };
        let model_elems = params::resident_elems(&self.model);
        let resident = model_elems - gathered;
        // The working weights' bytes per element: 4 in fp32, 2 in bf16/fp16 (where burn's f32
        // copies hold 2 more, reported as `f32_compute_copies`).
        let w = if self.half.is_some() { 2 } else { 4 };
        let p = &mut self.peak;
        p.parameters = p
            .parameters
            .max(resident * w + self.shard.len() as u64 * 4 + self.shard16.len() as u64 * 2);
        // The canonical tree's pending subtrees are gradient accumulators too (not in the plan).
        p.gradients = p
            .gradients
            .max((self.acc.len() + self.tree.len()) as u64 * 4 + self.acc16.len() as u64 * 2);
        p.optimizer_states = p.optimizer_states.max(self.opt.bytes());
        p.master_weights = p.master_weights.max(self.master.len() as u64 * 4);
        if self.half.is_some() {
            p.f32_compute_copies = p.f32_compute_copies.max(model_elems * 2);
        }
        let sec: u64 = self
            .secondary
            .iter()
            .flatten()
            .map(|s| s.len() as u64 * 4)
            .sum::<u64>()
            + self
                .secondary16
                .iter()
                .flatten()
                .map(|s| s.len() as u64 * 2)
                .sum::<u64>();
        p.hpz_secondary = p.hpz_secondary.max(sec);
    }
}

/// What [`Reduction::CanonicalTree`] needs: a communicator that sums in the pairwise-tree order,
/// and no reduction path with an order of its own.
fn check_canonical_tree<C: Communicator>(plan: &Plan, world: &C) -> Result<()> {
    let c = plan.config();
    let order = world.reduce_order();
    if order != Some(zero_comm::ReduceOrder::PairwiseTree) {
        return Err(Error::Invalid {
            field: "reduction",
            got: format!("canonical_tree on a communicator whose reduce order is {order:?}"),
            expected: "a communicator that sums over the pairwise tree (the host loopback built \
                       with ReduceOrder::PairwiseTree), or rank_ordered"
                .into(),
        });
    }
    if c.quantized_gradients {
        return Err(Error::Invalid {
            field: "reduction",
            got: "canonical_tree with qgZ".into(),
            expected: "rank_ordered (qgZ's all-to-all sums in its own order)".into(),
        });
    }
    if c.accumulate_before_reduce && c.gradient_accumulation_steps > 1 {
        return Err(Error::Invalid {
            field: "reduction",
            got: "canonical_tree with accumulate_before_reduce and gradient accumulation".into(),
            expected: "rank_ordered, or a reduction every micro-step (the tree numbers \
                       micro-batches micro-step-major)"
                .into(),
        });
    }
    Ok(())
}

fn add_into(dst: &mut [f32], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d += s;
    }
}
