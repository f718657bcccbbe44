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
//!
//! # Modules
//!
//! - `model`, `topology`, `config`: the inputs (`ModelDesc`, `Topology`, `ZeroConfig`; DeepSpeed
//!   JSON imported with unknown keys reported, its `"auto"` values resolved).
//! - `plan`: units (buckets, gather groups, persistent groups), entries, fragments on demand.
//! - `memory`: bytes per rank by category.
//! - `gather`: `GatherOrder`: the modules' order, what each needs at stage 3, which run a
//!   backward, how long shared units stay gathered; `Plan::peak_gathered` replays it.
//! - `comm_model`: `Plan::schedule()`, every collective of one optimizer step, and
//!   `Plan::comm(rank)`, its bytes per collective and link class.
//! - `traffic`: the accounting convention and `TrafficTable`, shared with zero-comm so that
//!   prediction and measurement compare with `==`.
//! - `quant_wire`: the wire sizes of zero-quant's codecs, for the byte predictions.
//! - `checkpoint`: the manifest, rank-file header and `LATEST` types, the parameter → unit →
//!   offset table (`CkptLayout`), the plan fingerprint, and the reshard map (`copies`,
//!   `loose_copies`: O(P log P) per rank, by binary search over unit entries). No IO and no
//!   hashing crate: checksums are plain `u32` values computed by zero-burn.
//! - `sim`: the simulator (step time, throughput, memory fit on a modelled GPU cluster); its
//!   module docs give the cost model.
//! - `report`: a plan's summary for one rank, what `cargo xtask plan` prints.
//! - `error`: the crate's errors.

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
