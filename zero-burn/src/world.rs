//! Launching N ranks in one process on the host loopback.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use zero_comm::Communicator;
use zero_comm::ReduceOrder;
use zero_comm::host::HostWorld;
use zero_core::{Plan, TrafficTable};

use crate::data::Corpus;
use crate::error::{Error, Result};
use crate::model::Segmented;
use crate::reduction::{Reduction, canonical_sum};
use crate::trainer::{MeasuredMemory, RankTrainer, TrainOptions};

/// What one rank reports after training.
#[derive(Debug)]
pub struct RankResult<M> {
    /// The rank.
    pub rank: usize,
    /// This rank's mean loss per step.
    pub losses: Vec<f32>,
    /// This rank's unscaled loss of each micro-step, per step (for [`global_losses`]).
    pub micro_losses: Vec<Vec<f32>>,
    /// Traffic measured over all steps.
    pub traffic: TrafficTable,
    /// Peak measured memory.
    pub memory: MeasuredMemory,
    /// The final model (stage 3: gather units released).
    pub model: M,
    /// Every parameter's final values, indexed like the plan's model (for equivalence checks);
    /// empty unless [`HostRun::keep_final_params`].
    pub final_params: Vec<Vec<f32>>,
}

/// How long to run and what to keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostRun {
    /// Optimizer steps.
    pub steps: u64,
    /// Timeout of every collective.
    pub timeout: Duration,
    /// Gather every parameter at the end into [`RankResult::final_params`].
    pub keep_final_params: bool,
}

/// Trains `steps` optimizer steps with one thread per rank on the host loopback. Every rank starts
/// from a clone of `model`. The loopback sums in the order `options.reduction` needs (rank order,
/// or the pairwise tree for [`Reduction::CanonicalTree`]). `on_step(step, mean_loss)` is called by rank 0 after each step.
pub fn train_host<M: Segmented>(
    plan: Arc<Plan>,
    model: M,
    corpus: &dyn Corpus,
    options: TrainOptions,
    run: HostRun,
    on_step: &(dyn Fn(u64, f32) + Sync),
) -> Result<Vec<RankResult<M>>> {
    let HostRun {
        steps,
        timeout,
        keep_final_params,
    } = run;
    // burn modules are Send but not Sync: hand each rank its own clone through a mutex.
    let models: Mutex<Vec<Option<M>>> = Mutex::new(
        (0..plan.world_size())
            .map(|_| Some(model.clone()))
            .collect(),
    );
    let order = match options.reduction {
        Reduction::RankOrdered => ReduceOrder::RankSequential,
        Reduction::CanonicalTree => ReduceOrder::PairwiseTree,
    };
    let results = HostWorld::new(*plan.topology(), timeout)
        .with_reduce_order(order)
        .launch(|comm| -> Result<RankResult<M>> {
            let rank = comm.rank();
            let mine = models.lock().unwrap_or_else(|e| e.into_inner())[rank].take();
            let mine = mine.ok_or_else(|| Error::Model(format!("rank {rank} launched twice")))?;
            let mut t = RankTrainer::new(plan.clone(), comm, mine, options)?;
            let mut losses = Vec::with_capacity(steps as usize);
            let mut micro_losses = Vec::with_capacity(steps as usize);
            for s in 0..steps {
                let l = t.train_step(corpus)?;
                if t.rank() == 0 {
                    on_step(s, l);
                }
                losses.push(l);
                micro_losses.push(t.last_micro_losses().to_vec());
            }
            let traffic = t.traffic();
            // Gathering every parameter costs a full copy per rank: only on request.
            let final_params = if keep_final_params {
                t.gather_all_params()?
            } else {
                Vec::new()
            };
            Ok(RankResult {
                rank: t.rank(),
                losses,
                micro_losses,
                traffic,
                memory: t.measured_memory(),
                model: t.model().clone(),
                final_params,
            })
        });
    let mut out = Vec::with_capacity(results.len());
    let mut first_err = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(Ok(v)) => out.push(v),
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(p) => {
                let message = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                first_err.get_or_insert(Error::RankPanicked { rank, message });
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// The global loss of every step: the canonical pairwise-tree sum of all `N·A` micro-batch losses,
/// numbered `a·N + rank` like the data, divided once by `N·A`. With
/// [`Reduction::CanonicalTree`] it is bit-identical across the world sizes the gradients are (see
/// [`crate::reduction`]); ranks' [`RankResult::losses`] are per-rank means.
pub fn global_losses<M>(results: &[RankResult<M>]) -> Vec<f32> {
    let Some(first) = results.first() else {
        return Vec::new();
    };
    (0..first.micro_losses.len())
        .map(|s| {
            let a = first.micro_losses[s].len();
            let leaves: Vec<f32> = (0..a)
                .flat_map(|m| results.iter().map(move |r| r.micro_losses[s][m]))
                .collect();
            canonical_sum(&leaves) / leaves.len() as f32
        })
        .collect()
}
