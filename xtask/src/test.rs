//! `cargo xtask test`: what CI runs.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use clap::Args;

#[derive(Args, Debug)]
pub(crate) struct TestArgs {
    /// Skip `cargo fmt --check` and clippy.
    #[arg(long)]
    no_lint: bool,
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

fn run_step(name: &str, mut cmd: Command) -> anyhow::Result<()> {
    eprintln!("==> {name}: {cmd:?}");
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {name}"))?;
    if !status.success() {
        bail!("{name} failed with {status}");
    }
    Ok(())
}

pub(crate) fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

pub(crate) fn run(a: TestArgs) -> anyhow::Result<()> {
    let root = workspace_root();
    std::env::set_current_dir(&root)?;
    if !a.no_lint {
        let mut fmt = cargo();
        fmt.args(["fmt", "--all", "--", "--check"]);
        run_step("fmt", fmt)?;
        let mut clippy = cargo();
        clippy.args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--features",
            "zero-comm/nccl,zero-comm/wgpu,zero-quant/wgpu,zero-quant/cuda,zero-burn/wgpu,zero-burn/nccl",
            "--",
            "-D",
            "warnings",
        ]);
        run_step("clippy", clippy)?;
    }
    let mut test = cargo();
    // The wgpu loopback, the WGSL codecs and the trainer on burn's wgpu backend run on Mesa's
    // lavapipe in CI (ZERO_REQUIRE_WGPU=1 makes a missing adapter a failure; elsewhere those tests
    // print why they skip). zero-burn/wgpu is for these debug builds only: burn-wgpu takes more
    // than 20 minutes to build in release, so `cargo xtask train` never enables it.
    test.args([
        "test",
        "--workspace",
        "--features",
        "zero-comm/wgpu,zero-quant/wgpu,zero-burn/wgpu",
    ]);
    // insta: with CI set, a missing or changed snapshot fails and nothing is written.
    if std::env::var_os("CI").is_some() {
        test.env("INSTA_UPDATE", "no");
    }
    run_step("tests", test)?;
    let stray = find_pending_snapshots(&root)?;
    if !stray.is_empty() {
        bail!("pending snapshots left behind (review and commit or delete them): {stray:?}");
    }
    eprintln!("==> all checks passed");
    Ok(())
}

fn find_pending_snapshots(root: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir)? {
            let e = e?;
            let p = e.path();
            let name = e.file_name();
            let name = name.to_string_lossy();
            if e.file_type()?.is_dir() {
                if !name.starts_with('.') && name != "target" {
                    stack.push(p);
                }
            } else if name.ends_with(".snap.new") || name.ends_with(".pending-snap") {
                out.push(p);
            }
        }
    }
    Ok(out)
}
