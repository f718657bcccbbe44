//! # zero-core
//!
//! Partition planning for ZeRO-style sharded data parallelism.
//!
//! **Role.** Given a model description (named parameter tensors in forward order), a topology
//! (world size, ranks per node) and a ZeRO configuration (stage 0–3, precision, buckets, ZeRO++
//! switches), [`Plan::new`] validates everything once and returns a checked plan: the flat layout,
//! each rank's shard and the fragments of each parameter in it, gradient buckets in backward order,
//! stage-3 gather groups, the hpZ secondary layout, and the memory ([`Plan::memory`]) and
//! communication ([`Plan::comm`], [`Plan::schedule`]) model. The engine (`zero-burn`) executes
//! exactly this plan, so predicted and measured bytes can be compared exactly.
//!
//! **May depend on:** serde, serde_json, toml and thiserror only. It never touches a device, a
//! thread, a file or the network; everything here is pure and deterministic.
//!
//! Sibling crates: `zero-quant` (codecs), `zero-comm` (communicators), `zero-burn` (the trainer).

pub mod checkpoint;
pub mod comm_model;
pub mod config;
pub mod error;
pub mod gather;
pub mod memory;
pub mod model;
pub mod plan;
pub mod quant_wire;
pub mod report;
pub mod sim;
pub mod topology;
pub mod traffic;

pub use comm_model::{CommModel, GroupKind, Payload, Phase, PlannedOp};
pub use config::{
    AdamWValues, AutoResolution, DeepSpeedImport, LossScaleConfig, OptimizerKind, Placement,
    Precision, RunBatch, RunValues, ZeroConfig,
};
pub use error::{CheckpointError, Error, Result};
pub use gather::GatherOrder;
pub use memory::MemoryModel;
pub use model::{DType, MAX_MODEL_PARAMS, ModelDesc, ParamDesc};
pub use plan::{Entry, Fragment, HpzLayout, Plan, Unit, UnitKind};
pub use report::{PlanReport, SharedParam};
pub use topology::{LinkClass, MAX_WORLD_SIZE, Topology};
pub use traffic::{Collective, CollectiveTraffic, GroupView, LinkBytes, TrafficTable};
