//! `cargo xtask test`: what CI runs.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use clap::Args;

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

/// The test features: the MPI communicator (OpenMPI), the wgpu loopback, the WGSL codecs, the
/// trainer on burn's wgpu backend (on Mesa's lavapipe without a GPU) and xtask's own MPI launcher
/// (its command-line test). zero-burn/wgpu is for these debug builds only: burn-wgpu takes more
/// than 20 minutes to build in release, so `cargo xtask train` never enables it.
const TEST_FEATURES: &str =
    "zero-comm/mpi,zero-comm/wgpu,zero-quant/wgpu,zero-burn/mpi,zero-burn/wgpu,xtask/mpi";

/// The burn-train adapter's tests, in a build of their own: burn-train asks for burn-flex's
/// default features, rayon among them, for everything in the build, so the other tests (and
/// their snapshots) keep the build `cargo xtask train` uses.
const BURN_TRAIN_TESTS: [&str; 7] = [
    "test",
    "-p",
    "zero-burn",
    "--features",
    "burn-train",
    "--test",
    "burn_train",
];

/// Clippy's features: the test features, NCCL and CUDA (burn's CUDA backend included), and the
/// GPU tests (compiled here, run only by `cargo xtask gpu-check`), so GPU-only code is linted
/// without a GPU.
const LINT_FEATURES: &str = "zero-comm/mpi,zero-comm/nccl,zero-comm/wgpu,zero-comm/gpu-tests,zero-quant/wgpu,\
                             zero-quant/cuda,zero-quant/gpu-tests,zero-burn/mpi,zero-burn/wgpu,zero-burn/nccl,zero-burn/burn-train,\
                             zero-burn/cuda,zero-burn/gpu-tests,xtask/mpi,xtask/nccl,xtask/cuda";

/// burn's CUDA backend, built and linked with LLVM in one test program of its own (LLVM is
/// linked statically: no other test binary carries it): the driver guard runs here, the GPU test
/// only with `ZERO_GPU_TESTS=1` on a GPU.
const CUDA_TESTS: [&str; 7] = [
    "test",
    "-p",
    "zero-burn",
    "--features",
    "cuda",
    "--test",
    "cuda_path",
];

/// The LLVM burn's CUDA backend links: tracel-llvm-bundler's folder under
/// `$XDG_DATA_HOME/tracel` (default `~/.local/share`), named by its version in `Cargo.lock`, with
/// its "installed" marker. Without it the bundler downloads LLVM, which an offline machine cannot:
/// the error names `.ci/llvm-sdk.sh`, which installs it (`ZERO_LLVM_DOWNLOAD=1` lets the bundler
/// download instead, with internet).
fn check_llvm_sdk(root: &Path) -> anyhow::Result<()> {
    if std::env::var("ZERO_LLVM_DOWNLOAD").as_deref() == Ok("1") {
        return Ok(());
    }
    let lock = std::fs::read_to_string(root.join("Cargo.lock")).context("reading Cargo.lock")?;
    let version = bundler_version(&lock)
        .context("Cargo.lock has no tracel-llvm-bundler (burn's CUDA backend needs it)")?;
    let data = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
        .context("neither XDG_DATA_HOME nor HOME is set")?;
    let marker = data
        .join("tracel")
        .join(format!("tracel-llvm-{version}"))
        .join(".tracel-llvm-installed");
    if !marker.exists() {
        bail!(
            "burn's CUDA backend (feature zero-burn/cuda, built by the checks) needs LLVM 23 and \
             {} is missing: run `.ci/llvm-sdk.sh` once (offline-safe; CI does), or set \
             ZERO_LLVM_DOWNLOAD=1 to let the build download LLVM",
            marker.display()
        );
    }
    Ok(())
}

/// tracel-llvm-bundler's version in a `Cargo.lock`.
fn bundler_version(lock: &str) -> Option<&str> {
    let mut lines = lock.lines();
    lines.find(|l| l.trim() == "name = \"tracel-llvm-bundler\"")?;
    lines
        .next()?
        .trim()
        .strip_prefix("version = \"")?
        .strip_suffix('"')
}

/// Where the test gates record a test that did not run: one line `<crate>/<binary>::<test>\t<why>`
/// (`record_skip` in zero-comm/tests/comm/common.rs, zero-quant/tests/common/mod.rs and
/// zero-burn/tests/common/mod.rs).
const SKIP_LOG: &str = "ZERO_SKIP_LOG";
/// Makes the wgpu gates behave as on a machine without an adapter (the self-check below).
const SIMULATE_NO_ADAPTER: &str = "ZERO_SIMULATE_NO_ADAPTER";
/// Makes a missing adapter fail the wgpu tests instead of skipping them.
const REQUIRE_WGPU: &str = "ZERO_REQUIRE_WGPU";
/// Makes a missing `mpirun` fail the MPI tests instead of skipping them.
const REQUIRE_MPI: &str = "ZERO_REQUIRE_MPI";

/// Makes the MPI gates behave as on a machine without `mpirun` (the self-check below).
const SIMULATE_NO_MPI: &str = "ZERO_SIMULATE_NO_MPI";

/// A test binary behind a gate, as the gate names it in the skip log (`package/binary`), and the
/// tests of it the self-check runs (a filter; `None`: all of them).
type Gated = (&'static str, &'static str, Option<&'static str>);

/// A device gate that `cargo xtask test` simulates away to check its not-run accounting.
struct Gate {
    /// What is missing, for messages.
    missing: &'static str,
    /// The variable that simulates its absence.
    simulate: &'static str,
    /// The variable that makes its absence fail the tests.
    require: &'static str,
    /// The test binaries whose tests need it.
    binaries: &'static [Gated],
}

/// The gates: a wgpu adapter, and `mpirun`.
const GATES: [Gate; 2] = [
    Gate {
        missing: "a wgpu adapter",
        simulate: SIMULATE_NO_ADAPTER,
        require: REQUIRE_WGPU,
        binaries: &[
            ("zero-comm", "wgpu", None),
            ("zero-quant", "wgpu_kernels", None),
            ("zero-burn", "wgpu_bridge", None),
            ("zero-burn", "wgpu_path", None),
        ],
    },
    Gate {
        missing: "mpirun",
        simulate: SIMULATE_NO_MPI,
        require: REQUIRE_MPI,
        binaries: &[
            ("zero-comm", "mpi", None),
            ("zero-burn", "mpi", None),
            (
                "xtask",
                "cli",
                Some("the_mpi_launcher_from_the_command_line_gives_the_bits_of_threads"),
            ),
        ],
    },
];

/// A test that returned early without checking anything, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
struct NotRun {
    test: String,
    reason: String,
}

/// Reads a skip log (see [`SKIP_LOG`]), one entry per test (a test that checked its gate more
/// than once is listed once, with its first reason); a line without a reason keeps the whole line
/// as the test.
fn parse_skip_log(text: &str) -> Vec<NotRun> {
    let mut seen = std::collections::BTreeSet::new();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| match l.split_once('\t') {
            Some((t, r)) => NotRun {
                test: t.to_string(),
                reason: r.to_string(),
            },
            None => NotRun {
                test: l.to_string(),
                reason: "no reason given".into(),
            },
        })
        .filter(|n| seen.insert(n.test.clone()))
        .collect()
}

/// `N tests did not run` and, per reason, how many and which.
fn not_run_summary(skips: &[NotRun]) -> String {
    let mut by_reason: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    for s in skips {
        by_reason.entry(&s.reason).or_default().push(&s.test);
    }
    let mut out = format!(
        "{} test{} did not run (cargo counts {} as passed; {} checked nothing):",
        skips.len(),
        if skips.len() == 1 { "" } else { "s" },
        if skips.len() == 1 { "it" } else { "them" },
        if skips.len() == 1 { "it" } else { "they" },
    );
    for (reason, tests) in by_reason {
        out += &format!("\n  {} x {reason}:", tests.len());
        for t in tests {
            out += &format!("\n      {t}");
        }
    }
    out
}

/// The self-check's verdict for `gate`: with its device simulated away, every test binary behind
/// it must have recorded tests that did not run, each for the simulated reason. Returns how many.
fn simulated_verdict(gate: &Gate, log: &str) -> anyhow::Result<usize> {
    let skips = parse_skip_log(log);
    let mut missing = Vec::new();
    for (package, binary, _) in gate.binaries {
        let prefix = format!("{package}/{binary}::");
        if !skips.iter().any(|s| s.test.starts_with(&prefix)) {
            missing.push(format!("{package}/{binary}"));
        }
    }
    if !missing.is_empty() {
        bail!(
            "with {}=1 these test binaries recorded no test that did not run, so their skips \
             would go uncounted: {missing:?}",
            gate.simulate
        );
    }
    if let Some(s) = skips.iter().find(|s| !s.reason.contains(gate.simulate)) {
        bail!(
            "with {}=1, {} recorded another reason: {}",
            gate.simulate,
            s.test,
            s.reason
        );
    }
    Ok(skips.len())
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
    check_llvm_sdk(&root)?;
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
            LINT_FEATURES,
            "--",
            "-D",
            "warnings",
        ]);
        run_step("clippy", clippy)?;
        // The build the `cargo xtask` alias makes: xtask without the engine (no burn).
        let mut thin = cargo();
        thin.args([
            "clippy",
            "-p",
            "xtask",
            "--no-default-features",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]);
        run_step("clippy (xtask without the engine)", thin)?;
        // The API docs: broken links and bad markup fail like lints.
        let mut doc = cargo();
        doc.args([
            "doc",
            "--no-deps",
            "--workspace",
            "--features",
            LINT_FEATURES,
        ])
        .env("RUSTDOCFLAGS", "-D warnings");
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
    insta_strictness(&mut test, a.accept_snapshots);
    let tests = run_step("tests", test);
    // What did not run, printed whether or not the tests passed.
    let skips = parse_skip_log(&std::fs::read_to_string(&skip_log).unwrap_or_default());
    if !skips.is_empty() {
        eprintln!("\n==> {}\n", not_run_summary(&skips));
    }
    tests?;
    let mut learner = cargo();
    learner.args(BURN_TRAIN_TESTS);
    insta_strictness(&mut learner, a.accept_snapshots);
    run_step("tests (burn-train, a build of its own)", learner)?;
    let mut cuda = cargo();
    cuda.args(CUDA_TESTS).env(SKIP_LOG, &skip_log);
    run_step("tests (burn's CUDA backend, a build of its own)", cuda)?;
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

/// The environment of the test run for the device tests: a missing wgpu adapter fails them
/// unless `allow_skips`; an inherited simulation switch is removed; `XDG_RUNTIME_DIR` (which
/// Mesa's Vulkan drivers want) is made, private, when the environment has none.
fn device_env(cmd: &mut Command, work: &Path, allow_skips: bool) -> anyhow::Result<()> {
    let require = if allow_skips { "0" } else { "1" };
    cmd.env(REQUIRE_WGPU, require)
        .env(REQUIRE_MPI, require)
        .env_remove(SIMULATE_NO_ADAPTER)
        .env_remove(SIMULATE_NO_MPI);
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        let xdg = work.join("xdg-runtime");
        std::fs::create_dir_all(&xdg)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&xdg, std::fs::Permissions::from_mode(0o700))?;
        }
        cmd.env("XDG_RUNTIME_DIR", &xdg);
    }
    Ok(())
}

/// Checks the not-run accounting itself on a machine without a wgpu adapter or `mpirun`, each
/// simulated by its gate's variable (`ZERO_SIMULATE_NO_ADAPTER=1`, `ZERO_SIMULATE_NO_MPI=1`; the
/// test programs are already built): the test binaries behind the gate must pass with its
/// `ZERO_REQUIRE_*=0` and record every test that returned early, and must fail with `=1`.
fn simulated_gates_check(work: &Path) -> anyhow::Result<()> {
    for gate in &GATES {
        let log = work.join(format!("simulated-{}.log", gate.simulate));
        let _ = std::fs::remove_file(&log);
        // One cargo per filter: the binaries run whole together, each filtered one alone.
        let whole: Vec<&str> = gate
            .binaries
            .iter()
            .filter(|b| b.2.is_none())
            .map(|b| b.1)
            .collect();
        let mut runs: Vec<(Vec<&str>, Option<&str>)> = vec![(whole, None)];
        runs.extend(
            gate.binaries
                .iter()
                .filter_map(|b| b.2.map(|f| (vec![b.1], Some(f)))),
        );
        runs.retain(|r| !r.0.is_empty());
        let run = |require: &str| -> anyhow::Result<bool> {
            let mut all_passed = true;
            for (binaries, filter) in &runs {
                let mut c = cargo();
                c.args(["test", "--workspace", "--features", TEST_FEATURES]);
                for binary in binaries {
                    c.args(["--test", binary]);
                }
                if let Some(f) = *filter {
                    c.args(["--", f]);
                }
                c.env(gate.simulate, "1")
                    .env(gate.require, require)
                    .env(SKIP_LOG, &log)
                    .env("INSTA_UPDATE", "no");
                eprintln!(
                    "==> not-run accounting, without {} (simulated), {}={require}: {c:?}",
                    gate.missing, gate.require
                );
                let out = c.output().context("cannot start cargo test")?;
                if require == "0" && !out.status.success() {
                    bail!(
                        "without {} (simulated) and with skips allowed, the tests failed ({}):\n{}\n{}",
                        gate.missing,
                        out.status,
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                all_passed &= out.status.success();
            }
            Ok(all_passed)
        };
        run("0")?;
        let n = simulated_verdict(gate, &std::fs::read_to_string(&log).unwrap_or_default())?;
        if run("1")? {
            bail!(
                "without {} (simulated) and with {}=1 some tests passed; they must fail",
                gate.missing,
                gate.require
            );
        }
        eprintln!(
            "==> not-run accounting checked: without {} {n} tests are recorded as not run, and \
             {}=1 fails them",
            gate.missing, gate.require
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
    fn the_bundler_version_is_read_from_the_lock_file() {
        let lock = "[[package]]\nname = \"tracel-llvm\"\nversion = \"1\"\n\n[[package]]\n\
                    name = \"tracel-llvm-bundler\"\nversion = \"23.1.0-4\"\n";
        assert_eq!(bundler_version(lock), Some("23.1.0-4"));
        assert_eq!(bundler_version("name = \"other\"\nversion = \"1\"\n"), None);
        // This workspace's: what .ci/llvm-sdk.sh installs LLVM for.
        let ours = std::fs::read_to_string(workspace_root().join("Cargo.lock")).unwrap();
        let script = std::fs::read_to_string(workspace_root().join(".ci/llvm-sdk.sh")).unwrap();
        let v = bundler_version(&ours).expect("burn-cuda's bundler is in Cargo.lock");
        assert!(
            script.contains(&format!("expected=\"{v}\"")),
            "Cargo.lock has tracel-llvm-bundler {v}; .ci/llvm-sdk.sh installs another"
        );
    }

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

    /// The log the gates write on a machine without an adapter (simulated), read back.
    fn simulated_log() -> String {
        let why = "no wgpu adapter (simulated by ZERO_SIMULATE_NO_ADAPTER=1); install \
                   mesa-vulkan-drivers for lavapipe";
        [
            "zero-comm/wgpu::collectives::all_reduce",
            "zero-comm/wgpu::failures::a_missing_rank_times_out_and_aborts_the_world",
            "zero-quant/wgpu_kernels::hand_computed_int4_wire",
            "zero-burn/wgpu_bridge::a_loopback_buffer_becomes_a_tensor",
            "zero-burn/wgpu_path::the_default_job_runs_on_the_wgpu_backend",
        ]
        .iter()
        .map(|t| format!("{t}\t{why}\n"))
        .collect()
    }

    #[test]
    fn tests_that_did_not_run_are_counted_and_listed_by_reason() {
        let mut log = simulated_log();
        log += "zero-comm/nccl::gpu_bandwidth_report\tZERO_GPU_BENCH=1 is not set\n";
        // A test that asked twice is one test.
        log += "zero-comm/wgpu::collectives::all_reduce\tno wgpu adapter (again)\n";
        log += "a line without a reason\n\n";
        let skips = parse_skip_log(&log);
        assert_eq!(skips.len(), 7);
        assert_eq!(skips[6].reason, "no reason given");
        let summary = not_run_summary(&skips);
        assert!(
            summary.starts_with("7 tests did not run (cargo counts them as passed"),
            "{summary}"
        );
        assert!(
            summary.contains("\n  5 x no wgpu adapter (simulated"),
            "{summary}"
        );
        assert!(
            summary.contains("\n  1 x ZERO_GPU_BENCH=1 is not set:"),
            "{summary}"
        );
        assert!(
            summary
                .contains("\n      zero-burn/wgpu_path::the_default_job_runs_on_the_wgpu_backend"),
            "{summary}"
        );
        assert!(not_run_summary(&skips[..1]).starts_with("1 test did not run (cargo counts it"));
    }

    #[test]
    fn the_simulated_machine_without_an_adapter_must_record_every_wgpu_binary() {
        assert_eq!(simulated_verdict(&GATES[0], &simulated_log()).unwrap(), 5);
        // A binary whose gate records nothing (its skips would go uncounted) fails the check.
        let without_quant: String = simulated_log()
            .lines()
            .filter(|l| !l.starts_with("zero-quant/"))
            .map(|l| format!("{l}\n"))
            .collect();
        let e = simulated_verdict(&GATES[0], &without_quant)
            .unwrap_err()
            .to_string();
        assert!(e.contains("zero-quant/wgpu_kernels"), "{e}");
        // So does a skip for another reason than the simulated one.
        let other = format!("{}zero-comm/wgpu::x\tsomething else\n", simulated_log());
        let e = simulated_verdict(&GATES[0], &other)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("zero-comm/wgpu::x recorded another reason"),
            "{e}"
        );
        assert!(simulated_verdict(&GATES[0], "").is_err());
    }

    #[test]
    fn the_simulated_machine_without_mpirun_must_record_every_mpi_binary() {
        let why = "no mpirun (simulated by ZERO_SIMULATE_NO_MPI=1)";
        let log: String = ["zero-comm/mpi::a", "zero-burn/mpi::b", "zero-burn/mpi::c"]
            .iter()
            .map(|t| format!("{t}\t{why}\n"))
            .collect();
        let e = simulated_verdict(&GATES[1], &log).unwrap_err().to_string();
        assert!(e.contains("xtask/cli"), "{e}");
        let log = format!("{log}xtask/cli::d\t{why}\n");
        assert_eq!(simulated_verdict(&GATES[1], &log).unwrap(), 4);
        // The wgpu gate's reason is not this gate's.
        let e = simulated_verdict(&GATES[1], &simulated_log())
            .unwrap_err()
            .to_string();
        assert!(e.contains("recorded no test"), "{e}");
    }
}
