//! `cargo xtask simulate`: step time, throughput and memory of a plan on a cluster, from
//! `zero_core::sim`; one configuration, or a sweep as a table and a plot.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::Args;
use zero_core::sim::sweep::{VARIANTS, sweep};
use zero_core::sim::{
    CLUSTER_PRESETS, Cluster, ModelShape, Overlap, SimOptions, SweepAxis, SweepTable, Variant,
    compute, simulate,
};
use zero_core::{ModelDesc, Plan};

use crate::plan::{ModelArgs, ZeroArgs, load_model, parse_count};

use crate::plot::{Panel, Series, line_charts};

#[cfg(feature = "engine")]
mod host;

/// The calibrated host loopback.
const HOST_LOOPBACK: &str = include_str!("host-loopback.toml");

#[derive(Args, Debug)]
pub(crate) struct SimulateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// A GPT-2-style model LAYERSxHIDDEN (e.g. 40x6144: 18B), sequence length from --seq-len.
    #[arg(long, conflicts_with_all = ["preset", "model", "params"])]
    gpt: Option<String>,
    /// Transformer layers (attention FLOPs, activations); presets and --gpt know theirs.
    #[arg(long)]
    layers: Option<u64>,
    /// Hidden size (attention FLOPs, activations).
    #[arg(long)]
    hidden: Option<u64>,
    /// Sequence length (default: the preset's context, else 1024).
    #[arg(long)]
    seq_len: Option<u64>,
    #[command(flatten)]
    zero: ZeroArgs,
    /// A cluster preset (dgx2-v100, dgx-a100, dgx-h100; default dgx-h100), `host-loopback` (this
    /// machine's calibrated loopback) or a TOML file (`preset = "NAME"` plus the fields to change,
    /// or a full description: see `--print-cluster`).
    #[arg(long)]
    cluster: Option<String>,
    /// Nodes.
    #[arg(long, default_value_t = 8)]
    nodes: usize,
    /// GPUs per node (overrides the cluster).
    #[arg(long)]
    gpus_per_node: Option<usize>,
    /// NICs per node (overrides the cluster).
    #[arg(long)]
    nics_per_node: Option<usize>,
    /// Line rate of one NIC, Gbit/s (overrides the cluster).
    #[arg(long)]
    nic_gbps: Option<f64>,
    /// Total NIC line rate per node, Gbit/s (split over the NICs; applied last).
    #[arg(long)]
    nic_gbps_per_node: Option<f64>,
    /// GPU memory, GiB (overrides the cluster).
    #[arg(long)]
    gpu_memory_gib: Option<f64>,
    /// Sustained fraction of peak FLOPs (overrides the cluster).
    #[arg(long)]
    compute_efficiency: Option<f64>,
    /// Any cluster field by dotted path, e.g. `--set intra.efficiency=0.9` (repeatable).
    #[arg(long, value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Tokens per GPU per micro-step (default: one sequence).
    #[arg(long)]
    tokens_per_gpu: Option<String>,
    /// Overlap of communication with compute: none, full or a fraction (default: the config's
    /// overlap_comm).
    #[arg(long)]
    overlap: Option<String>,
    /// No activation checkpointing (the trainer always recomputes).
    #[arg(long)]
    no_recompute: bool,
    /// Sweep: `nodes=1,8,64`, `nic-gbps=100,200,400,800` (per node) or `variants`.
    #[arg(long)]
    sweep: Option<String>,
    /// Variants of a sweep, comma-separated (default: zero-3,zero++; all for `variants`).
    #[arg(long, requires = "sweep")]
    variants: Option<String>,
    /// Where a sweep's plot goes (SVG; PNG when the name ends in `.png`).
    #[arg(long, default_value = "runs/simulate.svg")]
    plot: PathBuf,
    /// Print the cluster description (TOML) and exit.
    #[arg(long)]
    print_cluster: bool,
    /// Replay the default training job's collectives on the host loopback, timed, next to the
    /// prediction on the calibrated `host-loopback` cluster (no model or ZeRO flags).
    #[arg(long, conflicts_with_all = ["sweep", "preset", "model", "params", "gpt"])]
    pub(crate) validate_host: bool,
    /// Replayed steps for --validate-host (after one warm-up).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
}

pub(crate) fn run(a: SimulateArgs) -> anyhow::Result<()> {
    let cluster = load_cluster(&a)?;
    if a.print_cluster {
        if a.json {
            println!("{}", serde_json::to_string_pretty(&cluster)?);
        } else {
            print!("{}", cluster.to_toml());
        }
        return Ok(());
    }
    if a.validate_host {
        #[cfg(feature = "engine")]
        return host::validate(&cluster, a.steps, a.json);
        #[cfg(not(feature = "engine"))]
        return Err(crate::release::missing(&[]));
    }
    let (model, shape) = model_and_shape(&a)?;
    let tokens = match &a.tokens_per_gpu {
        Some(t) => parse_count(t).map_err(|_| {
            anyhow::anyhow!(
                "--tokens-per-gpu {t:?}: expected a whole number of tokens ≥ 1 (e.g. 2048 or 2k)"
            )
        })?,
        None => shape.map_or(1024, |s| s.seq_len),
    };
    let opts = SimOptions {
        tokens_per_gpu: tokens,
        shape,
        recompute: !a.no_recompute,
        overlap: a.overlap.as_deref().map(Overlap::parse).transpose()?,
    };
    let cfg = a.zero.config(&a.model)?;
    let Some(spec) = &a.sweep else {
        let plan = Plan::new(&model, cluster.topology(a.nodes)?, &cfg)?;
        let r = simulate(&plan, &cluster, &opts)?;
        if a.json {
            println!("{}", serde_json::to_string_pretty(&r)?);
        } else {
            print!("{r}");
        }
        return Ok(());
    };
    let axis = parse_sweep(spec)?;
    let default = match axis {
        SweepAxis::Variants => VARIANTS[2..].join(","),
        _ => "zero-3,zero++".into(),
    };
    let variants = a
        .variants
        .as_deref()
        .unwrap_or(&default)
        .split(',')
        .map(|v| Variant::named(v.trim(), &cfg, cluster.gpus_per_node))
        .collect::<Result<Vec<_>, _>>()?;
    let ext = a.plot.extension().and_then(|e| e.to_str()).unwrap_or("");
    if !ext.eq_ignore_ascii_case("svg") && !ext.eq_ignore_ascii_case("png") {
        bail!(
            "--plot {}: expected a file name ending in .svg or .png",
            a.plot.display()
        );
    }
    let table = sweep(&model, &cluster, a.nodes, &axis, &variants, &opts)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&table)?);
    } else {
        let r = &table.rows[0].report;
        println!(
            "{} on {} ({} GPUs/node, {} Gbps/node unless swept), {} tokens/GPU x {} micro-step(s), overlap {}",
            model_name(&a),
            cluster.name,
            cluster.gpus_per_node,
            cluster.nic_gbps_per_node(),
            r.tokens_per_gpu,
            r.grad_accum,
            r.overlap
        );
        print!("{table}");
    }
    plot_sweep(&a.plot, &table, &model_name(&a), &cluster)?;
    eprintln!("plot: {}", a.plot.display());
    Ok(())
}

fn load_cluster(a: &SimulateArgs) -> anyhow::Result<Cluster> {
    let default = if a.validate_host {
        "host-loopback"
    } else {
        "dgx-h100"
    };
    let name = a.cluster.as_deref().unwrap_or(default);
    let mut c = if name == "host-loopback" {
        Cluster::from_toml(HOST_LOOPBACK)?
    } else if CLUSTER_PRESETS.contains(&name) || !Path::new(name).exists() {
        Cluster::preset(name)?
    } else {
        let text = std::fs::read_to_string(name)
            .with_context(|| format!("cannot read cluster file {name}"))?;
        Cluster::from_toml(&text).with_context(|| format!("in cluster file {name}"))?
    };
    for kv in &a.set {
        let Some((k, v)) = kv.split_once('=') else {
            bail!("--set {kv:?}: expected KEY=VALUE, e.g. inter.efficiency=0.9");
        };
        c = c
            .set(k.trim(), v.trim())
            .with_context(|| format!("--set {kv}"))?;
    }
    let flags = [
        ("gpus_per_node", a.gpus_per_node.map(|v| v.to_string())),
        (
            "inter.nics_per_node",
            a.nics_per_node.map(|v| v.to_string()),
        ),
        ("inter.nic_gbps", a.nic_gbps.map(toml_f64)),
        ("gpu.memory_gib", a.gpu_memory_gib.map(toml_f64)),
        ("gpu.compute_efficiency", a.compute_efficiency.map(toml_f64)),
    ];
    for (k, v) in flags {
        if let Some(v) = v {
            c = c.set(k, &v)?;
        }
    }
    if let Some(g) = a.nic_gbps_per_node {
        c = c.with_nic_gbps_per_node(g)?;
    }
    Ok(c)
}

/// A number flag as TOML text: NaN and the infinities as TOML spells them, so that the cluster's
/// range check names them (`got NaN, expected a finite number > 0`).
fn toml_f64(v: f64) -> String {
    if v.is_nan() {
        "nan".into()
    } else if v.is_infinite() {
        if v > 0.0 { "inf" } else { "-inf" }.into()
    } else {
        format!("{v:?}")
    }
}

fn model_and_shape(a: &SimulateArgs) -> anyhow::Result<(ModelDesc, Option<ModelShape>)> {
    for (flag, v) in [
        ("--layers", a.layers),
        ("--hidden", a.hidden),
        ("--seq-len", a.seq_len),
    ] {
        if v == Some(0) {
            bail!("{flag} 0: expected at least 1");
        }
    }
    if let Some(g) = &a.gpt {
        let Some((l, h)) = g
            .split_once('x')
            .and_then(|(l, h)| Some((l.parse().ok()?, h.parse().ok()?)))
        else {
            bail!("--gpt {g:?}: expected LAYERSxHIDDEN, e.g. 40x6144");
        };
        let (m, s) = compute::gpt(l, h, a.seq_len.unwrap_or(1024) as usize)?;
        return Ok((m, Some(s)));
    }
    let model = load_model(&a.model)?;
    let base = a.model.preset.as_deref().and_then(ModelShape::of_preset);
    let shape = match (base, a.layers, a.hidden) {
        (Some(s), l, h) => Some(ModelShape {
            layers: l.unwrap_or(s.layers),
            hidden: h.unwrap_or(s.hidden),
            seq_len: a.seq_len.unwrap_or(s.seq_len),
        }),
        (None, Some(layers), Some(hidden)) => Some(ModelShape {
            layers,
            hidden,
            seq_len: a.seq_len.unwrap_or(1024),
        }),
        (None, None, None) => {
            eprintln!("note: no --layers/--hidden: attention FLOPs and activations are left out");
            None
        }
        _ => bail!("give both --layers and --hidden, or neither"),
    };
    Ok((model, shape))
}

fn model_name(a: &SimulateArgs) -> String {
    if let Some(g) = &a.gpt {
        return format!("GPT {g}");
    }
    match (&a.model.preset, &a.model.model, &a.model.params) {
        (Some(p), _, _) => p.clone(),
        (_, Some(f), _) => f.display().to_string(),
        (_, _, Some(n)) => format!("{n} params"),
        _ => "model".into(),
    }
}

fn parse_sweep(spec: &str) -> anyhow::Result<SweepAxis> {
    if spec == "variants" {
        return Ok(SweepAxis::Variants);
    }
    let Some((axis, list)) = spec.split_once('=') else {
        bail!("--sweep {spec:?}: expected nodes=1,8,64, nic-gbps=100,200,400,800 or variants");
    };
    let values: Vec<&str> = list
        .split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .collect();
    // Each value of `--sweep <axis>=…` parsed, or which one is not `what`.
    fn parse<T: std::str::FromStr>(
        axis: &str,
        values: &[&str],
        what: &str,
    ) -> anyhow::Result<Vec<T>>
    where
        T::Err: std::error::Error + Send + Sync + 'static,
    {
        let one = |v: &&str| {
            v.parse()
                .with_context(|| format!("--sweep {axis}: {v:?} is not {what}"))
        };
        values.iter().map(one).collect()
    }
    match axis {
        "nodes" => Ok(SweepAxis::Nodes(parse(axis, &values, "a node count")?)),
        "nic-gbps" => Ok(SweepAxis::NicGbpsPerNode(parse(axis, &values, "a number")?)),
        other => bail!("--sweep {other:?}: expected nodes, nic-gbps or variants"),
    }
}

/// Tokens/s and TFLOPs/GPU against the swept value, one line per variant, side by side.
fn plot_sweep(path: &Path, t: &SweepTable, model: &str, c: &Cluster) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let (x_label, x_names) = match t.axis {
        SweepAxis::Nodes(_) => ("nodes".to_string(), None),
        SweepAxis::NicGbpsPerNode(_) => ("NIC Gbps per node".to_string(), None),
        SweepAxis::Variants => (
            "variant".to_string(),
            Some(t.rows.iter().map(|r| r.variant.clone()).collect()),
        ),
    };
    let mut names: Vec<String> = Vec::new();
    for r in &t.rows {
        if !names.contains(&r.variant) {
            names.push(r.variant.clone());
        }
    }
    let series = |y: fn(&zero_core::sim::SimReport) -> f64| -> Vec<Series> {
        match t.axis {
            SweepAxis::Variants => vec![Series {
                name: "all variants".into(),
                points: t
                    .rows
                    .iter()
                    .enumerate()
                    .map(|(i, r)| (i as f64, y(&r.report)))
                    .collect(),
            }],
            _ => names
                .iter()
                .map(|n| Series {
                    name: n.clone(),
                    points: t
                        .rows
                        .iter()
                        .filter(|r| &r.variant == n)
                        .map(|r| (r.x, y(&r.report)))
                        .collect(),
                })
                .collect(),
        }
    };
    let title = |what: &str| format!("{what}: {model} on {}", c.name);
    let panels = [
        Panel {
            title: title("tokens/s"),
            x_label: x_label.clone(),
            y_label: "tokens/s (cluster)".into(),
            x_names: x_names.clone(),
            series: series(|r| r.tokens_per_sec),
        },
        Panel {
            title: title("TFLOPs per GPU"),
            x_label,
            y_label: "TFLOPs/GPU (recompute counted)".into(),
            x_names,
            series: series(|r| r.tflops_per_gpu),
        },
    ];
    line_charts(path, &panels, 1200, 450)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: SimulateArgs,
    }

    fn args(line: &str) -> SimulateArgs {
        Cli::try_parse_from(std::iter::once("simulate").chain(line.split_whitespace()))
            .unwrap()
            .a
    }

    #[test]
    fn cluster_flags_override_the_preset() {
        let a = args(
            "--cluster dgx2-v100 --gpus-per-node 8 --nics-per-node 4 --nic-gbps-per-node 200 \
             --set intra.efficiency=0.9 --compute-efficiency 0.4",
        );
        let c = load_cluster(&a).unwrap();
        assert_eq!(c.gpus_per_node, 8);
        assert_eq!((c.inter.nics_per_node, c.inter.nic_gbps), (4, 50.0));
        assert_eq!((c.intra.efficiency, c.gpu.compute_efficiency), (0.9, 0.4));
        assert!(load_cluster(&args("--set intra.efficiency")).is_err());
        assert!(load_cluster(&args("--cluster nowhere.toml")).is_err());
        let h = load_cluster(&args("--cluster host-loopback")).unwrap();
        assert_eq!((h.gpus_per_node, h.protocols.len()), (2, 1));
    }

    #[test]
    fn shapes_come_from_presets_flags_or_gpt() {
        let (_, s) = model_and_shape(&args("--preset llama-7b --seq-len 2048")).unwrap();
        assert_eq!(
            s.map(|s| (s.layers, s.hidden, s.seq_len)),
            Some((32, 4096, 2048))
        );
        let (m, s) = model_and_shape(&args("--gpt 2x64 --seq-len 16")).unwrap();
        assert_eq!(s.map(|s| s.seq_len), Some(16));
        assert!(m.numel() > 2 * 12 * 64 * 64);
        let (_, s) = model_and_shape(&args("--params 1e6 --layers 2 --hidden 8")).unwrap();
        assert_eq!(s.map(|s| s.seq_len), Some(1024));
        assert!(model_and_shape(&args("--params 1e6 --hidden 8")).is_err());
        assert!(model_and_shape(&args("--gpt 2by64")).is_err());
    }

    /// `simulate --validate-host` as a smoke test, with a wide band: the replay runs every
    /// collective of the default job's plan (its traffic checked against the plan inside), and
    /// for the whole step the calibrated prediction (B) lands within 5x of the measurement,
    /// either way (docs/benchmarks-history.md records 1.22x from a quiet run; tests run beside
    /// others here).
    #[cfg(feature = "engine")]
    #[test]
    fn the_calibrated_prediction_is_within_a_wide_band_of_the_replay() {
        let c = load_cluster(&args("--cluster host-loopback --validate-host")).unwrap();
        let v = host::measure(&c, 3).unwrap();
        let (b, m) = (v.inproc.iter().sum::<f64>(), v.measured.iter().sum::<f64>());
        assert!(m > 0.0 && b > 0.0, "predicted {b} s, measured {m} s");
        assert!(
            (0.2..=5.0).contains(&(b / m)),
            "predicted {b:.6} s against {m:.6} s measured: {:.2}x",
            b / m
        );
        assert!(v.bench.iter().sum::<f64>() > 0.0);
    }

    #[test]
    fn sweeps_parse() {
        assert_eq!(
            parse_sweep("nodes=1,8").unwrap(),
            SweepAxis::Nodes(vec![1, 8])
        );
        assert_eq!(
            parse_sweep("nic-gbps=100, 800").unwrap(),
            SweepAxis::NicGbpsPerNode(vec![100.0, 800.0])
        );
        assert_eq!(parse_sweep("variants").unwrap(), SweepAxis::Variants);
        assert!(parse_sweep("nodes=x").is_err());
        assert!(parse_sweep("gpus=8").is_err());
        assert!(parse_sweep("nodes").is_err());
    }
}
