//! ZeRO configuration: the types and our own format (TOML or JSON); DeepSpeed's JSON is read in
//! `deepspeed`, its `"auto"` values resolved in `auto`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::model::DType;

mod auto;
mod deepspeed;
mod json;
mod offload;
mod validate;

pub(crate) use validate::validate;

pub use auto::{AdamWValues, AutoResolution, RunBatch, RunValues};
pub use deepspeed::DeepSpeedImport;

/// Training precision.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// fp32 weights, gradients and optimizer states (no master copy: the weight is fp32).
    #[default]
    Fp32,
    /// bf16 weights and gradients, fp32 master weights and optimizer states.
    Bf16,
    /// fp16 weights and gradients with dynamic loss scaling, fp32 master weights.
    Fp16,
}

impl Precision {
    /// The working (communicated) dtype of weights and gradients.
    pub fn working_dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::Bf16,
            Precision::Fp16 => DType::F16,
        }
    }

    /// Whether an fp32 master copy of the weights is kept.
    pub fn has_master_weights(self) -> bool {
        self != Precision::Fp32
    }

    /// Parses `fp32`, `bf16` or `fp16`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "fp32" | "f32" => Ok(Precision::Fp32),
            "bf16" => Ok(Precision::Bf16),
            "fp16" | "f16" => Ok(Precision::Fp16),
            o => Err(Error::invalid("precision", o, "one of fp32, bf16, fp16")),
        }
    }
}

/// The optimizer, for the optimizer-state part of the memory model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// Adam / AdamW: two fp32 moments per parameter (8 bytes).
    #[default]
    Adam,
    /// SGD with momentum: one fp32 buffer (4 bytes).
    SgdMomentum,
    /// Plain SGD: no state.
    Sgd,
}

impl OptimizerKind {
    /// Optimizer-state bytes per trainable element (excluding master weights).
    pub fn state_bytes(self) -> u64 {
        match self {
            OptimizerKind::Adam => 8,
            OptimizerKind::SgdMomentum => 4,
            OptimizerKind::Sgd => 0,
        }
    }
}

/// Where a part of the model states lives: the optimizer's state ([`ZeroConfig::optimizer_placement`])
/// or stage 3's parameter shard ([`ZeroConfig::param_placement`]). The memory model books device,
/// host and NVMe bytes apart ([`crate::MemoryModel`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// On the model's device (host memory on a CPU backend).
    #[default]
    Device,
    /// In host memory (DeepSpeed's `offload_*: {device: "cpu"}`, ZeRO-Offload).
    Host,
    /// In files under [`ZeroConfig::nvme_path`], read and written through a ring of
    /// [`ZeroConfig::offload_buffer_count`] host buffers (DeepSpeed's `device: "nvme"`,
    /// ZeRO-Infinity).
    Nvme,
}

impl Placement {
    fn is_device(&self) -> bool {
        *self == Placement::Device
    }

    /// Off the device: in host memory or on NVMe.
    pub fn is_offloaded(&self) -> bool {
        !self.is_device()
    }

    /// The name configurations spell it with.
    pub fn name(&self) -> &'static str {
        match self {
            Placement::Device => "device",
            Placement::Host => "host",
            Placement::Nvme => "nvme",
        }
    }
}

/// DeepSpeed's default `buffer_count` of `offload_optimizer`: the NVMe ring's buffers.
pub const DEFAULT_OFFLOAD_BUFFERS: u32 = 4;

fn is_default_buffers(n: &u32) -> bool {
    *n == DEFAULT_OFFLOAD_BUFFERS
}

/// A ZeRO configuration. Sizes are in elements, as in DeepSpeed.
///
/// Every field has DeepSpeed's default except where noted; unknown keys are
/// rejected with the list of valid ones.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ZeroConfig {
    /// 0 (plain data parallel), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters).
    pub stage: u8,
    /// Precision of weights and gradients.
    pub precision: Precision,
    /// Optimizer (memory model only).
    pub optimizer: OptimizerKind,
    /// Gradient bucket size in elements (stages 0–2: one reduction per bucket).
    pub reduce_bucket_size: u64,
    /// Persistent-parameter all-gather bucket size in elements (stage 3).
    pub allgather_bucket_size: u64,
    /// Micro-steps per optimizer step.
    pub gradient_accumulation_steps: u32,
    /// Global-norm clipping threshold; 0 disables clipping.
    pub gradient_clipping: f64,
    /// Overlap gradient reduction with backward (doubles the reduce buffer).
    pub overlap_comm: bool,
    /// Stage 3: how many elements may be prefetched ahead of use.
    pub prefetch_bucket_size: u64,
    /// Stage 3: the most gathered elements alive at once (plus the current module).
    pub max_live_parameters: u64,
    /// Stage 3: parameters with at most this many elements stay gathered (persistent).
    pub param_persistence_threshold: u64,
    /// Stage 3: cap on the total elements kept persistent.
    pub model_persistence_threshold: u64,
    /// qwZ: int8 block-quantized weight all-gather (stage 3).
    pub quantized_weights: bool,
    /// hpZ: secondary shard group size (1 = off). Must divide ranks per node (stage 3).
    pub hpz_partition_size: usize,
    /// qgZ: int4 hierarchical all-to-all gradient reduction (stage 3).
    pub quantized_gradients: bool,
    /// qwZ block size in elements.
    pub qwz_block_size: usize,
    /// qgZ block size in elements (even).
    pub qgz_block_size: usize,
    /// Stages 0 and 1 only: accumulate full gradients locally over the micro-steps and reduce once
    /// per optimizer step (DeepSpeed's stage-1 behaviour: fewer bytes on the wire). Off by default,
    /// so every stage reduces every micro-step in the same order and stages 0–3 stay bit-identical
    /// for any accumulation count (invariant I1).
    pub accumulate_before_reduce: bool,
    /// bf16/fp16: the gradient accumulator's type (DeepSpeed's `data_types.grad_accum_dtype`):
    /// `None` or the working precision accumulates in 16 bits; `fp32` accumulates the reduced
    /// 16-bit gradients in an fp32 buffer (4 B per element instead of 2; the wire stays 16-bit).
    pub grad_accum_dtype: Option<Precision>,
    /// fp16 only: the loss scaler (DeepSpeed's `fp16` section). Ignored in fp32 and bf16, which
    /// run unscaled.
    pub loss_scaler: LossScaleConfig,
    /// Activation checkpointing at segment granularity: the forward keeps only the activations
    /// between segments and the backward recomputes each segment from its input (a third more
    /// compute). Without it one autodiff graph spans the whole forward and the backward runs once.
    /// `None` (the default): on at stage 3, where it is what lets each segment's gathered weights
    /// be released after use (and gathered again, from the hpZ group with hpZ, for the backward);
    /// off at stages 0–2. Off at stage 3 keeps every gathered unit from the forward to the
    /// backward instead: no backward gathers, ZeRO-2-like peak memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_activations: Option<bool>,
    /// Where the optimizer's moments, fp32 master weights and gradient accumulator live, and so
    /// where the optimizer step runs: on the model's device (the default) or offloaded to host
    /// memory. NVMe (ZeRO-Infinity) keeps the moments and masters on disk and the gradient
    /// accumulator in host memory, as DeepSpeed does.
    #[serde(skip_serializing_if = "Placement::is_device")]
    pub optimizer_placement: Placement,
    /// Stage 3: where the rank's parameter shard lives between gathers (DeepSpeed's
    /// `offload_param`): on the device (the default), in host memory or on NVMe. It moves to the
    /// device for each gather; persistent parameters and buffers stay on the device.
    #[serde(skip_serializing_if = "Placement::is_device")]
    pub param_placement: Placement,
    /// The folder of the NVMe store: each rank keeps its files in its own subfolder. Required
    /// when a placement is [`Placement::Nvme`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvme_path: Option<String>,
    /// The NVMe ring's host buffers, each one unit's offloaded state: unit k+1 is read while unit
    /// k steps and unit k-1 is written back (DeepSpeed's `buffer_count`; at least 3).
    #[serde(skip_serializing_if = "is_default_buffers")]
    pub offload_buffer_count: u32,
}

/// fp16 loss scaling, with DeepSpeed's keys, defaults and semantics.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LossScaleConfig {
    /// A static scale; 0 means dynamic (DeepSpeed's `loss_scale`).
    pub loss_scale: f64,
    /// The dynamic scaler starts at 2^this.
    pub initial_scale_power: u32,
    /// Clean (non-overflowing) steps after which the dynamic scale doubles.
    pub loss_scale_window: u64,
    /// Overflows tolerated before the scale halves (1 = halve on every overflow).
    pub hysteresis: u32,
    /// Whether a clean step restores the hysteresis (else only a window's end does).
    pub consecutive_hysteresis: bool,
    /// The dynamic scale never falls below this; an overflow at this scale is an error.
    pub min_loss_scale: f64,
}

impl Default for LossScaleConfig {
    fn default() -> Self {
        LossScaleConfig {
            loss_scale: 0.0,
            initial_scale_power: 16,
            loss_scale_window: 1000,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min_loss_scale: 1.0,
        }
    }
}

impl LossScaleConfig {
    /// Whether the scale adapts to overflows.
    pub fn dynamic(&self) -> bool {
        self.loss_scale == 0.0
    }

    /// The scale of the first step.
    pub fn initial_scale(&self) -> f64 {
        if self.dynamic() {
            2f64.powi(self.initial_scale_power as i32)
        } else {
            self.loss_scale
        }
    }
}

/// Default qwZ block (elements); see zero-quant's measurements.
pub const DEFAULT_QWZ_BLOCK: usize = 1024;
/// Default qgZ block (elements); see zero-quant's measurements.
pub const DEFAULT_QGZ_BLOCK: usize = 512;

impl Default for ZeroConfig {
    fn default() -> Self {
        ZeroConfig {
            stage: 0,
            precision: Precision::Fp32,
            optimizer: OptimizerKind::Adam,
            reduce_bucket_size: 500_000_000,
            allgather_bucket_size: 500_000_000,
            gradient_accumulation_steps: 1,
            gradient_clipping: 0.0,
            overlap_comm: false,
            prefetch_bucket_size: 50_000_000,
            max_live_parameters: 1_000_000_000,
            param_persistence_threshold: 100_000,
            model_persistence_threshold: i64::MAX as u64,
            quantized_weights: false,
            hpz_partition_size: 1,
            quantized_gradients: false,
            qwz_block_size: DEFAULT_QWZ_BLOCK,
            qgz_block_size: DEFAULT_QGZ_BLOCK,
            accumulate_before_reduce: false,
            grad_accum_dtype: None,
            loss_scaler: LossScaleConfig::default(),
            checkpoint_activations: None,
            optimizer_placement: Placement::Device,
            param_placement: Placement::Device,
            nvme_path: None,
            offload_buffer_count: DEFAULT_OFFLOAD_BUFFERS,
        }
    }
}

impl ZeroConfig {
    /// A default configuration at `stage`.
    pub fn stage(stage: u8) -> Self {
        ZeroConfig {
            stage,
            ..Default::default()
        }
    }

    /// Whether hpZ is on.
    pub fn hpz(&self) -> bool {
        self.hpz_partition_size > 1
    }

    /// Whether the backward recomputes each segment from its saved input
    /// ([`ZeroConfig::checkpoint_activations`], by default only at stage 3).
    pub fn recompute(&self) -> bool {
        self.checkpoint_activations.unwrap_or(self.stage == 3)
    }

    /// Parses our own format from TOML.
    pub fn from_toml(text: &str) -> Result<Self> {
        toml::from_str(text).map_err(|e| Error::Parse {
            what: "ZeRO config (TOML)".into(),
            message: e.to_string(),
        })
    }

    /// Parses our own format from JSON.
    pub fn from_json(text: &str) -> Result<Self> {
        serde_json::from_str(text).map_err(|e| Error::Parse {
            what: "ZeRO config (JSON)".into(),
            message: e.to_string(),
        })
    }

    /// Parses a config file by content: a JSON object with a `zero_optimization` key is read as
    /// DeepSpeed's format, any other JSON as ours, anything else as our TOML; text that starts
    /// like a JSON object (`{`) but does not parse is reported as JSON, and an empty file is an
    /// error (not the defaults). DeepSpeed's `"auto"`
    /// values resolve to zero-rs's defaults where they can (see [`ZeroConfig::from_any_with`]).
    pub fn from_any(text: &str) -> Result<DeepSpeedImport> {
        Self::from_any_with(text, &RunValues::default())
    }

    /// [`ZeroConfig::from_any`], resolving a DeepSpeed config's `"auto"` values from `run` as the
    /// Hugging Face Trainer does (see [`RunValues`]).
    pub fn from_any_with(text: &str, run: &RunValues) -> Result<DeepSpeedImport> {
        let start = text.trim_start();
        if start.is_empty() {
            return Err(Error::Parse {
                what: "ZeRO config".into(),
                message: "the file is empty; write {} (JSON) for every default".into(),
            });
        }
        match serde_json::from_str::<Value>(text) {
            Ok(v) if v.get("zero_optimization").is_some() => Self::from_deepspeed_value(v, run),
            Ok(_) => Ok(DeepSpeedImport {
                config: Self::from_json(text)?,
                notes: vec![],
                resolved: vec![],
            }),
            // `[` also starts a TOML table header, so only `{` means JSON.
            Err(e) if start.starts_with('{') => Err(Error::Parse {
                what: "ZeRO config (JSON)".into(),
                message: e.to_string(),
            }),
            Err(_) => Ok(DeepSpeedImport {
                config: Self::from_toml(text)?,
                notes: vec![],
                resolved: vec![],
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_format_round_trips_and_rejects_unknown_keys() {
        let c = ZeroConfig {
            stage: 3,
            hpz_partition_size: 2,
            ..Default::default()
        };
        let t = toml::to_string(&c).unwrap();
        assert_eq!(ZeroConfig::from_toml(&t).unwrap(), c);
        let e = ZeroConfig::from_toml("stage = 2\nstgae = 3\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("stgae"), "{e}");
        let any = ZeroConfig::from_any("stage = 2\n").unwrap();
        assert_eq!(any.config.stage, 2);
        let any = ZeroConfig::from_any(r#"{"zero_optimization": {"stage": 1}}"#).unwrap();
        assert_eq!(any.config.stage, 1);
        // A table header starts TOML, not JSON.
        let any = ZeroConfig::from_any("[topology]\nworld_size = 2\nranks_per_node = 1\n");
        assert!(!any.is_err_and(|e| e.to_string().contains("JSON")));
        // Broken JSON is reported as JSON, with serde's line and column; an empty file is refused.
        let e = ZeroConfig::from_any("{\"stage\": 3,,}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("JSON") && e.contains("column"), "{e}");
        for empty in ["", "  \n"] {
            let e = ZeroConfig::from_any(empty).unwrap_err().to_string();
            assert!(e.contains("empty"), "{e}");
        }
    }
}
