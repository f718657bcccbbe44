//! `cargo xtask plan`: the estimator.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Args;
use zero_core::model::{PRESETS, preset_hidden_size};
use zero_core::{ModelDesc, Plan, Precision, RunValues, Topology, ZeroConfig};

/// Which model: shared by `plan` and `simulate`.
#[derive(Args, Debug)]
pub(crate) struct ModelArgs {
    /// A preset model: gpt2-small, gpt2-medium, llama-7b, llama-70b.
    #[arg(long, conflicts_with_all = ["model", "params"])]
    pub(crate) preset: Option<String>,
    /// A model-description file (JSON or TOML: a list of params with name, shape, module).
    #[arg(long, conflicts_with = "params")]
    pub(crate) model: Option<PathBuf>,
    /// A parameter count alone (e.g. 7.5e9): a synthetic model of 32 equal layers.
    #[arg(long)]
    pub(crate) params: Option<String>,
}

/// The ZeRO switches: shared by `plan` and `simulate`.
#[derive(Args, Debug)]
pub(crate) struct ZeroArgs {
    /// ZeRO stage 0–3 (overrides the config file).
    #[arg(long)]
    stage: Option<u8>,
    /// fp32, bf16 or fp16 (overrides the config file).
    #[arg(long)]
    precision: Option<String>,
    /// qwZ: int8 weight all-gather.
    #[arg(long)]
    qwz: bool,
    /// hpZ: secondary shard group size.
    #[arg(long)]
    hpz: Option<usize>,
    /// qgZ: int4 hierarchical gradient reduction.
    #[arg(long)]
    qgz: bool,
    /// Gradient accumulation steps (overrides the config file).
    #[arg(long)]
    grad_accum: Option<u32>,
    /// A config file: ours (TOML or JSON) or a DeepSpeed JSON config (HF Trainer style `"auto"`
    /// values included).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The model's hidden size, for a DeepSpeed config's `"auto"` bucket sizes and persistence
    /// threshold (a preset's own by default).
    #[arg(long)]
    hidden_size: Option<u64>,
}

impl ZeroArgs {
    /// The config file (or the defaults) with the flags applied; a DeepSpeed config's `"auto"`
    /// values are resolved from the flags and `model`'s hidden size.
    pub(crate) fn config(&self, model: &ModelArgs) -> anyhow::Result<ZeroConfig> {
        let precision = self
            .precision
            .as_deref()
            .map(Precision::parse)
            .transpose()?;
        let run = RunValues {
            hidden_size: self
                .hidden_size
                .or_else(|| model.preset.as_deref().and_then(preset_hidden_size)),
            gradient_accumulation_steps: self.grad_accum,
            precision,
            ..Default::default()
        };
        let mut cfg = match &self.config {
            Some(path) => load_config(path, &run).map_err(|e| {
                if run.hidden_size.is_none() && format!("{e:#}").contains("no model hidden size") {
                    e.context("pass the model's hidden size with --hidden-size N")
                } else {
                    e
                }
            })?,
            None => ZeroConfig::default(),
        };
        if let Some(s) = self.stage {
            cfg.stage = s;
        }
        if let Some(p) = precision {
            cfg.precision = p;
        }
        if self.qwz {
            cfg.quantized_weights = true;
        }
        if let Some(h) = self.hpz {
            cfg.hpz_partition_size = h;
        }
        if self.qgz {
            cfg.quantized_gradients = true;
        }
        if let Some(g) = self.grad_accum {
            cfg.gradient_accumulation_steps = g;
        }
        Ok(cfg)
    }
}

#[derive(Args, Debug)]
pub(crate) struct PlanArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Data-parallel world size.
    #[arg(long, default_value_t = 8)]
    world_size: usize,
    /// Ranks per node (defaults to min(world size, 8)).
    #[arg(long)]
    ranks_per_node: Option<usize>,
    #[command(flatten)]
    zero: ZeroArgs,
    /// The rank to report (traffic is per rank).
    #[arg(long, default_value_t = 0)]
    rank: usize,
    /// Print JSON (bytes) instead of a table.
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(a: PlanArgs) -> anyhow::Result<()> {
    print!("{}", render(&a)?);
    Ok(())
}

/// What `plan` prints: the report of `a.rank` as a table, or as JSON (bytes) with `--json`.
fn render(a: &PlanArgs) -> anyhow::Result<String> {
    let model = load_model(&a.model)?;
    let cfg = a.zero.config(&a.model)?;
    let rpn = a.ranks_per_node.unwrap_or(a.world_size.clamp(1, 8));
    let topo = Topology::new(a.world_size, rpn)?;
    if a.rank >= a.world_size {
        bail!(
            "--rank {} is out of range: expected 0..{}",
            a.rank,
            a.world_size
        );
    }
    let plan = Plan::new(&model, topo, &cfg)?;
    let report = plan.report(a.rank);
    Ok(if a.json {
        serde_json::to_string_pretty(&report)? + "\n"
    } else {
        report.to_string()
    })
}

/// Reads a config file (ours in TOML/JSON, or DeepSpeed's JSON), resolving a DeepSpeed config's
/// `"auto"` values from `run`; prints the import's notes and one line per resolved value.
pub(crate) fn load_config(path: &std::path::Path, run: &RunValues) -> anyhow::Result<ZeroConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config {}", path.display()))?;
    let imp = ZeroConfig::from_any_with(&text, run)
        .with_context(|| format!("in config {}", path.display()))?;
    for n in &imp.notes {
        eprintln!("note: {n}");
    }
    for r in &imp.resolved {
        eprintln!("auto: {r}");
    }
    Ok(imp.config)
}

pub(crate) fn load_model(a: &ModelArgs) -> anyhow::Result<ModelDesc> {
    if let Some(p) = &a.preset {
        return Ok(ModelDesc::preset(p)?);
    }
    if let Some(path) = &a.model {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read model file {}", path.display()))?;
        let m = if path.extension().is_some_and(|e| e == "toml") {
            ModelDesc::from_toml(&text)?
        } else {
            ModelDesc::from_json(&text)?
        };
        return Ok(m);
    }
    if let Some(n) = &a.params {
        return Ok(ModelDesc::synthetic(parse_count(n)?, 32)?);
    }
    bail!("say which model: --preset NAME (one of {PRESETS:?}), --model FILE or --params N")
}

/// Parses `124000000`, `7.5e9`, `7.5B`, `350M`.
pub(crate) fn parse_count(s: &str) -> anyhow::Result<u64> {
    let t = s.trim().replace('_', "");
    let (num, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1e3),
        Some('m' | 'M') => (&t[..t.len() - 1], 1e6),
        Some('b' | 'B' | 'g' | 'G') => (&t[..t.len() - 1], 1e9),
        Some('t' | 'T') => (&t[..t.len() - 1], 1e12),
        _ => (t.as_str(), 1.0),
    };
    let x: f64 = num
        .parse()
        .with_context(|| format!("--params {s:?} is not a number (e.g. 7.5e9 or 350M)"))?;
    let v = x * mult;
    if !(v >= 1.0 && v.fract() == 0.0) {
        bail!("--params {s:?} must be a whole number of parameters ≥ 1");
    }
    let max = zero_core::MAX_MODEL_PARAMS;
    if v > max as f64 {
        bail!(
            "--params {s:?} is too large: at most 2^50 ({:.2e}) parameters are planned",
            max as f64
        );
    }
    Ok(v as u64)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        plan: PlanArgs,
    }

    fn plan(argv: &[&str]) -> anyhow::Result<String> {
        let a = Cli::try_parse_from([&["plan"], argv].concat()).expect("flags parse");
        render(&a.plan)
    }

    #[test]
    fn counts() {
        assert_eq!(parse_count("7.5e9").unwrap(), 7_500_000_000);
        assert_eq!(parse_count("350M").unwrap(), 350_000_000);
        assert_eq!(parse_count("1_000").unwrap(), 1000);
        assert!(parse_count("0").is_err());
        assert!(parse_count("1.5").is_err());
        assert!(parse_count("lots").is_err());
        // Too large says so (a whole number, but its bytes would not fit in 64 bits).
        assert!(parse_count("1.1e15").is_ok());
        let e = parse_count("1.2e18").unwrap_err().to_string();
        assert!(e.contains("too large"), "{e}");
    }

    /// `--json` is the plan's own report of the rank asked for, and the table says the same
    /// stage and world.
    #[test]
    fn json_and_table_are_the_plans_report() {
        let argv = [
            "--preset",
            "gpt2-small",
            "--world-size",
            "16",
            "--stage",
            "3",
            "--qwz",
            "--hpz",
            "8",
            "--rank",
            "5",
        ];
        let json: serde_json::Value =
            serde_json::from_str(&plan(&[&argv[..], &["--json"]].concat()).unwrap()).unwrap();
        let model = ModelDesc::preset("gpt2-small").unwrap();
        let cfg = ZeroConfig {
            stage: 3,
            quantized_weights: true,
            hpz_partition_size: 8,
            ..Default::default()
        };
        let direct = Plan::new(&model, Topology::new(16, 8).unwrap(), &cfg)
            .unwrap()
            .report(5);
        assert_eq!(json, serde_json::to_value(&direct).unwrap());
        let table = plan(&argv).unwrap();
        assert_eq!(table, direct.to_string());
        assert!(table.contains("ZeRO-3"), "{table}");
    }

    /// A DeepSpeed config as the HF Trainer writes it (`"auto"` values) plans, its values
    /// resolved from the flags and the preset's hidden size; offload is refused naming the key;
    /// bad flags name what was wrong.
    #[test]
    fn configs_and_bad_flags() {
        let tmp = crate::temp_dir("zero-rs-plan-");
        let dir = tmp.path().to_path_buf();
        let hf = dir.join("ds_hf.json");
        std::fs::write(
            &hf,
            r#"{"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto", "overlap_comm": true},
                "bf16": {"enabled": "auto"}, "gradient_accumulation_steps": "auto",
                "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto"}"#,
        )
        .unwrap();
        let hf_s = hf.to_str().unwrap();
        let base = ["--preset", "gpt2-small", "--world-size", "8", "--json"];
        let out: serde_json::Value = serde_json::from_str(
            &plan(&[&base[..], &["--config", hf_s, "--grad-accum", "4"]].concat()).unwrap(),
        )
        .unwrap();
        assert!(out.is_object(), "{out}");
        let cfg = ZeroArgs::config(
            &Cli::try_parse_from([&["plan"], &base[..], &["--config", hf_s]].concat())
                .unwrap()
                .plan
                .zero,
            &ModelArgs {
                preset: Some("gpt2-small".into()),
                model: None,
                params: None,
            },
        )
        .unwrap();
        // HF's formulas from gpt2-small's hidden size 768.
        assert_eq!(cfg.stage, 3);
        assert_eq!(cfg.reduce_bucket_size, 768 * 768);
        assert_eq!(cfg.param_persistence_threshold, 10 * 768);
        let off = dir.join("ds_offload.json");
        std::fs::write(
            &off,
            r#"{"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}"#,
        )
        .unwrap();
        let e = plan(&[&base[..], &["--config", off.to_str().unwrap()]].concat()).unwrap_err();
        assert!(format!("{e:#}").contains("nvme_path"), "{e:#}");
        std::fs::write(
            &off,
            r#"{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}}"#,
        )
        .unwrap();
        let out = plan(&[&base[..], &["--config", off.to_str().unwrap()]].concat()).unwrap();
        for split in [
            "\"device_bytes\"",
            "\"host_bytes\"",
            "\"disk_bytes\"",
            "\"offload_buffers\"",
        ] {
            assert!(out.contains(split), "{split}: {out}");
        }
        let e = plan(&["--preset", "gpt2-small", "--world-size", "4", "--rank", "4"]).unwrap_err();
        assert!(
            format!("{e:#}").contains("--rank 4 is out of range"),
            "{e:#}"
        );
        let e = plan(&["--world-size", "4"]).unwrap_err();
        assert!(format!("{e:#}").contains("llama-7b"), "{e:#}");
        let e = plan(&[
            "--preset",
            "gpt2-small",
            "--world-size",
            "4",
            "--stage",
            "4",
        ])
        .unwrap_err();
        assert!(format!("{e:#}").contains("stage"), "{e:#}");
    }
}
