//! DeepSpeed's JSON config read into a [`ZeroConfig`]: its `zero_optimization` section and the
//! engine keys around it, with unknown and unsupported keys reported.

use serde_json::Value;

use super::auto::{self, AutoResolution, RunValues};
use super::json::{boolean, int, num};
use super::offload;
use super::{OptimizerKind, Precision, ZeroConfig};
use crate::error::{Error, Result};

impl ZeroConfig {
    /// Reads a DeepSpeed JSON config: its `zero_optimization` section and the `fp16`, `bf16` (or
    /// its legacy spelling `bfloat16`), `gradient_clipping` and `gradient_accumulation_steps`
    /// keys, with DeepSpeed's key names and meanings. Keys we do not know, and features we do not implement (parameter or NVMe offload, MiCS, …), are
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
    /// [`DeepSpeedImport::resolved`]. Unsupported keys (parameter or NVMe offload, MiCS, …) are still errors.
    pub fn from_deepspeed_json_with(text: &str, run: &RunValues) -> Result<DeepSpeedImport> {
        let v: Value = serde_json::from_str(text).map_err(|e| Error::Parse {
            what: "DeepSpeed config (JSON)".into(),
            message: e.to_string(),
        })?;
        Self::from_deepspeed_value(v, run)
    }

    pub(super) fn from_deepspeed_value(mut v: Value, run: &RunValues) -> Result<DeepSpeedImport> {
        let top = v.as_object_mut().ok_or_else(|| Error::Parse {
            what: "DeepSpeed config".into(),
            message: "expected a JSON object at the top level".into(),
        })?;
        let mut c = ZeroConfig::default();
        let mut bad = Vec::new();
        let mut notes = Vec::new();
        let resolved = auto::resolve(top, run, &mut bad, &mut notes);
        // `bfloat16` is DeepSpeed's legacy spelling of `bf16`; as in DeepSpeed, it is read only
        // when `bf16` is absent.
        let bf16_key = if top.contains_key("bf16") {
            "bf16"
        } else {
            "bfloat16"
        };
        for (k, val) in top.iter() {
            match k.as_str() {
                "zero_optimization" => read_zero_section(val, &mut c, &mut bad, &mut notes),
                "fp16" => read_precision(k, val, bf16_key, &mut c, &mut bad, &mut notes),
                "bf16" | "bfloat16" if k == bf16_key => {
                    read_precision(k, val, bf16_key, &mut c, &mut bad, &mut notes)
                }
                "bfloat16" => notes.push(
                    "bfloat16: not read: `bf16` is given too, and DeepSpeed then reads `bf16` \
                     alone (`bfloat16` is its legacy spelling)"
                        .into(),
                ),
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
                // NVIDIA Apex's AMP: fine when off; on, it is a precision zero-rs does not run.
                "amp" if val.get("enabled") == Some(&Value::Bool(false)) => {
                    notes.push("amp: disabled, as here".into())
                }
                "amp" => bad.push(format!(
                    "amp: got {val}, expected {{\"enabled\": false}} or no such section (Apex \
                     AMP is not supported by zero-rs: use bf16 or fp16)"
                )),
                "aio" => offload::read_aio(val, &mut notes, &mut bad),
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

/// Reads the `fp16` section, or the bf16 one (`k` is `bf16` or its legacy spelling `bfloat16`);
/// `bf16_key` is the spelling this config's bf16 section is read under, for the error that both
/// precisions are enabled.
fn read_precision(
    k: &str,
    v: &Value,
    bf16_key: &str,
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
            ("bf16" | "bfloat16", "immediate_grad_update" | "check_grad_overflow") => {
                notes.push(format!("{k}.{key}: no effect here"))
            }
            _ => bad.push(format!("unknown key `{k}.{key}`")),
        }
    }
    if enabled {
        let (clash, other) = if k == "fp16" {
            (c.precision == Precision::Bf16, bf16_key)
        } else {
            (c.precision != Precision::Fp32, "fp16")
        };
        if clash {
            bad.push(format!(
                "{other} and {k} are both enabled; enable at most one"
            ));
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
    let mut ring = None;
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
            _ if offload::read_offload(k, val, c, &mut ring, notes, bad) => {}
            "mics_shard_size"
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
                        "zero_quantized_nontrainable_weights" => "quantizing frozen weights",
                        "zeropp_loco_param" => "ZeRO++ LoCo",
                        _ => "MiCS",
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
    if let Some(n) = ring {
        c.offload_buffer_count = n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{LossScaleConfig, Placement};

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
            "offload_param": {"device": "cpu", "colour": 2}}, "fancy": true}"#;
        let e = ZeroConfig::from_deepspeed_json(text)
            .unwrap_err()
            .to_string();
        assert!(e.contains("zero_optimization.colour"), "{e}");
        assert!(
            e.contains("`zero_optimization.offload_param.colour`"),
            "{e}"
        );
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
    fn offload_optimizer_to_the_cpu_is_host_placement() {
        for text in [
            r#"{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true}}}"#,
            r#"{"zero_optimization": {"stage": 2, "cpu_offload": true}}"#,
        ] {
            let imp = ZeroConfig::from_deepspeed_json(text).unwrap();
            assert_eq!(imp.config.optimizer_placement, Placement::Host, "{text}");
            assert!(
                imp.notes.iter().any(|n| n.contains("host memory")),
                "{text}"
            );
        }
        let ratio = r#"{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}"#;
        let e = ZeroConfig::from_deepspeed_json(ratio)
            .unwrap_err()
            .to_string();
        assert!(e.contains("offload_optimizer.ratio"), "{e}");
        let none =
            r#"{"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"}}}"#;
        let c = ZeroConfig::from_deepspeed_json(none).unwrap().config;
        assert_eq!(c.optimizer_placement, Placement::Device);
    }

    #[test]
    fn apex_amp_is_fine_when_off_and_refused_when_on() {
        let off = r#"{"amp": {"enabled": false, "opt_level": "O2"}, "zero_optimization": {}}"#;
        let imp = ZeroConfig::from_deepspeed_json(off).unwrap();
        assert!(imp.notes.iter().any(|n| n.contains("amp: disabled")));
        let on = r#"{"amp": {"enabled": true}, "zero_optimization": {}}"#;
        let e = ZeroConfig::from_deepspeed_json(on).unwrap_err().to_string();
        assert!(e.contains("amp: got") && e.contains("Apex"), "{e}");
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
    fn both_precisions_is_an_error() {
        let text =
            r#"{"fp16": {"enabled": true}, "bf16": {"enabled": true}, "zero_optimization": {}}"#;
        assert!(ZeroConfig::from_deepspeed_json(text).is_err());
    }

    #[test]
    fn bfloat16_is_deepspeed_s_legacy_spelling_of_bf16() {
        let text = r#"{"bfloat16": {"enabled": true, "immediate_grad_update": false},
            "zero_optimization": {"stage": 2}}"#;
        let imp = ZeroConfig::from_deepspeed_json(text).unwrap();
        assert_eq!(imp.config.precision, Precision::Bf16);
        assert!(
            imp.notes
                .iter()
                .any(|n| n.starts_with("bfloat16.immediate_grad_update")),
            "{:?}",
            imp.notes
        );
        let off = r#"{"bfloat16": {"enabled": false}, "zero_optimization": {}}"#;
        let c = ZeroConfig::from_deepspeed_json(off).unwrap().config;
        assert_eq!(c.precision, Precision::Fp32);
        // Errors name the key as written. The HF Trainer fills "auto" in `bf16.enabled` only, so
        // `bfloat16`'s "auto" stays a value DeepSpeed would refuse too.
        for (text, want) in [
            (
                r#"{"bfloat16": {"enabled": true, "loss_scale": 1.0}, "zero_optimization": {}}"#,
                "unknown key `bfloat16.loss_scale`",
            ),
            (
                r#"{"bfloat16": {"enabled": "auto"}, "zero_optimization": {}}"#,
                "bfloat16.enabled: got \"auto\", expected true or false",
            ),
            (
                r#"{"bfloat16": {"enabled": true}, "fp16": {"enabled": true}, "zero_optimization": {}}"#,
                "bfloat16 and fp16 are both enabled",
            ),
        ] {
            let e = ZeroConfig::from_deepspeed_json(text)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
        // Both given: DeepSpeed reads `bf16` alone, and so does the import, saying so.
        let both = r#"{"bf16": {"enabled": false}, "bfloat16": {"enabled": true},
            "zero_optimization": {}}"#;
        let imp = ZeroConfig::from_deepspeed_json(both).unwrap();
        assert_eq!(imp.config.precision, Precision::Fp32);
        assert!(
            imp.notes
                .iter()
                .any(|n| n.starts_with("bfloat16: not read")),
            "{:?}",
            imp.notes
        );
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
