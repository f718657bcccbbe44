//! Train-mode layers: the seeded forwards that make a recompute replay its forward (see
//! [`crate::rng`]), the check that it did, and the model's buffers: module state that is not a
//! parameter (burn's `RunningState`, e.g. BatchNorm's running mean and variance), updated by the
//! training forward, never by the optimizer.
//!
//! - They are in no unit of the plan at any stage (zero-core's `ParamDesc::buffer`): every rank
//!   holds them whole, stage 3 never releases, gathers or overwrites them, and checkpoints save
//!   them once, like frozen parameters at stages 0–2.
//! - Only the real forward updates them: the backward's recompute (activation checkpointing) runs
//!   the segment in training mode again, so the engine puts back the values the forward left.
//! - After every micro-step's forward they are made equal across ranks by [`BufferSync`]: rank 0's
//!   values (DDP's default, `broadcast_buffers=True`), or the mean over ranks. Every forward
//!   therefore starts from the same buffers on every rank, and checkpoints, `consolidated_model()`,
//!   `eval` and exports see one consistent set. The collective is booked as other traffic
//!   ([`RankReport::other_traffic`](super::RankReport::other_traffic)): it is not in the plan's
//!   step traffic. Batch statistics computed across ranks (SyncBatchNorm) are not offered yet: each
//!   rank normalises with its own micro-batch's statistics, as DDP does without SyncBatchNorm.

use std::collections::HashMap;

use burn::module::ParamId;
use serde::Serialize;
use zero_comm::{Communicator, ReduceOp};

use super::{Core, ZeroEngine};
use crate::error::Result;
use crate::params;
use crate::segmented::{SegmentOut, Segmented};

/// How the model's buffers are kept equal across ranks after each micro-step's forward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub enum BufferSync {
    /// Every rank takes rank 0's buffers (PyTorch DDP's `broadcast_buffers=True`).
    #[default]
    Broadcast,
    /// Every rank takes the mean of the ranks' buffers (summed in rank order, then divided by
    /// the world size, in f32).
    Average,
}

impl<C: Communicator, M: Segmented> Core<C, M> {
    /// Runs segment `i` of `model` with the device's generator seeded for this step, micro-step,
    /// segment and rank (see [`crate::rng`]): the first forward, the recompute and the forward
    /// without checkpointing draw the same numbers. `graph`: whether the forward records a graph
    /// (not the checkpointed first forward); forwards that draw nothing run unseeded, in parallel
    /// with the other in-process ranks (`crate::rng::Draws`). It runs under the read guard
    /// ([`Self::guarded`]).
    pub(super) fn seeded_forward(
        &self,
        model: &M,
        i: usize,
        graph: bool,
        batch: &M::Batch,
        x: Option<M::Act>,
    ) -> Result<SegmentOut<M::Act, M::Output>> {
        let seed = crate::rng::segment_seed(
            self.options.seed,
            self.clock.step,
            self.clock.micro as usize,
            i,
            self.rank,
        );
        self.guarded(i, batch, x, |x| {
            self.draws.run(&self.device, seed, i, graph, || {
                model.forward_segment(i, batch, x)
            })
        })
    }

    /// The buffers' ids, numbered in visit order.
    fn buffer_slots(&self) -> HashMap<ParamId, usize> {
        self.params
            .iter()
            .filter(|p| p.buffer)
            .enumerate()
            .map(|(k, p)| (p.id, k))
            .collect()
    }

    /// Whether the model has buffers.
    pub(super) fn has_buffers(&self) -> bool {
        self.params.iter().any(|p| p.buffer)
    }

    /// The buffers as the forward left them (burn's pending updates settled), where they live:
    /// what [`Self::restore_buffers`] puts back after a recompute.
    pub(super) fn snapshot_buffers(&self) -> params::NewTensors {
        params::settle_buffers(&self.model);
        params::read_tensors(&self.model, &self.buffer_slots())
    }

    /// Puts back buffers taken by [`Self::snapshot_buffers`], dropping whatever a recompute
    /// recorded since.
    pub(super) fn restore_buffers(&mut self, snapshot: params::NewTensors) {
        params::settle_buffers(&self.model);
        let model = self.model.clone();
        self.model = params::write_tensors(model, snapshot);
    }
}

impl<C: Communicator, M: Segmented> ZeroEngine<C, M> {
    /// Makes the buffers equal across ranks by the engine's [`BufferSync`] (collective; every rank
    /// calls it after each micro-step). Booked as other traffic.
    pub(super) fn sync_buffers(&mut self) -> Result<()> {
        if !self.core.has_buffers() {
            return Ok(());
        }
        params::settle_buffers(&self.core.model);
        if self.core.plan.world_size() == 1 {
            return Ok(());
        }
        let slots = self.core.buffer_slots();
        let values = params::read_values(&self.core.model, &slots)?;
        let lens: Vec<usize> = values.iter().map(Vec::len).collect();
        let mut flat: Vec<f32> = values.into_iter().flatten().collect();
        let sync = self.core.options.buffers;
        self.untracked(|e| {
            let world = &mut e.comms.world;
            match sync {
                BufferSync::Broadcast => world.broadcast_host(&mut flat, 0)?,
                BufferSync::Average => world.all_reduce_host(&mut flat, ReduceOp::Mean)?,
            }
            Ok(())
        })?;
        let mut rest = flat.as_slice();
        let mut values = params::NewValues::with_capacity(slots.len());
        let buffers = self.core.params.iter().filter(|p| p.buffer);
        for (p, len) in buffers.zip(lens) {
            let (mine, tail) = rest.split_at(len);
            rest = tail;
            values.insert(p.id, (mine.to_vec(), p.shape.clone(), false));
        }
        self.core.set_params(values);
        Ok(())
    }
}
