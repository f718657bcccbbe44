//! # zero-burn
//!
//! **Role.** The burn integration: runs ZeRO-1/2/3 data-parallel training of burn modules by
//! executing a `zero_core::Plan` with one `zero_comm` communicator per rank. See [`trainer`] for
//! the step, [`model`] for how models are executed segment by segment, and [`world`] for the
//! in-process launcher.
//!
//! **May depend on:** zero-core, zero-comm, zero-quant and burn. It is the only library crate that
//! names burn types.
//!
//! **Status:** stages 0–3 and ZeRO++ (qwZ, hpZ, qgZ, alone or together) in fp32, bf16 and fp16
//! on burn's CPU backend (flex) with the host loopback. Stages 0–3 are bit-identical to each
//! other; with [`Reduction::CanonicalTree`] also across world sizes for the same global batch
//! (fp32 only; any power-of-two N, or accumulation 1; not with clipping, qwZ or qgZ), see
//! [`reduction`]. bf16/fp16 keep fp32 master weights and optimizer states, move and store 16-bit
//! weights and gradients, and (fp16) scale the loss and skip overflowing steps on every rank
//! together; compute stays f32 on the CPU backend, see [`precision`]. Feature `wgpu`:
//! the same trainer on burn's wgpu backend with the wgpu loopback on one shared device
//! (`world::train_wgpu`; collectives round-trip through host memory), and [`bridge`], which hands
//! a burn-wgpu tensor's own storage to the wgpu loopback without a copy (the wgpu path packs and
//! reduces gradients through it on the device). `overlap_comm` runs each rank's collectives on a thread of its own, bit-identical to
//! synchronous. bf16/fp16 can accumulate gradients in fp32 (`grad_accum_dtype`). The CUDA path
//! (burn's CUDA backend) is not built: it cannot be built offline.

#[cfg(feature = "wgpu")]
pub mod bridge;
mod comms;
pub mod data;
pub mod error;
pub mod job;
pub mod model;
pub mod optim;
pub mod params;
pub mod precision;
pub mod reduction;
pub mod trainer;
pub mod world;

pub use error::{Error, Result};
pub use model::{Gpt, GptConfig, Segmented};
pub use precision::StepInfo;
pub use reduction::Reduction;
pub use trainer::{DeviceQuant, DeviceTensors, MeasuredMemory, RankTrainer, TrainOptions};

use zero_core::{ModelDesc, Plan, Topology, ZeroConfig};

/// The zero-core description of a segmented model: parameters in visit order, grouped for stage-3
/// gathers by segment.
pub fn describe_model<M: Segmented>(model: &M) -> Result<ModelDesc> {
    let params = params::describe(model);
    params::model_desc(&params, |path| {
        format!("segment.{}", model.segment_of(path))
    })
}

/// A checked plan for `model`.
pub fn plan_for<M: Segmented>(model: &M, topology: Topology, config: &ZeroConfig) -> Result<Plan> {
    Ok(Plan::new(&describe_model(model)?, topology, config)?)
}
