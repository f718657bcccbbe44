//! The training job behind `cargo xtask train` (feature `engine`): flags to a [`JobConfig`], the
//! run, its report.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use zero_burn::demo::job::{Backend, DataSource, JobConfig, Tick, check, run_job};
use zero_burn::optim::Optimizer;
use zero_core::{AdamWValues, Precision, RunBatch, RunValues, ZeroConfig};

use super::checkpointing;
use super::{Offload, TrainArgs, check_writable};

/// Where an `--offload-*` flag puts the state.
fn placement(o: Offload) -> zero_core::Placement {
    match o {
        Offload::None => zero_core::Placement::Device,
        Offload::Cpu => zero_core::Placement::Host,
        Offload::Nvme => zero_core::Placement::Nvme,
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
        // The 10M-parameter GPT of BENCHMARKS.md's comparison with plain data parallel (global
        // batch 8 = 2 ranks x 4).
        "gpt-10m" => GptConfig {
            vocab: 2048,
            context: 128,
            d_model: 384,
            heads: 6,
            layers: 5,
        },
        // 1.66B parameters, with short sequences: its model states (16 bytes a parameter with
        // AdamW, in fp32 or bf16) are 26.6 GB, more than this machine's 24 GiB of memory; they
        // fit with the optimizer state and the parameter shard on NVMe.
        "gpt-1.7b" => GptConfig {
            vocab: 64,
            context: 16,
            d_model: 2048,
            heads: 16,
            layers: 33,
        },
        o => bail!("--model {o:?}: expected tiny, small, medium, wide, gpt-10m or gpt-1.7b"),
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
        "cuda" if !cfg!(feature = "cuda") => bail!(
            "--backend cuda: this xtask was built without its `cuda` feature; run `cargo run -p \
             xtask --release --features cuda -- train --backend cuda ...` (offline, run \
             `.ci/llvm-sdk.sh` first: burn's CUDA backend links LLVM 23)"
        ),
        "cuda" => Backend::Cuda,
        o => bail!("--backend {o:?}: expected host, wgpu or cuda"),
    };
    let mut job = JobConfig::default_job();
    job.backend = backend;
    job.model = model_preset(&a.model)?;
    job.tie_embeddings = a.tie_embeddings;
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
    if let Some(o) = a.offload_optimizer {
        zero.optimizer_placement = placement(o);
    }
    if let Some(o) = a.offload_param {
        zero.param_placement = placement(o);
    }
    if let Some(p) = &a.nvme_path {
        zero.nvme_path = Some(p.display().to_string());
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
    job.checkpoint = checkpointing::checkpointing(&a, &out, job.steps)?;
    match a.launcher.as_str() {
        "mpi" if !cfg!(feature = "mpi") => bail!(
            "--launcher mpi: this xtask was built without its `mpi` feature; with --backend wgpu \
             run `cargo run -p xtask --features mpi,wgpu -- train --backend wgpu --launcher mpi \
             ...` (one wgpu device per process)"
        ),
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
    check_writable(&out, "the run directory")?;

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
    // Building can take a while (with NVMe placement it writes every offloaded unit first): the
    // bar ticks and says so until the first step.
    let nvme = zero_core::Placement::Nvme;
    bar.set_message(
        if job.zero.optimizer_placement == nvme || job.zero.param_placement == nvme {
            "building the engine (writing the offloaded state to NVMe)"
        } else {
            "building the engine"
        },
    );
    bar.enable_steady_tick(Duration::from_millis(500));
    let tokens_per_step = job.tokens_per_step();
    let started = std::time::Instant::now();
    let on_step = |t: Tick| {
        let tps = (t.step + 1) as f64 * tokens_per_step as f64
            / started.elapsed().as_secs_f64().max(1e-9);
        bar.set_position(t.step + 1);
        bar.set_message(format!(
            "loss {:.4} (rank 0)  {tps:.0} tok/s{}",
            t.loss,
            crate::report::io_progress(t.nvme_io)
        ));
    };
    let report = run_job(&job, &on_step);
    bar.finish_and_clear();
    crate::report::finish(&report?, &out, zero_burn::demo::run::peak_rss_bytes())
}

/// The most in-process ranks (threads) a run starts.
const MAX_THREAD_RANKS: usize = 256;

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
