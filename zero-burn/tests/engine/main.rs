//! The engine's tests against their oracles (plain burn, the host loopback, the plan), in one
//! binary, so burn is linked once. Each module's doc says what it checks. The tests that need a
//! binary of their own are beside it: `memory` (a counting global allocator), `mpi` (ranks
//! re-run the binary), the wgpu, CUDA and NCCL paths (features), and `burn_train` (built apart
//! from the others, with the CUDA path).

#[path = "../common/mod.rs"]
mod common;

mod checkpoint;
mod checkpoint_export;
mod checkpoint_faults;
mod checkpoint_frozen;
mod checkpoint_ranged;
mod checkpoint_rank_failure;
mod checkpoint_reshard;
mod cross_world;
mod default_run;
mod equivalence;
mod families;
mod gpt_oracle;
mod mixed_precision;
mod model_safety;
mod offload;
mod overlap;
mod placement;
mod source_layout;
mod train_mode;
mod train_mode_zeropp;
