//! The demo: a GPT-style decoder ([`gpt`]), token corpora with a known loss floor ([`data`]),
//! in-process launchers that train it ([`run`]; on wgpu, `wgpu_run`; on CUDA, `cuda_run`), and
//! the whole job `cargo xtask train` runs ([`job`]). Nothing in the engine depends on this module.
//!
//! It is built on the public API but for one crate-private helper, which its launchers use:
//! `launch::Clones`, the per-rank deep copies of the model behind `Launch::run_with`.
//!
//! - `gpt.rs`: the GPT (`Gpt`, `GptConfig`), a `Segmented` model: embeddings, blocks, the head
//!   with the loss.
//! - `data.rs`: a synthetic language with a known entropy rate (`MarkovLanguage`) and byte-level
//!   text (`ByteText`); any rank makes any sequence from its global index.
//! - `run.rs`: `train_host` (in-process ranks on the host loopback) and `train_rank` (one rank of
//!   a job whose ranks are processes), with optional checkpointing (save every N steps, resume,
//!   reshard); `global_losses`.
//! - `wgpu_run.rs` (feature `wgpu`): `train_wgpu`, `train_host` on burn-wgpu and the wgpu loopback.
//! - `cuda_run.rs` (feature `cuda`): `train_cuda`, `train_host` on burn-cuda and the CUDA loopback.
//! - `config.rs`: a job's settings (`JobConfig`), the default job.
//! - `job.rs`: the job behind `cargo xtask train`: `run_job`, `run_job_rank` and
//!   `run_job_rank_cuda` (one NCCL rank on burn-cuda).
//! - `report.rs`: the run report, merged from every rank's summary.

mod config;
#[cfg(feature = "cuda")]
pub mod cuda_run;
pub mod data;
pub mod gpt;
pub mod job;
mod report;
pub mod run;
#[cfg(feature = "wgpu")]
pub mod wgpu_run;
