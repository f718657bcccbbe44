//! `cargo xtask gpu-check`: the one prepared script for a machine with an NVIDIA GPU.
//!
//! A lent GPU machine has about 15 minutes of device time in all, start-up included, so every
//! step has a wall-clock limit and nothing is run twice:
//!
//! 1. **gpu**: `nvidia-smi` (name, driver, memory per GPU). No GPU (no `nvidia-smi`, no
//!    `/dev/nvidia*`) stops here with a reason and a non-zero exit.
//! 2. **libs**: finds libcuda and libnccl. cudarc looks for `libnccl.so` but not `libnccl.so.2`
//!    (the name Debian's `libnccl2` and pip's `nvidia-nccl-cu12`/`-cu13` install), so a
//!    `libnccl.so` symlink is made under `<work>/gpu-check/lib` and put first on
//!    `LD_LIBRARY_PATH` (`<work>`: the target dir, or the bundle).
//! 3. **build**: `cargo test --no-run -p zero-comm -p zero-quant -p zero-burn --features
//!    zero-comm/gpu-tests,zero-quant/gpu-tests,zero-burn/gpu-tests`, keeping four programs:
//!    zero-comm's unit tests (the mean kernels), its `nccl` tests, zero-burn's `nccl_path` test and
//!    zero-quant's `cuda_kernels` tests.
//! 4. **tests**: each program with `ZERO_GPU_TESTS=1`: the NCCL collectives, split, groups,
//!    validation and init timeout at world size 1, the mean kernels, the ZeRO-3 trainer over NCCL
//!    (bit-identical to the host loopback at world size 1), and the CUDA quantization kernels bit
//!    for bit against the host codecs (f32, bf16, f16). Each GPU test that passes appends
//!    `<name> ok` to the cookie `<work>/.gpu_tests_ran` (`ZERO_GPU_COOKIE`), removed beforehand,
//!    and one that this machine's library cannot run `<name> skipped: <reason>`. The step passes
//!    only when every test of [`GPU_TESTS`] wrote `ok`: a missing or skipped one fails it, named.
//! 5. **bench**: NCCL all-gather, reduce-scatter and all-reduce of 64 MiB at world size 1
//!    (`ZERO_GPU_BENCH=1`), and **quant**: int8/int4 encode and decode throughput of a 256 MiB
//!    tensor on the device (printed by the CUDA kernel tests), and **train**: the NCCL trainer
//!    test's losses and time.
//!
//! 6. **wgpu**: the wgpu programs (zero-comm's wgpu loopback tests, zero-quant's WGSL kernels,
//!    zero-burn's bridge and wgpu-path tests, features `wgpu`, debug build) with
//!    `ZERO_REQUIRE_WGPU=1` on the GPU's Vulkan driver: NVIDIA's ICD manifest is passed as
//!    `VK_DRIVER_FILES`, and a machine without a Vulkan loader gets Debian's, unpacked from the
//!    bundle's `debs/` into `<work>/vulkan`. No loader at all skips the step.
//!    **calibration**: the codec figures (and NCCL's, as comments) written as
//!    `<work>/gpu-calibration.toml`, the GPU class's simulator preset with this GPU's codec speeds,
//!    for `cargo xtask simulate --cluster <that file>`.
//! 7. **launch**: one rank per process over NCCL, as a user runs it (see [`launch`]): a release
//!    xtask with `--features nccl` (built here, or the bundle's `xtask-nccl`) runs `launch
//!    --nproc-per-node <GPUs> -- train --launcher nccl` on the tiny model; rank 0's report must
//!    show the measured bytes equal to the plan.
//!
//! A GPU machine without cargo (the lent ones have none) runs a bundle: `cargo xtask gpu-check
//! --bundle DIR` builds the programs here and copies them, stripped and gzipped, with the xtask
//! binary and the Vulkan loader's packages (`apt-get download`) into DIR (about 54 MiB);
//! `DIR/xtask gpu-check --prebuilt DIR` there unzips them into `DIR/bin` and skips the build. A short report (pass/fail
//! per step, figures) ends the run; any failed step makes the exit status non-zero, and so does a
//! step that could not run (no programs, no figures, no Vulkan loader): only a step turned off
//! by a flag (`--no-bench`) is reported as SKIP.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;

mod bundle;
mod calibration;
mod launch;
mod machine;
mod wgpu;

use bundle::{bundle, unpack};
use machine::{gpus, libraries};
use wgpu::{wgpu_programs, wgpu_step};

#[derive(Args, Debug)]
pub(crate) struct GpuCheckArgs {
    /// Skip the bandwidth check.
    #[arg(long)]
    no_bench: bool,
    /// Buffer size of the bandwidth check, in MiB.
    #[arg(long, default_value_t = 64)]
    bench_mib: usize,
    /// Wall-clock limit of each step (build, each test program, bench), in seconds.
    #[arg(long, default_value_t = 360)]
    step_timeout: u64,
    /// Only build the GPU test programs and copy them (debug info stripped), with this xtask,
    /// into DIR; no GPU needed. On a GPU machine without cargo, run `DIR/xtask gpu-check
    /// --prebuilt DIR` from the repository root.
    #[arg(long, value_name = "DIR", conflicts_with = "prebuilt")]
    bundle: Option<PathBuf>,
    /// Run the programs of a bundle made with `--bundle` instead of building them.
    #[arg(long, value_name = "DIR")]
    prebuilt: Option<PathBuf>,
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
    "cuda_encode_decode_accumulate_match_host_bit_for_bit",
    "cuda_every_length_up_to_70_with_small_blocks",
    "cuda_hand_computed_int4_wire",
    "cuda_non_finite_input_reports_the_first_index",
    "cuda_corrupt_wires_give_the_host_errors",
    "cuda_bf16_and_f16_tensors_match_host_bit_for_bit",
    "cuda_a_large_tensor_matches_the_host_and_reports_throughput",
    "cuda_buffers_and_codecs_are_checked",
    "zero3_over_nccl_is_bit_identical_to_the_host_loopback",
    "gpu_qwz_on_device_matches_the_host_path",
    "gpu_qgz_on_device_matches_the_host_path",
    "gpu_qgz_finish_kernels_divide_and_round_like_the_host",
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

/// Runs `cmd` (its stdout echoed as it comes when `echo`; cargo's JSON is not), killing it after `limit`.
fn run_limited(name: &str, mut cmd: Command, limit: Duration, echo: bool) -> anyhow::Result<Ran> {
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

/// One GPU test program: a test binary of a workspace crate, built with its `gpu-tests` feature.
struct Program {
    /// Its name in a bundle.
    name: &'static str,
    /// The crate directory (and package name).
    package: &'static str,
    /// `None`: the library's unit tests; `Some(t)`: the integration test `t`.
    test: Option<&'static str>,
    /// Arguments for the test harness (a filter).
    args: &'static [&'static str],
}

const PROGRAMS: &[Program] = &[
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
/// trainer's wgpu path, run on the GPU's Vulkan driver. A bundle holds them gzipped (they are
/// large: burn-wgpu builds in debug only).
const WGPU_PROGRAMS: &[Program] = &[
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

const GPU_FEATURES: &str = "zero-comm/gpu-tests,zero-quant/gpu-tests,zero-burn/gpu-tests";
const WGPU_FEATURES: &str = "zero-comm/wgpu,zero-quant/wgpu,zero-burn/wgpu";

/// Debian's Vulkan loader and the GL libraries NVIDIA's Vulkan ICD loads, for a GPU machine
/// without them: `--bundle` downloads them (`apt-get download`), `--prebuilt` unpacks them.
const VULKAN_DEBS: &[&str] = &[
    "libvulkan1",
    "libegl1",
    "libglvnd0",
    "libopengl0",
    "libgl1",
    "libglx0",
    "libgles2",
];

/// Where NVIDIA's driver installs its Vulkan ICD manifest.
const NVIDIA_ICDS: &[&str] = &[
    "/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json",
    "/usr/share/vulkan/icd.d/nvidia_icd.json",
    "/etc/vulkan/icd.d/nvidia_icd.json",
];

/// Lines the wgpu programs print with figures.
const WGPU_PREFIX: &str = "ZERO_WGPU_BRIDGE ";

const QUANT_PREFIX: &str = "ZERO_GPU_QUANT ";
const TRAIN_PREFIX: &str = "ZERO_GPU_TRAIN ";

/// Builds `programs` with `features` and returns `(program, executable)` pairs.
fn build_programs(
    root: &Path,
    target: &Path,
    limit: Duration,
    features: &str,
    programs: &[Program],
) -> anyhow::Result<(Ran, Vec<(usize, PathBuf)>)> {
    let mut c = cargo();
    c.current_dir(root)
        .args([
            "test",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ])
        .args(["-p", "zero-comm", "-p", "zero-quant", "-p", "zero-burn"])
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

pub(crate) fn run(a: GpuCheckArgs) -> anyhow::Result<()> {
    // A bundle runs where it was copied to, not where it was built.
    let root = match a.prebuilt {
        Some(_) => std::env::current_dir()?,
        None => crate::test::workspace_root(),
    };
    let limit = Duration::from_secs(a.step_timeout);
    let mut steps: Vec<Step> = Vec::new();

    if let Some(dir) = &a.bundle {
        let target = target_dir(&root)?;
        let (b, programs) = build_programs(&root, &target, limit, GPU_FEATURES, PROGRAMS)?;
        if !b.ok {
            bail!("building the GPU test programs failed: {}", b.status);
        }
        if programs.len() != PROGRAMS.len() {
            bail!(
                "cargo built {} of the {} GPU test programs",
                programs.len(),
                PROGRAMS.len()
            );
        }
        let (b, wgpu) = build_programs(&root, &target, limit, WGPU_FEATURES, WGPU_PROGRAMS)?;
        if !b.ok || wgpu.len() != WGPU_PROGRAMS.len() {
            bail!(
                "building the wgpu test programs failed: {}; {} of {} built",
                b.status,
                wgpu.len(),
                WGPU_PROGRAMS.len()
            );
        }
        let nccl_xtask = launch::build(&root, &target, limit)?;
        return bundle(dir, &programs, &wgpu, &nccl_xtask);
    }

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
    let work = match &a.prebuilt {
        Some(dir) => dir.clone(),
        None => target_dir(&root)?,
    };
    let (ld_path, libs_ok) = match libraries(&work) {
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

    // 3. Build (or find the bundle's programs).
    let programs: Vec<(usize, PathBuf)> = match &a.prebuilt {
        Some(dir) => {
            let mut found: Vec<(usize, PathBuf)> = Vec::new();
            for (i, p) in PROGRAMS.iter().enumerate() {
                if let Some(exe) = unpack(dir, &work, p.name)? {
                    found.push((i, exe));
                }
            }
            steps.push(Step {
                name: "build",
                verdict: if found.len() == PROGRAMS.len() {
                    Verdict::Pass
                } else {
                    Verdict::Fail
                },
                secs: None,
                detail: format!(
                    "prebuilt: {} of {} programs in {}",
                    found.len(),
                    PROGRAMS.len(),
                    dir.display()
                ),
            });
            found
        }
        None => {
            let (b, found) = build_programs(&root, &work, limit, GPU_FEATURES, PROGRAMS)?;
            let ok = b.ok && found.len() == PROGRAMS.len();
            steps.push(Step {
                name: "build",
                verdict: if ok { Verdict::Pass } else { Verdict::Fail },
                secs: Some(b.secs),
                detail: if ok {
                    String::new()
                } else {
                    format!("{}; {} programs", b.status, found.len())
                },
            });
            found
        }
    };

    // 4. Tests, with the cookie as proof that the GPU ones ran.
    let cookie = work.join(".gpu_tests_ran");
    let _ = std::fs::remove_file(&cookie);
    let program_cmd = |exe: &Path| {
        let mut c = Command::new(exe);
        c.current_dir(&root)
            .env("LD_LIBRARY_PATH", &ld_path)
            .env("ZERO_GPU_TESTS", "1")
            .env("ZERO_GPU_COOKIE", &cookie);
        c
    };
    let mut quant_figures = Vec::new();
    let mut train_figures: Vec<String> = Vec::new();
    if programs.is_empty() {
        steps.push(Step {
            name: "tests",
            verdict: Verdict::Fail,
            secs: None,
            detail: "no test programs to run".into(),
        });
    } else {
        let t = Instant::now();
        let mut failed = Vec::new();
        for (i, exe) in &programs {
            let p = &PROGRAMS[*i];
            let mut c = program_cmd(exe);
            c.args(p.args);
            let r = run_limited(p.name, c, limit, true)?;
            if !r.ok {
                failed.push(format!("{}: {}", p.name, r.status));
            }
            quant_figures.extend(
                r.stdout
                    .iter()
                    .filter_map(|l| l.trim().strip_prefix(QUANT_PREFIX).map(str::to_string)),
            );
            train_figures.extend(
                r.stdout
                    .iter()
                    .filter_map(|l| l.trim().strip_prefix(TRAIN_PREFIX).map(str::to_string)),
            );
        }
        let cookie_text = std::fs::read_to_string(&cookie).unwrap_or_default();
        let (verdict, mut detail) = tests_verdict(&cookie_text, &failed);
        if !libs_ok {
            detail += "; libraries missing (step libs)";
        }
        steps.push(Step {
            name: "tests",
            verdict,
            secs: Some(t.elapsed().as_secs_f64()),
            detail,
        });
    }

    // 5. Bandwidth: NCCL collectives, and the quantization kernels' figures from step 4.
    let mut nccl_figures: Vec<(String, u64, f64)> = Vec::new();
    let nccl = programs
        .iter()
        .find(|(i, _)| PROGRAMS[*i].name == "zero-comm-nccl");
    match (a.no_bench, nccl) {
        (true, _) => steps.push(Step {
            name: "bench",
            verdict: Verdict::Skip,
            secs: None,
            detail: "--no-bench".into(),
        }),
        (_, None) => steps.push(Step {
            name: "bench",
            verdict: Verdict::Fail,
            secs: None,
            detail: "did not run: no NCCL test program".into(),
        }),
        (false, Some((_, exe))) => {
            let mut bench = program_cmd(exe);
            bench
                .args(["gpu_bandwidth_report", "--exact", "--nocapture"])
                .env("ZERO_GPU_BENCH", "1")
                .env("ZERO_GPU_BENCH_MIB", a.bench_mib.to_string());
            let r = run_limited("bench", bench, limit, true)?;
            let parsed: Vec<_> = r.stdout.iter().filter_map(|l| parse_bw_line(l)).collect();
            nccl_figures.extend(parsed.iter().map(|(op, b, s, _)| (op.clone(), *b, *s)));
            let figures: Vec<String> = parsed
                .into_iter()
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
    }
    steps.push(Step {
        name: "quant",
        verdict: if quant_figures.is_empty() {
            Verdict::Fail
        } else {
            Verdict::Pass
        },
        secs: None,
        detail: if quant_figures.is_empty() {
            "did not run: no figures (the CUDA kernel test did not print them)".into()
        } else {
            quant_figures.join("; ")
        },
    });

    steps.push(calibration_step(
        &gpus,
        &quant_figures,
        &nccl_figures,
        &work,
    ));

    steps.push(Step {
        name: "train",
        verdict: if train_figures.is_empty() {
            Verdict::Fail
        } else {
            Verdict::Pass
        },
        secs: None,
        detail: if train_figures.is_empty() {
            "did not run: no figures (the NCCL trainer test did not print them)".into()
        } else {
            train_figures.join("; ")
        },
    });

    // 6. wgpu on the GPU's Vulkan driver.
    let step = wgpu_programs(&root, &work, a.prebuilt.as_deref(), limit).and_then(|programs| {
        wgpu_step(
            &root,
            &work,
            a.prebuilt.as_deref(),
            &programs,
            &ld_path,
            limit,
        )
    });
    steps.push(step.unwrap_or_else(|e| Step {
        name: "wgpu",
        verdict: Verdict::Fail,
        secs: None,
        detail: format!("{e:#}"),
    }));

    // 7. One rank per process over NCCL, from the command line.
    let nccl_xtask = match &a.prebuilt {
        Some(dir) => match unpack(dir, &work, launch::PROGRAM) {
            Ok(Some(exe)) => Ok(exe),
            Ok(None) => Err(format!("the bundle has no {}", launch::PROGRAM)),
            Err(e) => Err(format!("{e:#}")),
        },
        None => launch::build(&root, &work, limit).map_err(|e| format!("{e:#}")),
    };
    steps.push(launch::step(
        nccl_xtask,
        &root,
        &work,
        &ld_path,
        gpus.len(),
        limit,
    ));

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

/// Writes what the codecs and NCCL measured as `<work>/gpu-calibration.toml`, a cluster file for
/// `cargo xtask simulate --cluster FILE` ([`calibration`]).
fn calibration_step(
    gpus: &[String],
    quant: &[String],
    nccl: &[(String, u64, f64)],
    work: &Path,
) -> Step {
    // `index, name, driver, memory` (nvidia-smi's CSV; anything else is another message).
    let name = gpus
        .first()
        .map(|g| g.split(',').collect::<Vec<_>>())
        .filter(|f| f.len() == 4)
        .map_or("unknown GPU", |f| f[1].trim());
    let codecs: Vec<_> = quant
        .iter()
        .filter_map(|l| calibration::parse_codec(l))
        .collect();
    let path = work.join("gpu-calibration.toml");
    let r = calibration::cluster_toml(name, &codecs, nccl).and_then(|text| {
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))
    });
    Step {
        name: "calibration",
        verdict: if r.is_ok() {
            Verdict::Pass
        } else {
            Verdict::Fail
        },
        secs: None,
        detail: match r {
            Ok(()) => format!(
                "{} (codec speeds for `cargo xtask simulate --cluster` that file)",
                path.display()
            ),
            Err(e) => format!("not written: {e:#}"),
        },
    }
}

/// The tests step's verdict from the cookie's text and the programs that failed: PASS only when
/// no program failed and every test of [`GPU_TESTS`] wrote `<name> ok`. A test missing from the
/// cookie, or one that wrote `<name> skipped: <reason>`, fails the step, named with its reason.
fn tests_verdict(cookie: &str, failed: &[String]) -> (Verdict, String) {
    let mut ran = BTreeSet::new();
    let mut skipped = Vec::new();
    let mut unexpected = Vec::new();
    for line in cookie.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let name = if let Some(n) = line.strip_suffix(" ok") {
            ran.insert(n.to_string());
            n
        } else if let Some((n, why)) = line.split_once(" skipped: ") {
            skipped.push(format!("{n} ({why})"));
            n
        } else {
            unexpected.push(line.to_string());
            continue;
        };
        if !GPU_TESTS.contains(&name) {
            unexpected.push(line.to_string());
        }
    }
    let missing: Vec<&str> = GPU_TESTS
        .iter()
        .copied()
        .filter(|t| !ran.contains(*t) && !skipped.iter().any(|s| s.starts_with(&format!("{t} ("))))
        .collect();
    let ok = failed.is_empty() && missing.is_empty() && skipped.is_empty();
    let passed = GPU_TESTS.iter().filter(|t| ran.contains(**t)).count();
    let mut detail = format!("{passed} of {} GPU tests passed", GPU_TESTS.len());
    if !skipped.is_empty() {
        detail += &format!("; did not run on this machine: {}", skipped.join(", "));
    }
    if !missing.is_empty() {
        detail += &format!("; never reported (skipped or not compiled in): {missing:?}");
    }
    if !unexpected.is_empty() {
        detail += &format!("; cookie lines gpu-check does not expect: {unexpected:?}");
    }
    if !failed.is_empty() {
        detail = format!("failed: {}; {detail}", failed.join(", "));
    }
    (if ok { Verdict::Pass } else { Verdict::Fail }, detail)
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

    fn full_cookie() -> String {
        GPU_TESTS.iter().map(|t| format!("{t} ok\n")).collect()
    }

    /// The calibration step writes a cluster file `simulate` loads, on the GPU's preset, from
    /// the quant lines of step 4; without them it fails, saying why.
    #[test]
    fn the_calibration_step_writes_a_cluster_file() {
        let work = std::env::temp_dir().join(format!("zero-gpu-cal-{}", std::process::id()));
        std::fs::create_dir_all(&work).unwrap();
        let gpus = vec!["0, NVIDIA A100-SXM4-80GB, 580.65, 81920 MiB".to_string()];
        let quant = [
            "codec=int8 n=1 encode_gbps=900.0 decode_gbps=1000.0",
            "codec=int4 n=1 encode_gbps=700.0 decode_gbps=800.0",
        ]
        .map(String::from);
        let s = calibration_step(&gpus, &quant, &[], &work);
        assert_eq!(s.verdict, Verdict::Pass, "{}", s.detail);
        let text = std::fs::read_to_string(work.join("gpu-calibration.toml")).unwrap();
        let c = zero_core::sim::Cluster::from_toml(&text).unwrap();
        assert!(
            c.name.contains("dgx-a100") && c.name.contains("A100-SXM4-80GB"),
            "{}",
            c.name
        );
        assert!((c.codec.int4_decode * c.gpu.hbm_gbytes_per_s - 800.0).abs() < 1e-6);
        let s = calibration_step(&gpus, &[], &[], &work);
        assert_eq!(s.verdict, Verdict::Fail);
        assert!(s.detail.contains("no int8 codec figures"), "{}", s.detail);
        std::fs::remove_dir_all(&work).unwrap();
    }

    #[test]
    fn every_gpu_test_must_pass_for_the_tests_step_to_pass() {
        assert_eq!(tests_verdict(&full_cookie(), &[]).0, Verdict::Pass);

        // A partial cookie: one of the 19 ran. That used to pass; now it fails naming the rest.
        let partial = format!("{} ok\n", GPU_TESTS[0]);
        let (v, detail) = tests_verdict(&partial, &[]);
        assert_eq!(v, Verdict::Fail);
        assert!(
            detail.starts_with(&format!("1 of {} GPU tests passed", GPU_TESTS.len())),
            "{detail}"
        );
        for t in &GPU_TESTS[1..] {
            assert!(detail.contains(t), "{t} not named: {detail}");
        }

        // All but one, which the library could not run: it fails with the reason.
        let cookie = full_cookie().replace(
            "gpu_split_into_a_group_of_one ok",
            "gpu_split_into_a_group_of_one skipped: libnccl (2, 17, 1) has no ncclCommSplit",
        );
        let (v, detail) = tests_verdict(&cookie, &[]);
        assert_eq!(v, Verdict::Fail);
        assert!(
            detail.contains(
                "did not run on this machine: gpu_split_into_a_group_of_one (libnccl (2, 17, 1) \
                 has no ncclCommSplit)"
            ),
            "{detail}"
        );
        assert!(!detail.contains("never reported"), "{detail}");

        // An empty cookie, and a full cookie next to a failed program, fail too.
        assert_eq!(tests_verdict("", &[]).0, Verdict::Fail);
        let (v, detail) =
            tests_verdict(&full_cookie(), &["zero-comm-nccl: exit status: 101".into()]);
        assert_eq!(v, Verdict::Fail);
        assert!(detail.starts_with("failed: zero-comm-nccl"), "{detail}");

        // A name gpu-check does not know is reported (the list is out of date), not counted.
        let (v, detail) = tests_verdict(&format!("{}gpu_new_test ok\n", full_cookie()), &[]);
        assert_eq!(v, Verdict::Pass);
        assert!(detail.contains("gpu_new_test"), "{detail}");
    }
}
