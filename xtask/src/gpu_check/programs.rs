//! The GPU and wgpu test programs: which they are, building them with cargo, and running a child
//! process under a wall-clock limit with its output echoed and kept.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

pub(super) fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// How a child process ended.
pub(super) struct Ran {
    pub(super) ok: bool,
    pub(super) status: String,
    pub(super) secs: f64,
    pub(super) stdout: Vec<String>,
}

/// Runs `cmd` (its stdout echoed as it comes when `echo`; cargo's JSON is not), killing it after `limit`.
pub(super) fn run_limited(
    name: &str,
    mut cmd: Command,
    limit: Duration,
    echo: bool,
) -> anyhow::Result<Ran> {
    eprintln!("==> {name}: {cmd:?}");
    let start = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {name}"))?;
    let out = child.stdout.take();
    let reader = thread::spawn(move || {
        let mut lines = Vec::new();
        if let Some(out) = out {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if echo {
                    println!("{line}");
                }
                lines.push(line);
            }
        }
        lines
    });
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s.to_string();
        }
        if start.elapsed() >= limit {
            let _ = child.kill();
            let _ = child.wait();
            break format!("killed after the {}s limit", limit.as_secs());
        }
        thread::sleep(Duration::from_millis(100));
    };
    let stdout = reader.join().unwrap_or_default();
    Ok(Ran {
        ok: status == "exit status: 0",
        status,
        secs: start.elapsed().as_secs_f64(),
        stdout,
    })
}

pub(super) fn target_dir(root: &Path) -> anyhow::Result<PathBuf> {
    let o = cargo()
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .current_dir(root)
        .output()
        .context("cannot run cargo metadata")?;
    if !o.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    let dir = v["target_directory"]
        .as_str()
        .context("cargo metadata has no target_directory")?;
    Ok(PathBuf::from(dir))
}

/// One GPU test program: a test binary of a workspace crate, built with its `gpu-tests` feature.
pub(super) struct Program {
    /// Its name in a bundle.
    pub(super) name: &'static str,
    /// The crate directory (and package name).
    pub(super) package: &'static str,
    /// `None`: the library's unit tests; `Some(t)`: the integration test `t`.
    pub(super) test: Option<&'static str>,
    /// Arguments for the test harness (a filter).
    pub(super) args: &'static [&'static str],
}

pub(super) const PROGRAMS: &[Program] = &[
    Program {
        name: "zero-comm-lib",
        package: "zero-comm",
        test: None,
        args: &["nccl"],
    },
    Program {
        name: "zero-comm-nccl",
        package: "zero-comm",
        test: Some("nccl"),
        args: &["--nocapture"],
    },
    Program {
        name: "zero-burn-nccl",
        package: "zero-burn",
        test: Some("nccl_path"),
        args: &["--nocapture"],
    },
    Program {
        name: "zero-quant-cuda",
        package: "zero-quant",
        test: Some("cuda_kernels"),
        args: &["--nocapture"],
    },
];

/// The wgpu test programs (features `wgpu`): the loopback, the WGSL codecs, the bridge and the
/// trainer's wgpu path, run on the GPU's Vulkan driver. A bundle holds them compressed (they are
/// large: burn-wgpu builds in debug only).
pub(super) const WGPU_PROGRAMS: &[Program] = &[
    Program {
        name: "zero-comm-wgpu",
        package: "zero-comm",
        test: Some("wgpu"),
        args: &[],
    },
    Program {
        name: "zero-quant-wgpu",
        package: "zero-quant",
        test: Some("wgpu_kernels"),
        args: &[],
    },
    Program {
        name: "zero-burn-wgpu-bridge",
        package: "zero-burn",
        test: Some("wgpu_bridge"),
        args: &[],
    },
    Program {
        name: "zero-burn-wgpu-path",
        package: "zero-burn",
        test: Some("wgpu_path"),
        args: &["--nocapture", "--test-threads", "1"],
    },
];

/// burn's CUDA backend and the trainer on it (zero-burn's `cuda_path`, features `cuda` and
/// `gpu-tests`): a build of its own, since LLVM, which burn-cuda links statically, would land in
/// every test program of a build that enables `cuda`.
pub(super) const CUDA_PROGRAM: Program = Program {
    name: "zero-burn-cuda",
    package: "zero-burn",
    test: Some("cuda_path"),
    args: &["--nocapture", "--test-threads", "1"],
};

pub(super) const GPU_FEATURES: &str =
    "zero-comm/gpu-tests,zero-quant/gpu-tests,zero-burn/gpu-tests";
pub(super) const WGPU_FEATURES: &str = "zero-comm/wgpu,zero-quant/wgpu,zero-burn/wgpu";
pub(super) const CUDA_FEATURES: &str = "zero-burn/cuda,zero-burn/gpu-tests";

/// The packages [`PROGRAMS`] and [`WGPU_PROGRAMS`] come from.
pub(super) const EVERY_PACKAGE: &[&str] =
    &["-p", "zero-comm", "-p", "zero-quant", "-p", "zero-burn"];
/// Only [`CUDA_PROGRAM`]'s target.
pub(super) const CUDA_SCOPE: &[&str] = &["-p", "zero-burn", "--test", "cuda_path"];

/// Builds `programs` with `features`, from the packages and targets of `scope` (cargo's
/// `-p`/`--test` arguments), and returns `(program, executable)` pairs.
pub(super) fn build_programs(
    root: &Path,
    target: &Path,
    limit: Duration,
    (features, scope): (&str, &[&str]),
    programs: &[Program],
) -> anyhow::Result<(Ran, Vec<(usize, PathBuf)>)> {
    let mut c = cargo();
    c.current_dir(root)
        .args([
            "test",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ])
        .args(scope)
        .args(["--features", features])
        .env("CARGO_TARGET_DIR", target);
    let ran = run_limited("build", c, limit, false)?;
    let mut found = Vec::new();
    for line in &ran.stdout {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["reason"] != "compiler-artifact" || v["profile"]["test"] != true {
            continue;
        }
        let Some(exe) = v["executable"].as_str() else {
            continue;
        };
        let manifest = Path::new(v["manifest_path"].as_str().unwrap_or_default());
        let package = manifest
            .parent()
            .and_then(|d| d.file_name())
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let kind = v["target"]["kind"][0].as_str().unwrap_or_default();
        let tname = v["target"]["name"].as_str().unwrap_or_default();
        for (i, p) in programs.iter().enumerate() {
            let hit = match p.test {
                None => kind == "lib",
                Some(t) => kind == "test" && tname == t,
            };
            if hit && p.package == package {
                found.push((i, PathBuf::from(exe)));
            }
        }
    }
    Ok((ran, found))
}
