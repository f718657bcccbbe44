//! Step 7 of gpu-check, **launch**: the trainer with one rank per process over NCCL, as a user
//! runs it: `xtask launch --nproc-per-node G -- train --launcher nccl ...` with one process per
//! GPU (`LOCAL_RANK` picks it; one process on a one-GPU machine), from a release xtask built with
//! `--features nccl` (packed into a bundle as `xtask-nccl`). It passes when every process exits
//! cleanly and rank 0's `report.json` says the measured bytes equal the plan.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::{Step, Verdict, cargo, run_limited};

/// The bundle's name for the release xtask with NCCL.
pub(super) const PROGRAM: &str = "xtask-nccl";

/// Steps of the launched training run.
const STEPS: u64 = 10;

/// Builds the release xtask with `--features nccl` into `target`; its path.
pub(super) fn build(root: &Path, target: &Path, limit: Duration) -> anyhow::Result<PathBuf> {
    let mut c = cargo();
    c.current_dir(root).env("CARGO_TARGET_DIR", target).args([
        "build",
        "--release",
        "-p",
        "xtask",
        "--features",
        "nccl",
    ]);
    let r = run_limited("build xtask --features nccl", c, limit, true)?;
    anyhow::ensure!(
        r.ok,
        "building the release xtask with NCCL failed: {}",
        r.status
    );
    Ok(target.join("release").join("xtask"))
}

/// The launch command line after the program: `gpus` processes on one node, a tiny ZeRO-3 run
/// into `out` (at one process, without ZeRO++'s switches, which need a second rank to matter).
pub(super) fn args(gpus: usize, out: &Path) -> Vec<String> {
    let n = gpus.max(1).to_string();
    let mut a: Vec<String> = [
        "launch",
        "--nproc-per-node",
        &n,
        "--",
        "train",
        "--launcher",
        "nccl",
        "--world-size",
        &n,
        "--ranks-per-node",
        &n,
        "--model",
        "tiny",
        "--micro-batch",
        "2",
        "--stage",
        "3",
    ]
    .iter()
    .map(|s| (*s).to_string())
    .collect();
    a.extend(["--steps".into(), STEPS.to_string()]);
    if gpus <= 1 {
        a.extend(["--qwz", "false", "--qgz", "false", "--hpz", "1"].map(String::from));
    }
    a.extend(["--out".into(), out.display().to_string()]);
    a
}

/// Runs the step with `exe` (the NCCL xtask), or fails it with `missing` as the reason.
pub(super) fn step(
    exe: Result<PathBuf, String>,
    root: &Path,
    work: &Path,
    ld_path: &str,
    gpus: usize,
    limit: Duration,
) -> Step {
    let exe = match exe {
        Ok(e) => e,
        Err(why) => return fail(None, format!("did not run: {why}")),
    };
    let out = work.join("gpu-check").join("launch-run");
    let _ = std::fs::remove_dir_all(&out);
    let mut c = Command::new(&exe);
    c.current_dir(root)
        .args(args(gpus, &out))
        .env("LD_LIBRARY_PATH", ld_path)
        // The NCCL xtask runs as it is: no rebuild on the GPU machine.
        .env("ZERO_XTASK_NO_RELEASE", "1");
    match run_limited("launch", c, limit, true) {
        Err(e) => fail(None, format!("{e:#}")),
        Ok(r) => {
            let report = std::fs::read_to_string(out.join("report.json")).ok();
            let (verdict, detail) = verdict(r.ok, &r.status, report.as_deref(), gpus);
            Step {
                name: "launch",
                verdict,
                secs: Some(r.secs),
                detail,
            }
        }
    }
}

fn fail(secs: Option<f64>, detail: String) -> Step {
    Step {
        name: "launch",
        verdict: Verdict::Fail,
        secs,
        detail,
    }
}

/// The step's verdict from the launcher's exit and rank 0's report: PASS only when the launcher
/// exited cleanly and the report has every step with measured bytes equal to the plan.
pub(super) fn verdict(
    ok: bool,
    status: &str,
    report: Option<&str>,
    gpus: usize,
) -> (Verdict, String) {
    let Some(text) = report else {
        return (
            Verdict::Fail,
            format!("{status}; no report.json from rank 0"),
        );
    };
    let v: serde_json::Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            return (
                Verdict::Fail,
                format!("{status}; report.json unreadable: {e}"),
            );
        }
    };
    let loss: Vec<f64> = v["loss"]
        .as_array()
        .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
        .unwrap_or_default();
    let comm = v["comm_matches_plan"].as_bool() == Some(true);
    let memory = v["memory_matches_plan"].as_bool() == Some(true);
    let detail = format!(
        "{gpus} NCCL process(es), {} steps: loss {} -> {}, {:.0} tokens/s; bytes {} the plan, \
         model states {} the plan",
        loss.len(),
        loss.first().map_or("?".into(), |l| format!("{l:.4}")),
        loss.last().map_or("?".into(), |l| format!("{l:.4}")),
        v["tokens_per_sec"].as_f64().unwrap_or(f64::NAN),
        if comm { "equal" } else { "DIFFER FROM" },
        if memory { "equal" } else { "DIFFER FROM" },
    );
    let pass = ok && comm && memory && loss.len() as u64 == STEPS;
    if pass {
        (Verdict::Pass, detail)
    } else {
        (Verdict::Fail, format!("{status}; {detail}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_gpu_runs_one_process_without_zeropp() {
        let a = args(1, Path::new("/tmp/x"));
        let s = a.join(" ");
        assert!(
            s.starts_with(
                "launch --nproc-per-node 1 -- train --launcher nccl --world-size 1 \
                           --ranks-per-node 1"
            ),
            "{s}"
        );
        assert!(s.contains("--hpz 1") && s.ends_with("--out /tmp/x"), "{s}");
        let a = args(8, Path::new("/tmp/x")).join(" ");
        assert!(a.contains("--world-size 8") && !a.contains("--hpz"), "{a}");
    }

    /// What follows `--` is a command line `train` accepts.
    #[test]
    fn the_train_flags_parse() {
        for gpus in [1, 4] {
            let a = args(gpus, Path::new("/tmp/x"));
            let at = a.iter().position(|s| s == "--").expect("a -- separator");
            assert_eq!(a[at + 1], "train");
            let parsed = crate::train::TrainArgs::try_parse_words(&a[at + 1..]);
            assert!(parsed.is_ok(), "{gpus} GPUs: {parsed:?}");
        }
    }

    #[test]
    fn the_verdict_needs_a_clean_exit_and_bytes_equal_to_the_plan() {
        let good = format!(
            r#"{{"loss": [{}], "comm_matches_plan": true, "memory_matches_plan": true,
                "tokens_per_sec": 1000.0}}"#,
            vec!["4.1"; STEPS as usize].join(", ")
        );
        let (v, d) = verdict(true, "exit status: 0", Some(&good), 1);
        assert_eq!(v, Verdict::Pass, "{d}");
        assert!(d.contains("loss 4.1000 -> 4.1000"), "{d}");
        assert_eq!(
            verdict(false, "exit status: 1", Some(&good), 1).0,
            Verdict::Fail
        );
        assert_eq!(verdict(true, "exit status: 0", None, 1).0, Verdict::Fail);
        let differs = good.replace(
            r#""comm_matches_plan": true"#,
            r#""comm_matches_plan": false"#,
        );
        let (v, d) = verdict(true, "exit status: 0", Some(&differs), 1);
        assert_eq!(v, Verdict::Fail);
        assert!(d.contains("DIFFER FROM"), "{d}");
        let short = r#"{"loss": [4.1], "comm_matches_plan": true, "memory_matches_plan": true}"#;
        assert_eq!(
            verdict(true, "exit status: 0", Some(short), 1).0,
            Verdict::Fail
        );
    }
}
