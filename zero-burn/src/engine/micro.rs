//! One micro-step: forward and backward over the segments, in order; what each hands the
//! executor, and what comes back, is in `submit.rs`.

use burn::optim::GradientsParams;
use zero_comm::Communicator;

use super::submit::reductions_in_flight;
use super::{Core, Pending, Ticket, ZeroEngine};
use crate::comms::Exec;
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
