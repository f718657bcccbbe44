//! The optimizer step, one function for fp32, bf16 and fp16:
//!
//! 1. **Finish the gradients** ([`GradAcc`](super::grad_acc::GradAcc)).
//!    [`Reduction::CanonicalTree`](crate::Reduction::CanonicalTree): the root of the tree over
//!    all N·A micro-batches, then the one division. bf16/fp16: the 16-bit accumulator is read
//!    widened and unscaled (fp16; the scale is a power of two, so unscaling is exact barring
//!    subnormals).
//! 2. **The global norm** (`clip`, [`global_sum_sq`]; when clipping, and always in fp16 where it is
//!    the overflow flag): non-finite in fp16 skips the step on every rank together; non-finite
//!    otherwise is [`Error::Diverged`] on every rank together.
//! 3. **The update** of this rank's part of every trainable unit: its fp32 master is the model's
//!    weights (fp32, stages 0–2), the stage-3 shard (fp32), or the master slab (bf16/fp16, whose
//!    rounding is the new working weights).
//! 4. **Publish** (`publish`): write the unit into the model (stage 0), all-gather the updated
//!    chunks (stages 1–2, and stage-3 persistent units), or nothing (stage-3 gather units, gathered
//!    at their next use). With the state in host memory, stages 0–2 step the unit's parameters in
//!    burn's own memory, taken out of the model and put back at once (stages 1–2 gather there).

use burn::tensor::Tensor;

use zero_comm::Communicator;
use zero_core::{Plan, UnitKind};

use super::Core;
use super::grad_acc::GradView;
use super::sharded::Source;
use super::slab::Slab;
use super::weights::{self, cut_range, fill_parts};
use super::words::{Words, words_place};
use crate::comms::{Comms, Elems, Out};
use crate::error::{Error, Result};
use crate::params;
use crate::precision::{LossScaler, StepInfo};
use crate::segmented::Segmented;

/// What an updated unit needs before the model sees it.
enum Publish<O> {
    /// Written into the model as it is (stage 0: the whole unit).
    Write(Vec<f32>),
    /// [`Publish::Write`] of the unit as a tensor on the optimizer state's device.
    WriteTensor(Box<Tensor<1>>),
    /// The rank's updated chunk, all-gathered (stages 1–2, stage-3 persistent units): fp32 or
    /// 16-bit words, in host memory or already copied into the communicator's.
    Gather(O),
    /// Updated in place: in the stage-3 shard, or (stages 0–2 with the state in host memory) in
    /// the model's own tensors.
    InPlace,
}

impl<C: Communicator, M: Segmented> Core<C, M> {
    pub(super) fn optimizer_step(&mut self, comms: &mut Comms<C>, lr: f32) -> Result<()> {
        let plan = self.plan.clone();
        let c = plan.config();
        let stage = plan.stage();
        let half = self.half();
        let fp16 = self.opt.scaler.is_some();
        self.clock.step += 1;
        let loss_scale = self.opt.scaler.as_ref().map_or(1.0, LossScaler::scale);
        // A power of two (1 in fp32 and bf16): unscaling is exact barring subnormals.
        let inv = (1.0 / loss_scale) as f32;
        if half.is_some() && std::mem::take(&mut self.opt.inject_overflow) {
            self.acc.poison();
        }
        // The canonical tree's root over all N·A micro-batches, then the one division.
        self.acc
            .finish(plan.world_size(), c.gradient_accumulation_steps);
        // A device accumulator is read into host memory (whole, once) only when clipping, for the
        // norm and the clipped slices; otherwise the update takes its slices as they are (fp32
        // without clipping: nothing changes them).
        let grads = self.acc.view(c.gradient_clipping > 0.0 || fp16, inv);
        let (coef, info) = self.clip(comms, &grads, loss_scale)?;
        let overflow = info.skipped;
        if let Some(s) = &mut self.opt.scaler {
            s.update(overflow).map_err(|m| Error::Diverged {
                step: self.clock.step,
                rank: self.rank,
                what: format!(
                    "fp16 gradients overflow at the minimum loss scale {}",
                    m.min_loss_scale
                ),
            })?;
        }
        self.opt.last = info;
        if overflow {
            // Skip: master, working weights and optimizer state stay as they are.
            self.meter.skipped += 1;
            self.end_step();
            return Ok(());
        }
        self.opt.steps += 1;
        let mut updates: Vec<(usize, Publish<Out<C>>)> = Vec::new();
        for (u, unit) in plan.units().iter().enumerate() {
            // Every trainable unit has a slot in the accumulator; a frozen one none.
            let Some(off) = self.layout.acc_offset[u] else {
                continue;
            };
            let len = if stage == 0 {
                unit.len as usize
            } else {
                plan.chunk_len(u) as usize
            };
            // With accumulate_before_reduce the reduced chunk sits at the slot's start too.
            let g = grads.slice(off, len, coef);
            let publish = match (half, stage) {
                (None, 0) if self.opt.device().is_none() => {
                    // The state in host memory: each parameter is taken out of the model (so
                    // burn hands its memory over), stepped there (the same elementwise arithmetic
                    // as over the unit; its padding, zero in the weights, gradients and moments,
                    // stays so either way) and put back before anything else reads the model.
                    let g = g.host();
                    let (offsets, want) = self.parts_wanted(u, 0..len);
                    let mut parts = params::take_data(&mut self.model, &want);
                    // Every part is checked before any is stepped: a refusal leaves the unit as
                    // it was.
                    let found: Option<Vec<&mut [f32]>> = parts
                        .iter_mut()
                        .map(|d| d.as_mut().and_then(|d| d.as_mut_slice::<f32>().ok()))
                        .collect();
                    let stepped = match found {
                        Some(found) => offsets.into_iter().zip(found).try_for_each(|(at, w)| {
                            self.opt.step_host_part(u, lr, at, &g[at..at + w.len()], w)
                        }),
                        None => Err(params::missing(&format!("unit {u}"))),
                    };
                    let tensors = self.part_tensors(u, parts);
                    self.model = params::write_tensors(self.model.clone(), tensors);
                    stepped?;
                    Publish::InPlace
                }
                (None, 1 | 2) if self.opt.device().is_none() && self.device_tensors.is_none() => {
                    // The unit's parameters are taken out of the model (so burn hands their
                    // memory over), the rank's chunk is cut from them, stepped and all-gathered,
                    // and the gathered unit is written into the same memory and put back at
                    // once: with the values they had if the gather fails.
                    let (offsets, want) = self.parts_wanted(u, 0..unit.len as usize);
                    let mut parts = params::take_data(&mut self.model, &want);
                    let mine = self.rank * len..(self.rank + 1) * len;
                    let at = offsets.iter().copied();
                    let gathered = match cut_range(at.zip(parts.iter().map(Option::as_ref)), mine) {
                        Some(mut w) => {
                            let stepped = self.opt.step_host_part(u, lr, 0, &g.host(), &mut w);
                            stepped.and_then(|()| {
                                let world = &mut comms.world;
                                world.all_gather_vec(w).map_err(Error::from)
                            })
                        }
                        None => Err(params::missing(&format!("unit {u}"))),
                    };
                    if let Ok(full) = &gathered {
                        fill_parts(&offsets, &mut parts, full);
                    }
                    let tensors = self.part_tensors(u, parts);
                    self.model = params::write_tensors(self.model.clone(), tensors);
                    gathered?;
                    Publish::InPlace
                }
                (None, 0..=2) => {
                    // The weights are read where the optimizer's state lives: on its device from
                    // the model's tensors, else into host memory.
                    let mine = if stage == 0 {
                        0..len
                    } else {
                        self.rank * len..(self.rank + 1) * len
                    };
                    let mut slab = match self.opt.device().cloned() {
                        Some(d) => {
                            let full = self.unit_tensor(u, &d)?;
                            let w = if stage == 0 { full } else { full.slice(mine) };
                            Slab::Device(Box::new(w))
                        }
                        None => Slab::Host(self.read_unit_range(u, mine)?),
                    };
                    self.opt.step_weights(u, lr, g, &mut slab)?;
                    match (stage, slab) {
                        (0, Slab::Host(w)) => Publish::Write(w),
                        (0, Slab::Device(w)) => Publish::WriteTensor(w),
                        (_, Slab::Host(w)) => Publish::Gather(Elems::F32(w)),
                        (_, slab) => {
                            let hook = self.device_tensors.as_deref();
                            Publish::Gather(weights::piece(hook, Source::F32(&slab), false)?)
                        }
                    }
                }
                (None, _) => {
                    // On NVMe the next trainable unit's shard is read ahead.
                    let units = plan.units();
                    let next = (u + 1..units.len()).find(|&k| units[k].trainable);
                    self.opt
                        .step_weights(u, lr, g, self.sharded.f32_mut(u, next)?)?;
                    Publish::InPlace
                }
                (Some(_), 3) => {
                    // The shard takes the new master rounded, on the device where both live.
                    let sharded = &mut self.sharded;
                    self.opt
                        .step_master(u, lr, g, |m| sharded.round_master(u, m))??;
                    Publish::InPlace
                }
                (Some(h), _) => {
                    // Rounded where the master lives, if its device has the 16-bit type.
                    let on = words_place(h, self.opt.place().clone());
                    let w16 = self
                        .opt
                        .step_master(u, lr, g, |m| Words::round_slab(h, m, &on))?;
                    match (stage, w16) {
                        (0, w16) => match w16.widened(0..len) {
                            Some(t) => Publish::WriteTensor(Box::new(t)),
                            None => Publish::Write(h.widen_all(&w16.bits(h))),
                        },
                        (_, w16) => {
                            let hook = self.device_tensors.as_deref();
                            Publish::Gather(weights::piece(hook, Source::Half(h, &w16), false)?)
                        }
                    }
                }
            };
            updates.push((u, publish));
        }
        // NVMe placement: the store holds the whole stepped state before anything else moves.
        self.opt.settle()?;
        self.publish(comms, updates)
    }

    /// Step 2: the global norm, when clipping and always in fp16 (where a non-finite norm is the
    /// overflow flag): the clipping coefficient of the gradients, and what the step does
    /// (skipped in fp16 on overflow; otherwise a non-finite norm is [`Error::Diverged`]).
    fn clip(
        &self,
        comms: &mut Comms<C>,
        grads: &GradView<'_>,
        loss_scale: f64,
    ) -> Result<(f32, StepInfo)> {
        let plan = &self.plan;
        let c = plan.config();
        let fp16 = self.opt.scaler.is_some();
        let mut coef = 1.0f32;
        let mut overflow = false;
        let mut grad_norm = None;
        // fp16 always checks (the plan schedules the 8-byte partial for it); otherwise only to
        // clip.
        if c.gradient_clipping > 0.0 || fp16 {
            // A non-finite element makes its rank's partial, and so every rank's total,
            // non-finite: every rank sums the same partials in the same order and decides alike.
            let total = global_sum_sq(
                &mut comms.world,
                plan,
                &self.layout.acc_offset,
                self.rank,
                |mut s, at, len| {
                    for i in at..at + len {
                        let g = f64::from(grads.at(i));
                        s += g * g;
                    }
                    s
                },
            )?;
            if !total.is_finite() {
                if !fp16 {
                    return Err(Error::Diverged {
                        step: self.clock.step,
                        rank: self.rank,
                        what: "the global gradient norm is not finite".into(),
                    });
                }
                overflow = true;
            } else if c.gradient_clipping > 0.0 {
                let norm = total.sqrt();
                grad_norm = Some(norm as f32);
                let k = c.gradient_clipping / (norm + 1e-6);
                if k < 1.0 {
                    coef = k as f32;
                }
            }
        }
        let info = StepInfo {
            skipped: overflow,
            loss_scale: loss_scale as f32,
            grad_norm,
        };
        Ok((coef, info))
    }

    /// Step 4: publish every updated unit: stage 3's persistent units gathered from the shard,
    /// the all-gathers of the updated chunks, and the units written into the model in one pass;
    /// then the step is closed.
    fn publish(
        &mut self,
        comms: &mut Comms<C>,
        mut updates: Vec<(usize, Publish<Out<C>>)>,
    ) -> Result<()> {
        let plan = self.plan.clone();
        if plan.stage() == 3 {
            // Persistent units stay gathered: all-gather them after the step.
            for (u, unit) in plan.units().iter().enumerate() {
                if unit.kind == UnitKind::Persistent && unit.trainable {
                    let hook = self.device_tensors.as_deref();
                    let piece = weights::piece(hook, self.sharded.source(u, false, None)?, false)?;
                    updates.push((u, Publish::Gather(piece)));
                }
            }
            // hpZ secondary shards never outlive a weight update; on NVMe the store holds the
            // whole stepped shard.
            self.sharded.clear_secondaries();
            self.sharded.settle()?;
        }
        // The units not yet in the model written back in one pass over it.
        let mut values = params::NewValues::new();
        let mut tensors = params::NewTensors::new();
        for (u, publish) in updates {
            match publish {
                Publish::Write(full) => self.unit_values(u, &full, &mut values),
                Publish::WriteTensor(full) => self.unit_tensors(u, &full, &mut tensors),
                Publish::Gather(piece) => match self.post_step_gather(comms, piece)? {
                    Elems::F32(full) => self.unit_values(u, &full, &mut values),
                    Elems::U16(h, full) => self.unit_values(u, &h.widen_all(&full), &mut values),
                    Elems::Device(buf) => self.install_tensors(u, &buf)?,
                    Elems::DeviceWords(buf) => self.install_words(u, &buf, None)?,
                },
                Publish::InPlace => {}
            }
        }
        if !values.is_empty() {
            self.set_params(values);
        }
        if !tensors.is_empty() {
            let model = self.model.clone();
            self.model = params::write_tensors(model, tensors);
        }
        self.end_step();
        Ok(())
    }

    /// Closes an optimizer step (taken or skipped): samples memory, clears the accumulators.
    fn end_step(&mut self) {
        self.sample_memory();
        self.acc.zero();
        self.clock.micro = 0;
    }
}

/// The global sum of squared gradients, identical on every rank and at every stage: an f64
/// partial per rank over the chunks it owns (`sq(s, at, len)` adds to the running sum `s` the
/// squares of `len` gradient elements from `at` in the accumulator, one by one), summed in rank
/// order. At stage 0 every rank holds every chunk and sums all partials itself; otherwise the
/// partials travel in the plan's 8-byte all-gather.
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
        for (u, off) in acc_offset.iter().enumerate() {
            // Trainable units only: a frozen one has no slot.
            let Some(off) = *off else { continue };
            let cl = plan.chunk_len(u) as usize;
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
        .as_chunks::<8>()
        .0
        .iter()
        .map(|b| f64::from_le_bytes(*b))
        .fold(0.0, |a, b| a + b))
}
