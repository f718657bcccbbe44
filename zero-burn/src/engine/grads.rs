//! Collecting a segment's parameter gradients from burn into the units' gradient buffers: in
//! host memory, or packed in the communicator's memory by a
//! [`DeviceTensors`](crate::device::DeviceTensors) hook; and the optimizer step from gradients
//! the caller computed ([`ZeroEngine::step_grads`], what burn-train's `Learner` drives).

use std::collections::HashMap;

use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use zero_comm::Communicator;
use zero_core::UnitKind;

use super::micro::Stash;
use super::slab::Place;
use super::{Core, Pending, ZeroEngine, check_lr, words};
use crate::error::{Error, Result};
use crate::params::{self, GradSource};
use crate::precision::{Half, StepInfo};
use crate::segmented::Segmented;

impl<C: Communicator, M: Segmented> ZeroEngine<C, M> {
    /// One optimizer step from gradients computed outside the engine, by a forward and backward
    /// over this rank's copy of the model (the engine's model, or a clone of it: the gradients
    /// are found by [`ParamId`](burn::module::ParamId)), as burn-train's `TrainStep::step` does:
    /// the reductions, the global norm and clipping, the sharded update, the new weights
    /// published into the engine's model. Returns what the step did; the loss is the caller's.
    ///
    /// The gradients must be those of one micro-batch's mean loss, unscaled: the plan must have
    /// `gradient_accumulation_steps = 1` (accumulate before, as burn's `GradientsAccumulator`
    /// does). Refused at stage 3 (the engine gathers the weights for its own forward only; use
    /// [`ZeroEngine::step`]) and in fp16 (the loss scale must multiply the loss before the
    /// backward). A parameter without a gradient counts as zeros, as in [`ZeroEngine::step`]; a
    /// non-finite gradient on this rank is [`Error::Diverged`] (on gradients packed on a device
    /// only the clipping norm, when clipping is on, sees it).
    pub fn step_grads(&mut self, lr: f32, grads: &GradientsParams) -> Result<StepInfo> {
        self.core.check_external_grads()?;
        self.core.check_restored()?;
        check_lr(lr)?;
        let overlap = self.core.plan.config().overlap_comm;
        let max_reduces = usize::from(overlap);
        let segments = self.core.model.num_segments();
        self.with_exec(overlap, |t, exec| {
            let mut pending: Vec<Option<Pending<C::Buffer<f32>>>> =
                (0..t.plan.units().len()).map(|_| None).collect();
            for i in (0..segments).rev() {
                let dq = exec.device_quant();
                t.collect_grads(i, GradSource::Read(grads), &mut pending, None, dq)?;
            }
            // The loss is the caller's, so this rank's gradients stand in for `step`'s check of
            // it (the other ranks learn of it from this rank's dropped communicator).
            for (u, p) in pending.iter().enumerate() {
                if let Some(Pending::Host(g)) = p
                    && g.iter().any(|x| !x.is_finite())
                {
                    return Err(Error::Diverged {
                        step: t.clock.step + 1,
                        rank: t.rank,
                        what: format!("a gradient of unit {u} is not finite"),
                    });
                }
            }
            for i in (0..segments).rev() {
                t.reduce_completed(exec, i, &mut pending, max_reduces)?;
            }
            Ok(())
        })?;
        // The caller's forward updated the buffers (a clone of the engine's model shares them).
        self.sync_buffers()?;
        let core = &mut self.core;
        core.clock.micro += 1;
        core.sample_memory();
        core.clock.micro_losses.clear();
        core.optimizer_step(&mut self.comms, lr)?;
        Ok(core.opt.last)
    }
}

impl<C: Communicator, M: Segmented> Core<C, M> {
    /// The 16-bit type unit `u`'s bf16/fp16 gradients are rounded to and reduced in on the device,
    /// if they are: with a [`DeviceTensors`](crate::device::DeviceTensors) hook that moves 16-bit
    /// words, on a device with the type, reduced every micro-step, not through qgZ (which quantizes
    /// them widened in host memory).
    pub(super) fn words_on_device(&self, u: usize) -> Option<Half> {
        let plan = &self.plan;
        let c = plan.config();
        let h = self.half()?;
        let on_device = words::words_place(h, Place::Device(self.device.clone().inner()))
            .device()
            .is_some();
        let moves = self
            .device_tensors
            .as_ref()
            .is_some_and(|d| d.moves_words());
        let every_micro_step = !(plan.stage() <= 1 && c.accumulate_before_reduce);
        let qgz = c.quantized_gradients && plan.units()[u].kind == UnitKind::Gather;
        (on_device && moves && every_micro_step && !qgz).then_some(h)
    }

    /// Whether unit `u`'s gradients are packed on the device by the
    /// [`DeviceTensors`](crate::device::DeviceTensors) hook.
    pub(super) fn packs_grads_on_device(&self, u: usize, device_quant: bool) -> bool {
        let plan = &self.plan;
        let c = plan.config();
        self.device_tensors.is_some()
            && self.half().is_none()
            && !(plan.stage() <= 1 && c.accumulate_before_reduce)
            && (device_quant
                || !(c.quantized_gradients && plan.units()[u].kind == UnitKind::Gather))
    }

    /// Why [`ZeroEngine::step_grads`] cannot serve this engine, if it cannot.
    pub(crate) fn check_external_grads(&self) -> Result<()> {
        let cfg = self.plan.config();
        let refuse = |field, got: String, expected: &str| {
            Err(Error::Invalid {
                field,
                got,
                expected: expected.into(),
            })
        };
        if self.plan.stage() == 3 {
            return refuse(
                "stage",
                "3".into(),
                "0, 1 or 2 for gradients computed outside the engine (at stage 3 the engine \
                 gathers the weights for its own forward: use step)",
            );
        }
        if self.opt.scaler.is_some() {
            return refuse(
                "precision",
                "fp16".into(),
                "fp32 or bf16 for gradients computed outside the engine (fp16's loss scale must \
                 multiply the loss before the backward: use step)",
            );
        }
        if cfg.gradient_accumulation_steps != 1 {
            return refuse(
                "gradient_accumulation_steps",
                cfg.gradient_accumulation_steps.to_string(),
                "1 for gradients computed outside the engine (accumulate them before the step)",
            );
        }
        Ok(())
    }

    /// Moves the gradients of segment `seg`'s trainable parameters in `gp` (read, or taken out of
    /// it where the engine owns it, so that burn hands their memory over) into their units'
    /// buffers in `pending` (created on first use), on the device where the unit is packed there.
    ///
    /// With a `stash` (activation checkpointing: one backward per segment), the segment's part
    /// of a shared parameter it reads but does not own is added to the stash, and the owner's
    /// backward adds its own part to what the readers left there (burn's order: earlier
    /// backward first). Without (one backward over every segment, or the caller's gradients),
    /// burn has summed the readers' parts already and the owner alone collects them.
    pub(super) fn collect_grads(
        &mut self,
        seg: usize,
        gp: GradSource<'_>,
        pending: &mut [Option<Pending<C::Buffer<f32>>>],
        mut stash: Option<&mut Stash>,
        device_quant: bool,
    ) -> Result<()> {
        let plan = self.plan.clone();
        let mut want = HashMap::new();
        let mut slots = Vec::new();
        let mut owned = Vec::new();
        for (i, p) in self.params.iter().enumerate() {
            let own = self.layout.param_segment[i] == seg;
            let read = stash.is_some() && self.layout.param_readers[i].contains(&seg);
            if p.trainable && (own || read) {
                want.insert(p.id, slots.len());
                slots.push(i);
                owned.push(own);
            }
        }
        let device: Vec<bool> = (0..plan.units().len())
            .map(|u| self.packs_grads_on_device(u, device_quant))
            .collect();
        let words: Vec<Option<Half>> = (0..plan.units().len())
            .map(|u| self.words_on_device(u))
            .collect();
        let hook = self.device_tensors.as_deref();
        let params = &self.params;
        let mut failed = None;
        let mut packed = 0u64;
        let mut put = |i: usize, g: Tensor<1>| {
            let Some((u, off)) = plan.locate(i) else {
                return;
            };
            let (len, off) = (plan.units()[u].len as usize, off as usize);
            let n = g.shape().num_elements();
            let r = if n != params[i].numel() {
                Err(Error::Tensor(format!(
                    "the gradient of `{}` has {n} elements, expected {}: a segment read it \
                     while it was released (stage 3); visit it from every segment that reads it",
                    params[i].path,
                    params[i].numel()
                )))
            } else {
                match (hook, device[u], words[u]) {
                    // Each parameter is collected once, by its owner: a copy.
                    (Some(hook), true, _) => (|| {
                        if pending[u].is_none() {
                            pending[u] = Some(Pending::Device(hook.zeros(len)?));
                        }
                        packed += 4 * n as u64;
                        match &mut pending[u] {
                            Some(Pending::Device(buf)) => hook.copy_in(buf, off, &g),
                            _ => Ok(()),
                        }
                    })(),
                    // Placed in the unit's f32 tensor on the device as `0 + g` (as in host memory).
                    (_, _, Some(h)) => {
                        let p = pending[u].get_or_insert_with(|| {
                            Pending::Tensor(h, Box::new(Tensor::zeros([len], &g.device())))
                        });
                        if let Pending::Tensor(_, t) = p {
                            // Taken out so the tensor is the only handle: burn writes in place.
                            let unit = std::mem::replace(&mut **t, Tensor::empty([0], &g.device()));
                            **t = unit.slice_assign(off..off + n, g.add_scalar(0.0));
                        }
                        packed += 2 * n as u64;
                        Ok(())
                    }
                    // Read where burn's data lies (a Vec of it would be one more copy).
                    _ => (|| {
                        let bad = |e| Error::Tensor(format!("gradient: {e:?}"));
                        let data = g.into_data().try_cast_as::<f32>().map_err(bad)?;
                        let g = data.as_slice::<f32>().map_err(bad)?;
                        let p = pending[u].get_or_insert_with(|| Pending::Host(vec![0.0; len]));
                        if let Pending::Host(buf) = p {
                            super::slab::write_once(&mut buf[off..off + g.len()], g);
                        }
                        Ok(())
                    })(),
                }
            };
            if let Err(e) = r {
                failed.get_or_insert(e);
            }
        };
        params::visit_grads(&self.model, gp, &want, |slot, g| {
            let i = slots[slot];
            let Some(stash) = stash.as_deref_mut() else {
                return put(i, g);
            };
            let g = match stash.remove(&i) {
                Some(earlier) => earlier + g,
                None => g,
            };
            if owned[slot] {
                put(i, g);
            } else {
                stash.insert(i, g);
            }
        });
        // An owned parameter whose gradient came only from the segments that read it.
        if let Some(stash) = stash {
            for (&i, _) in slots.iter().zip(&owned).filter(|(_, own)| **own) {
                if let Some(g) = stash.remove(&i) {
                    put(i, g);
                }
            }
        }
        self.meter.device_grad_bytes += packed;
        failed.map_or(Ok(()), Err)
    }
}
