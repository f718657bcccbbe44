//! What a micro-step hands the executor and takes back: each unit's reduction and stage 3's
//! gathers (with prefetch), submitted with a [`Ticket`], and their results applied in
//! submission order. With `micro.rs`, the only code that talks to the executor.

use zero_comm::{Communicator, ReduceOp};
use zero_core::{GroupKind, UnitKind};

use super::layout::ReduceBy;
use super::{Core, Pending, Ticket, UnitStatus, weights, words};
use crate::comms::{Exec, Job, Wire};
use crate::error::Result;
use crate::reduction::Reduction;
use crate::segmented::Segmented;

impl<C: Communicator, M: Segmented> Core<C, M> {
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
        // What the plan's schedule lists for the unit; a frozen unit has neither a slot nor a
        // reduction, so nothing to submit.
        let Some((off, reduce)) = self.layout.reduction(u) else {
            return Ok(());
        };
        let len = self.plan.units()[u].len as usize;
        // The canonical tree sums across ranks and divides once, after the last micro-step;
        // bf16/fp16 always take the mean.
        let op = match (self.options.reduction, self.half()) {
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
            // hook and reduced in the communicator's memory (every micro-step).
            Pending::Tensor(h, t) => {
                let data = self.hook()?.words_of(&t.cast(words::dtype(h)))?;
                let job = match reduce {
                    ReduceBy::AllReduce => Job::AllReduceWords { data, op },
                    ReduceBy::ReduceScatter | ReduceBy::Qgz => Job::ReduceScatterWords {
                        data,
                        op,
                        qgz: reduce == ReduceBy::Qgz,
                    },
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
            match self.half() {
                None => Wire::F32(g),
                Some(h) => Wire::U16(h, h.round_all(&g)),
            }
        };
        let bytes = match &data {
            Wire::F32(v) => v.capacity() as u64 * 4,
            Wire::U16(_, v) => v.capacity() as u64 * 2,
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
        let qwz = plan.config().quantized_weights;
        let hook = (self.device_tensors.as_deref()).filter(|_| exec.device_quant() || !qwz);
        // On NVMe: the shard paged in, the next gather unit in this direction read ahead.
        let units = plan.units();
        let gathered = |k: &usize| units[*k].kind == UnitKind::Gather;
        let next = match backward {
            false => (u + 1..units.len()).find(gathered),
            true => (0..u).rev().find(gathered),
        };
        let job = Job::Gather {
            piece: weights::piece(hook, self.sharded.source(u, hpz, next)?, qwz)?,
            hpz,
            qwz: true,
            device: hook.is_some(),
        };
        exec.submit(job, Ticket::Gather { u, backward })?;
        self.status[u] = UnitStatus::Fetching;
        // In flight: the buffer each collective will return (the unit's length).
        let w = if self.half().is_some() { 2 } else { 4 };
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
pub(super) fn reductions_in_flight<C: Communicator>(exec: &Exec<'_, C, Ticket>) -> (usize, u64) {
    exec.in_flight()
        .filter_map(|t| match t {
            Ticket::Reduce { bytes, .. } => Some(*bytes),
            Ticket::Gather { .. } => None,
        })
        .fold((0, 0), |(n, b), x| (n + 1, b + x))
}
