//! `cargo xtask test`: what CI runs. It sets the machine up first (`setup.rs`), then runs the
//! lints and every test step, and checks that every test ran: none returned early for want of a
//! device (`gates.rs`), each binary executed every test it lists, and no `#[test]` function of the
//! sources was compiled out of every step but the GPU tests (`ran.rs`).

mod gates;
mod ran;
mod setup;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use clap::Args;

use gates::{SKIP_LOG, device_env, not_run_summary, parse_skip_log, simulated_gates_check};
use ran::BinaryRun;

#[derive(Args, Debug)]
pub(crate) struct TestArgs {
    /// Skip `cargo fmt --check`, clippy and the doc build.
    #[arg(long)]
    no_lint: bool,
    /// Let insta rewrite snapshots that changed (`INSTA_UPDATE=always`) instead of failing, for a
    /// deliberate update; review the result with `git diff -- '*.snap'` and commit it.
    #[arg(long)]
    accept_snapshots: bool,
    /// Let the tests that need a wgpu adapter (a Vulkan driver) or `mpirun` (OpenMPI) return
    /// early when there is none instead of failing. They still count as passed in cargo's output, so the run ends with a
    /// list of every test that did not run and why. Without this flag a missing adapter fails the
    /// run, as in CI.
    #[arg(long)]
    allow_device_skips: bool,
}

/// The test features: the MPI communicator (OpenMPI), the NCCL communicator without a GPU (its
/// bootstrap, its refusals and its GPU-free units; cudarc loads libcuda only when asked), the wgpu
/// loopback, the WGSL codecs, the
/// trainer on burn's wgpu backend (on Mesa's lavapipe without a GPU) and xtask's own MPI launcher
/// (its command-line test). zero-burn/wgpu is for these debug builds only: burn-wgpu takes more
/// than 20 minutes to build in release, so `cargo xtask train` never enables it.
const TEST_FEATURES: &str = "zero-comm/mpi,zero-comm/nccl,zero-comm/wgpu,zero-quant/wgpu,zero-burn/mpi,zero-burn/wgpu,xtask/mpi";

/// The burn-train adapter's tests and burn's CUDA backend, in one build of their own.
/// - burn-train asks for burn-flex's default features, rayon among them, for everything in the
///   build, so the other tests (and their snapshots) keep the build `cargo xtask train` uses.
/// - burn's CUDA backend links LLVM statically, so no binary of the main test build carries it.
///   Its driver guard runs here; its GPU tests only with `ZERO_GPU_TESTS=1` on a GPU
///   (`cargo xtask gpu-check`).
///
/// One build for both: burn and its dependencies compile once for the two programs, not twice.
const OWN_BUILD_TESTS: [&str; 9] = [
    "test",
    "-p",
    "zero-burn",
    "--features",
    "burn-train,cuda",
    "--test",
    "burn_train",
    "--test",
    "cuda_path",
];

/// Clippy's features: the test features, NCCL and CUDA (burn's CUDA backend included), and the
/// GPU tests (compiled here, run only by `cargo xtask gpu-check`), so GPU-only code is linted
/// without a GPU.
const LINT_FEATURES: &str = "zero-comm/mpi,zero-comm/nccl,zero-comm/wgpu,zero-comm/gpu-tests,zero-quant/wgpu,\
                             zero-quant/cuda,zero-quant/gpu-tests,zero-burn/mpi,zero-burn/wgpu,zero-burn/nccl,zero-burn/burn-train,\
                             zero-burn/cuda,zero-burn/gpu-tests,xtask/mpi,xtask/nccl,xtask/cuda";

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// `cargo` with `args`, split at whitespace.
fn cargo_with(args: &str) -> Command {
    let mut c = cargo();
    c.args(args.split_whitespace());
    c
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

/// Runs one `cargo test` step, keeping what each of its test binaries executed.
fn run_tests(
    name: &str,
    cmd: Command,
    root: &Path,
    runs: &mut Vec<BinaryRun>,
) -> anyhow::Result<()> {
    let (status, output) = ran::run_capturing(name, cmd)?;
    let these = ran::parse_runs(&output, root);
    if status.success() && these.is_empty() {
        bail!("{name} passed, and no test binary could be read from its output");
    }
    runs.extend(these);
    if !status.success() {
        bail!("{name} failed with {status}");
    }
    Ok(())
}

/// Every test each binary lists was executed, and every `#[test]` function of the sources was
/// executed by some step (but the GPU tests).
fn every_test_executed(root: &Path, runs: &[BinaryRun]) -> anyhow::Result<()> {
    let unexecuted = ran::not_executed(runs)?;
    let out = ran::compiled_out(&ran::source_tests(root)?, runs);
    if !unexecuted.is_empty() {
        bail!("{}", not_run_summary(&unexecuted));
    }
    if !out.is_empty() {
        let list: Vec<String> = out
            .iter()
            .map(|s| format!("{}: {}", s.file, s.name))
            .collect();
        bail!(
            "{} #[test] functions were executed by no test step (compiled out by a feature, or in \
             a binary no step builds); enable them in a step, or, for GPU tests, list their file \
             in GPU_ONLY (xtask/src/test/ran.rs):\n  {}",
            out.len(),
            list.join("\n  ")
        );
    }
    let listed: usize = runs.iter().map(|r| r.executed.len()).sum();
    eprintln!(
        "==> every test ran: {} test binaries executed each test they list ({listed} tests)",
        runs.len()
    );
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
    setup::system_packages(a.allow_device_skips)?;
    setup::llvm_sdk(&root)?;
    let ptxas = setup::ptxas(&root, a.allow_device_skips)?;
    if !a.no_lint {
        run_step("fmt", cargo_with("fmt --all -- --check"))?;
        let clippy = "clippy --workspace --all-targets --features";
        let clippy = cargo_with(&format!("{clippy} {LINT_FEATURES} -- -D warnings"));
        run_step("clippy", clippy)?;
        // The build the `cargo xtask` alias makes: xtask without the engine (no burn).
        let thin = cargo_with("clippy -p xtask --no-default-features --all-targets -- -D warnings");
        run_step("clippy (xtask without the engine)", thin)?;
        // The API docs: broken links and bad markup fail like lints.
        let mut doc = cargo_with(&format!(
            "doc --no-deps --workspace --features {LINT_FEATURES}"
        ));
        doc.env("RUSTDOCFLAGS", "-D warnings");
        run_step("docs", doc)?;
    }
    // Removed when it drops, whichever way this returns.
    let work_dir = tempfile::Builder::new()
        .prefix("zero-rs-xtask-test-")
        .tempdir()?;
    let work = work_dir.path().to_path_buf();
    let skip_log = work.join("not-run.log");
    let _ = std::fs::remove_file(&skip_log);
    let mut test = cargo();
    test.args(["test", "--workspace", "--features", TEST_FEATURES]);
    device_env(&mut test, &work, a.allow_device_skips)?;
    test.env(SKIP_LOG, &skip_log);
    if let Some(p) = &ptxas {
        test.env("ZERO_PTXAS", p);
    }
    insta_strictness(&mut test, a.accept_snapshots);
    let mut runs = Vec::new();
    let tests = run_tests("tests", test, &root, &mut runs);
    // What did not run, printed whether or not the tests passed.
    let skips = parse_skip_log(&std::fs::read_to_string(&skip_log).unwrap_or_default());
    if !skips.is_empty() {
        eprintln!("\n==> {}\n", not_run_summary(&skips));
    }
    tests?;
    let mut own = cargo();
    own.args(OWN_BUILD_TESTS).env(SKIP_LOG, &skip_log);
    insta_strictness(&mut own, a.accept_snapshots);
    run_tests(
        "tests (burn-train and burn's CUDA backend, a build of their own)",
        own,
        &root,
        &mut runs,
    )?;
    every_test_executed(&root, &runs)?;
    let skips = parse_skip_log(&std::fs::read_to_string(&skip_log).unwrap_or_default());
    if !skips.is_empty() && !a.allow_device_skips {
        bail!(
            "{} tests did not run; every test must run here (pass --allow-device-skips to accept \
             a missing wgpu adapter or mpirun)",
            skips.len()
        );
    }
    simulated_gates_check(&work)?;
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
    drop(work_dir);
    if skips.is_empty() {
        eprintln!("==> all checks passed; every test ran");
    } else {
        eprintln!(
            "==> all checks passed, but NOT every test ran: {} did not (--allow-device-skips; \
             listed above)",
            skips.len()
        );
    }
    Ok(())
}

/// insta's strictness, set here whatever the environment says: a missing or changed snapshot
/// fails and nothing is written, unless `accept` (then changed snapshots are rewritten in place).
/// `INSTA_FORCE_PASS=0` also overrides an insta config file's `force_pass`; the legacy variables
/// that would turn updates back on are removed. Snapshots are looked up under this checkout
/// (`INSTA_WORKSPACE_ROOT`): a test binary cargo reuses from a build in another checkout of the
/// same sources would otherwise look in that one's directory, which may be gone.
fn insta_strictness(cmd: &mut Command, accept: bool) {
    cmd.env("INSTA_WORKSPACE_ROOT", workspace_root())
        .env("INSTA_UPDATE", if accept { "always" } else { "no" })
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
        let root = get("INSTA_WORKSPACE_ROOT")
            .flatten()
            .expect("the root is set");
        assert!(
            Path::new(&root).join("zero-core/tests/snapshots").is_dir(),
            "{root}"
        );
        let mut c = Command::new("true");
        insta_strictness(&mut c, true);
        assert!(
            c.get_envs()
                .any(|(k, v)| k == "INSTA_UPDATE" && v == Some("always".as_ref()))
        );
    }
}
