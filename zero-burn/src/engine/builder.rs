//! [`EngineBuilder`] makes one rank's [`ZeroEngine`]; the caller owns the loop and the data.
//!
//! ```text
//! let mut engine = ZeroEngine::builder(comm, model)   // any Communicator, any Segmented model
//!     .config(zero_config)                             // or .plan(Arc<Plan>)
//!     .optimizer(Optimizer::default())
//!     .build()?;
//! for step in 0..steps {
//!     let out = engine.step(lr, &batches)?;            // gradient_accumulation_steps batches
//! }
//! let model = engine.consolidated_model()?;           // collective: the full model on every rank
//! ```

use std::sync::Arc;

use zero_comm::{Communicator, ReduceOrder};
use zero_core::{OptimizerKind, Plan, ZeroConfig};

use super::{BufferSync, EngineOptions, ZeroEngine};
use crate::device::{DeviceQuant, DeviceTensors};
use crate::error::{Error, Result};
use crate::optim::Optimizer;
use crate::reduction::Reduction;
use crate::segmented::Segmented;

/// Where the engine's plan comes from.
#[derive(Debug)]
enum PlanFrom {
    /// A plan made by the caller (it must describe the model and the communicator's world).
    Plan(Arc<Plan>),
    /// A ZeRO configuration, planned for the model on the communicator's topology.
    Config(Box<ZeroConfig>),
}

/// Builds one rank's [`ZeroEngine`]: the communicator, the model, the plan (or a [`ZeroConfig`]
/// to plan from), the optimizer, the reduction order and the device hooks. Every check happens
/// once, in [`EngineBuilder::build`].
#[derive(Debug)]
#[must_use = "an EngineBuilder does nothing until `build`"]
pub struct EngineBuilder<C: Communicator, M: Segmented> {
    comm: C,
    model: M,
    plan: PlanFrom,
    optimizer: Option<Optimizer>,
    reduction: Option<Reduction>,
    device_tensors: Option<Box<dyn DeviceTensors<C>>>,
    device_quant: Option<Arc<dyn DeviceQuant<C>>>,
    seed: u64,
    buffers: BufferSync,
    recompute_check: bool,
}

impl<C: Communicator, M: Segmented> ZeroEngine<C, M> {
    /// A builder for this rank's engine over `comm`, training `model`. Every rank must pass a
    /// model with the same structure and the same initial values. Without
    /// [`plan`](EngineBuilder::plan) or [`config`](EngineBuilder::config) it plans with
    /// [`ZeroConfig::default`] (ZeRO-1).
    pub fn builder(comm: C, model: M) -> EngineBuilder<C, M> {
        EngineBuilder {
            comm,
            model,
            plan: PlanFrom::Config(Box::default()),
            optimizer: None,
            reduction: None,
            device_tensors: None,
            device_quant: None,
            seed: 0,
            buffers: BufferSync::default(),
            recompute_check: true,
        }
    }
}

impl<C: Communicator, M: Segmented> EngineBuilder<C, M> {
    /// Executes `plan`, which must describe the model and the communicator's world (see
    /// [`crate::plan_for`]).
    pub fn plan(mut self, plan: Arc<Plan>) -> Self {
        self.plan = PlanFrom::Plan(plan);
        self
    }

    /// Plans `config` for the model on the communicator's topology. The optimizer set with
    /// [`optimizer`](Self::optimizer) decides `config.optimizer`.
    pub fn config(mut self, config: ZeroConfig) -> Self {
        self.plan = PlanFrom::Config(Box::new(config));
        self
    }

    /// The optimizer; by default the plan's optimizer kind with its usual hyper-parameters
    /// (AdamW β = (0.9, 0.999), ε = 1e-8, no weight decay; SGD with momentum 0.9 or none).
    pub fn optimizer(mut self, optimizer: Optimizer) -> Self {
        self.optimizer = Some(optimizer);
        self
    }

    /// How gradients are summed over micro-steps and ranks; by default the communicator's own
    /// order decides ([`Reduction::CanonicalTree`] on a pairwise-tree loopback, else
    /// [`Reduction::RankOrdered`]).
    pub fn reduction(mut self, reduction: Reduction) -> Self {
        self.reduction = Some(reduction);
        self
    }

    /// The base seed of the randomness the model draws in training (Dropout): before every
    /// forward of a segment the engine seeds the device with
    /// [`crate::rng::segment_seed`]`(seed, step, micro, segment, rank)`, so the recompute of
    /// activation checkpointing replays the forward's draws and runs are reproducible. 0 by
    /// default; every rank must pass the same.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// How the model's buffers (BatchNorm's running statistics) are kept equal across ranks;
    /// [`BufferSync::Broadcast`] (rank 0's, as DDP's `broadcast_buffers`) by default.
    pub fn buffers(mut self, sync: BufferSync) -> Self {
        self.buffers = sync;
        self
    }

    /// Whether activation checkpointing's recompute of every segment is compared with its first
    /// forward (the loss bit for bit, every other output by a crc32c of its bytes), failing the
    /// step with [`Error::RecomputeMismatch`] when they differ. On by default; its cost is in
    /// BENCHMARKS.md (a copy of each output activation to host memory, twice).
    pub fn recompute_check(mut self, on: bool) -> Self {
        self.recompute_check = on;
        self
    }

    /// Moves gradients and gathered weights (fp32, and 16-bit words where the hook moves them)
    /// between burn and the communicator's memory through `hook` instead of through host memory
    /// (the wgpu path's zero-copy bridge, or burn-cuda's `cuda::CudaTensors`). The arithmetic is
    /// the same, so are the bits.
    pub fn device_tensors(mut self, hook: Box<dyn DeviceTensors<C>>) -> Self {
        self.device_tensors = Some(hook);
        self
    }

    /// Runs qwZ and qgZ on the communicator's memory where a [`DeviceTensors`] hook keeps the
    /// tensors there. It must give the host codecs' bits.
    pub fn device_quant(mut self, quant: Arc<dyn DeviceQuant<C>>) -> Self {
        self.device_quant = Some(quant);
        self
    }

    /// Checks everything and builds the engine: the plan against the model (names, shapes,
    /// trainable flags) and the communicator's world, the optimizer against the plan, the
    /// reduction order against the communicator, the segments against the parameters.
    pub fn build(self) -> Result<ZeroEngine<C, M>> {
        if let Some(device) = self.model.devices().into_iter().find(|d| !d.is_autodiff()) {
            return Err(Error::NotAutodiff {
                device: format!("{device:?}"),
            });
        }
        let reduction = self.reduction.unwrap_or(match self.comm.reduce_order() {
            Some(ReduceOrder::PairwiseTree) => Reduction::CanonicalTree,
            _ => Reduction::RankOrdered,
        });
        let (plan, optimizer) = match self.plan {
            PlanFrom::Plan(plan) => {
                let optimizer = self
                    .optimizer
                    .unwrap_or_else(|| default_optimizer(plan.config().optimizer));
                (plan, optimizer)
            }
            PlanFrom::Config(config) => {
                let optimizer = self
                    .optimizer
                    .unwrap_or_else(|| default_optimizer(config.optimizer));
                let config = ZeroConfig {
                    optimizer: optimizer.kind(),
                    ..*config
                };
                let plan = crate::model::plan_for(&self.model, *self.comm.topology(), &config)?;
                (Arc::new(plan), optimizer)
            }
        };
        let options = EngineOptions {
            optimizer,
            reduction,
            seed: self.seed,
            buffers: self.buffers,
            recompute_check: self.recompute_check,
        };
        let mut engine = ZeroEngine::new(plan, self.comm, self.model, options)?;
        if let Some(hook) = self.device_tensors {
            engine = engine.with_device_tensors(hook);
        }
        if let Some(quant) = self.device_quant {
            if !engine.has_device_tensors() {
                return Err(Error::Invalid {
                    field: "device_quant",
                    got: "device codecs without a device_tensors hook".into(),
                    expected: "a device_tensors hook as well (the codecs run where it puts the \
                               tensors)"
                        .into(),
                });
            }
            engine = engine.with_device_quant(quant);
        }
        Ok(engine)
    }
}

/// The optimizer a plan's kind stands for, with its usual hyper-parameters.
fn default_optimizer(kind: OptimizerKind) -> Optimizer {
    match kind {
        OptimizerKind::Adam => Optimizer::default(),
        OptimizerKind::SgdMomentum => Optimizer::Sgd { momentum: 0.9 },
        OptimizerKind::Sgd => Optimizer::Sgd { momentum: 0.0 },
    }
}
