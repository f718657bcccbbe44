//! The demo: a GPT-style decoder ([`gpt`]), token corpora with a known loss floor ([`data`]),
//! one in-process launcher that trains it on the host, wgpu or CUDA ([`train`]), and the whole
//! job `cargo xtask train` runs ([`job`]). Nothing in the engine depends on this module.
//!
//! It is built on the public API but for one crate-private helper, which its launcher uses:
//! `launch::Clones`, the per-rank deep copies of the model behind `Launch::run_with`.
//!
//! - `gpt.rs`: the GPT (`Gpt`, `GptConfig`), a `Segmented` model: embeddings, blocks, the head
//!   with the loss.
//! - `data.rs`: a synthetic language with a known entropy rate (`MarkovLanguage`) and byte-level
//!   text (`ByteText`); any rank makes any sequence from its global index.
//! - `train.rs`: `train`, in-process ranks `On` the host loopback, burn-wgpu and the wgpu loopback
//!   (feature `wgpu`), or burn-cuda and the CUDA loopback (feature `cuda`).
//! - `run.rs`: one rank's run (`train_rank` for a job whose ranks are processes), with optional
//!   checkpointing (save every N steps, resume, reshard); `global_losses`.
//! - `config.rs`: a job's settings (`JobConfig`), the default job.
//! - `job.rs`: the job behind `cargo xtask train`: `run_job`, `run_job_rank` and
//!   `run_job_rank_cuda` (one NCCL rank on burn-cuda).
//! - `report.rs`: the run report, merged from every rank's summary.

mod config;
pub mod data;
pub mod gpt;
pub mod job;
mod report;
pub mod run;
pub mod train;
