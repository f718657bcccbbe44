//! The device gates: tests that need a wgpu adapter or `mpirun` record, when they return early,
//! that they did not run; with the device simulated away, every gated binary must do so.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};

use super::{TEST_FEATURES, cargo};

use zero_testkit::gate::Device;
/// Where the test gates record a test that did not run: one line `<crate>/<binary>::<test>\t<why>`
/// (the test kit's `record_skip!` and `Device::missing`).
pub(super) use zero_testkit::gate::SKIP_LOG;

/// A test binary behind a gate, as the gate names it in the skip log (`package/binary`), and the
/// tests of it the self-check runs (a filter; `None`: all of them).
type Gated = (&'static str, &'static str, Option<&'static str>);

/// A device gate that `cargo xtask test` simulates away to check its not-run accounting.
struct Gate {
    /// The device.
    device: Device,
    /// The test binaries whose tests need it.
    binaries: &'static [Gated],
}

/// The gates: a wgpu adapter, and `mpirun`.
const GATES: [Gate; 2] = [
    Gate {
        device: Device::Wgpu,
        binaries: &[
            ("zero-comm", "wgpu", None),
            ("zero-quant", "wgpu_kernels", None),
            ("zero-burn", "wgpu_bridge", None),
            ("zero-burn", "wgpu_path", None),
        ],
    },
    Gate {
        device: Device::Mpi,
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
pub(super) struct NotRun {
    pub(super) test: String,
    pub(super) reason: String,
}

/// Reads a skip log (see [`SKIP_LOG`]), one entry per test (a test that checked its gate more
/// than once is listed once, with its first reason); a line without a reason keeps the whole line
/// as the test.
pub(super) fn parse_skip_log(text: &str) -> Vec<NotRun> {
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
pub(super) fn not_run_summary(skips: &[NotRun]) -> String {
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
            gate.device.simulate_var()
        );
    }
    if let Some(s) = skips
        .iter()
        .find(|s| !s.reason.contains(gate.device.simulate_var()))
    {
        bail!(
            "with {}=1, {} recorded another reason: {}",
            gate.device.simulate_var(),
            s.test,
            s.reason
        );
    }
    Ok(skips.len())
}
/// The environment of the test run for the device tests: a missing wgpu adapter fails them
/// unless `allow_skips`; an inherited simulation switch is removed; `XDG_RUNTIME_DIR` (which
/// Mesa's Vulkan drivers want) is made, private, when the environment has none.
pub(super) fn device_env(cmd: &mut Command, work: &Path, allow_skips: bool) -> anyhow::Result<()> {
    let require = if allow_skips { "0" } else { "1" };
    for gate in &GATES {
        cmd.env(gate.device.require_var(), require)
            .env_remove(gate.device.simulate_var());
    }
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
pub(super) fn simulated_gates_check(work: &Path) -> anyhow::Result<()> {
    for gate in &GATES {
        let log = work.join(format!("simulated-{}.log", gate.device.simulate_var()));
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
                c.env(gate.device.simulate_var(), "1")
                    .env(gate.device.require_var(), require)
                    .env(SKIP_LOG, &log)
                    .env("INSTA_UPDATE", "no");
                eprintln!(
                    "==> not-run accounting, without {} (simulated), {}={require}: {c:?}",
                    gate.device.what(),
                    gate.device.require_var()
                );
                let out = c.output().context("cannot start cargo test")?;
                if require == "0" && !out.status.success() {
                    bail!(
                        "without {} (simulated) and with skips allowed, the tests failed ({}):\n{}\n{}",
                        gate.device.what(),
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
                gate.device.what(),
                gate.device.require_var()
            );
        }
        eprintln!(
            "==> not-run accounting checked: without {} {n} tests are recorded as not run, and \
             {}=1 fails them",
            gate.device.what(),
            gate.device.require_var()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
