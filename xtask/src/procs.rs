//! `cargo xtask train --launcher mpi|nccl`: one rank per process.
//!
//! - **MPI.** Started by hand, the command is the launcher ([`launch_mpi`]): it runs this same
//!   binary (a release build with the `mpi` feature, see `release`) under `mpirun -n <world
//!   size>` with the same arguments and the run directory fixed, forwards its output, and exits as
//!   it did. Under `mpirun` (this one, or a user's on a cluster) every process is one rank
//!   ([`mpi_rank`]) on an MPI communicator. A rank that fails prints its error and aborts the job,
//!   so that its peers do not wait out the collective timeout.
//! - **NCCL.** Each process (started by `cargo xtask launch`, torchrun or a cluster's launcher
//!   with torchrun's variables) is one rank on the NCCL communicator of the TCP bootstrap
//!   ([`nccl_rank`]), on the GPU named by `LOCAL_RANK`.
//!
//! Either way every rank learns every rank's numbers after training, and rank 0 prints the report
//! and writes the run directory.

use std::path::Path;

use anyhow::{Context, bail};
use zero_burn::demo::job::{JobConfig, RunReport, Tick, run_job_rank};
use zero_comm::Communicator;
use zero_comm::mpi::{ENV_RANKS_PER_NODE, MpiComm, MpiGuard, MpiOptions, abort_job, mpirun};
use zero_comm::nccl::{LaunchEnv, NcclComm, NcclOptions};

/// Starts the job's ranks under `mpirun` and waits for them. `add_out`: the arguments have no
/// `--out`, so `out` is appended (every rank must write to the same run directory).
pub(crate) fn launch_mpi(job: &JobConfig, out: &Path, add_out: bool) -> anyhow::Result<()> {
    let Some(mut cmd) = mpirun(job.world_size) else {
        bail!(
            "--launcher mpi: no mpirun on PATH; install OpenMPI (`apt-get install openmpi-bin \
             libopenmpi-dev`)"
        );
    };
    let exe = std::env::current_exe().context("cannot find this xtask's executable")?;
    cmd.args([
        "-x",
        &format!("{ENV_RANKS_PER_NODE}={}", job.ranks_per_node),
    ])
    .args(["-x", "ZERO_XTASK_NO_RELEASE=1"])
    .arg(exe)
    .args(std::env::args_os().skip(1));
    if add_out {
        cmd.arg("--out").arg(out);
    }
    eprintln!(
        "launching {} MPI processes ({} per node): {cmd:?}",
        job.world_size, job.ranks_per_node
    );
    let status = cmd.status().context("cannot start mpirun")?;
    if !status.success() {
        bail!("the MPI job failed ({status}); the ranks' messages are above");
    }
    Ok(())
}

/// One rank of the job, in a process that `mpirun` started.
pub(crate) fn mpi_rank(job: &JobConfig, out: &Path) -> anyhow::Result<()> {
    // Held until the end: the engine dropping its communicator must not finalise MPI (which
    // waits for peers) before a failing rank can abort the job.
    let _guard = MpiGuard::new()?;
    let result = mpi_train(job, out);
    if let Err(e) = &result {
        eprintln!("error: {e:#}");
        // The peers may be waiting in a collective: end the whole job now.
        abort_job(1);
    }
    result
}

fn mpi_train(job: &JobConfig, out: &Path) -> anyhow::Result<()> {
    let opts = MpiOptions {
        ranks_per_node: Some(job.ranks_per_node),
        timeout: job.timeout,
        ..MpiOptions::from_env()?
    };
    let comm = MpiComm::world(opts)?;
    if comm.world_size() != job.world_size {
        bail!(
            "mpirun started {} processes but --world-size is {}; start one process per rank",
            comm.world_size(),
            job.world_size
        );
    }
    train(job, comm, out, "MPI", run_job_rank)
}

/// One rank of the job over NCCL, from torchrun's variables (`cargo xtask launch`).
pub(crate) fn nccl_rank(job: &JobConfig, out: &Path) -> anyhow::Result<()> {
    let env = LaunchEnv::from_env().context(
        "--launcher nccl needs torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, \
         LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT): start it with `cargo xtask launch`",
    )?;
    if env.world_size != job.world_size || env.local_world_size != job.ranks_per_node {
        bail!(
            "the launcher started {} ranks, {} per node, but the job has --world-size {} and \
             --ranks-per-node {}",
            env.world_size,
            env.local_world_size,
            job.world_size,
            job.ranks_per_node
        );
    }
    let opts = NcclOptions {
        timeout: job.timeout,
        ..NcclOptions::from_env()?
    };
    let comm = NcclComm::new(&env, opts)?;
    // On burn-cuda the collectives read and write the GPU's memory (the CUDA bridge).
    #[cfg(feature = "cuda")]
    let rank = zero_burn::demo::job::run_job_rank_cuda;
    #[cfg(not(feature = "cuda"))]
    let rank = run_job_rank;
    train(job, comm, out, "NCCL", rank)
}

/// Trains this rank on `comm` with `rank` (`run_job_rank` or a form of it); rank 0 reports.
fn train<C: Communicator>(
    job: &JobConfig,
    comm: C,
    out: &Path,
    backend: &str,
    rank: impl FnOnce(&JobConfig, C, &(dyn Fn(Tick) + Sync)) -> zero_burn::Result<RunReport>,
) -> anyhow::Result<()> {
    let (me, n) = (comm.rank(), comm.world_size());
    if me == 0 {
        std::fs::create_dir_all(out)
            .with_context(|| format!("cannot create run directory {}", out.display()))?;
        eprintln!(
            "training: ZeRO-{} | {n} {backend} processes ({} per node) | {} steps | run dir {}",
            job.zero.stage,
            job.ranks_per_node,
            job.steps,
            out.display()
        );
    }
    let every = (job.steps / 10).max(1);
    let on_step = |t: Tick| {
        if (t.step + 1).is_multiple_of(every) || t.step + 1 == job.steps {
            eprintln!(
                "step {}/{}  loss {:.4} (rank 0){}",
                t.step + 1,
                job.steps,
                t.loss,
                crate::report::io_progress(t.nvme_io)
            );
        }
    };
    let report = rank(job, comm, &on_step)?;
    if me != 0 {
        return Ok(());
    }
    // Every process's own peak RSS is in the report; the launcher's is not a rank's.
    crate::report::finish(&report, out, None)?;
    if !report.peak_rss_per_rank.is_empty() {
        let mib: Vec<String> = report
            .peak_rss_per_rank
            .iter()
            .map(|b| format!("{:.1}", *b as f64 / (1 << 20) as f64))
            .collect();
        println!("peak RSS per rank process (MiB): {}", mib.join(", "));
    }
    Ok(())
}
