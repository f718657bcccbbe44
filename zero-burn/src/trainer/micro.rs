//! One micro-step: forward and backward over the segments, the gathers and the reductions.
//! The only code that talks to the executor.

use burn::optim::GradientsParams;
use zero_comm::{Communicator, ReduceOp};
use zero_core::{GroupKind, UnitKind};

use super::layout::ReduceBy;
use super::sharded::Source;
use super::{Core, Pending, Ticket, UnitStatus, ZeroEngine, words};
use crate::comms::{Elems, Exec, Job};
use crate::error::{Error, Result};
use crate::params::GradSource;
use crate::reduction::Reduction;
use crate::segmented::{Activation, SegmentOut, Segmented};

impl<C: Communicator, M: Segmented> ZeroEngine<C, M> {
    pub(super) fn micro_step(&mut self, batch: &M::Batch) -> Result<f32> {
        let overlap = self.core.plan.config().overlap_comm;
        let r = self.with_exec(overlap, |core, exec| core.micro_step_with(exec, batch));
        let loss = r?;
        self.sync_buffers()?;
        self.core.clock.micro += 1;
        self.core.sample_memory();
        Ok(loss)
    }
}

impl<C: Communicator, M: Segmented> Core<C, M> {
    pub(super) fn micro_step_with(
        &mut self,
        exec: &mut Exec<'_, C, Ticket>,
        batch: &M::Batch,
    ) -> Result<f32> {
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
        let scale = scale * self.opt.scaler.as_ref().map_or(1.0, |s| s.scale() as f32);
        // With overlap, one reduction may be in flight while the next bucket fills (the plan's
        // doubled reduction buffer); inline, each is applied as soon as it is submitted.
        let max_reduces = usize::from(plan.config().overlap_comm);
        if !plan.config().recompute() {
            return self.micro_step_one_graph(exec, batch, scale, max_reduces);
        }
        let fwd = self.forward(exec, batch, true)?;
        // The buffers as the forward left them: the recompute updates them again.
        let buffers = self.has_buffers().then(|| self.snapshot_buffers());
        // Backward, recomputing each segment from the first that takes a gradient on (the
        // segments before it are neither recomputed nor back-propagated: their outputs are kept).
        let from = self.layout.order.backward_from;
        let mut pending: Vec<Option<Pending<C::Buffer<f32>>>> =
            (0..plan.units().len()).map(|_| None).collect();
        let mut stash = Stash::new();
        let mut grad_out: Option<M::Act> = None;
        for i in (from..segments).rev() {
            if stage3 {
                self.gather_segment(exec, i, true)?;
            }
            // The first segment that runs a backward needs no gradient for its input.
            let x = (i > 0).then(|| match i > from {
                true => fwd.acts[i - 1].leaf(),
                false => fwd.acts[i - 1].clone(),
            });
            let out = self.seeded_forward(&self.model, i, true, batch, x.clone())?;
            let surrogate = match (out, &grad_out) {
                (SegmentOut::Loss(l) | SegmentOut::LossAnd(l, _), None) => {
                    self.check_recomputed_loss(i, fwd.loss, l.clone())?;
                    l.mul_scalar(scale).sum()
                }
                (SegmentOut::Next(y), Some(g)) => {
                    self.check_recomputed_output(i, fwd.sums[i], &y)?;
                    y.dot(g)
                }
                (_, g) => return Err(crate::segmented::wrong_output(i, segments, g.is_none())),
            };
            let grads = surrogate.backward();
            grad_out = x.as_ref().filter(|_| i > from).and_then(|x| x.grad(&grads));
            if i > from && grad_out.is_none() {
                return Err(Error::NoInputGradient { segment: i });
            }
            let mut gp = GradientsParams::from_grads(grads, &self.model);
            self.collect_grads(
                i,
                GradSource::Take(&mut gp),
                &mut pending,
                Some(&mut stash),
                exec.device_quant(),
            )?;
            self.check_no_stray_grads(i, &gp)?;
            drop(gp);
            if stage3 {
                self.release_where(i, |o, u| o.released_after_backward(u, i));
            }
            self.reduce_completed(exec, i, &mut pending, max_reduces)?;
        }
        if let Some(b) = buffers {
            self.restore_buffers(b);
        }
        Ok(fwd.loss)
    }

    /// Submits the reductions of the units segment `i`'s backward completed, keeping at most
    /// `max_reduces` in flight.
    pub(super) fn reduce_completed(
        &mut self,
        exec: &mut Exec<'_, C, Ticket>,
        i: usize,
        pending: &mut [Option<Pending<C::Buffer<f32>>>],
        max_reduces: usize,
    ) -> Result<()> {
        for u in self.layout.completes_at[i].clone() {
            let g = pending[u]
                .take()
                .unwrap_or_else(|| Pending::Host(vec![0.0; self.plan.units()[u].len as usize]));
            self.submit_reduce(exec, u, g)?;
            while reductions_in_flight(exec).0 > max_reduces {
                self.complete_one(exec)?;
            }
        }
        Ok(())
    }

    /// A micro-step without activation checkpointing: one autodiff graph over every segment
    /// (stage 3: each segment's units gathered before it runs and kept until the backward is
    /// done), one backward, then every unit's reduction in the order the segment-wise backward
    /// issues them (last segment first).
    pub(super) fn micro_step_one_graph(
        &mut self,
        exec: &mut Exec<'_, C, Ticket>,
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
                self.seeded_forward(&self.model, i, true, batch, x.take())?,
                i + 1 == segments,
            ) {
                (SegmentOut::Loss(l) | SegmentOut::LossAnd(l, _), true) => loss = Some(l),
                (SegmentOut::Next(y), false) => x = Some(y),
                (_, last) => return Err(crate::segmented::wrong_output(i, segments, last)),
            }
        }
        let loss = loss.ok_or_else(|| crate::segmented::wrong_output(0, segments, true))?;
        let value = crate::segmented::loss_value(loss.clone())?;
        let grads = loss.mul_scalar(scale).sum().backward();
        let mut gp = GradientsParams::from_grads(grads, &self.model);
        let mut pending: Vec<Option<Pending<C::Buffer<f32>>>> =
            (0..plan.units().len()).map(|_| None).collect();
        // One graph: burn summed the gradients of a shared parameter over its readers; its owner
        // collects them.
        for i in (0..segments).rev() {
            self.collect_grads(
                i,
                GradSource::Take(&mut gp),
                &mut pending,
                None,
                exec.device_quant(),
            )?;
        }
        drop(gp);
        for i in (0..segments).rev() {
            if stage3 {
                self.release_where(i, |o, u| o.released_after_backward(u, i));
            }
            self.reduce_completed(exec, i, &mut pending, max_reduces)?;
        }
        Ok(value)
    }

    /// The forward pass segment by segment (stage 3: gathered before, released after), keeping
    /// only the activations between segments.
    ///
    /// `train`: the first forward of activation checkpointing, in training mode exactly as the
    /// recompute will run it (BatchNorm on batch statistics, updating its running statistics;
    /// Dropout drawing from the seeded generator), on the autodiff device with no parameter
    /// requiring a gradient, so no graph is kept; shared units stay gathered for the backward,
    /// and the outputs the recompute will reproduce are checksummed for its guard. Otherwise an
    /// evaluation: the model made `valid()` (inference mode, no autodiff).
    pub(super) fn forward(
        &mut self,
        exec: &mut Exec<'_, C, Ticket>,
        batch: &M::Batch,
        train: bool,
    ) -> Result<Forward<M>> {
        let stage3 = self.plan.stage() == 3;
        let segments = self.model.num_segments();
        let guard = train && self.recompute_guarded();
        let mut fwd: Forward<M> = Forward {
            loss: 0.0,
            acts: Vec::with_capacity(segments),
            output: None,
            sums: vec![None; segments],
        };
        for i in 0..segments {
            if stage3 {
                self.gather_segment(exec, i, false)?;
            }
            // No parameter requires a gradient: a graph recorded here would never be consumed,
            // and it would keep the released weights alive. The backward recomputes the segment
            // with gradients.
            let x = (i > 0).then(|| fwd.acts[i - 1].clone());
            let out = if train {
                let model = self.model.clone().no_grad();
                self.seeded_forward(&model, i, false, batch, x)?
            } else {
                let model = self.model.valid();
                self.guarded(i, batch, x, |x| model.forward_segment(i, batch, x))?
            };
            match (out, i + 1 == segments) {
                (SegmentOut::Loss(l), true) => fwd.loss = crate::segmented::loss_value(l)?,
                (SegmentOut::LossAnd(l, o), true) => {
                    fwd.loss = crate::segmented::loss_value(l)?;
                    fwd.output = Some(o);
                }
                (SegmentOut::Next(y), false) => {
                    // Recomputed (and so checked) from the first segment that runs a backward.
                    if guard && i >= self.layout.order.backward_from {
                        fwd.sums[i] = Some(y.checksum(0));
                    }
                    fwd.acts.push(y);
                }
                (_, last) => return Err(crate::segmented::wrong_output(i, segments, last)),
            }
            if stage3 {
                self.release_where(i, |o, u| o.released_after_forward(u, i, train));
            }
        }
        Ok(fwd)
    }

    /// Submits the reduction of unit `u`'s gradients `g` of this micro-step (stage 0: an
    /// all-reduce; 1–3: a reduce-scatter, through qgZ for gather units when it is on; with
    /// `accumulate_before_reduce` at stages 0–1, only after the last micro-step). The result is
    /// applied to the accumulator by [`Self::complete_one`].
    pub(super) fn submit_reduce(
        &mut self,
        exec: &mut Exec<'_, C, Ticket>,
        u: usize,
        g: Pending<C::Buffer<f32>>,
    ) -> Result<()> {
        let off = self.layout.acc_offset[u].expect("only trainable units are reduced");
        // What the plan's schedule lists for the unit (checked at build: every trainable unit
        // has one).
        let reduce = self.layout.reduce[u].expect("the schedule reduces every trainable unit");
        let len = self.plan.units()[u].len as usize;
        // The canonical tree sums across ranks and divides once, after the last micro-step;
        // bf16/fp16 always take the mean.
        let op = match (self.options.reduction, self.half) {
            (Reduction::CanonicalTree, None) => ReduceOp::Sum,
            _ => ReduceOp::Mean,
        };
        // The job, the gradient buffer in reduction (as allocated), and whether its result
        // overwrites the accumulator's slot.
        let (job, bytes, overwrite) = match g {
            Pending::Host(g) => match self.host_job(g, off, len, reduce, op) {
                Some(submit) => submit,
                None => return Ok(()),
            },
            // bf16/fp16 gathered in an f32 tensor on the device: rounded there, handed to the
            // hook and reduced in the communicator's memory (plain, every micro-step).
            Pending::Tensor(t) => {
                let h = self.half.ok_or_else(|| {
                    Error::Internal(format!("unit {u}: a 16-bit gradient in an fp32 trainer"))
                })?;
                let data = self.hook()?.words_of(&t.cast(words::dtype(h)))?;
                let job = match reduce {
                    ReduceBy::AllReduce => Job::AllReduceWords { data, op },
                    ReduceBy::ReduceScatter => Job::ReduceScatterWords { data, op },
                    ReduceBy::Qgz => {
                        return Err(Error::Internal(format!(
                            "unit {u}: qgZ on 16-bit words in the communicator's memory"
                        )));
                    }
                };
                (job, len as u64 * 2, false)
            }
            // Packed on the device (fp32, reduced every micro-step, no qgZ): reduce it there.
            Pending::Device(data) => {
                let job = match reduce {
                    ReduceBy::AllReduce => Job::AllReduceDevice { data, op },
                    ReduceBy::ReduceScatter | ReduceBy::Qgz => Job::ReduceScatterDevice {
                        data,
                        op,
                        qgz: reduce == ReduceBy::Qgz,
                    },
                };
                // Allocated by the hook with the unit's length.
                (job, len as u64 * 4, false)
            }
        };
        self.track_comm_buffer(reductions_in_flight(exec).1 + bytes);
        exec.submit(
            job,
            Ticket::Reduce {
                off,
                overwrite,
                bytes,
            },
        )
    }

    /// [`Self::submit_reduce`]'s job for gradients `g` in host memory, with its buffer's bytes and
    /// whether it overwrites; `None` while `accumulate_before_reduce` (stages 0–1) defers the
    /// reduction to the last micro-step.
    fn host_job(
        &mut self,
        g: Vec<f32>,
        off: usize,
        len: usize,
        reduce: ReduceBy,
        op: ReduceOp,
    ) -> Option<(Job<C>, u64, bool)> {
        let c = self.plan.config();
        let defer = self.plan.stage() <= 1 && c.accumulate_before_reduce;
        let last_micro = self.clock.micro + 1 == c.gradient_accumulation_steps;
        let data = if defer {
            // Add into the full-unit accumulator; reduce it (once) after the last micro-step,
            // written over the slot's start.
            self.acc.add_local(off, &g);
            if !last_micro {
                return None;
            }
            self.acc.wire(off..off + len)
        } else {
            match self.half {
                None => Elems::F32(g),
                Some(h) => Elems::U16(h.round_all(&g)),
            }
        };
        let bytes = match &data {
            Elems::F32(v) => v.capacity() as u64 * 4,
            Elems::U16(v) => v.capacity() as u64 * 2,
            Elems::Device(_) => len as u64 * 4,
            Elems::DeviceWords(_) => len as u64 * 2,
        };
        let job = match reduce {
            ReduceBy::AllReduce => Job::AllReduce { data, op },
            ReduceBy::ReduceScatter | ReduceBy::Qgz => Job::ReduceScatter {
                data,
                op,
                qgz: reduce == ReduceBy::Qgz,
            },
        };
        Some((job, bytes, defer))
    }

    /// Waits for the oldest collective in flight and applies its result: a gathered unit is
    /// installed in the model, a reduced gradient goes into the accumulator.
    pub(super) fn complete_one(&mut self, exec: &mut Exec<'_, C, Ticket>) -> Result<()> {
        let Some((ticket, words)) = exec.next()? else {
            return Ok(());
        };
        match ticket {
            Ticket::Gather { u, backward } => self.install(u, backward, words)?,
            Ticket::Reduce { off, overwrite, .. } => {
                self.acc.apply(off, words, overwrite, self.clock.micro)?
            }
        }
        Ok(())
    }

    /// Applies everything in flight.
    pub(super) fn settle_all(&mut self, exec: &mut Exec<'_, C, Ticket>) -> Result<()> {
        while exec.in_flight().next().is_some() {
            self.complete_one(exec)?;
        }
        Ok(())
    }

    /// Submits the all-gather of stage-3 unit `u` unless it is installed or already on its way:
    /// from the rank's shard over the world, or for the backward from the hpZ secondary shard
    /// within the hpZ group. Its elements count as gathered from here on.
    pub(super) fn submit_gather(
        &mut self,
        exec: &mut Exec<'_, C, Ticket>,
        u: usize,
        backward: bool,
    ) -> Result<()> {
        if self.status[u] != UnitStatus::Released {
            return Ok(());
        }
        let plan = self.plan.clone();
        // The backward's group is the schedule's: the hpZ group, from the secondary shard.
        let hpz = backward && self.layout.backward_gather[u] == Some(GroupKind::Hpz);
        // fp32 (qwZ only with device codecs): gathered into the communicator's memory, installed
        // from there.
        let device = self.device_tensors.is_some()
            && (exec.device_quant() || !plan.config().quantized_weights);
        if !hpz {
            // On NVMe: the shard paged in, the next gather unit in this direction read ahead.
            let units = plan.units();
            let gathered = |k: &usize| units[*k].kind == UnitKind::Gather;
            let next = match backward {
                false => (u + 1..units.len()).find(gathered),
                true => (0..u).rev().find(gathered),
            };
            self.sharded.page(u, next, false)?;
        }
        let job = match self.sharded.source(u, hpz)? {
            Source::F32(slab) if device => Job::GatherDevice {
                piece: self.device_piece(slab)?,
                hpz,
                qwz: true,
            },
            Source::F32(slab) => Job::Gather {
                piece: Elems::F32(slab.read(0..slab.len())),
                hpz,
            },
            // 16-bit words gathered on the device where they live and the hook moves them (not
            // through qwZ, which quantizes them widened in host memory).
            Source::Half(h, words) => {
                let piece = match plan.config().quantized_weights {
                    true => None,
                    false => self.words_piece(words)?,
                };
                match piece {
                    Some(piece) => Job::GatherDevice {
                        piece,
                        hpz,
                        qwz: false,
                    },
                    None => Job::Gather {
                        piece: Elems::U16(words.bits(h).into_owned()),
                        hpz,
                    },
                }
            }
        };
        exec.submit(job, Ticket::Gather { u, backward })?;
        self.status[u] = UnitStatus::Fetching;
        // In flight: the buffer each collective will return (the unit's length).
        let w = if self.half.is_some() { 2 } else { 4 };
        let fetching: u64 = exec
            .in_flight()
            .map(|t| match t {
                Ticket::Gather { u, .. } => plan.units()[*u].len,
                Ticket::Reduce { .. } => 0,
            })
            .sum();
        let live = self.meter.gathered_bytes + fetching * w;
        self.meter.peak.gathered_working_set = self.meter.peak.gathered_working_set.max(live);
        Ok(())
    }

    /// Makes the gather units segment `seg` needs resident (its own, and the shared units it
    /// reads), then submits the prefetch of the next gather unit in execution order when the plan
    /// allows it (with `overlap_comm` it arrives while the segment computes; see
    /// [`zero_core::GatherOrder::prefetch`]).
    pub(super) fn gather_segment(
        &mut self,
        exec: &mut Exec<'_, C, Ticket>,
        seg: usize,
        backward: bool,
    ) -> Result<()> {
        let units = self.layout.order.needs[seg].clone();
        for &u in &units {
            self.submit_gather(exec, u, backward)?;
        }
        for &u in &units {
            while self.status[u] == UnitStatus::Fetching {
                self.complete_one(exec)?;
            }
        }
        if let Some(v) = self.layout.order.prefetch(&self.plan, seg, backward) {
            self.submit_gather(exec, v, backward)?;
        }
        self.sample_memory();
        Ok(())
    }
}

/// The reductions in flight: how many, and the bytes of their gradient buffers.
fn reductions_in_flight<C: Communicator>(exec: &Exec<'_, C, Ticket>) -> (usize, u64) {
    exec.in_flight()
        .filter_map(|t| match t {
            Ticket::Reduce { bytes, .. } => Some(*bytes),
            Ticket::Gather { .. } => None,
        })
        .fold((0, 0), |(n, b), x| (n + 1, b + x))
}

/// What the forward pass keeps.
pub(super) struct Forward<M: Segmented> {
    /// The loss.
    pub(super) loss: f32,
    /// The activations between segments.
    pub(super) acts: Vec<M::Act>,
    /// The last segment's output, when it returned one.
    pub(super) output: Option<M::Output>,
    /// Per segment: the checksum of its output activation, for the recompute guard (`None` where
    /// it is not checked).
    pub(super) sums: Vec<Option<u32>>,
}

/// Gradients of shared parameters (tied weights) from the segments that read them but do not own
/// them, summed in backward order, until the owner's backward adds its own (activation
/// checkpointing); by parameter index.
pub(super) type Stash = std::collections::HashMap<usize, burn::tensor::Tensor<1>>;
