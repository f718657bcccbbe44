//! A job's settings ([`JobConfig`]): model, data, world, ZeRO configuration, backend; the
//! default job `cargo xtask train` runs. Re-exported by [`super::job`], which runs it.

use std::time::Duration;

use serde::Serialize;
use zero_core::ZeroConfig;

use crate::demo::gpt::GptConfig;
use crate::demo::run::Checkpointing;

/// Where the data comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum DataSource {
    /// The synthetic Markov language with `vocab` tokens (known entropy floor).
    Markov {
        /// Vocabulary size.
        vocab: usize,
    },
    /// Byte-level text from a file's contents.
    Text {
        /// A label (the file name).
        name: String,
        /// The bytes.
        #[serde(skip)]
        bytes: Vec<u8>,
    },
}

/// Where a job's ranks compute and communicate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// burn's flex backend on the CPU with the host loopback (the reference; bit-exact).
    #[default]
    Host,
    /// burn's wgpu backend with the wgpu loopback on one shared device (feature `wgpu`; fp32
    /// gradients and gathers go through the zero-copy bridge, the rest through host memory: see
    /// `demo::train::train` on `On::Wgpu`).
    Wgpu,
    /// burn's CUDA backend (feature `cuda`): every rank's model and optimizer state on a GPU,
    /// the one [`local_rank`](crate::local_rank) names. In-process ranks share it and reduce and
    /// gather in its memory (the CUDA loopback, `demo::train::train` on `On::Cuda`); one rank per
    /// process over NCCL does likewise through the CUDA bridge; over MPI the collectives are
    /// staged through host memory.
    Cuda,
}

/// Everything a job needs.
#[derive(Clone, Debug, Serialize)]
pub struct JobConfig {
    /// Model size (its vocabulary is overridden by the data's).
    pub model: GptConfig,
    /// The head reuses the token embedding (weight tying; [`GptConfig::init_tied`]).
    pub tie_embeddings: bool,
    /// The ZeRO configuration.
    pub zero: ZeroConfig,
    /// World size.
    pub world_size: usize,
    /// Ranks per node.
    pub ranks_per_node: usize,
    /// Optimizer steps.
    pub steps: u64,
    /// Sequences per rank per micro-step.
    pub micro_batch: usize,
    /// Learning rate.
    pub lr: f32,
    /// Seed for weights and data.
    pub seed: u64,
    /// Data.
    pub data: DataSource,
    /// Compute and communication backend.
    pub backend: Backend,
    /// Collective timeout.
    #[serde(skip)]
    pub timeout: Duration,
    /// Checkpoints to save and to resume from; `None`: neither.
    #[serde(skip)]
    pub checkpoint: Option<Checkpointing>,
    /// Start from these weights (a safetensors file naming burn's parameter paths, such as
    /// `cargo xtask ckpt export` writes) instead of the seed's.
    pub init: Option<std::path::PathBuf>,
}

impl JobConfig {
    /// The embedded default: a small GPT-style decoder on the Markov language, 4 ranks as 2 nodes
    /// of 2, ZeRO-3 with qwZ, hpZ (2) and qgZ.
    pub fn default_job() -> Self {
        JobConfig {
            model: GptConfig {
                vocab: 64,
                context: 32,
                d_model: 64,
                heads: 4,
                layers: 4,
            },
            tie_embeddings: false,
            zero: ZeroConfig {
                stage: 3,
                quantized_weights: true,
                hpz_partition_size: 2,
                quantized_gradients: true,
                param_persistence_threshold: 1024,
                // Synchronous collectives (no prefetch): on a CPU-only host every rank's compute
                // already uses the cores, so a communication thread of its own gains nothing
                // (BENCHMARKS.md); `overlap_comm` is for backends that compute elsewhere.
                prefetch_bucket_size: 0,
                ..Default::default()
            },
            world_size: 4,
            ranks_per_node: 2,
            steps: 300,
            micro_batch: 8,
            lr: 3e-3,
            seed: 0,
            data: DataSource::Markov { vocab: 64 },
            backend: Backend::Host,
            timeout: Duration::from_secs(120),
            checkpoint: None,
            init: None,
        }
    }

    /// Global tokens per optimizer step.
    pub fn tokens_per_step(&self) -> u64 {
        (self.world_size * self.micro_batch * self.model.context) as u64
            * u64::from(self.zero.gradient_accumulation_steps)
    }
}
