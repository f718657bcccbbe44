//! A whole training job: model, data, plan, ranks, and the report `cargo xtask train` prints.

use std::sync::Arc;
use std::time::Instant;

use burn::tensor::Device;
use zero_comm::Communicator;
use zero_core::{Plan, Topology, ZeroConfig};

pub use super::config::{Backend, DataSource, JobConfig};
pub use super::report::{Compared, RunReport};
use super::report::{Described, report};
pub use super::run::Tick;
use crate::demo::data::{ByteText, Corpus, MarkovLanguage};
use crate::demo::gpt::Gpt;
use crate::demo::gpt::GptConfig;
use crate::demo::run::{HostRun, RankSummary, TrainOptions, Work, engine_builder, train_built};
use crate::demo::train::{On, train};
use crate::engine::EngineBuilder;
use crate::error::{Error, Result};
use crate::optim::Optimizer;
use crate::reduction::Reduction;

/// Where a job's models compute.
#[derive(Clone, Debug)]
enum Compute {
    /// burn-flex on the CPU.
    Flex,
    /// burn's wgpu backend on the process's shared device (with the wgpu loopback in-process).
    #[cfg(feature = "wgpu")]
    Wgpu(crate::WgpuShared),
    /// burn's CUDA backend on this device (without autodiff), GPU `.1`.
    #[cfg(feature = "cuda")]
    Cuda(Device, usize),
}

impl Compute {
    fn of(backend: Backend) -> Result<Compute> {
        match backend {
            Backend::Host => Ok(Compute::Flex),
            #[cfg(feature = "wgpu")]
            Backend::Wgpu => crate::WgpuShared::get().map(Compute::Wgpu),
            #[cfg(not(feature = "wgpu"))]
            Backend::Wgpu => Err(Error::Backend(
                "the wgpu backend is not compiled in: build with zero-burn's `wgpu` feature \
                 (`cargo run -p xtask --features wgpu -- train --backend wgpu`)"
                    .into(),
            )),
            #[cfg(feature = "cuda")]
            Backend::Cuda => {
                let gpu = crate::local_rank()?;
                crate::cuda::device(gpu).map(|d| Compute::Cuda(d, gpu))
            }
            #[cfg(not(feature = "cuda"))]
            Backend::Cuda => Err(Error::Backend(
                "the CUDA backend is not compiled in: build with zero-burn's `cuda` feature \
                 (`cargo run -p xtask --release --features cuda -- train --backend cuda`)"
                    .into(),
            )),
        }
    }

    /// The autodiff device to build the model on.
    fn device(&self) -> Device {
        match self {
            Compute::Flex => Device::flex().autodiff(),
            #[cfg(feature = "wgpu")]
            Compute::Wgpu(s) => s.autodiff_device(),
            #[cfg(feature = "cuda")]
            Compute::Cuda(d, _) => d.clone().autodiff(),
        }
    }
}

/// Everything a job needs before its ranks start, checked.
struct Prepared {
    described: Described,
    compute: Compute,
    model: crate::demo::gpt::Gpt,
    options: TrainOptions,
}

fn invalid(field: &'static str, got: impl ToString, expected: impl Into<String>) -> Error {
    Error::Invalid {
        field,
        got: got.to_string(),
        expected: expected.into(),
    }
}

/// Builds and checks the data, the model, the topology and the plan: every error a job can
/// meet before its ranks start.
fn prepare(job: &JobConfig) -> Result<Prepared> {
    if !(job.lr.is_finite() && job.lr > 0.0) {
        return Err(invalid("lr", job.lr, "a finite learning rate > 0"));
    }
    if job.timeout.is_zero() {
        return Err(invalid(
            "timeout",
            "0 s",
            "a collective timeout of at least 1 s",
        ));
    }
    if job.steps == 0 {
        return Err(invalid("steps", 0, "at least 1 optimizer step"));
    }
    if job.micro_batch == 0 {
        return Err(invalid("micro_batch", 0, "at least 1"));
    }
    // A step's token batches are made up front: bounded so that a typo fails here, not as an
    // allocation of terabytes (2^20 tokens per rank per micro-step, 2^24 per optimizer step).
    let seq = job.model.context.max(1);
    let micro_tokens = (job.micro_batch as u64).saturating_mul(seq as u64);
    if micro_tokens > 1 << 20 {
        return Err(invalid(
            "micro_batch",
            job.micro_batch,
            format!(
                "at most {} sequences of {seq} tokens (2^20 tokens per rank per micro-step)",
                (1usize << 20) / seq
            ),
        ));
    }
    let accum = u64::from(job.zero.gradient_accumulation_steps);
    if micro_tokens.saturating_mul(accum) > 1 << 24 {
        return Err(invalid(
            "gradient_accumulation_steps",
            accum,
            format!(
                "at most {} micro-steps of {micro_tokens} tokens (2^24 tokens per rank per step)",
                (1u64 << 24) / micro_tokens
            ),
        ));
    }
    if job.model.heads == 0 || !job.model.d_model.is_multiple_of(job.model.heads) {
        return Err(invalid(
            "heads",
            job.model.heads,
            format!("a divisor of d_model {}", job.model.d_model),
        ));
    }
    let corpus: Box<dyn Corpus> = match &job.data {
        DataSource::Markov { vocab } => Box::new(MarkovLanguage::new(*vocab, job.seed)?),
        DataSource::Text { bytes, .. } => Box::new(ByteText::new(bytes.clone(), job.seed)?),
    };
    let model_cfg = GptConfig {
        vocab: corpus.vocab(),
        ..job.model
    };
    let topo = Topology::new(job.world_size, job.ranks_per_node)?;
    let optimizer = Optimizer::default();
    let zero = ZeroConfig {
        optimizer: optimizer.kind(),
        ..job.zero.clone()
    };
    let compute = Compute::of(job.backend)?;
    let mut model = match job.tie_embeddings {
        true => model_cfg.init_tied(&compute.device(), job.seed),
        false => model_cfg.init(&compute.device(), job.seed),
    };
    if let Some(path) = &job.init {
        let bytes = std::fs::read(path).map_err(|e| Error::Init {
            file: path.display().to_string(),
            detail: format!("cannot read it: {e}"),
        })?;
        model =
            crate::checkpoint::init_from_safetensors(model, &bytes, &path.display().to_string())?;
    }
    let plan: Arc<Plan> = Arc::new(crate::model::plan_for(&model, topo, &zero)?);
    let options = TrainOptions {
        lr: job.lr,
        optimizer,
        micro_batch: job.micro_batch,
        seq: model_cfg.context,
        reduction: Reduction::RankOrdered,
    };
    Ok(Prepared {
        described: Described {
            corpus,
            model_cfg,
            zero,
            plan,
        },
        compute,
        model,
        options,
    })
}

/// Checks a job without training it: every error [`run_job`] can meet before its ranks start
/// (bad options, data, model shape, topology or ZeRO configuration), in "got X, expected Y" form.
pub fn check(job: &JobConfig) -> Result<()> {
    prepare(job).map(|_| ())
}

/// Builds everything and trains. `on_step` reports progress from rank 0.
pub fn run_job(job: &JobConfig, on_step: &(dyn Fn(Tick) + Sync)) -> Result<RunReport> {
    let Prepared {
        described,
        compute,
        model,
        options,
    } = prepare(job)?;
    let start = Instant::now();
    let run = host_run(job);
    let on = match &compute {
        Compute::Flex => On::Host,
        // On CUDA the in-process ranks share the GPU and the CUDA loopback's collectives run in
        // its memory.
        #[cfg(feature = "cuda")]
        Compute::Cuda(_, gpu) => On::Cuda(*gpu),
        #[cfg(feature = "wgpu")]
        Compute::Wgpu(s) => On::Wgpu(s.clone(), crate::demo::train::WgpuTensors::Bridge),
    };
    let work = Work::new(described.corpus.as_ref(), options, &run).on_step(on_step);
    let results = train(on, described.plan.clone(), model, work)?;
    let wall = start.elapsed().as_secs_f64();
    let summaries: Vec<RankSummary> = results.iter().map(RankSummary::of).collect();
    report(job, &described, &summaries, wall)
}

/// One rank of `job` in this process, on `comm`, for jobs whose ranks are processes (MPI, NCCL):
/// `comm`'s world must be the job's (`world_size`, `ranks_per_node`). Every rank trains from the
/// same seed-determined model and returns the whole job's report, merged from every rank's
/// numbers; `on_step` is called on rank 0. The model computes on the job's backend: flex, this
/// process's own wgpu device (wgpu's default adapter; `CUBECL_WGPU_DEFAULT_DEVICE` picks
/// another), or the GPU [`local_rank`](crate::local_rank) names, with the optimizer's state on
/// it and the collectives staged through host memory (over NCCL on burn-cuda,
/// `run_job_rank_cuda` keeps them on the GPU).
pub fn run_job_rank<C: Communicator>(
    job: &JobConfig,
    comm: C,
    on_step: &(dyn Fn(Tick) + Sync),
) -> Result<RunReport> {
    run_job_rank_with(job, comm, on_step, Ok)
}

/// [`run_job_rank`] over NCCL (or any communicator with [`NcclBuffer`](zero_comm::nccl::NcclBuffer)s
/// on one stream) on burn-cuda (feature `cuda`): on [`Backend::Cuda`] the CUDA bridge
/// ([`CudaTensors`](crate::cuda::CudaTensors)) and zero-quant's CUDA codecs move gradients and
/// weights between the model and the communicator's buffers on the GPU, so the collectives read
/// and write device memory; on other backends it is [`run_job_rank`].
#[cfg(feature = "cuda")]
pub fn run_job_rank_cuda<C: zero_comm::nccl::OnCuda>(
    job: &JobConfig,
    comm: C,
    on_step: &(dyn Fn(Tick) + Sync),
) -> Result<RunReport> {
    if job.backend != Backend::Cuda {
        return run_job_rank(job, comm, on_step);
    }
    let hooks = crate::cuda::CudaTensors::new(&comm, Compute::of(job.backend)?.device());
    let quant = Arc::new(zero_quant::CudaQuantizer::new(comm.cuda_stream().clone())?);
    run_job_rank_with(job, comm, on_step, move |builder| {
        Ok(builder
            .device_tensors(Box::new(hooks) as Box<dyn crate::DeviceTensors<C>>)
            .device_quant(quant as Arc<dyn crate::DeviceQuant<C>>))
    })
}

/// [`run_job_rank`] with `attach` adding to the rank's engine builder.
fn run_job_rank_with<C: Communicator>(
    job: &JobConfig,
    comm: C,
    on_step: &(dyn Fn(Tick) + Sync),
    attach: impl FnOnce(EngineBuilder<C, Gpt>) -> Result<EngineBuilder<C, Gpt>>,
) -> Result<RunReport> {
    let Prepared {
        described,
        model,
        options,
        ..
    } = prepare(job)?;
    if comm.topology() != described.plan.topology() {
        let t = comm.topology();
        return Err(invalid(
            "world_size",
            format!(
                "{} processes, {} per node",
                t.world_size(),
                t.ranks_per_node()
            ),
            format!(
                "{} ranks, {} per node, as the job says",
                job.world_size, job.ranks_per_node
            ),
        ));
    }
    let start = Instant::now();
    let run = host_run(job);
    let builder = attach(engine_builder(&described.plan, comm, model, options))?;
    let work = Work::new(described.corpus.as_ref(), options, &run).on_step(on_step);
    let (_, summaries) = train_built(builder, work)?;
    let wall = start.elapsed().as_secs_f64();
    report(job, &described, &summaries, wall)
}

/// How long `job` runs, with its checkpointing.
fn host_run(job: &JobConfig) -> HostRun {
    HostRun {
        checkpoint: job.checkpoint.clone(),
        ..HostRun::new(job.steps, job.timeout)
    }
}
