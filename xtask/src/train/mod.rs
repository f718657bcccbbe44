//! `cargo xtask train`: a real training job end to end, with a report.
//!
//! Its flags live here, in every build; the job (feature `engine`) in [`job`].

use std::path::PathBuf;

use clap::Args;

#[cfg(feature = "engine")]
mod checkpointing;
#[cfg(feature = "engine")]
mod job;
#[cfg(feature = "engine")]
pub(crate) use job::run;

/// Where `--offload-optimizer` and `--offload-param` put the state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Offload {
    /// On the model's device: no offload.
    #[value(alias = "false", alias = "device")]
    None,
    /// Host memory (DeepSpeed's `device: "cpu"`).
    #[value(alias = "true", alias = "host")]
    Cpu,
    /// The NVMe store under `--nvme-path`.
    Nvme,
}

#[derive(Args, Debug)]
pub(crate) struct TrainArgs {
    /// Model size: tiny, small (default), medium, wide (model states dominate memory), gpt-10m, or
    /// gpt-1.7b (1.66B parameters: to train on this machine, offload to NVMe).
    #[arg(long, default_value = "small")]
    model: String,
    /// ZeRO stage 0–3 (default 3, or the config file's).
    #[arg(long)]
    stage: Option<u8>,
    /// qwZ on or off (default: on at stage 3 without a config file).
    #[arg(long)]
    qwz: Option<bool>,
    /// hpZ group size; 1 turns it off (default: ranks per node at stage 3 without a config file).
    #[arg(long)]
    hpz: Option<usize>,
    /// qgZ on or off (default: on at stage 3 without a config file).
    #[arg(long)]
    qgz: Option<bool>,
    /// Number of ranks (threads; processes with --launcher mpi or nccl).
    #[arg(long, default_value_t = 4)]
    world_size: usize,
    /// Ranks per node (on one machine the nodes are simulated; bytes are classified by it).
    /// Default 2, or 1 when the world size is odd.
    #[arg(long)]
    ranks_per_node: Option<usize>,
    /// Backend: host (burn flex on the CPU, host loopback) or wgpu (burn's wgpu backend and the
    /// wgpu loopback on one device; needs `cargo run -p xtask --features wgpu -- train ...`,
    /// a debug build: burn-wgpu takes over 20 minutes to build in release; with --launcher mpi,
    /// `--features mpi,wgpu`: each process on its own wgpu device) or cuda (burn's CUDA backend
    /// on the GPU `LOCAL_RANK` names, or GPU 0, in a release build with `--features cuda`; the
    /// collectives are staged through host memory).
    #[arg(long, default_value = "host")]
    backend: String,
    /// Optimizer steps.
    #[arg(long, default_value_t = 300)]
    steps: u64,
    /// Sequences per rank per micro-step.
    #[arg(long, default_value_t = 8)]
    micro_batch: usize,
    /// Gradient accumulation steps.
    #[arg(long)]
    grad_accum: Option<u32>,
    /// Learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f32,
    /// Seed for weights and data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Global-norm clipping threshold (0 = off).
    #[arg(long)]
    clip: Option<f64>,
    /// Precision: fp32, bf16 or fp16 (16-bit weights and gradients with fp32 master weights;
    /// fp16 with dynamic loss scaling). Default fp32, or the config file's.
    #[arg(long)]
    precision: Option<String>,
    /// Overlap communication with compute: each rank's collectives run on a thread of their own
    /// (reductions during the next segment's backward, stage-3 prefetches during the current
    /// segment), bit-identical to off. Default off (on 2 CPU cores it gains nothing), or the
    /// config file's `overlap_comm`; on also turns stage-3 prefetching on.
    #[arg(long)]
    overlap_comm: Option<bool>,
    /// Activation checkpointing: the backward recomputes each segment from its saved input.
    /// Default: on at stage 3 (each segment's weights gathered again for the backward), off at
    /// stages 0–2 (one autodiff graph); off at stage 3 keeps the gathered weights for the backward.
    #[arg(long)]
    checkpoint_activations: Option<bool>,
    /// Tie the output layer to the token embedding (GPT-2's weight tying): the head reads the
    /// embedding's weight, one parameter shared by the first segment and the last.
    #[arg(long)]
    tie_embeddings: bool,
    /// Offload the optimizer: its moments and fp32 master weights live in host memory (`cpu`)
    /// or in the NVMe store under `--nvme-path` (`nvme`), and are stepped on the CPU
    /// (DeepSpeed's `offload_optimizer: {device: ...}`). Default `none`: they live on the
    /// model's device (host memory on the host backend). Or the config file's.
    #[arg(long, value_enum)]
    offload_optimizer: Option<Offload>,
    /// Offload stage 3's parameter shard between gathers: to host memory (`cpu`) or to the NVMe
    /// store under `--nvme-path` (`nvme`), moved to the device for each gather (DeepSpeed's
    /// `offload_param: {device: ...}`). Default `none`. Or the config file's.
    #[arg(long, value_enum)]
    offload_param: Option<Offload>,
    /// The folder of the NVMe store (`--offload-optimizer nvme`, `--offload-param nvme`): each
    /// rank keeps its files in `rank<r>/` under it while it runs, and removes them at the end.
    #[arg(long)]
    nvme_path: Option<PathBuf>,
    /// A config file: ours (TOML or JSON) or a DeepSpeed JSON config; a Hugging Face Trainer
    /// style config's `"auto"` values resolve from this run (one `auto:` line each).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Train a byte-level model on this text file instead of the synthetic language.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Run directory (default: `runs/<time>-stage<N>`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Collective timeout in seconds.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// How ranks run: `threads` (one process, the host loopback); `mpi` (one process per rank
    /// under OpenMPI's `mpirun`, started by this command; builds xtask with its `mpi` feature;
    /// run under `mpirun` yourself, on a cluster, each process is one rank); `nccl` (this process
    /// is one rank of a torchrun-style launch, `cargo xtask launch`, on the GPU `LOCAL_RANK`).
    #[arg(long, default_value = "threads")]
    launcher: String,
    /// Save a checkpoint after every N optimizer steps, and after the last (into --save-dir,
    /// by default `<run dir>/checkpoints`).
    #[arg(long)]
    save_every: Option<u64>,
    /// Where checkpoints are saved (a save also happens after the last step). Default: the
    /// --resume checkpoint root, or `<run dir>/checkpoints` with --save-every.
    #[arg(long)]
    save_dir: Option<PathBuf>,
    /// Continue from a checkpoint: a checkpoint root (the one its `LATEST` names) or one tag's
    /// directory in it (`DIR/step-00000004`); `--steps` counts optimizer steps in all, so the run
    /// goes on from the checkpoint's step up to it.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// With --resume: the checkpoint may come from another plan (world size, ranks per node,
    /// stage, buckets, hpZ); it is resharded on load. Without it, another plan is refused.
    #[arg(long)]
    reshard: bool,
    /// Start from the weights in this safetensors file (burn's parameter paths as names, e.g. a
    /// `cargo xtask ckpt export`) instead of the seed's: fine-tuning. Not with --resume.
    #[arg(long)]
    init: Option<PathBuf>,
}

impl TrainArgs {
    /// Parses `train`'s flags from `words`, whose first is `train` itself (where clap expects
    /// the program's name): what `launch -- train ...` passes on, and what the tests build.
    pub(crate) fn try_parse_words<S: Into<std::ffi::OsString> + Clone>(
        words: impl IntoIterator<Item = S>,
    ) -> Result<TrainArgs, clap::Error> {
        #[derive(clap::Parser)]
        struct Train {
            #[command(flatten)]
            train: TrainArgs,
        }
        <Train as clap::Parser>::try_parse_from(words).map(|t| t.train)
    }

    /// `--launcher`: threads, mpi or nccl.
    pub(crate) fn launcher(&self) -> &str {
        &self.launcher
    }

    /// The xtask features this job needs: `mpi` for `--launcher mpi`, `cuda` for `--backend cuda`.
    pub(crate) fn features(&self) -> Vec<&'static str> {
        let mut f = Vec::new();
        if self.launcher == "mpi" {
            f.push("mpi");
        }
        if self.backend == "cuda" {
            f.push("cuda");
        }
        f
    }

    /// Whether the command reruns itself from a build that has [`Self::features`] (a release
    /// build; never from a wgpu build, whose features a rerun would lose: see `run`).
    pub(crate) fn needs_other_build(&self) -> bool {
        !cfg!(feature = "wgpu") && !crate::release::compiled(&self.features())
    }
}

/// Fails now, not after the training, when `dir` cannot take a new file: one is made and removed
/// (a permission check alone misses read-only mounts, and root ignores permissions).
#[cfg(feature = "engine")]
fn check_writable(dir: &std::path::Path, what: &str) -> anyhow::Result<()> {
    use anyhow::Context;

    let probe = dir.join(format!(".zero-rs-write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .with_context(|| format!("{what} {} cannot be written", dir.display()))?;
    std::fs::remove_file(&probe).with_context(|| format!("cannot remove {}", probe.display()))?;
    Ok(())
}

#[cfg(all(test, feature = "engine"))]
pub(crate) mod tests;
