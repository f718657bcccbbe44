//! The demo, on the public API alone: a GPT-style decoder ([`gpt`]), token corpora with a known
//! loss floor ([`data`]), in-process launchers that train it ([`run`]; on wgpu, `wgpu_run`; on CUDA, `cuda_run`), and
//! the whole job `cargo xtask train` runs ([`job`]). Nothing in the engine depends on this module.

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
