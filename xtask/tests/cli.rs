//! README's command-line claims, run as a user runs them: the `xtask` binary itself.
//!
//! - `train --launcher mpi` starts its own `mpirun` of 2 processes and gives the bits of 2
//!   in-process ranks (`--launcher threads`): losses in `report.json`, traffic equal to the
//!   plan, and each rank process's own peak RSS (`VmHWM`) in the report.
//! - `launch` stops every process it started within 2 s of a SIGTERM or a Ctrl-C (SIGINT).

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use zero_testkit::gate::Device;

mod support {
    pub(crate) mod report_json;
}

fn xtask() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_xtask"));
    // The test build trains as it is (no release rebuild).
    c.env("ZERO_XTASK_NO_RELEASE", "1");
    c
}

/// A fresh temporary directory for test `name`, removed when the returned guard drops.
fn temp(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("zero-rs-cli-{name}-"))
        .tempdir()
        .expect("a temp dir")
}

fn ok(out: Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `report.json`'s losses as bits, whether traffic and memory equal the plan, each rank
/// process's peak RSS (empty for threads) and the plan's model-state bytes per rank.
fn report(dir: &Path) -> (Vec<u32>, bool, bool, Vec<u64>, u64) {
    let v = support::report_json::read(dir);
    (
        support::report_json::loss_bits(&v),
        v["comm_matches_plan"].as_bool().unwrap(),
        v["memory_matches_plan"].as_bool().unwrap(),
        v["peak_rss_per_rank"]
            .as_array()
            .map(|a| a.iter().map(|b| b.as_u64().unwrap()).collect())
            .unwrap_or_default(),
        v["memory"]["planned"][0]["total_bytes"].as_u64().unwrap(),
    )
}

#[test]
fn the_mpi_launcher_from_the_command_line_gives_the_bits_of_threads() {
    let name = "the_mpi_launcher_from_the_command_line_gives_the_bits_of_threads";
    if !cfg!(feature = "mpi") {
        // Without the feature the command would rebuild itself in release first.
        return zero_testkit::record_skip!(name, "xtask was built without its `mpi` feature");
    }
    // As on a machine without mpirun when simulated (`cargo xtask test`'s check).
    let simulated = Device::Mpi.simulated();
    let has_mpirun = simulated.is_none()
        && Command::new("mpirun")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    if !has_mpirun {
        let why = simulated.unwrap_or_else(|| "not on PATH".into());
        return Device::Mpi.missing(zero_testkit::binary!(), name, &why);
    }
    let tmp = temp("mpi");
    let root = tmp.path().to_path_buf();
    let job = [
        "train",
        "--model",
        "tiny",
        "--micro-batch",
        "2",
        "--steps",
        "2",
        "--world-size",
        "2",
        "--stage",
        "3",
    ];
    let mut runs = Vec::new();
    for launcher in ["threads", "mpi"] {
        let out = root.join(launcher);
        let r = xtask()
            .args(job)
            .args(["--launcher", launcher, "--out"])
            .arg(&out)
            .output()
            .unwrap();
        ok(r, launcher);
        runs.push(report(&out));
    }
    assert_eq!(runs[0].0.len(), 2, "two steps");
    assert_eq!(runs[1].0, runs[0].0, "MPI's losses are the threads' bits");
    assert!(
        runs[1].1 && runs[1].2,
        "MPI's traffic and memory equal the plan"
    );
    assert!(
        runs[0].3.is_empty(),
        "threads share one process: no RSS per rank"
    );
    let (rss, state) = (&runs[1].3, runs[1].4);
    assert_eq!(rss.len(), 2, "one peak RSS per rank process: {rss:?}");
    for (rank, &b) in rss.iter().enumerate() {
        // A process holds at least its model state, and the tiny job far less than 4 GiB.
        assert!(
            b >= state && b < 4 << 30,
            "rank {rank}'s peak RSS {b} B (its model state is {state} B)"
        );
    }
}

/// `launch` stops its processes on SIGTERM and on Ctrl-C (SIGINT): 2 ranks that would sleep for
/// a minute are gone, and the launcher has exited with an error, within 2 s of the signal
/// (measured from the signal).
#[test]
fn launch_stops_its_processes_within_two_seconds_of_sigterm() {
    for signal in ["-TERM", "-INT"] {
        stops_within_two_seconds_of(signal);
    }
}

fn stops_within_two_seconds_of(signal: &str) {
    let tmp = temp(&format!("launch{signal}"));
    let root = tmp.path().to_path_buf();
    let pids = root.join("pids");
    let script = format!("echo $$ >> {}; exec sleep 60", pids.display());
    let mut launcher = xtask()
        .args(["launch", "--nproc-per-node", "2", "--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Both ranks are up once both wrote their pid.
    let up = Instant::now();
    let ranks: Vec<u32> = loop {
        let text = std::fs::read_to_string(&pids).unwrap_or_default();
        let v: Vec<u32> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
        if v.len() == 2 {
            break v;
        }
        assert!(
            up.elapsed() < Duration::from_secs(30),
            "the ranks did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let signalled = Instant::now();
    let status = Command::new("kill")
        .args([signal, &launcher.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exited = loop {
        if let Some(s) = launcher.try_wait().unwrap() {
            break s;
        }
        if signalled.elapsed() > Duration::from_secs(10) {
            let _ = launcher.kill();
            panic!("the launcher still runs 10 s after {signal}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let alive = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            // A zombie (state Z) has exited.
            .is_ok_and(|s| {
                s.rsplit(')')
                    .next()
                    .is_some_and(|r| !r.trim_start().starts_with('Z'))
            })
    };
    while ranks.iter().any(|&p| alive(p)) && signalled.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let took = signalled.elapsed();
    assert!(!exited.success(), "an interrupted launch fails");
    assert!(
        ranks.iter().all(|&p| !alive(p)),
        "ranks {ranks:?} still run after {signal}"
    );
    assert!(
        took <= Duration::from_secs(2),
        "the launcher and its ranks took {took:?} to stop after {signal}"
    );
}
