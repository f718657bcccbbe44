//! `cargo xtask train`: a real training job end to end, with a report.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use zero_burn::demo::job::{Backend, DataSource, JobConfig, check, run_job};
use zero_burn::optim::Optimizer;
use zero_core::{AdamWValues, Precision, RunBatch, RunValues, ZeroConfig};

#[derive(Args, Debug)]
pub(crate) struct TrainArgs {
    /// Model size: tiny, small (default), medium, or wide (model states dominate memory).
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
    /// a debug build: burn-wgpu takes over 20 minutes to build in release). CUDA: see README.
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
    /// `--launcher`: threads, mpi or nccl.
    pub(crate) fn launcher(&self) -> &str {
        &self.launcher
    }

    /// `--launcher mpi` in a build without MPI: the command reruns itself from one that has it.
    pub(crate) fn needs_mpi_build(&self) -> bool {
        self.launcher == "mpi" && !cfg!(feature = "mpi")
    }
}

/// What this run uses, for a DeepSpeed config's `"auto"` values (HF Trainer style): the model's
/// width, the batch, the flags that set engine keys, and the trainer's AdamW with `--lr`.
fn run_values(a: &TrainArgs, job: &JobConfig, precision: Option<Precision>) -> RunValues {
    // The job trains with `Optimizer::default()` at `--lr`.
    let adamw = match Optimizer::default() {
        Optimizer::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
        } => Some(AdamWValues {
            lr: a.lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        }),
        Optimizer::Sgd { .. } => None,
    };
    RunValues {
        hidden_size: Some(job.model.d_model as u64),
        batch: Some(RunBatch {
            world_size: a.world_size as u64,
            micro_batch_per_rank: a.micro_batch as u64,
        }),
        gradient_accumulation_steps: a.grad_accum,
        gradient_clipping: a.clip,
        precision,
        adamw,
    }
}

fn model_preset(name: &str) -> anyhow::Result<zero_burn::demo::gpt::GptConfig> {
    use zero_burn::demo::gpt::GptConfig;
    Ok(match name {
        "tiny" => GptConfig {
            vocab: 64,
            context: 16,
            d_model: 32,
            heads: 2,
            layers: 2,
        },
        "small" => JobConfig::default_job().model,
        // Wide, with short sequences and tiny batches: model states dominate memory.
        "wide" => GptConfig {
            vocab: 64,
            context: 16,
            d_model: 384,
            heads: 4,
            layers: 8,
        },
        "medium" => GptConfig {
            vocab: 64,
            context: 64,
            d_model: 128,
            heads: 4,
            layers: 6,
        },
        // The 10M-parameter GPT of the engine issue's benchmark (global batch 8 = 2 ranks x 4).
        "gpt-10m" => GptConfig {
            vocab: 2048,
            context: 128,
            d_model: 384,
            heads: 6,
            layers: 5,
        },
        o => bail!("--model {o:?}: expected tiny, small, medium, wide or gpt-10m"),
    })
}

pub(crate) fn run(a: TrainArgs) -> anyhow::Result<()> {
    let backend = match a.backend.as_str() {
        "host" => Backend::Host,
        "wgpu" if !cfg!(feature = "wgpu") => bail!(
            "--backend wgpu: this xtask was built without its `wgpu` feature; run `cargo run -p \
             xtask --features wgpu -- train --backend wgpu ...` (a debug build: burn-wgpu takes \
             over 20 minutes to build in release)"
        ),
        "wgpu" => Backend::Wgpu,
        "cuda" => bail!(
            "--backend cuda: burn's CUDA backend cannot be built offline (cubecl-cuda downloads \
             LLVM at build time); the trainer runs over NCCL with `cargo xtask gpu-check` (README)"
        ),
        o => bail!("--backend {o:?}: expected host or wgpu"),
    };
    let mut job = JobConfig::default_job();
    job.backend = backend;
    job.model = model_preset(&a.model)?;
    // The synthetic language has the model's vocabulary (a --data file brings its own).
    job.data = DataSource::Markov {
        vocab: job.model.vocab,
    };
    let from_file = a.config.is_some();
    let precision = a.precision.as_deref().map(Precision::parse).transpose()?;
    let mut zero = match &a.config {
        Some(path) => crate::plan::load_config(path, &run_values(&a, &job, precision))?,
        None => job.zero.clone(),
    };
    if let Some(s) = a.stage {
        zero.stage = s;
    }
    let ranks_per_node = a
        .ranks_per_node
        .unwrap_or(if a.world_size.is_multiple_of(2) { 2 } else { 1 });
    let zpp_default = zero.stage == 3 && !from_file;
    zero.quantized_weights = a.qwz.unwrap_or(zpp_default && zero.quantized_weights);
    zero.quantized_gradients = a.qgz.unwrap_or(zpp_default && zero.quantized_gradients);
    zero.hpz_partition_size = a.hpz.unwrap_or(if zpp_default {
        ranks_per_node
    } else if zero.stage == 3 {
        zero.hpz_partition_size
    } else {
        1
    });
    if let Some(g) = a.grad_accum {
        zero.gradient_accumulation_steps = g;
    }
    if let Some(c) = a.clip {
        zero.gradient_clipping = c;
    }
    if let Some(p) = precision {
        zero.precision = p;
    }
    if let Some(c) = a.checkpoint_activations {
        zero.checkpoint_activations = Some(c);
    }
    if let Some(o) = a.overlap_comm {
        zero.overlap_comm = o;
        if !from_file {
            // The default job turns stage-3 prefetching off only because synchronous collectives
            // gain nothing from it (it would only hold one more gathered unit); overlapped,
            // DeepSpeed's default applies.
            zero.prefetch_bucket_size = if o {
                ZeroConfig::default().prefetch_bucket_size
            } else {
                0
            };
        }
    }
    job.zero = zero;
    job.world_size = a.world_size;
    job.ranks_per_node = ranks_per_node;
    job.steps = a.steps;
    job.micro_batch = a.micro_batch;
    job.lr = a.lr;
    job.seed = a.seed;
    job.timeout = Duration::from_secs(a.timeout);
    if a.init.is_some() && a.resume.is_some() {
        bail!("--init and --resume: a resumed run restores its weights from the checkpoint");
    }
    job.init = a.init.clone();
    if let Some(path) = &a.data {
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read --data {}", path.display()))?;
        if (2..=job.model.context).contains(&bytes.len()) {
            eprintln!(
                "note: --data {} has {} bytes, less than one sequence of {} tokens and its \
                 target: every sequence wraps around the text",
                path.display(),
                bytes.len(),
                job.model.context
            );
        }
        job.data = DataSource::Text {
            name: path.display().to_string(),
            bytes,
        };
    }
    // Every flag and config value is checked before the run directory exists or a rank starts.
    check(&job)?;
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| default_run_dir(job.zero.stage));
    if let Some(c) = crate::ckpt::enclosing_checkpoint(&out) {
        bail!(
            "--out {} is, or lies inside, the checkpoint {}: a run directory goes elsewhere",
            out.display(),
            c.display()
        );
    }
    job.checkpoint = checkpointing(&a, &out, job.steps)?;
    match a.launcher.as_str() {
        "threads" if job.world_size > MAX_THREAD_RANKS => bail!(
            "--world-size {}: in-process ranks are threads of this process, each with a model \
             replica; at most {MAX_THREAD_RANKS} (more with --launcher mpi, one process per rank)",
            job.world_size
        ),
        "threads" => {}
        "mpi" if zero_comm::mpi::launched_by_mpi() => return crate::procs::mpi_rank(&job, &out),
        "mpi" => return crate::procs::launch_mpi(&job, &out, a.out.is_none()),
        "nccl" => return crate::procs::nccl_rank(&job, &out),
        o => bail!("--launcher {o:?}: expected threads, mpi or nccl"),
    }
    std::fs::create_dir_all(&out)
        .with_context(|| format!("cannot create run directory {}", out.display()))?;
    crate::report::check_writable(&out, "the run directory")?;

    eprintln!(
        "training: ZeRO-{}{} | {} | {} ranks ({} node(s) x {}) | {} steps x {} tokens | run dir {}",
        job.zero.stage,
        zpp_label(&job.zero),
        precision_label(job.zero.precision),
        job.world_size,
        job.world_size / job.ranks_per_node.max(1),
        job.ranks_per_node,
        job.steps,
        job.tokens_per_step(),
        out.display()
    );
    let bar = ProgressBar::new(job.steps);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:40} {pos}/{len} steps  {elapsed_precise}<{eta_precise}  {msg}",
        )
        .expect("valid template"),
    );
    let tokens_per_step = job.tokens_per_step();
    let started = std::time::Instant::now();
    let on_step = |step: u64, loss: f32| {
        let tps =
            (step + 1) as f64 * tokens_per_step as f64 / started.elapsed().as_secs_f64().max(1e-9);
        bar.set_position(step + 1);
        bar.set_message(format!("loss {loss:.4} (rank 0)  {tps:.0} tok/s"));
    };
    let report = run_job(&job, &on_step);
    bar.finish_and_clear();
    crate::report::finish(&report?, &out, zero_burn::demo::run::peak_rss_bytes())
}

/// The most in-process ranks (threads) a run starts.
const MAX_THREAD_RANKS: usize = 256;

/// The run's checkpointing from the flags: the save and resume stores, checked before any rank
/// starts (a resume needs a committed checkpoint).
fn checkpointing(
    a: &TrainArgs,
    out: &Path,
    steps: u64,
) -> anyhow::Result<Option<zero_burn::demo::run::Checkpointing>> {
    use std::sync::Arc;
    use zero_burn::checkpoint::{DirStorage, Storage, read_manifest};
    if a.reshard && a.resume.is_none() {
        bail!("--reshard needs --resume DIR (it reshards the checkpoint being loaded)");
    }
    if a.save_every == Some(0) {
        bail!("--save-every 0: expected a number of steps of at least 1");
    }
    // The resumed checkpoint, read and checked before any rank starts.
    let resumed = match &a.resume {
        None => None,
        Some(dir) => {
            anyhow::ensure!(
                dir.is_dir(),
                "--resume {}: no such directory",
                dir.display()
            );
            let (store, tag) = crate::ckpt::locate(dir)?;
            let (tag, m) = read_manifest(&store, tag.as_deref())
                .with_context(|| format!("--resume {}: no checkpoint to resume", dir.display()))?;
            let step = m.scalars.step;
            if step >= steps {
                bail!(
                    "--resume {}: the checkpoint is at step {step} and --steps is {steps}, so \
                     nothing is left to train (--steps counts every step, the checkpoint's too)",
                    dir.display()
                );
            }
            Some((store, tag, step))
        }
    };
    let save_dir = a
        .save_dir
        .clone()
        .or_else(|| resumed.as_ref().map(|(s, ..)| s.root().to_path_buf()))
        .or_else(|| a.save_every.map(|_| out.join("checkpoints")));
    if save_dir.is_none() && resumed.is_none() {
        return Ok(None);
    }
    let first_step = resumed.as_ref().map_or(0, |(_, _, step)| *step);
    if let Some(d) = &save_dir {
        // Another run's checkpoints are not taken over: saving there would move its LATEST and
        // leave its tags to `ckpt gc`. Only the resumed root itself is continued, and nothing is
        // saved inside a checkpoint (a root or a committed tag).
        let resuming_here = resumed
            .as_ref()
            .is_some_and(|(s, ..)| crate::ckpt::same_place(s.root(), d));
        match crate::ckpt::enclosing_checkpoint(d) {
            Some(c) if crate::ckpt::same_place(&c, d) && resuming_here => {}
            Some(c) if crate::ckpt::same_place(&c, d) && d.join("LATEST").is_file() => bail!(
                "--save-dir {} already holds another run's checkpoints (its LATEST): resume it \
                 with --resume {0}, or save somewhere else",
                d.display()
            ),
            Some(c) => bail!(
                "--save-dir {} is, or lies inside, the checkpoint {}: save somewhere else",
                d.display(),
                c.display()
            ),
            None => {}
        }
        // A committed checkpoint is never rewritten: a run resumed from an older tag would
        // collide with the later tags already there. Refuse it now rather than at that save.
        let every = a.save_every.unwrap_or(0);
        let saves_at = |s: u64| {
            s > first_step && s <= steps && (s == steps || (every > 0 && s.is_multiple_of(every)))
        };
        let clash = std::fs::read_dir(d)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.strip_prefix("step-")?.parse().ok())
            .filter(|s| saves_at(*s))
            .min();
        if let Some(step) = clash {
            bail!(
                "{} already holds {}, which this run would save again (committed checkpoints \
                 are never rewritten): pass another --save-dir, or resume its LATEST",
                d.display(),
                zero_core::checkpoint::Manifest::tag_of(step)
            );
        }
    }
    let save: Option<Arc<dyn Storage>> = match &save_dir {
        Some(d) => {
            let store = DirStorage::new(d)
                .with_context(|| format!("cannot create checkpoint directory {}", d.display()))?;
            crate::report::check_writable(d, "the checkpoint directory")?;
            Some(Arc::new(store))
        }
        None => None,
    };
    let (resume, resume_tag) = match resumed {
        None => (None, None),
        Some((store, tag, step)) => {
            // Under a launcher every process reads it; one says so.
            let quiet = ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK"]
                .iter()
                .any(|v| std::env::var(v).is_ok_and(|r| r != "0"));
            if !quiet {
                eprintln!(
                    "resuming from {tag} (step {step}) in {}",
                    store.root().display()
                );
            }
            (Some(Arc::new(store) as Arc<dyn Storage>), Some(tag))
        }
    };
    Ok(Some(zero_burn::demo::run::Checkpointing {
        save,
        save_every: a.save_every.unwrap_or(0),
        resume,
        resume_tag,
        reshard: a.reshard,
    }))
}

fn precision_label(p: Precision) -> &'static str {
    match p {
        Precision::Fp32 => "fp32",
        Precision::Bf16 => "bf16 (fp32 master; compute f32 on the CPU backend)",
        Precision::Fp16 => "fp16 (fp32 master, loss scaling; compute f32 on the CPU backend)",
    }
}

fn zpp_label(z: &ZeroConfig) -> String {
    let mut s = String::new();
    if z.quantized_weights {
        s += " + qwZ";
    }
    if z.hpz_partition_size > 1 {
        let _ = write!(s, " + hpZ({})", z.hpz_partition_size);
    }
    if z.quantized_gradients {
        s += " + qgZ";
    }
    s
}

fn default_run_dir(stage: u8) -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Path::new("runs").join(format!("{secs}-zero{stage}"))
}

#[cfg(test)]
pub(crate) mod tests {
    use std::path::Path;

    use clap::Parser;

    use super::{TrainArgs, run};

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        train: TrainArgs,
    }

    pub(crate) fn args(out: &Path, extra: &[&str]) -> TrainArgs {
        let out = out.to_str().expect("a UTF-8 temp path");
        let mut argv = vec!["train", "--out", out];
        argv.extend_from_slice(extra);
        Cli::try_parse_from(argv).expect("flags parse").train
    }

    /// Each bad flag is refused before any rank starts, naming the value, and leaves no run
    /// directory behind.
    #[test]
    fn invalid_flags_fail_before_a_run_directory_exists() {
        let root = std::env::temp_dir().join(format!("zero-rs-train-flags-{}", std::process::id()));
        let cases: [(&[&str], &str); 7] = [
            (&["--lr", "nan"], "lr"),
            (&["--timeout", "0"], "timeout"),
            (&["--stage", "4"], "stage"),
            (&["--steps", "0"], "steps"),
            (&["--micro-batch", "0"], "micro_batch"),
            (
                &["--world-size", "3", "--ranks-per-node", "2"],
                "ranks_per_node",
            ),
            (&["--stage", "3", "--hpz", "3"], "hpz_partition_size"),
        ];
        for (i, (flags, field)) in cases.into_iter().enumerate() {
            let out = root.join(format!("run-{i}"));
            let err = run(args(&out, flags)).expect_err("a bad flag fails");
            let msg = format!("{err:#}");
            assert!(msg.contains(field), "{flags:?}: {msg}");
            assert!(!out.exists(), "{flags:?} left {}", out.display());
        }
        let _ = std::fs::remove_dir_all(&root);
    }

    fn losses(dir: &Path) -> (u64, Vec<u32>) {
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
        let loss = v["loss"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| (x.as_f64().unwrap() as f32).to_bits())
            .collect();
        (v["first_step"].as_u64().unwrap(), loss)
    }

    /// `--save-every` saves every N steps and after the last; `--resume` continues bit-identically
    /// up to `--steps` in all and saves into the same directory; another plan is refused without
    /// `--reshard` and resharded with it; `ckpt gc` keeps the newest.
    #[test]
    fn save_resume_reshard_and_gc_from_the_command_line() {
        let root = std::env::temp_dir().join(format!("zero-rs-train-ckpt-{}", std::process::id()));
        let tiny = ["--model", "tiny", "--micro-batch", "2"];
        fn with<'a>(tiny: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
            [tiny, extra].concat()
        }
        let with = |extra: &[&'static str]| with(&tiny, extra);
        let whole = root.join("whole");
        run(args(&whole, &with(&["--steps", "6"]))).unwrap();
        let first = root.join("first");
        run(args(&first, &with(&["--steps", "4", "--save-every", "2"]))).unwrap();
        let ck = first.join("checkpoints");
        let mut tags: Vec<String> = std::fs::read_dir(&ck)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("step-"))
            .collect();
        tags.sort();
        assert_eq!(tags, ["step-00000002", "step-00000004"]);
        let ck_s: &'static str = Box::leak(ck.to_str().unwrap().to_owned().into_boxed_str());
        let second = root.join("second");
        run(args(&second, &with(&["--steps", "6", "--resume", ck_s]))).unwrap();
        let (start, tail) = losses(&second);
        let (_, all) = losses(&whole);
        assert_eq!(start, 4);
        assert_eq!(
            tail,
            all[4..],
            "the resumed steps differ from the uninterrupted run"
        );
        // An older tag resumes too (its directory names it), into another --save-dir; into its
        // own root it would save step 6 again, which is refused before any rank starts.
        let tag2: &'static str = Box::leak(
            ck.join("step-00000002")
                .to_str()
                .unwrap()
                .to_owned()
                .into_boxed_str(),
        );
        let again = root.join("again");
        let again_ck: &'static str = Box::leak(
            again
                .join("ck")
                .to_str()
                .unwrap()
                .to_owned()
                .into_boxed_str(),
        );
        run(args(
            &again,
            &with(&["--steps", "6", "--resume", tag2, "--save-dir", again_ck]),
        ))
        .unwrap();
        let (start, tail) = losses(&again);
        assert_eq!(start, 2);
        assert_eq!(tail, all[2..], "the steps resumed from step 2 differ");
        let e = run(args(
            &root.join("clash"),
            &with(&["--steps", "6", "--resume", tag2]),
        ))
        .unwrap_err();
        assert!(
            format!("{e:#}").contains("already holds step-00000006"),
            "{e:#}"
        );
        assert!(
            !root.join("clash").exists(),
            "no run directory on a refusal"
        );
        // A fresh run does not take over another run's checkpoints (its LATEST stays), and a
        // resume with nothing left to train is refused up front; neither leaves a run directory.
        let latest = std::fs::read(ck.join("LATEST")).unwrap();
        let fresh = ["--steps", "2", "--save-every", "1", "--save-dir", ck_s];
        let e = run(args(&root.join("takeover"), &with(&fresh))).unwrap_err();
        assert!(
            format!("{e:#}").contains("another run's checkpoints"),
            "{e:#}"
        );
        assert_eq!(std::fs::read(ck.join("LATEST")).unwrap(), latest);
        let e = run(args(
            &root.join("done"),
            &with(&["--steps", "6", "--resume", ck_s]),
        ))
        .unwrap_err();
        assert!(
            format!("{e:#}").contains("nothing is left to train"),
            "{e:#}"
        );
        for d in ["takeover", "done"] {
            assert!(!root.join(d).exists(), "{d}: no run directory on a refusal");
        }
        // An odd world size needs no --ranks-per-node (one rank per node by default).
        run(args(
            &root.join("odd"),
            &with(&["--world-size", "1", "--steps", "1"]),
        ))
        .unwrap();
        // Another world without --reshard is refused, naming the plan; with it, it runs.
        let other = ["--world-size", "2", "--ranks-per-node", "1", "--steps", "7"];
        let e = run(args(
            &root.join("other"),
            &with(&[&other[..], &["--resume", ck_s]].concat()),
        ))
        .unwrap_err();
        assert!(format!("{e:#}").contains("plan"), "{e:#}");
        let resharded = root.join("resharded");
        run(args(
            &resharded,
            &with(&[&other[..], &["--resume", ck_s, "--reshard"]].concat()),
        ))
        .unwrap();
        assert_eq!(losses(&resharded).0, 6);
        crate::ckpt::gc(&ck, 1, false).unwrap();
        let left: Vec<String> = std::fs::read_dir(&ck)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("step-"))
            .collect();
        assert_eq!(left, ["step-00000007"]);
        assert!(run(args(&root.join("bad"), &with(&["--reshard"]))).is_err());
        // Fine-tuning from an export of the checkpoint; not together with --resume.
        let st = root.join("model.safetensors");
        let st_s: &'static str = Box::leak(st.to_str().unwrap().to_owned().into_boxed_str());
        let store = zero_burn::checkpoint::DirStorage::new(&ck).unwrap();
        let out = zero_burn::checkpoint::DirStorage::new(&root).unwrap();
        zero_burn::checkpoint::export_safetensors(
            &store,
            None,
            &out,
            "model.safetensors",
            zero_burn::checkpoint::ExportDtype::F32,
        )
        .unwrap();
        run(args(
            &root.join("init"),
            &with(&["--steps", "2", "--init", st_s]),
        ))
        .unwrap();
        let e = run(args(
            &root.join("both"),
            &with(&["--init", st_s, "--resume", ck_s]),
        ))
        .unwrap_err();
        assert!(format!("{e:#}").contains("--init and --resume"), "{e:#}");
        let _ = std::fs::remove_dir_all(&root);
    }

    /// report.svg is well-formed XML (SVG) holding the loss line, its legend, the tokens/s of
    /// each step and the memory bars; report.png decodes; report.json has one tokens/s figure per
    /// step.
    #[test]
    fn the_report_figure_is_svg_with_the_loss_and_memory_bars() {
        let out = std::env::temp_dir().join(format!("zero-rs-train-svg-{}", std::process::id()));
        run(args(
            &out,
            &["--model", "tiny", "--steps", "3", "--micro-batch", "2"],
        ))
        .unwrap();
        let text = std::fs::read_to_string(out.join("report.svg")).unwrap();
        let (mut texts, mut rects, mut lines, mut root) = (String::new(), 0, 0, None);
        for e in xml::reader::EventReader::from_str(&text) {
            match e.expect("report.svg is well-formed XML") {
                xml::reader::XmlEvent::StartElement { name, .. } => {
                    root.get_or_insert_with(|| name.local_name.clone());
                    match name.local_name.as_str() {
                        "rect" => rects += 1,
                        "polyline" | "path" => lines += 1,
                        _ => {}
                    }
                }
                xml::reader::XmlEvent::Characters(c) => texts += &c,
                _ => {}
            }
        }
        assert_eq!(root.as_deref(), Some("svg"));
        for want in [
            "loss per step",
            "entropy floor",
            "throughput per step",
            "tokens/s (slowest rank)",
            "measured",
            "planned",
            "gradients",
        ] {
            assert!(
                texts.contains(want),
                "no {want:?} in the figure's text: {texts}"
            );
        }
        // 7 categories x 2 bars, plus legend boxes and the background.
        assert!(rects >= 14, "{rects} rectangles");
        assert!(lines >= 3, "{lines} lines");
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
        let per_step = v["step_tokens_per_sec"].as_array().unwrap();
        assert_eq!(per_step.len(), 3);
        assert!(
            per_step.iter().all(|t| t.as_f64().is_some_and(|t| t > 0.0)),
            "{per_step:?}"
        );
        // The same figure as a PNG, at the SVG's size, not blank.
        let (w, h, rgb) = crate::plot::tests::decode_png(&out.join("report.png"));
        assert_eq!((w, h), (1500, 420));
        let inked = rgb.chunks(3).filter(|p| p.iter().any(|&c| c < 200)).count();
        assert!(inked > 5_000, "{inked} inked pixels of {}", w * h);
        let _ = std::fs::remove_dir_all(&out);
    }
}
