//! # zero-burn
//!
//! ZeRO-1/2/3 and ZeRO++ data-parallel training for any burn model. One [`ZeroEngine`] per rank
//! executes a `zero_core::Plan` over one `zero_comm` communicator; the caller owns the model, the
//! batches, the loss and the loop.
//!
//! - A model is [`Segmented`]: it splits itself into segments (the points where stage 3 gathers and
//!   releases weights and where gradients are complete) and runs them one at a time, with any
//!   batch type and any [`Activation`] between segments. [`Whole`] makes any burn module plus a
//!   loss closure a one-segment model.
//! - [`EngineBuilder`] checks the model, plan, communicator and optimizer once, in `build`.
//! - [`ZeroEngine::step`] runs one optimizer step over this rank's micro-batches;
//!   [`ZeroEngine::eval`] a forward pass; [`ZeroEngine::consolidated_model`] gathers the full
//!   model; [`ZeroEngine::report`] compares measured traffic and memory with the plan.
//! - [`Launch`] runs one closure per rank on threads of this process (host loopback; the wgpu
//!   loopback with feature `wgpu`, `Launch::run_wgpu`; the CUDA loopback with feature `cuda`,
//!   `Launch::run_cuda`); a failing rank fails the others fast.
//! - With feature `burn-train`, `learner::Sharded` lets burn-train's `Learner` and
//!   `SupervisedTraining` drive the loop (metrics, validation, early stopping, checkpoints) while
//!   the engine runs the sharded optimizer step ([`ZeroEngine::step_grads`]; stages 0–2).
//!
//! The demo (a GPT-style decoder, corpora and the job `cargo xtask train` runs) lives in
//! [`demo`] and uses this API, plus the crate's per-rank model copies behind
//! `Launch::run_with`.
//!
//! A user's loop needs one import, [`prelude`]. README's snippet is the middle of this example,
//! line for line (`zero-burn/tests/engine/source_layout.rs` checks it):
//!
//! ```
//! use burn::nn::loss::CrossEntropyLossConfig;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::tensor::{Device, Int, Tensor, TensorData};
//!
//! // Any burn module and a loss: here a linear classifier of 4 features into 2 classes.
//! struct Batch { x: Tensor<2>, y: Tensor<1, Int> }
//! let device = Device::flex().autodiff();
//! let model = Whole::new(LinearConfig::new(4, 2).init(&device), |m: &Linear, b: &Batch| {
//!     CrossEntropyLossConfig::new().init(&b.x.device()).forward(m.forward(b.x.clone()), b.y.clone())
//! });
//! // Rank r's micro-batches at step s: one of two points of its own.
//! let my_batches = |s: usize, r: usize| {
//!     let v = (s * 2 + r) as f32;
//!     vec![Batch {
//!         x: Tensor::from_data(TensorData::new(vec![v, 1.0, -v, 0.5, -1.0, v, 0.0, 2.0], [2, 4]), &Device::flex()),
//!         y: Tensor::from_data(TensorData::new(vec![0i64, 1], [2]), &Device::flex()),
//!     }]
//! };
//! let (steps, lr) = (3, 1e-2);
//! use zero_burn::prelude::*; // Launch, ZeroEngine, ZeroConfig, Topology, Optimizer, Communicator…
//!
//! let models = Launch::new(Topology::single_node(2)?).run_with(&model, |comm, model| {
//!     let rank = comm.rank();
//!     let mut engine = ZeroEngine::builder(comm, model)
//!         .config(ZeroConfig { stage: 3, ..Default::default() })   // or .plan(Arc<Plan>)
//!         .optimizer(Optimizer::default())                          // AdamW; or Optimizer::Sgd { .. }
//!         .build()?;                                                // every check happens here
//!     for step in 0..steps {
//!         let out = engine.step(lr, &my_batches(step, rank))?;      // A micro-batches of this rank
//!         println!("rank {rank} step {step}: loss {}", out.loss);
//!     }
//!     assert!(engine.report().traffic_matches_plan());              // counted vs planned
//!     engine.consolidated_model()                                   // collective: the full model
//! })?;
//! assert_eq!(models.len(), 2);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! **May depend on:** zero-core, zero-comm, zero-quant and burn. It is the only library crate that
//! names burn types. What works and what does not is in STATUS.md.
//!
//! # Modules
//!
//! `demo` sits on top; `checkpoint` and `learner` build on `engine`, which builds on the rest;
//! `error` is at the bottom. They import each other one way, with no circle
//! (`module_folders_import_one_way` in `xtask/tests/tidy.rs`).
//!
//! - `segmented`: the model contract (`Segmented`, `Whole`, `Activation`, `SegmentOut`).
//! - `model`: a model as the planner sees it (`parameters`, `describe_model`, `plan_for`).
//! - `engine`: `ZeroEngine` and its parts, `EngineBuilder` (every check, once, in `build`) and
//!   `RankReport`; its module docs list its files.
//! - `comms`: the executor (`Comms`, `Job`, `Exec`): a micro-step's collectives, inline or on a
//!   communication thread of the rank's own (`overlap_comm`).
//! - `device`: the `DeviceTensors` and `DeviceQuant` hooks, which keep burn tensors and ZeRO++'s
//!   codecs in the communicator's own memory; `WordBuffer` for 16-bit words.
//! - `params` (and `params/grads.rs`): burn's `ModuleVisitor`/`ModuleMapper` glue: describe a
//!   module's parameters, read values and gradients into flat `f32` slices, write values back.
//! - `precision`: 16-bit working weights and gradients, fp16 loss scaling.
//! - `reduction`: how gradients are summed over micro-steps and ranks (`Reduction`).
//! - `rng`: the segments' seeds, so a recompute replays its forward.
//! - `optim`: AdamW and SGD over flat `f32` buffers, on the host or as device tensors.
//! - `checkpoint`: sharded, crash-safe, verified checkpoints and safetensors export and import;
//!   its module docs list its files.
//! - `launch.rs`: `Launch`, `deep_copy` and `WgpuShared` (feature `wgpu`): ranks as threads of
//!   this process; `local_rank`: a process's rank on its node, which picks its GPU.
//! - `error`: the crate's `Error`.
//! - `bridge` (feature `wgpu`): the zero-copy bridge between burn-wgpu tensors and the wgpu
//!   loopback's buffers, and the `DeviceTensors` hook over it.
//! - `cuda` (feature `cuda`): a burn-cuda device, or an error naming what is missing, and
//!   `CudaTensors`, the `DeviceTensors` hook over NCCL's or the CUDA loopback's buffers.
//! - `offload`: the NVMe store of `optimizer_placement = nvme`, and its prefetch ring.
//! - `learner` (feature `burn-train`): `Sharded`, burn-train's `Learner` over `step_grads`.
//! - `demo`: the GPT, the corpora, the launchers and the job `cargo xtask train` runs; its
//!   module docs list its files.

#[cfg(feature = "wgpu")]
pub mod bridge;
pub mod checkpoint;
mod comms;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod demo;
mod device;
mod engine;
mod error;
mod launch;
#[cfg(feature = "burn-train")]
pub mod learner;
mod model;
mod offload;
pub mod optim;
pub mod params;
pub mod precision;
pub mod reduction;
pub mod rng;
mod segmented;

pub use device::{DeviceQuant, DeviceTensors, WordBuffer};
pub use engine::{BufferSync, EngineBuilder, MeasuredMemory, RankReport, StepOutput, ZeroEngine};
pub use error::{Error, Result};
#[cfg(feature = "wgpu")]
pub use launch::WgpuShared;
pub use launch::{LOCAL_RANK_VARS, Launch, deep_copy, local_rank};
pub use model::{describe_model, parameters, plan_for};
pub use offload::IoReport;
#[doc(hidden)]
pub use offload::{StoreTimes, time_store};
pub use optim::Optimizer;
pub use precision::StepInfo;
pub use reduction::Reduction;
pub use segmented::{Activation, SegmentOut, Segmented, Whole};
pub use zero_comm::Communicator;
pub use zero_core::{Placement, Plan, Precision, Topology, ZeroConfig};

/// What a training loop names, in one import: `use zero_burn::prelude::*;`.
pub mod prelude {
    pub use crate::{
        Activation, BufferSync, Communicator, EngineBuilder, Error, Launch, Optimizer, Placement,
        Plan, Precision, Reduction, SegmentOut, Segmented, Topology, Whole, ZeroConfig, ZeroEngine,
        parameters, plan_for,
    };
}
