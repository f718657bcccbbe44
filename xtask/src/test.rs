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
    /// Let insta rewrite snapshots that changed (`INSTA_UPDATE=always`) instead of failing, for a
    /// deliberate update; review the result with `git diff -- '*.snap'` and commit it.
    #[arg(long)]
    accept_snapshots: bool,
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
    insta_strictness(&mut test, a.accept_snapshots);
    run_step("tests", test)?;
    let stray = find_pending_snapshots(&root)?;
    if !stray.is_empty() {
        bail!("pending snapshots left behind (review and commit or delete them): {stray:?}");
    }
    let changed = changed_snapshots(&root)?;
    if !changed.is_empty() {
        if a.accept_snapshots {
            eprintln!(
                "==> snapshots rewritten (review with `git diff -- '*.snap'` and commit): {changed:?}"
            );
        } else {
            bail!(
                "snapshots differ from git (commit or stage them, or rerun with \
                 --accept-snapshots to rewrite them deliberately): {changed:?}"
            );
        }
    }
    eprintln!("==> all checks passed");
    Ok(())
}

/// insta's strictness, set here whatever the environment says: a missing or changed snapshot
/// fails and nothing is written, unless `accept` (then changed snapshots are rewritten in place).
/// `INSTA_FORCE_PASS=0` also overrides an insta config file's `force_pass`; the legacy variables
/// that would turn updates back on are removed.
fn insta_strictness(cmd: &mut Command, accept: bool) {
    cmd.env("INSTA_UPDATE", if accept { "always" } else { "no" })
        .env("INSTA_FORCE_PASS", "0")
        .env_remove("INSTA_FORCE_UPDATE")
        .env_remove("INSTA_FORCE_UPDATE_SNAPSHOTS");
}

/// Tracked `.snap` files that differ from git's index, and untracked ones: after the tests, any of
/// these means a snapshot was written or is not committed.
fn changed_snapshots(root: &Path) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    for args in [
        &["diff", "--name-only", "--", "*.snap"][..],
        &["ls-files", "--others", "--exclude-standard", "--", "*.snap"][..],
    ] {
        let o = Command::new("git")
            .current_dir(root)
            .args(args)
            .output()
            .context("cannot run git to check the snapshots (the check needs a git checkout)")?;
        if !o.status.success() {
            bail!(
                "git {} failed ({}): {}",
                args.join(" "),
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            );
        }
        out.extend(
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| !l.is_empty())
                .map(str::to_string),
        );
    }
    Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insta_is_strict_whatever_the_environment() {
        let mut c = Command::new("true");
        insta_strictness(&mut c, false);
        let envs: Vec<(String, Option<String>)> = c
            .get_envs()
            .map(|(k, v)| {
                (
                    k.to_string_lossy().into_owned(),
                    v.map(|v| v.to_string_lossy().into_owned()),
                )
            })
            .collect();
        let get = |k: &str| envs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(get("INSTA_UPDATE"), Some(Some("no".into())));
        assert_eq!(get("INSTA_FORCE_PASS"), Some(Some("0".into())));
        assert_eq!(get("INSTA_FORCE_UPDATE"), Some(None), "removed");
        let mut c = Command::new("true");
        insta_strictness(&mut c, true);
        assert!(
            c.get_envs()
                .any(|(k, v)| k == "INSTA_UPDATE" && v == Some("always".as_ref()))
        );
    }
}
