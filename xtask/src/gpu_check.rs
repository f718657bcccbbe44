//! `cargo xtask gpu-check`: the one prepared script for a machine with an NVIDIA GPU.
//!
//! A lent GPU machine has about 15 minutes of device time in all, start-up included, so every
//! step has a wall-clock limit and nothing is run twice:
//!
//! 1. **gpu**: `nvidia-smi` (name, driver, memory per GPU). No GPU (no `nvidia-smi`, no
//!    `/dev/nvidia*`) stops here with a reason and a non-zero exit.
//! 2. **libs**: finds libcuda and libnccl. cudarc looks for `libnccl.so` but not `libnccl.so.2`
//!    (the name Debian's `libnccl2` and pip's `nvidia-nccl-cu12` install), so a `libnccl.so`
//!    symlink is made under `<target>/gpu-check/lib` and put first on `LD_LIBRARY_PATH`.
//! 3. **build**: `cargo test -p zero-comm --features gpu-tests --no-run`.
//! 4. **tests**: the same with `ZERO_GPU_TESTS=1`: the whole zero-comm suite, whose GPU tests
//!    (collectives, split, groups, validation, init timeout, the mean kernels) then run on
//!    device 0. Each GPU test that passes appends its name to `<target>/.gpu_tests_ran`, removed
//!    beforehand; no name there means they all skipped, which fails the step.
//! 5. **bench**: all-gather, reduce-scatter and all-reduce of 64 MiB at world size 1
//!    (`ZERO_GPU_BENCH=1`): device-copy-like bandwidth, one line per op.
//!
//! A short report (pass/fail per step, figures) ends the run; any failed step makes the exit
//! status non-zero.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;

#[derive(Args, Debug)]
pub(crate) struct GpuCheckArgs {
    /// Skip the bandwidth check.
    #[arg(long)]
    no_bench: bool,
    /// Buffer size of the bandwidth check, in MiB.
    #[arg(long, default_value_t = 64)]
    bench_mib: usize,
    /// Wall-clock limit of each cargo step, in seconds.
    #[arg(long, default_value_t = 360)]
    step_timeout: u64,
}

/// Every GPU test that writes the cookie when it passes (the bandwidth report excepted).
const GPU_TESTS: &[&str] = &[
    "gpu_every_collective_at_world_1",
    "gpu_traffic_equals_the_formulas_at_world_1",
    "gpu_split_into_a_group_of_one",
    "gpu_groups_defer_the_mean_and_run_on_finish",
    "gpu_validation_errors_leave_the_communicator_usable",
    "gpu_init_times_out_when_a_peer_never_joins",
    "gpu_mean_kernels_divide_like_the_host",
];

const BW_PREFIX: &str = "ZERO_GPU_BW ";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Pass,
    Fail,
    Skip,
}

#[derive(Debug)]
struct Step {
    name: &'static str,
    verdict: Verdict,
    secs: Option<f64>,
    detail: String,
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// How a child process ended.
struct Ran {
    ok: bool,
    status: String,
    secs: f64,
    stdout: Vec<String>,
}

/// Runs `cmd` (its output echoed as it comes), killing it after `limit`.
fn run_limited(name: &str, mut cmd: Command, limit: Duration) -> anyhow::Result<Ran> {
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
                println!("{line}");
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

/// `index, name, driver_version, memory.total` lines from `nvidia-smi --query-gpu`.
fn parse_nvidia_smi(csv: &str) -> Vec<String> {
    csv.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split(',').map(str::trim).collect();
            match f.as_slice() {
                [i, name, driver, mem] => format!("GPU {i}: {name}, driver {driver}, {mem}"),
                _ => l.to_string(),
            }
        })
        .collect()
}

/// Step 1: the GPUs, or why there are none.
fn gpus() -> anyhow::Result<Vec<String>> {
    let smi = Command::new("nvidia-smi")
        .args([
            "--query-gpu=index,name,driver_version,memory.total",
            "--format=csv,noheader",
        ])
        .output();
    let dev_nodes = Path::new("/dev/nvidia0").exists() || Path::new("/dev/nvidiactl").exists();
    match smi {
        Err(e) => {
            if dev_nodes {
                Ok(vec![format!(
                    "nvidia-smi unavailable ({e}), but /dev/nvidia* exists"
                )])
            } else {
                bail!(
                    "no NVIDIA GPU on this machine: nvidia-smi cannot run ({e}) and there is no \
                     /dev/nvidia0 or /dev/nvidiactl; gpu-check needs a GPU machine"
                )
            }
        }
        Ok(o) if !o.status.success() => bail!(
            "nvidia-smi failed ({}): {}{}",
            o.status,
            String::from_utf8_lossy(&o.stdout).trim(),
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Ok(o) => {
            let gpus = parse_nvidia_smi(&String::from_utf8_lossy(&o.stdout));
            if gpus.is_empty() {
                bail!("nvidia-smi lists no GPU");
            }
            Ok(gpus)
        }
    }
}

/// `(name, path)` pairs from `ldconfig -p`.
fn parse_ldconfig(out: &str) -> Vec<(String, PathBuf)> {
    out.lines()
        .filter_map(|l| {
            let (left, path) = l.split_once("=>")?;
            let name = left.split_whitespace().next()?;
            Some((name.to_string(), PathBuf::from(path.trim())))
        })
        .collect()
}

/// Directories where libcuda/libnccl may live, most specific first.
fn library_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .collect();
    if let Ok(o) = Command::new("ldconfig").arg("-p").output() {
        for (_, p) in parse_ldconfig(&String::from_utf8_lossy(&o.stdout)) {
            if let Some(d) = p.parent() {
                dirs.push(d.to_path_buf());
            }
        }
    }
    // pip's nvidia-nccl-cu12 (a namespace package: use __path__).
    if let Ok(o) = Command::new("python3")
        .args([
            "-c",
            "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))",
        ])
        .output()
        && o.status.success()
    {
        dirs.push(PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    }
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/local/cuda/lib64",
        "/usr/local/nvidia/lib64",
        "/usr/local/lib",
        "/opt/conda/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    let mut seen = BTreeSet::new();
    dirs.retain(|d| seen.insert(d.clone()) && d.is_dir());
    dirs
}

fn find_lib(dirs: &[PathBuf], names: &[&str]) -> Option<PathBuf> {
    for d in dirs {
        for n in names {
            let p = d.join(n);
            if p.exists() {
                return Some(p);
            }
        }
    }
    None
}

/// Step 2: the libraries, and the `LD_LIBRARY_PATH` the cargo steps get.
fn libraries(target: &Path) -> anyhow::Result<(String, String)> {
    let dirs = library_dirs();
    let cuda = find_lib(&dirs, &["libcuda.so", "libcuda.so.1"]);
    let nccl = find_lib(&dirs, &["libnccl.so", "libnccl.so.2"]);
    let mut path: Vec<String> = Vec::new();
    let mut detail = Vec::new();
    match &cuda {
        Some(p) => detail.push(format!("libcuda: {}", p.display())),
        None => detail.push("libcuda: not found".into()),
    }
    match &nccl {
        Some(p) if p.file_name().is_some_and(|f| f == "libnccl.so") => {
            detail.push(format!("libnccl: {}", p.display()));
            if let Some(d) = p.parent() {
                path.push(d.display().to_string());
            }
        }
        Some(p) => {
            // Only the runtime name: give cudarc the name it looks for.
            let dir = target.join("gpu-check").join("lib");
            std::fs::create_dir_all(&dir)?;
            let link = dir.join("libnccl.so");
            let _ = std::fs::remove_file(&link);
            symlink(p, &link)
                .with_context(|| format!("cannot link {} to {}", link.display(), p.display()))?;
            detail.push(format!(
                "libnccl: {} (linked as {})",
                p.display(),
                link.display()
            ));
            path.push(dir.display().to_string());
            if let Some(d) = p.parent() {
                path.push(d.display().to_string());
            }
        }
        None => detail.push("libnccl: not found".into()),
    }
    if let Ok(old) = std::env::var("LD_LIBRARY_PATH")
        && !old.is_empty()
    {
        path.push(old);
    }
    let detail = detail.join("; ");
    if cuda.is_none() || nccl.is_none() {
        bail!(
            "{detail} (install the NVIDIA driver, and libnccl2 or pip's nvidia-nccl-cu12, or put \
             their directory on LD_LIBRARY_PATH)"
        );
    }
    Ok((path.join(":"), detail))
}

#[cfg(unix)]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(target, link)
}

#[cfg(not(unix))]
fn symlink(_target: &Path, _link: &Path) -> std::io::Result<()> {
    Err(std::io::Error::other(
        "gpu-check links libnccl.so on Unix only",
    ))
}

fn target_dir(root: &Path) -> anyhow::Result<PathBuf> {
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

/// One `ZERO_GPU_BW op=… bytes=… seconds=… algbw_gbps=…` line as `(op, bytes, seconds, GB/s)`.
fn parse_bw_line(line: &str) -> Option<(String, u64, f64, f64)> {
    let rest = line.trim().strip_prefix(BW_PREFIX)?;
    let mut op = None;
    let (mut bytes, mut secs, mut gbps) = (None, None, None);
    for kv in rest.split_whitespace() {
        let (k, v) = kv.split_once('=')?;
        match k {
            "op" => op = Some(v.to_string()),
            "bytes" => bytes = v.parse().ok(),
            "seconds" => secs = v.parse().ok(),
            "algbw_gbps" => gbps = v.parse().ok(),
            _ => {}
        }
    }
    Some((op?, bytes?, secs?, gbps?))
}

fn gpu_test_cmd(root: &Path, target: &Path, ld_path: &str) -> Command {
    let mut c = cargo();
    c.current_dir(root)
        .args(["test", "-p", "zero-comm", "--features", "gpu-tests"])
        .env("CARGO_TARGET_DIR", target)
        .env("LD_LIBRARY_PATH", ld_path)
        .env("ZERO_GPU_TESTS", "1");
    c
}

pub(crate) fn run(a: GpuCheckArgs) -> anyhow::Result<()> {
    let root = crate::test::workspace_root();
    let limit = Duration::from_secs(a.step_timeout);
    let mut steps: Vec<Step> = Vec::new();

    // 1. The GPU, or a clear reason to stop.
    let t = Instant::now();
    let gpus = gpus()?;
    for g in &gpus {
        eprintln!("==> {g}");
    }
    steps.push(Step {
        name: "gpu",
        verdict: Verdict::Pass,
        secs: Some(t.elapsed().as_secs_f64()),
        detail: gpus.join("; "),
    });

    // 2. Libraries.
    let target = target_dir(&root)?;
    let (ld_path, libs_ok) = match libraries(&target) {
        Ok((p, detail)) => {
            steps.push(Step {
                name: "libs",
                verdict: Verdict::Pass,
                secs: None,
                detail,
            });
            (p, true)
        }
        Err(e) => {
            steps.push(Step {
                name: "libs",
                verdict: Verdict::Fail,
                secs: None,
                detail: format!("{e:#}"),
            });
            (std::env::var("LD_LIBRARY_PATH").unwrap_or_default(), false)
        }
    };

    // 3. Build.
    let mut build = gpu_test_cmd(&root, &target, &ld_path);
    build.arg("--no-run");
    let b = run_limited("build", build, limit)?;
    steps.push(Step {
        name: "build",
        verdict: if b.ok { Verdict::Pass } else { Verdict::Fail },
        secs: Some(b.secs),
        detail: if b.ok { String::new() } else { b.status },
    });

    // 4. Tests, with the cookie as proof that the GPU ones ran.
    let cookie = target.join(".gpu_tests_ran");
    let _ = std::fs::remove_file(&cookie);
    if b.ok {
        let r = run_limited("tests", gpu_test_cmd(&root, &target, &ld_path), limit)?;
        let ran: BTreeSet<String> = std::fs::read_to_string(&cookie)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.strip_suffix(" ok").map(str::to_string))
            .collect();
        let missing: Vec<&str> = GPU_TESTS
            .iter()
            .copied()
            .filter(|t| !ran.contains(*t))
            .collect();
        let verdict = if r.ok && !ran.is_empty() {
            Verdict::Pass
        } else {
            Verdict::Fail
        };
        let mut detail = format!("{} of {} GPU tests ran", ran.len(), GPU_TESTS.len());
        if !missing.is_empty() {
            detail += &format!("; not run: {missing:?}");
        }
        if ran.is_empty() {
            detail += " (all skipped: see their \"skip\" lines above";
            detail += if libs_ok { ")" } else { "; libraries missing)" };
        }
        if !r.ok {
            detail = format!("{}; {detail}", r.status);
        }
        steps.push(Step {
            name: "tests",
            verdict,
            secs: Some(r.secs),
            detail,
        });
    } else {
        steps.push(Step {
            name: "tests",
            verdict: Verdict::Skip,
            secs: None,
            detail: "build failed".into(),
        });
    }

    // 5. Bandwidth.
    if a.no_bench || !b.ok {
        steps.push(Step {
            name: "bench",
            verdict: Verdict::Skip,
            secs: None,
            detail: if a.no_bench {
                "--no-bench".into()
            } else {
                "build failed".into()
            },
        });
    } else {
        let mut bench = gpu_test_cmd(&root, &target, &ld_path);
        bench
            .args([
                "--test",
                "nccl",
                "gpu_bandwidth_report",
                "--",
                "--exact",
                "--nocapture",
            ])
            .env("ZERO_GPU_BENCH", "1")
            .env("ZERO_GPU_BENCH_MIB", a.bench_mib.to_string());
        let r = run_limited("bench", bench, limit)?;
        let figures: Vec<String> = r
            .stdout
            .iter()
            .filter_map(|l| parse_bw_line(l))
            .map(|(op, bytes, secs, gbps)| {
                format!(
                    "{op} {} MiB: {gbps:.1} GB/s ({:.1} µs)",
                    bytes >> 20,
                    secs * 1e6
                )
            })
            .collect();
        let ok = r.ok && figures.len() == 3;
        steps.push(Step {
            name: "bench",
            verdict: if ok { Verdict::Pass } else { Verdict::Fail },
            secs: Some(r.secs),
            detail: if figures.is_empty() {
                format!("{}; no figures (skipped? see above)", r.status)
            } else {
                figures.join("; ")
            },
        });
    }

    print_report(&steps);
    let failed: Vec<&str> = steps
        .iter()
        .filter(|s| s.verdict == Verdict::Fail)
        .map(|s| s.name)
        .collect();
    if !failed.is_empty() {
        bail!("gpu-check failed: {}", failed.join(", "));
    }
    Ok(())
}

fn print_report(steps: &[Step]) {
    println!();
    println!("== gpu-check report ==");
    for s in steps {
        let v = match s.verdict {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
            Verdict::Skip => "SKIP",
        };
        let t = s.secs.map_or(String::new(), |t| format!("{t:.1}s"));
        println!("{:<6} {v:<5} {t:>7}  {}", s.name, s.detail);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidth_lines_parse() {
        let l =
            "ZERO_GPU_BW op=all_gather bytes=67108864 iters=20 seconds=2.5e-5 algbw_gbps=2684.4";
        assert_eq!(
            parse_bw_line(l),
            Some(("all_gather".into(), 67108864, 2.5e-5, 2684.4))
        );
        assert_eq!(parse_bw_line("test foo ... ok"), None);
        assert_eq!(parse_bw_line("ZERO_GPU_BW op=x"), None);
    }

    #[test]
    fn ldconfig_and_nvidia_smi_parse() {
        let ld = "\t3 libs found in cache `/etc/ld.so.cache'\n\tlibnccl.so.2 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnccl.so.2\n";
        assert_eq!(
            parse_ldconfig(ld),
            vec![(
                "libnccl.so.2".to_string(),
                PathBuf::from("/usr/lib/x86_64-linux-gnu/libnccl.so.2")
            )]
        );
        assert_eq!(
            parse_nvidia_smi("0, NVIDIA H200, 570.86.15, 143771 MiB\n"),
            vec!["GPU 0: NVIDIA H200, driver 570.86.15, 143771 MiB".to_string()]
        );
    }
}
