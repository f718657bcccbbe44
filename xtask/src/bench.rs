//! `cargo xtask bench`: trainer benchmarks. Each configuration runs `cargo xtask train` in its own
//! process (so peak resident memory is per configuration) and the figures are read back from its
//! `report.json`.
//!
//! - step time and tokens/s for every stage and ZeRO++ switch, with and without `overlap_comm`,
//!   with the ratio to stage 0;
//! - the final-loss gap of qwZ/qgZ against plain ZeRO-3 after the same steps;
//! - peak resident memory of ZeRO-3 against stage 0 on a model whose states dominate memory.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};
use clap::Args;

#[derive(Args, Debug)]
pub(crate) struct BenchArgs {
    /// Steps per configuration for the speed and loss table.
    #[arg(long, default_value_t = 100)]
    steps: u64,
    /// Where the runs go.
    #[arg(long, default_value = "runs/bench")]
    out: String,
}

/// Plain ZeRO-3: no qwZ, qgZ or hpZ.
const Z3: &str = "--stage 3 --qwz false --qgz false --hpz 1";

/// The speed and loss table's configurations: a name and `cargo xtask train`'s arguments (the
/// steps and, but for the `overlap` rows, `--overlap-comm false` are added).
const ROWS: [(&str, &str); 12] = [
    ("stage0", "--stage 0"),
    ("stage1", "--stage 1"),
    ("stage2", "--stage 2"),
    ("stage3", Z3),
    ("stage3+qwz", "--stage 3 --qwz true --qgz false --hpz 1"),
    ("stage3+hpz", "--stage 3 --qwz false --qgz false --hpz 2"),
    ("stage3+qgz", "--stage 3 --qwz false --qgz true --hpz 1"),
    ("stage3+qwz+hpz+qgz", "--stage 3"),
    (
        "stage3+keep-gathered",
        "--stage 3 --qwz false --qgz false --hpz 1 --checkpoint-activations false",
    ),
    ("stage2+overlap", "--stage 2 --overlap-comm true"),
    (
        "stage3+overlap",
        "--stage 3 --qwz false --qgz false --hpz 1 --overlap-comm true",
    ),
    ("stage3+zpp+overlap", "--stage 3 --overlap-comm true"),
];

/// The memory table's configurations, on the `wide` model for 3 steps of micro-batch 1.
const MEMORY_ROWS: [(&str, &str); 3] = [
    ("mem-stage0", "--stage 0"),
    ("mem-stage3", Z3),
    ("mem-stage3+zpp", "--stage 3"),
];

fn run_train(out: &Path, name: &str, args: &[&str]) -> anyhow::Result<serde_json::Value> {
    let dir = out.join(name);
    let exe = std::env::current_exe().context("cannot find the xtask binary")?;
    let status = Command::new(exe)
        .arg("train")
        .args(args)
        .arg("--out")
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .status()
        .with_context(|| format!("cannot start the {name} run"))?;
    if !status.success() {
        bail!("the {name} run failed ({status})");
    }
    let text = std::fs::read_to_string(dir.join("report.json"))?;
    Ok(serde_json::from_str(&text)?)
}

fn tail_loss(v: &serde_json::Value) -> f64 {
    let l: Vec<f64> = v["loss"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
        .unwrap_or_default();
    let k = l.len().clamp(1, 10);
    l[l.len().saturating_sub(k)..].iter().sum::<f64>() / k as f64
}

pub(crate) fn run(a: BenchArgs) -> anyhow::Result<()> {
    let out = Path::new(&a.out);
    std::fs::create_dir_all(out)?;
    let s = a.steps.to_string();
    println!("speed and loss: default model, 4 ranks (2 nodes x 2), {s} steps each");
    println!(
        "{:<20} {:>10} {:>10} {:>10} {:>12} {:>10}",
        "config", "ms/step", "vs stage0", "tokens/s", "final loss", "vs ZeRO-3"
    );
    let mut base_ms = None;
    let mut z3_loss = None;
    for (name, row) in ROWS {
        let mut args: Vec<&str> = row.split_whitespace().collect();
        args.extend(["--steps", s.as_str()]);
        if !name.ends_with("overlap") {
            args.extend(["--overlap-comm", "false"]);
        }
        let v = run_train(out, name, &args)?;
        let wall = v["wall_secs"].as_f64().unwrap_or(f64::NAN);
        let ms = wall * 1e3 / a.steps as f64;
        let tps = v["tokens_per_sec"].as_f64().unwrap_or(f64::NAN);
        let loss = tail_loss(&v);
        let base = *base_ms.get_or_insert(ms);
        if name == "stage3" {
            z3_loss = Some(loss);
        }
        let gap = z3_loss
            .filter(|_| name.starts_with("stage3"))
            .map(|z| format!("{:+.4}", loss - z))
            .unwrap_or_default();
        println!(
            "{:<20} {:>10.1} {:>9.2}x {:>10.0} {:>12.4} {:>10}",
            name,
            ms,
            ms / base,
            tps,
            loss,
            gap
        );
    }
    println!(
        "\npeak resident memory: `wide` model (states dominate), 4 ranks, 3 steps, whole process"
    );
    let mut rss0 = None;
    for (name, row) in MEMORY_ROWS {
        let mut args: Vec<&str> = row.split_whitespace().collect();
        args.extend("--model wide --steps 3 --micro-batch 1 --overlap-comm false".split(' '));
        let v = run_train(out, name, &args)?;
        let rss = v["peak_rss_bytes"]
            .as_u64()
            .context("report.json lacks peak_rss_bytes (no /proc?)")?;
        let base = *rss0.get_or_insert(rss);
        println!(
            "{name:<20} {:>10.1} MiB {:>8.2}x",
            rss as f64 / (1u64 << 20) as f64,
            rss as f64 / base as f64
        );
    }
    Ok(())
}
