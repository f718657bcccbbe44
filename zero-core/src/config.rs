//! ZeRO configuration: our own format (TOML or JSON) and DeepSpeed's `zero_optimization` section.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::model::DType;

mod auto;

pub use auto::{AdamWValues, AutoResolution, RunBatch, RunValues};

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

/// A ZeRO configuration. Sizes are in elements, as in DeepSpeed.
///
/// Every field has DeepSpeed's default (zero-spec.md §9) except where noted; unknown keys are
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
}

/// fp16 loss scaling, with DeepSpeed's keys, defaults and semantics (zero-spec.md §3.4).
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

    /// Reads a DeepSpeed JSON config: its `zero_optimization` section and the `fp16`, `bf16`,
    /// `gradient_clipping` and `gradient_accumulation_steps` keys, with DeepSpeed's key names and
    /// meanings. Keys we do not know, and features we do not implement (offload, MiCS, …), are
    /// errors listing every such key. Keys that only tune DeepSpeed's own kernels and do not change
    /// results are accepted and listed in [`DeepSpeedImport::notes`], as are top-level sections
    /// outside the ZeRO engine's scope (`optimizer`, `scheduler`, batch sizes…). `"auto"` values
    /// resolve as in [`ZeroConfig::from_deepspeed_json_with`] with nothing known about the run.
    pub fn from_deepspeed_json(text: &str) -> Result<DeepSpeedImport> {
        Self::from_deepspeed_json_with(text, &RunValues::default())
    }

    /// [`ZeroConfig::from_deepspeed_json`] for a config written for the Hugging Face Trainer: its
    /// `"auto"` values are resolved from `run` the way HF resolves them (the model's hidden size
    /// for the bucket sizes and the persistence threshold, the run's own settings for batch sizes,
    /// accumulation, clipping, precision and the optimizer) and listed in
    /// [`DeepSpeedImport::resolved`]. Unsupported keys (offload, NVMe, MiCS, …) are still errors.
    pub fn from_deepspeed_json_with(text: &str, run: &RunValues) -> Result<DeepSpeedImport> {
        let v: Value = serde_json::from_str(text).map_err(|e| Error::Parse {
            what: "DeepSpeed config (JSON)".into(),
            message: e.to_string(),
        })?;
        Self::from_deepspeed_value(v, run)
    }

    fn from_deepspeed_value(mut v: Value, run: &RunValues) -> Result<DeepSpeedImport> {
        let top = v.as_object_mut().ok_or_else(|| Error::Parse {
            what: "DeepSpeed config".into(),
            message: "expected a JSON object at the top level".into(),
        })?;
        let mut c = ZeroConfig::default();
        let mut bad = Vec::new();
        let mut notes = Vec::new();
        let resolved = auto::resolve(top, run, &mut bad, &mut notes);
        for (k, val) in top.iter() {
            match k.as_str() {
                "zero_optimization" => read_zero_section(val, &mut c, &mut bad, &mut notes),
                "fp16" | "bf16" => read_precision(k, val, &mut c, &mut bad, &mut notes),
                "data_types" => read_data_types(val, &mut c, &mut bad),
                "gradient_clipping" => match num(val) {
                    Some(x) if x >= 0.0 && x.is_finite() => c.gradient_clipping = x,
                    _ => bad.push(format!(
                        "gradient_clipping: got {val}, expected a number ≥ 0"
                    )),
                },
                "gradient_accumulation_steps" => match int(val) {
                    Some(x) if x >= 1 && x <= u32::MAX as u64 => {
                        c.gradient_accumulation_steps = x as u32
                    }
                    _ => bad.push(format!(
                        "gradient_accumulation_steps: got {val}, expected an integer ≥ 1"
                    )),
                },
                "optimizer" => {
                    let t = val.get("type").and_then(Value::as_str).unwrap_or("");
                    match t.to_ascii_lowercase().as_str() {
                        "adam" | "adamw" | "fusedadam" => c.optimizer = OptimizerKind::Adam,
                        "sgd" => {
                            let m = val.pointer("/params/momentum").and_then(num).unwrap_or(0.0);
                            c.optimizer = if m != 0.0 {
                                OptimizerKind::SgdMomentum
                            } else {
                                OptimizerKind::Sgd
                            };
                        }
                        _ => notes.push(format!(
                            "optimizer type {t:?}: memory model assumes Adam (8 B/element of state)"
                        )),
                    }
                }
                "scheduler" => notes.push(
                    "top-level key `scheduler` is not read: the learning rate stays constant \
                     (its \"auto\" values are left unresolved)"
                        .into(),
                ),
                "train_batch_size"
                | "train_micro_batch_size_per_gpu"
                | "steps_per_print"
                | "wall_clock_breakdown"
                | "prescale_gradients"
                | "gradient_predivide_factor"
                | "communication_data_type"
                | "flops_profiler"
                | "activation_checkpointing"
                | "tensorboard"
                | "wandb"
                | "comms_logger"
                | "zero_allow_untested_optimizer"
                | "seed" => notes.push(format!(
                    "top-level key `{k}` is outside the ZeRO engine and is not read"
                )),
                "aio" => bad.push(format!(
                    "aio: got {val}, expected no such section (it tunes NVMe offload, which \
                     zero-rs does not support yet)"
                )),
                other => bad.push(format!("unknown top-level key `{other}`")),
            }
        }
        if !bad.is_empty() {
            return Err(Error::UnsupportedKeys(bad));
        }
        Ok(DeepSpeedImport {
            config: c,
            notes,
            resolved,
        })
    }
}

/// The result of reading a DeepSpeed config.
#[derive(Clone, Debug, PartialEq)]
pub struct DeepSpeedImport {
    /// The configuration read.
    pub config: ZeroConfig,
    /// Keys accepted without effect, each with the reason.
    pub notes: Vec<String>,
    /// Every `"auto"` value resolved, in the order resolved: one line each for the user.
    pub resolved: Vec<AutoResolution>,
}

fn num(v: &Value) -> Option<f64> {
    v.as_f64()
}

fn int(v: &Value) -> Option<u64> {
    let x = v.as_f64()?;
    (x >= 0.0 && x.fract() == 0.0 && x < 1.9e19).then_some(x as u64)
}

fn boolean(v: &Value) -> Option<bool> {
    v.as_bool()
}

fn read_precision(
    k: &str,
    v: &Value,
    c: &mut ZeroConfig,
    bad: &mut Vec<String>,
    notes: &mut Vec<String>,
) {
    let Some(obj) = v.as_object() else {
        bad.push(format!(
            "{k}: expected an object like {{\"enabled\": true}}"
        ));
        return;
    };
    let enabled = match obj.get("enabled") {
        None => false,
        Some(e) => match boolean(e) {
            Some(b) => b,
            None => {
                bad.push(format!("{k}.enabled: got {e}, expected true or false"));
                return;
            }
        },
    };
    for (key, val) in obj {
        let s = &mut c.loss_scaler;
        match (k, key.as_str()) {
            (_, "enabled") => {}
            ("fp16", "loss_scale") => match num(val) {
                Some(x) if x >= 0.0 && x.is_finite() => s.loss_scale = x,
                _ => bad.push(format!(
                    "fp16.loss_scale: got {val}, expected 0 (dynamic) or a positive scale"
                )),
            },
            ("fp16", "initial_scale_power") => match int(val) {
                Some(x) if x <= 126 => s.initial_scale_power = x as u32,
                _ => bad.push(format!(
                    "fp16.initial_scale_power: got {val}, expected an integer in 0..=126"
                )),
            },
            ("fp16", "loss_scale_window") => match int(val) {
                Some(x) if x >= 1 => s.loss_scale_window = x,
                _ => bad.push(format!(
                    "fp16.loss_scale_window: got {val}, expected an integer ≥ 1"
                )),
            },
            ("fp16", "hysteresis") => match int(val) {
                Some(x) if x >= 1 && x <= u32::MAX as u64 => s.hysteresis = x as u32,
                _ => bad.push(format!(
                    "fp16.hysteresis: got {val}, expected an integer ≥ 1"
                )),
            },
            ("fp16", "consecutive_hysteresis") => match boolean(val) {
                Some(b) => s.consecutive_hysteresis = b,
                None => bad.push(format!(
                    "fp16.consecutive_hysteresis: got {val}, expected a boolean"
                )),
            },
            ("fp16", "min_loss_scale") => match num(val) {
                Some(x) if x > 0.0 && x.is_finite() => s.min_loss_scale = x,
                _ => bad.push(format!(
                    "fp16.min_loss_scale: got {val}, expected a positive number"
                )),
            },
            ("fp16", "auto_cast") => notes.push(format!(
                "fp16.{key}: no effect here (the trainer casts weights and gradients itself)"
            )),
            ("bf16", "immediate_grad_update" | "check_grad_overflow") => {
                notes.push(format!("bf16.{key}: no effect here"))
            }
            _ => bad.push(format!("unknown key `{k}.{key}`")),
        }
    }
    if enabled {
        if c.precision != Precision::Fp32 && k == "bf16"
            || k == "fp16" && c.precision == Precision::Bf16
        {
            bad.push("fp16 and bf16 are both enabled; enable at most one".into());
        }
        c.precision = if k == "fp16" {
            Precision::Fp16
        } else {
            Precision::Bf16
        };
    }
}

fn read_data_types(v: &Value, c: &mut ZeroConfig, bad: &mut Vec<String>) {
    let Some(obj) = v.as_object() else {
        bad.push(format!("data_types: got {v}, expected an object"));
        return;
    };
    for (key, val) in obj {
        match key.as_str() {
            "grad_accum_dtype" => match val.as_str().map(Precision::parse) {
                Some(Ok(p)) => c.grad_accum_dtype = Some(p),
                _ => bad.push(format!(
                    "data_types.grad_accum_dtype: got {val}, expected \"fp32\", \"bf16\" or \"fp16\""
                )),
            },
            other => bad.push(format!("unknown key `data_types.{other}`")),
        }
    }
}

fn read_zero_section(
    v: &Value,
    c: &mut ZeroConfig,
    bad: &mut Vec<String>,
    notes: &mut Vec<String>,
) {
    let Some(obj) = v.as_object() else {
        bad.push("zero_optimization: expected an object".into());
        return;
    };
    for (k, val) in obj {
        let mut set_u64 = |field: &mut u64| match int(val) {
            Some(x) => *field = x,
            None if val.as_str() == Some("auto") => bad.push(format!(
                "zero_optimization.{k}: got \"auto\", expected a non-negative integer (\"auto\" \
                 is resolved only for {}, as the HF Trainer does)",
                auto::HIDDEN_SIZE_KEYS.join(", ")
            )),
            None => bad.push(format!(
                "zero_optimization.{k}: got {val}, expected a non-negative integer"
            )),
        };
        match k.as_str() {
            "stage" => match int(val) {
                Some(x) if x <= 3 => c.stage = x as u8,
                _ => bad.push(format!(
                    "zero_optimization.stage: got {val}, expected 0, 1, 2 or 3"
                )),
            },
            "reduce_bucket_size" => set_u64(&mut c.reduce_bucket_size),
            "allgather_bucket_size" => set_u64(&mut c.allgather_bucket_size),
            "stage3_prefetch_bucket_size" => set_u64(&mut c.prefetch_bucket_size),
            "stage3_max_live_parameters" => set_u64(&mut c.max_live_parameters),
            "stage3_param_persistence_threshold" => set_u64(&mut c.param_persistence_threshold),
            "stage3_model_persistence_threshold" => set_u64(&mut c.model_persistence_threshold),
            "overlap_comm" => match boolean(val) {
                Some(b) => c.overlap_comm = b,
                None => bad.push(format!(
                    "zero_optimization.overlap_comm: got {val}, expected a boolean"
                )),
            },
            "zero_quantized_weights" => match boolean(val) {
                Some(b) => c.quantized_weights = b,
                None => bad.push(format!(
                    "zero_optimization.{k}: got {val}, expected a boolean"
                )),
            },
            "zero_quantized_gradients" => match boolean(val) {
                Some(b) => c.quantized_gradients = b,
                None => bad.push(format!(
                    "zero_optimization.{k}: got {val}, expected a boolean"
                )),
            },
            "zero_hpz_partition_size" => match int(val) {
                Some(x) if x >= 1 => c.hpz_partition_size = x as usize,
                _ => bad.push(format!(
                    "zero_optimization.{k}: got {val}, expected an integer ≥ 1"
                )),
            },
            // Accepted: they tune DeepSpeed's buffers or kernels; results are unchanged here.
            "contiguous_gradients"
            | "reduce_scatter"
            | "allgather_partitions"
            | "round_robin_gradients"
            | "sub_group_size"
            | "stage3_max_reuse_distance"
            | "stage3_gather_16bit_weights_on_model_save"
            | "stage3_gather_fp16_weights_on_model_save"
            | "use_multi_rank_bucket_allreduce"
            | "load_from_fp32_weights"
            | "ignore_unused_parameters"
            | "memory_efficient_linear"
            | "stage3_module_granularity_threshold"
            | "stage3_use_all_reduce_for_fetch_params"
            | "elastic_checkpoint" => {
                if k == "reduce_scatter" && val == &Value::Bool(false) {
                    bad.push("zero_optimization.reduce_scatter=false: gradients are always reduce-scattered here".into());
                } else {
                    notes.push(format!("zero_optimization.{k}: accepted; it tunes DeepSpeed internals and has no effect here"));
                }
            }
            "offload_optimizer"
            | "offload_param"
            | "cpu_offload"
            | "cpu_offload_params"
            | "cpu_offload_use_pin_memory"
            | "mics_shard_size"
            | "mics_hierarchical_params_gather"
            | "zero_quantized_nontrainable_weights"
            | "zeropp_loco_param" => {
                let off = matches!(val, Value::Null | Value::Bool(false))
                    || val.get("device").and_then(Value::as_str) == Some("none")
                    || (k == "mics_shard_size" && int(val).is_none() && num(val) == Some(-1.0));
                if off {
                    notes.push(format!("zero_optimization.{k}: disabled, as here"));
                } else {
                    let what = match k.as_str() {
                        "mics_shard_size" | "mics_hierarchical_params_gather" => "MiCS",
                        "zero_quantized_nontrainable_weights" => "quantizing frozen weights",
                        "zeropp_loco_param" => "ZeRO++ LoCo",
                        _ => "CPU/NVMe offload",
                    };
                    let off_form = if k == "mics_shard_size" {
                        "-1"
                    } else if val.is_object() {
                        "{\"device\": \"none\"}"
                    } else {
                        "false"
                    };
                    bad.push(format!(
                        "zero_optimization.{k}: got {val}, expected {off_form} or no such key \
                         ({what} is not supported by zero-rs yet)"
                    ));
                }
            }
            other => bad.push(format!("unknown key `zero_optimization.{other}`")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_deepspeed_zeropp_tutorial_config() {
        let text = r#"{
          "train_micro_batch_size_per_gpu": 8,
          "fp16": {"enabled": true, "initial_scale_power": 12},
          "gradient_clipping": 1.0,
          "zero_optimization": {
            "stage": 3, "reduce_bucket_size": 1e7, "reduce_scatter": true,
            "contiguous_gradients": true, "overlap_comm": true,
            "zero_quantized_weights": true, "zero_hpz_partition_size": 16,
            "zero_quantized_gradients": true
          }
        }"#;
        let imp = ZeroConfig::from_deepspeed_json(text).unwrap();
        let c = imp.config;
        assert_eq!(c.stage, 3);
        assert_eq!(c.precision, Precision::Fp16);
        assert_eq!(c.reduce_bucket_size, 10_000_000);
        assert!(c.quantized_weights && c.quantized_gradients && c.overlap_comm);
        assert_eq!(c.hpz_partition_size, 16);
        assert_eq!(c.gradient_clipping, 1.0);
        assert_eq!(c.loss_scaler.initial_scale_power, 12);
        assert_eq!(c.loss_scaler.initial_scale(), 4096.0);
        assert!(imp.notes.iter().any(|n| n.contains("contiguous_gradients")));
        assert!(
            imp.notes
                .iter()
                .any(|n| n.contains("train_micro_batch_size_per_gpu"))
        );
    }

    #[test]
    fn reports_every_unknown_or_unsupported_key() {
        let text = r#"{"zero_optimization": {"stage": 2, "colour": 1,
            "offload_optimizer": {"device": "cpu"}}, "fancy": true}"#;
        let e = ZeroConfig::from_deepspeed_json(text)
            .unwrap_err()
            .to_string();
        assert!(e.contains("zero_optimization.colour"), "{e}");
        assert!(e.contains("offload_optimizer"), "{e}");
        assert!(e.contains("`fancy`"), "{e}");
    }

    #[test]
    fn reads_grad_accum_dtype_and_rejects_bad_values() {
        let text = r#"{"bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "fp32"}}"#;
        let c = ZeroConfig::from_deepspeed_json(text).unwrap().config;
        assert_eq!(c.grad_accum_dtype, Some(Precision::Fp32));
        for bad in [
            r#"{"data_types": {"grad_accum_dtype": "int8"}}"#,
            r#"{"data_types": {"grad_accum_dtype": 32}}"#,
            r#"{"data_types": {"accum": "fp32"}}"#,
        ] {
            let e = ZeroConfig::from_deepspeed_json(bad)
                .unwrap_err()
                .to_string();
            assert!(e.contains("data_types."), "{bad}: {e}");
        }
    }

    #[test]
    fn offload_to_none_is_fine() {
        let text =
            r#"{"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"}}}"#;
        assert_eq!(
            ZeroConfig::from_deepspeed_json(text).unwrap().config.stage,
            1
        );
    }

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

    #[test]
    fn both_precisions_is_an_error() {
        let text =
            r#"{"fp16": {"enabled": true}, "bf16": {"enabled": true}, "zero_optimization": {}}"#;
        assert!(ZeroConfig::from_deepspeed_json(text).is_err());
    }

    #[test]
    fn reads_the_fp16_loss_scaler() {
        let text = r#"{"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 20,
            "loss_scale_window": 50, "hysteresis": 1, "min_loss_scale": 4,
            "consecutive_hysteresis": true}, "zero_optimization": {"stage": 2}}"#;
        let c = ZeroConfig::from_deepspeed_json(text).unwrap().config;
        let want = LossScaleConfig {
            loss_scale: 0.0,
            initial_scale_power: 20,
            loss_scale_window: 50,
            hysteresis: 1,
            consecutive_hysteresis: true,
            min_loss_scale: 4.0,
        };
        assert_eq!(c.loss_scaler, want);
        assert!(c.loss_scaler.dynamic());
        let text = r#"{"fp16": {"enabled": true, "loss_scale": 128}, "zero_optimization": {}}"#;
        let c = ZeroConfig::from_deepspeed_json(text).unwrap().config;
        assert!(!c.loss_scaler.dynamic());
        assert_eq!(c.loss_scaler.initial_scale(), 128.0);
        let bad = r#"{"fp16": {"enabled": true, "loss_scale_window": 0}, "zero_optimization": {}}"#;
        let e = ZeroConfig::from_deepspeed_json(bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("loss_scale_window"), "{e}");
    }
}
