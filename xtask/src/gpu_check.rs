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
//!    zero-quant's `cuda_kernels` tests; and, a build of its own (LLVM, which burn-cuda links,
//!    stays out of the others), zero-burn's `cuda_path` test with `cuda,gpu-tests`.
//! 4. **tests**: each program with `ZERO_GPU_TESTS=1`: the NCCL collectives, split, groups,
//!    validation and init timeout at world size 1, the mean kernels, the ZeRO-3 trainer over NCCL
//!    (bit-identical to the host loopback at world size 1), the CUDA quantization kernels bit
//!    for bit against the host codecs (f32, bf16, f16), and burn's CUDA backend: a computation
//!    against flex, and ZeRO-3 over 2 in-process ranks on the GPU bit-identical to stage 0. Each
//!    GPU test that passes appends
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
//!    bundle's `debs/` into `<work>/vulkan`. No loader at all skips the step. The step passes
//!    only when the programs' figures name an NVIDIA adapter (not another driver the loader
//!    found). `--no-wgpu` turns it off.
//!    **calibration**: the codec figures (and NCCL's, as comments) written as
//!    `<work>/gpu-calibration.toml`, the GPU class's simulator preset with this GPU's codec speeds,
//!    for `cargo xtask simulate --cluster <that file>`.
//! 7. **launch**: one rank per process over NCCL, as a user runs it (see [`launch`]): a release
//!    xtask with `--features nccl` (built here, or the bundle's `xtask-nccl`) runs `launch
//!    --nproc-per-node <GPUs> -- train --launcher nccl` on the tiny model; rank 0's report must
//!    show the measured bytes equal to the plan.
//!
//! A GPU machine without cargo (the lent ones have none) runs a bundle: `cargo xtask gpu-check
//! --bundle DIR` builds the programs here and copies them, stripped and xz-compressed, with the
//! xtask binary and the Vulkan loader's packages (`apt-get download`) into DIR, and prints its
//! size; `--no-wgpu` leaves the wgpu programs out (a lent machine takes at most 64 MiB).
//! `DIR/xtask gpu-check --prebuilt DIR` there decompresses them into `DIR/bin` and skips the
//! build. A short report (pass/fail per step, figures) ends the run; any failed step makes the
//! exit status non-zero, and so does a step that could not run (no programs, no figures, no
//! Vulkan loader): only a step turned off by a flag (`--no-bench`, `--no-wgpu`) is reported as
//! SKIP.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;

mod bench;
mod bundle;
mod calibration;
mod launch;
mod machine;
mod programs;
mod wgpu;

use bundle::{bundle, unpack};
use machine::{gpus, libraries};
use programs::{
    CUDA_FEATURES, CUDA_PROGRAM, CUDA_SCOPE, EVERY_PACKAGE, GPU_FEATURES, PROGRAMS, Program,
    WGPU_FEATURES, WGPU_PROGRAMS, build_programs, cargo, run_limited, target_dir,
};
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
    /// Leave out the wgpu step (and, with `--bundle`, the wgpu programs: a smaller upload).
    #[arg(long)]
    no_wgpu: bool,
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
    "gpu_cuda_loopback_every_collective_at_worlds_1_to_8",
    "gpu_cuda_loopback_bits_equal_the_host_loopback",
    "gpu_cuda_loopback_groups_count_their_bytes",
    "gpu_cuda_loopback_qwz_and_qgz_match_the_host_path",
    "cuda_encode_decode_accumulate_match_host_bit_for_bit",
    "cuda_every_length_up_to_70_with_small_blocks",
    "cuda_hand_computed_int4_wire",
    "cuda_non_finite_input_reports_the_first_index",
    "cuda_corrupt_wires_give_the_host_errors",
    "cuda_bf16_and_f16_tensors_match_host_bit_for_bit",
    "cuda_a_large_tensor_matches_the_host_and_reports_throughput",
    "cuda_buffers_and_codecs_are_checked",
    "zero3_over_nccl_is_bit_identical_to_the_host_loopback",
    "a_checkpoint_over_nccl_resumes_bit_identically",
    "gpu_qwz_on_device_matches_the_host_path",
    "gpu_qgz_on_device_matches_the_host_path",
    "gpu_qgz_finish_kernels_divide_and_round_like_the_host",
    "gpu_burn_cuda_computes_like_flex",
    "gpu_zero3_on_cuda_equals_stage0_bit_for_bit",
    "gpu_nccl_on_cuda_bridged_equals_host_staged",
    "gpu_cuda_loopback_trains_like_host_staged",
];

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

impl Step {
    /// A step that passes with the `figures` a test printed, and fails without them, saying
    /// which test (`source`) did not print them.
    fn of_figures(name: &'static str, figures: &[String], source: &str) -> Step {
        let (verdict, detail) = if figures.is_empty() {
            let why = format!("did not run: no figures (the {source} test did not print them)");
            (Verdict::Fail, why)
        } else {
            (Verdict::Pass, figures.join("; "))
        };
        Step {
            name,
            verdict,
            secs: None,
            detail,
        }
    }
}

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
        let programs = built(&root, &target, limit)?;
        let wgpu = if a.no_wgpu {
            Vec::new()
        } else {
            let (b, wgpu) = build_programs(
                &root,
                &target,
                limit,
                (WGPU_FEATURES, EVERY_PACKAGE),
                WGPU_PROGRAMS,
            )?;
            if !b.ok || wgpu.len() != WGPU_PROGRAMS.len() {
                bail!(
                    "building the wgpu test programs failed: {}; {} of {} built",
                    b.status,
                    wgpu.len(),
                    WGPU_PROGRAMS.len()
                );
            }
            wgpu
        };
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
    let expected = PROGRAMS.len() + 1;
    let programs: Vec<(&Program, PathBuf)> = match &a.prebuilt {
        Some(dir) => {
            let mut found = Vec::new();
            for p in PROGRAMS.iter().chain([&CUDA_PROGRAM]) {
                if let Some(exe) = unpack(dir, &work, p.name)? {
                    found.push((p, exe));
                }
            }
            steps.push(Step {
                name: "build",
                verdict: if found.len() == expected {
                    Verdict::Pass
                } else {
                    Verdict::Fail
                },
                secs: None,
                detail: format!(
                    "prebuilt: {} of {expected} programs in {}",
                    found.len(),
                    dir.display()
                ),
            });
            found
        }
        None => {
            let t = Instant::now();
            let (verdict, detail, found) = match built(&root, &work, limit) {
                Ok(found) => (Verdict::Pass, String::new(), found),
                Err(e) => (Verdict::Fail, format!("{e:#}"), Vec::new()),
            };
            steps.push(Step {
                name: "build",
                verdict,
                secs: Some(t.elapsed().as_secs_f64()),
                detail,
            });
            found
        }
    };

    // 4. Tests, with the cookie as proof that the GPU ones ran.
    let cookie = work.join(zero_testkit::cookie::FILE);
    let _ = std::fs::remove_file(&cookie);
    let program_cmd = |exe: &Path| {
        let mut c = Command::new(exe);
        c.current_dir(&root)
            .env("LD_LIBRARY_PATH", &ld_path)
            .env(zero_testkit::cookie::GPU_TESTS, "1")
            .env(zero_testkit::cookie::VAR, &cookie);
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
        for (p, exe) in &programs {
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
    let nccl = programs
        .iter()
        .find(|(p, _)| p.name == "zero-comm-nccl")
        .map(|(_, exe)| program_cmd(exe));
    let (step, nccl_figures) = match (a.no_bench, nccl) {
        (true, _) => (
            Step {
                name: "bench",
                verdict: Verdict::Skip,
                secs: None,
                detail: "--no-bench".into(),
            },
            Vec::new(),
        ),
        (false, cmd) => bench::step(cmd, a.bench_mib, limit)?,
    };
    steps.push(step);
    steps.push(Step::of_figures("quant", &quant_figures, "CUDA kernel"));

    steps.push(calibration::step(
        &gpus,
        &quant_figures,
        &nccl_figures,
        &work,
    ));

    steps.push(Step::of_figures("train", &train_figures, "NCCL trainer"));

    // 6. wgpu on the GPU's Vulkan driver.
    let step = if a.no_wgpu {
        Ok(Step {
            name: "wgpu",
            verdict: Verdict::Skip,
            secs: None,
            detail: "--no-wgpu".into(),
        })
    } else {
        wgpu_programs(&root, &work, a.prebuilt.as_deref(), limit).and_then(|programs| {
            wgpu_step(
                &root,
                &work,
                a.prebuilt.as_deref(),
                &programs,
                &ld_path,
                limit,
            )
        })
    };
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

/// Builds [`PROGRAMS`] and [`CUDA_PROGRAM`] (a build of its own) into `target`: every one, or an
/// error saying which build failed.
fn built(
    root: &Path,
    target: &Path,
    limit: Duration,
) -> anyhow::Result<Vec<(&'static Program, PathBuf)>> {
    let mut all = Vec::new();
    for (features, scope, list) in [
        (GPU_FEATURES, EVERY_PACKAGE, PROGRAMS),
        (
            CUDA_FEATURES,
            CUDA_SCOPE,
            std::slice::from_ref(&CUDA_PROGRAM),
        ),
    ] {
        let (b, found) = build_programs(root, target, limit, (features, scope), list)?;
        if !b.ok || found.len() != list.len() {
            bail!(
                "building the GPU test programs ({features}) failed: {}; {} of {} built",
                b.status,
                found.len(),
                list.len()
            );
        }
        all.extend(found.into_iter().map(|(i, exe)| (&list[i], exe)));
    }
    Ok(all)
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

    fn full_cookie() -> String {
        GPU_TESTS.iter().map(|t| format!("{t} ok\n")).collect()
    }

    #[test]
    fn every_gpu_test_must_pass_for_the_tests_step_to_pass() {
        assert_eq!(tests_verdict(&full_cookie(), &[]).0, Verdict::Pass);

        // A partial cookie: one of the 20 ran. That used to pass; now it fails naming the rest.
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
