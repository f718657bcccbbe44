//! `"auto"` in DeepSpeed configs, resolved the way the Hugging Face Trainer's DeepSpeed
//! integration resolves it (`transformers.integrations.deepspeed`, `trainer_config_process` and
//! `trainer_config_finalize`):
//!
//! - from the model's hidden size `h`: `zero_optimization.reduce_bucket_size` = h²,
//!   `stage3_prefetch_bucket_size` = 0.9·h² (rounded down to whole elements) and
//!   `stage3_param_persistence_threshold` = 10·h. HF fills the last two only at stage 3; here they
//!   are filled at every stage, where below stage 3 they have no effect, so a later `--stage 3`
//!   sees resolved values.
//! - from the run: `train_micro_batch_size_per_gpu` (sequences per rank per micro-step),
//!   `train_batch_size` (world size × micro-batch × accumulation), `gradient_accumulation_steps`,
//!   `gradient_clipping`, `fp16.enabled` / `bf16.enabled` (the run's precision) and the optimizer's
//!   `lr`, `betas`, `eps` and `weight_decay`.
//!
//! As in HF, a value that is not `"auto"` but disagrees with the run (batch sizes, optimizer
//! parameters) is an error naming both; the engine keys the run sets itself (accumulation,
//! clipping, precision) keep zero-rs's rule: the config's value stands unless a flag overrides it.
//! Any other `"auto"` is refused by the key's own check.

use std::fmt;

use serde::Serialize;
use serde_json::{Map, Value};

use super::json::int;
use crate::config::{Precision, ZeroConfig};

/// What a run uses, for resolving `"auto"`. `None` means the caller does not know (e.g.
/// `cargo xtask plan` has no batch); see each field.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunValues {
    /// The model's hidden size (HF: `config.hidden_size`). `None`: the three hidden-size keys
    /// cannot be `"auto"`.
    pub hidden_size: Option<u64>,
    /// World size and micro-batch. `None`: batch-size keys are not read.
    pub batch: Option<RunBatch>,
    /// The run's own accumulation steps (a flag), if it sets them; `"auto"` without it means
    /// zero-rs's default (1). It also overrides the config's explicit value, which the caller
    /// applies; `train_batch_size` is checked against it.
    pub gradient_accumulation_steps: Option<u32>,
    /// The run's own clipping threshold, if it sets one; `"auto"` without it means 0 (off).
    pub gradient_clipping: Option<f64>,
    /// The run's own precision, if it sets one; `"auto"` without it means fp32 (both off).
    pub precision: Option<Precision>,
    /// The run's AdamW. `None`: the optimizer's parameters are not read.
    pub adamw: Option<AdamWValues>,
}

/// A run's data-parallel batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunBatch {
    /// Number of ranks.
    pub world_size: u64,
    /// Sequences per rank per micro-step.
    pub micro_batch_per_rank: u64,
}

/// A run's AdamW hyper-parameters (f32, as the trainer steps them).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWValues {
    /// Learning rate.
    pub lr: f32,
    /// β1.
    pub beta1: f32,
    /// β2.
    pub beta2: f32,
    /// ε.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
}

/// One `"auto"` value the import resolved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AutoResolution {
    /// Dotted key, e.g. `zero_optimization.reduce_bucket_size`.
    pub key: String,
    /// The value it resolved to, as written in JSON.
    pub value: String,
    /// Where the value came from.
    pub from: String,
}

impl fmt::Display for AutoResolution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} = {} ({})", self.key, self.value, self.from)
    }
}

/// The three keys HF derives from the hidden size, in its order.
pub(crate) const HIDDEN_SIZE_KEYS: [&str; 3] = [
    "reduce_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
];

fn is_auto(v: Option<&Value>) -> bool {
    matches!(v, Some(Value::String(s)) if s == "auto")
}

/// Collects resolutions and errors while the config is rewritten in place.
struct Resolver<'a> {
    run: &'a RunValues,
    resolved: Vec<AutoResolution>,
    bad: &'a mut Vec<String>,
    notes: &'a mut Vec<String>,
}

impl Resolver<'_> {
    fn set(
        &mut self,
        obj: &mut Map<String, Value>,
        prefix: &str,
        key: &str,
        value: Value,
        from: String,
    ) {
        self.resolved.push(AutoResolution {
            key: format!("{prefix}{key}"),
            value: value.to_string(),
            from,
        });
        obj.insert(key.to_string(), value);
    }

    fn hidden_size_keys(&mut self, zero: &mut Map<String, Value>) {
        for key in HIDDEN_SIZE_KEYS {
            if !is_auto(zero.get(key)) {
                continue;
            }
            let formula = match key {
                "reduce_bucket_size" => "hidden_size²",
                "stage3_prefetch_bucket_size" => "0.9 × hidden_size², rounded down",
                _ => "10 × hidden_size",
            };
            let value = match self.run.hidden_size {
                Some(h) if h >= 1 => match key {
                    "reduce_bucket_size" => h.checked_mul(h),
                    "stage3_prefetch_bucket_size" => h
                        .checked_mul(h)
                        .and_then(|x| x.checked_mul(9))
                        .map(|x| x / 10),
                    _ => h.checked_mul(10),
                },
                _ => None,
            };
            match (self.run.hidden_size, value) {
                (Some(h), Some(v)) => self.set(
                    zero,
                    "zero_optimization.",
                    key,
                    Value::from(v),
                    format!("{formula} with the model's hidden_size {h}"),
                ),
                (Some(h), None) => {
                    self.bad.push(format!(
                        "zero_optimization.{key}: got \"auto\" with hidden_size {h}, expected a \
                         hidden size from 1 whose {formula} fits in 64 bits"
                    ));
                    zero.remove(key);
                }
                (None, _) => {
                    self.bad.push(format!(
                        "zero_optimization.{key}: got \"auto\", expected a number of elements \
                         (\"auto\" is {formula}, and no model hidden size was given to resolve it)"
                    ));
                    zero.remove(key);
                }
            }
        }
    }

    fn engine_keys(&mut self, top: &mut Map<String, Value>) {
        let d = ZeroConfig::default();
        if is_auto(top.get("gradient_accumulation_steps")) {
            let (v, from) = match self.run.gradient_accumulation_steps {
                Some(g) => (g, "the run's gradient accumulation".to_string()),
                None => (
                    d.gradient_accumulation_steps,
                    "the default: the run sets no gradient accumulation".to_string(),
                ),
            };
            self.set(top, "", "gradient_accumulation_steps", Value::from(v), from);
        }
        if is_auto(top.get("gradient_clipping")) {
            let (v, from) = match self.run.gradient_clipping {
                Some(c) => (c, "the run's clipping threshold; 0 = off".to_string()),
                None => (
                    d.gradient_clipping,
                    "the default, off: the run sets no clipping threshold".to_string(),
                ),
            };
            self.set(top, "", "gradient_clipping", json_f64(v), from);
        }
        let precision = self.run.precision.unwrap_or(d.precision);
        let from = match self.run.precision {
            Some(p) => format!("the run's precision {}", precision_name(p)),
            None => "the default precision fp32: the run sets none".to_string(),
        };
        for (section, p) in [("fp16", Precision::Fp16), ("bf16", Precision::Bf16)] {
            if let Some(Value::Object(obj)) = top.get_mut(section)
                && is_auto(obj.get("enabled"))
            {
                let prefix = format!("{section}.");
                self.set(
                    obj,
                    &prefix,
                    "enabled",
                    Value::Bool(precision == p),
                    from.clone(),
                );
            }
        }
    }

    fn batch_keys(&mut self, top: &mut Map<String, Value>) {
        let Some(b) = self.run.batch else { return };
        let gas = self
            .run
            .gradient_accumulation_steps
            .map(u64::from)
            .or_else(|| top.get("gradient_accumulation_steps").and_then(int))
            .unwrap_or(1);
        let micro = b.micro_batch_per_rank;
        let Some(global) = b
            .world_size
            .checked_mul(micro)
            .and_then(|x| x.checked_mul(gas))
        else {
            return;
        };
        let keys = [
            (
                "train_micro_batch_size_per_gpu",
                micro,
                "the run's sequences per rank per micro-step".to_string(),
            ),
            (
                "train_batch_size",
                global,
                format!(
                    "world size {} × micro-batch {micro} × accumulation {gas}",
                    b.world_size
                ),
            ),
        ];
        for (key, want, from) in keys {
            match top.get(key) {
                None => {}
                Some(v) if is_auto(Some(v)) => self.set(top, "", key, Value::from(want), from),
                Some(v) if int(v) == Some(want) => {
                    self.notes
                        .push(format!("{key}: {v}, as the run's ({from})"));
                }
                Some(v) => self.bad.push(format!(
                    "{key}: got {v}, expected \"auto\" or the run's {want} ({from})"
                )),
            }
            // Checked against the run here, so not "outside the engine" any more.
            top.remove(key);
        }
    }

    fn optimizer_keys(&mut self, top: &mut Map<String, Value>) {
        let Some(a) = self.run.adamw else { return };
        let Some(Value::Object(params)) = top
            .get_mut("optimizer")
            .and_then(|o| o.as_object_mut())
            .and_then(|o| o.get_mut("params"))
        else {
            return;
        };
        let keys: [(&str, Value, Vec<f32>); 4] = [
            ("lr", json_f32(a.lr), vec![a.lr]),
            (
                "betas",
                Value::Array(vec![json_f32(a.beta1), json_f32(a.beta2)]),
                vec![a.beta1, a.beta2],
            ),
            ("eps", json_f32(a.eps), vec![a.eps]),
            (
                "weight_decay",
                json_f32(a.weight_decay),
                vec![a.weight_decay],
            ),
        ];
        for (key, value, want) in keys {
            let from = match key {
                "lr" => "the run's learning rate",
                _ => "the trainer's AdamW, which no flag changes",
            };
            match params.get(key) {
                None => {}
                Some(v) if is_auto(Some(v)) => {
                    let prefix = "optimizer.params.";
                    self.set(params, prefix, key, value, from.to_string())
                }
                Some(v) if as_f32s(v).as_deref() == Some(&want[..]) => {}
                Some(v) => self.bad.push(format!(
                    "optimizer.params.{key}: got {v}, expected \"auto\" or the run's {value} \
                     ({from})"
                )),
            }
        }
    }
}

/// Resolves the `"auto"` values of a DeepSpeed config in place, returning what was resolved;
/// problems go to `bad`, accepted-as-is values to `notes`.
pub(crate) fn resolve(
    top: &mut Map<String, Value>,
    run: &RunValues,
    bad: &mut Vec<String>,
    notes: &mut Vec<String>,
) -> Vec<AutoResolution> {
    let mut r = Resolver {
        run,
        resolved: Vec::new(),
        bad,
        notes,
    };
    if let Some(Value::Object(zero)) = top.get_mut("zero_optimization") {
        r.hidden_size_keys(zero);
    }
    r.engine_keys(top);
    r.batch_keys(top);
    r.optimizer_keys(top);
    r.resolved
}

fn precision_name(p: Precision) -> &'static str {
    match p {
        Precision::Fp32 => "fp32",
        Precision::Bf16 => "bf16",
        Precision::Fp16 => "fp16",
    }
}

fn json_f64(x: f64) -> Value {
    // Whole numbers print as integers ("0", not "0.0"), as a user would write them.
    if x.fract() == 0.0 && x.abs() < 9.0e15 {
        Value::from(x as i64)
    } else {
        Value::from(x)
    }
}

/// An f32 as the shortest decimal that reads back as the same f32 (`3e-3`, not
/// `0.003000000026077032`).
fn json_f32(x: f32) -> Value {
    let shortest: f64 = x.to_string().parse().unwrap_or(f64::from(x));
    json_f64(shortest)
}

fn as_f32s(v: &Value) -> Option<Vec<f32>> {
    match v {
        Value::Array(xs) => xs.iter().map(|x| x.as_f64().map(|f| f as f32)).collect(),
        x => x.as_f64().map(|f| vec![f as f32]),
    }
}
