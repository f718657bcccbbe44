//! Project workflows. Run `cargo xtask --help`.
//!
//! - `plan`: the estimator: memory per rank and bytes on the wire for a model, topology and config.
//! - `simulate`: the plan's step time, throughput and memory on a modelled GPU cluster (sweeps, plots).
//! - `train`: a real training job end to end (default: a small GPT on a synthetic language, 4
//!   in-process ranks as 2 nodes of 2, ZeRO-3 + qwZ + hpZ + qgZ), or one rank per process
//!   (`--launcher mpi`, or under `launch`).
//! - `launch`: a torchrun: starts N processes with torchrun's variables (e.g. `-- train ...` over
//!   NCCL), prefixes their output, and stops them all when one fails.
//! - `ckpt`: offline checkpoint tools (`inspect`, `verify`, `gc`, `export` to safetensors).
//! - `bench`: trainer benchmarks, one `train` process per configuration.
//! - `test`: what CI runs: formatting, lints (the GPU-only features included, so GPU-only code
//!   compiles), rustdoc, and the whole test suite with snapshot checks.
//! - `gpu-check`: the short script for a machine with a GPU: the NCCL and CUDA-codec tests, the
//!   trainer over NCCL, the wgpu programs on the GPU's Vulkan driver, bandwidth figures, a report;
//!   `--bundle` builds it for a GPU machine without cargo.
//! - `ptx`: compiles zero-quant's CUDA kernels to the checked-in PTX (needs libnvrtc, no GPU).

#[cfg(all(feature = "engine", target_os = "linux"))]
mod alloc;
mod bench;
mod ckpt;
mod gpu_check;
mod launch;
mod plan;
mod plot;
#[cfg(feature = "engine")]
mod procs;
mod ptx;
mod release;
#[cfg(feature = "engine")]
mod report;
mod simulate;
mod test;
mod train;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "cargo xtask", about = "zero-rs project workflows", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Estimate memory per rank and communication per step for a model, topology and config.
    Plan(plan::PlanArgs),
    /// Predict step time, throughput and memory of a plan on a GPU cluster (one point or a sweep).
    Simulate(Box<simulate::SimulateArgs>),
    /// Train a GPT-style model with ZeRO (ranks as threads, or one per process); prints and writes a report.
    Train(Box<train::TrainArgs>),
    /// Start N processes with torchrun's variables (e.g. `-- train ...` over NCCL), prefix their
    /// output, stop them all when one fails.
    Launch(launch::LaunchArgs),
    /// Trainer benchmarks: step time per stage and switch, loss gap, peak memory.
    Bench(bench::BenchArgs),
    /// Run what CI runs: fmt check, clippy (all features that compile here), all tests.
    Test(test::TestArgs),
    /// On a GPU machine: every GPU test (NCCL, CUDA codecs, the trainer, wgpu on Vulkan), figures.
    GpuCheck(gpu_check::GpuCheckArgs),
    /// Offline checkpoint tools: inspect, verify, gc, export to safetensors.
    Ckpt(ckpt::CkptArgs),
    /// Compile zero-quant's CUDA kernels to the checked-in PTX (needs libnvrtc, no GPU).
    Ptx(ptx::PtxArgs),
}

/// Restores SIGPIPE's default action, which Rust's runtime sets to "ignore": a write to a closed
/// pipe (`cargo xtask plan | head -1`) then ends the process quietly, as it does any Unix tool,
/// instead of `println!` panicking with "Broken pipe". Cargo does the same. Not for `launch` or a
/// train with another launcher than threads: a launcher must outlive its output to stop the
/// processes it started, and a rank's sockets (MPI, NCCL's bootstrap) keep their error path.
fn restore_sigpipe() {
    // SAFETY: called first thing in `main`, before any other thread exists; `signal` with
    // `SIG_DFL` installs no handler code.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let multi_process = match &cli.command {
        Command::Launch(_) => true,
        Command::Train(a) => a.launcher() != "threads",
        _ => false,
    };
    if !multi_process {
        restore_sigpipe();
    }
    let result = match cli.command {
        Command::Plan(a) => plan::run(a),
        // The commands that run the engine run a release build that has it (see `release`).
        Command::Simulate(a) if a.validate_host && release::needed(&[]) => release::rerun(&[]),
        Command::Simulate(a) => simulate::run(*a),
        // The jobs that time real work run optimised (see `release`).
        Command::Train(a) if a.needs_other_build() || release::wanted() => {
            release::rerun(&a.features())
        }
        Command::Bench(_) if release::needed(&[]) => release::rerun(&[]),
        Command::Ckpt(_) if !release::compiled(&[]) => release::rerun(&[]),
        #[cfg(feature = "engine")]
        Command::Train(a) => train::run(*a),
        #[cfg(feature = "engine")]
        Command::Ckpt(a) => ckpt::run(a),
        #[cfg(not(feature = "engine"))]
        Command::Train(_) | Command::Ckpt(_) => Err(release::missing(&[])),
        // Every process runs this binary as it is: build the release one with NCCL first.
        // Checked first: a bad launch fails before a release build of minutes.
        Command::Launch(a) if a.is_train() && release::needed(&a.train_features()) => {
            a.check().and_then(|_| release::rerun(&a.train_features()))
        }
        Command::Launch(a) => launch::run(a),
        Command::Test(a) => test::run(a),
        Command::Bench(a) => bench::run(a),
        Command::GpuCheck(a) => gpu_check::run(a),
        Command::Ptx(a) => ptx::run(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// A temporary directory for a unit test, named `prefix…`, removed when it drops.
#[cfg(test)]
fn temp_dir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .expect("a temp dir")
}
