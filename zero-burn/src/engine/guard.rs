//! The guards around the user's forwards: the recompute guard (activation checkpointing must
//! reproduce every segment's forward bit for bit) and the read guard (a segment reads only the
//! parameters it visits).
//!
//! - **Recompute.** The first forward checksums every output activation the backward will
//!   recompute (a crc32c of its bytes, [`Activation::checksum`]); the recompute's output must
//!   have the same checksum, and the last segment's loss the same bits. Otherwise the step fails
//!   with [`Error::RecomputeMismatch`] naming the segment. With qwZ and hpZ at stage 3 the
//!   backward re-gathers the weights from the hpZ group through the int8 codec again, so the
//!   recompute runs on weights quantized twice (ZeRO++'s trade, within qwZ's bound) and is not
//!   compared.
//! - **Reads.** A segment's backward that yields a gradient for a parameter the segment does not
//!   visit (another segment's, read without declaring it) fails the step with
//!   [`Error::UndeclaredRead`] instead of dropping the gradient. At stage 3 such a read finds
//!   the parameter released and usually panics inside the user's forward; the engine catches the
//!   panic and finds the parameter by running the segment again on a copy of the model with
//!   zeros of the right shapes standing in for the released parameters, each requiring a
//!   gradient: the one that gets a gradient is the one the segment read.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use burn::module::ParamId;
use burn::optim::GradientsParams;
use zero_comm::Communicator;
use zero_core::UnitKind;

use super::{Core, UnitStatus};
use crate::error::{Error, Result};
use crate::params::{self, GradSource};
use crate::segmented::{Activation, SegmentOut, Segmented};

impl<C: Communicator, M: Segmented> Core<C, M> {
    /// Whether recomputes are compared with their forwards: when the check is on
    /// ([`crate::EngineBuilder::recompute_check`]), but not with qwZ and hpZ at stage 3.
    pub(super) fn recompute_guarded(&self) -> bool {
        let c = self.plan.config();
        self.options.recompute_check && !(self.plan.stage() == 3 && c.quantized_weights && c.hpz())
    }

    /// Fails the step unless segment `segment`'s recomputed loss equals the forward's bit for
    /// bit.
    pub(super) fn check_recomputed_loss(
        &self,
        segment: usize,
        forward: f32,
        recomputed: burn::tensor::Tensor<1>,
    ) -> Result<()> {
        if !self.recompute_guarded() {
            return Ok(());
        }
        let recomputed = crate::segmented::loss_value(recomputed)?;
        if recomputed.to_bits() == forward.to_bits() {
            return Ok(());
        }
        Err(self.mismatch(
            segment,
            format!("the loss {recomputed:e} differs from the forward's {forward:e}"),
        ))
    }

    /// Fails the step unless segment `segment`'s recomputed output has the checksum its forward's
    /// had (`None`: not checked).
    pub(super) fn check_recomputed_output(
        &self,
        segment: usize,
        forward: Option<u32>,
        recomputed: &M::Act,
    ) -> Result<()> {
        let Some(forward) = forward else {
            return Ok(());
        };
        let got = recomputed.checksum(0);
        if got == forward {
            return Ok(());
        }
        Err(self.mismatch(
            segment,
            format!("its output's checksum {got:08x} differs from the forward's {forward:08x}"),
        ))
    }

    fn mismatch(&self, segment: usize, what: String) -> Error {
        Error::RecomputeMismatch {
            step: self.clock.step + 1,
            micro: self.clock.micro,
            rank: self.rank,
            segment,
            what,
        }
    }

    /// Fails the step if `gp`, segment `seg`'s gradients after the engine collected those of the
    /// parameters it visits, still holds one: of a parameter the segment read without visiting.
    pub(super) fn check_no_stray_grads(&self, seg: usize, gp: &GradientsParams) -> Result<()> {
        if gp.is_empty() {
            return Ok(());
        }
        let want: HashMap<ParamId, usize> = (0..self.params.len())
            .filter(|&i| !self.layout.param_readers[i].contains(&seg))
            .map(|i| (self.params[i].id, i))
            .collect();
        let mut found = None;
        params::visit_grads(&self.model, GradSource::Read(gp), &want, |i, _| {
            found.get_or_insert(i);
        });
        let i = found.ok_or_else(|| {
            Error::Internal(format!(
                "segment {seg}'s backward left {} gradients uncollected",
                gp.len()
            ))
        })?;
        Err(self.undeclared(i, seg, "its backward produced a gradient for it"))
    }

    fn undeclared(&self, i: usize, reader: usize, found: &'static str) -> Error {
        Error::UndeclaredRead {
            path: self.params[i].path.clone(),
            owner: self.layout.param_segment[i],
            reader,
            found,
        }
    }

    /// Runs `f`, the user's forward of segment `i` on input `x`. If it panics at stage 3 because
    /// it read a released parameter it does not visit, the step fails with
    /// [`Error::UndeclaredRead`]; any other panic goes on unwinding.
    pub(super) fn guarded(
        &self,
        i: usize,
        batch: &M::Batch,
        x: Option<M::Act>,
        f: impl FnOnce(Option<M::Act>) -> SegmentOut<M::Act, M::Output>,
    ) -> Result<SegmentOut<M::Act, M::Output>> {
        let again = (self.plan.stage() == 3).then(|| x.clone());
        match catch_unwind(AssertUnwindSafe(|| f(x))) {
            Ok(out) => Ok(out),
            Err(panic) => match again.and_then(|x| self.released_read(i, batch, x)) {
                Some(p) => Err(self.undeclared(
                    p,
                    i,
                    "its forward read it while it was released: stage 3 gathers for a segment \
                     only the parameters it visits",
                )),
                None => resume_unwind(panic),
            },
        }
    }

    /// The released parameter (stage 3) that segment `i`'s forward reads without visiting it,
    /// found on a copy of the model where zeros requiring a gradient stand in for every released
    /// parameter the segment does not visit; `None` if none gets a gradient.
    fn released_read(&self, i: usize, batch: &M::Batch, x: Option<M::Act>) -> Option<usize> {
        let plan = &self.plan;
        let released: Vec<usize> = (0..self.params.len())
            .filter(|&p| !self.layout.param_readers[p].contains(&i))
            .filter(|&p| {
                plan.locate(p).is_some_and(|(u, _)| {
                    plan.units()[u].kind == UnitKind::Gather
                        && self.status[u] != UnitStatus::Installed
                })
            })
            .collect();
        if released.is_empty() {
            return None;
        }
        let stand_ins = released
            .iter()
            .map(|&p| {
                let info = &self.params[p];
                (info.id, (vec![0.0; info.numel()], info.shape.clone(), true))
            })
            .collect();
        // A deep copy: the probe's forward must not touch the engine's buffers.
        let probe = params::write_values(crate::launch::deep_copy(&self.model), stand_ins);
        let grads = catch_unwind(AssertUnwindSafe(|| {
            let scalar = match probe.forward_segment(i, batch, x) {
                SegmentOut::Loss(l) | SegmentOut::LossAnd(l, _) => l.sum(),
                SegmentOut::Next(y) => {
                    let zeros = y.zeros();
                    y.dot(&zeros)
                }
            };
            scalar.backward()
        }))
        .ok()?;
        let gp = GradientsParams::from_grads(grads, &probe);
        let want: HashMap<ParamId, usize> =
            released.iter().map(|&p| (self.params[p].id, p)).collect();
        let mut found = None;
        params::visit_grads(&probe, GradSource::Read(&gp), &want, |p, _| {
            found.get_or_insert(p);
        });
        found
    }
}
