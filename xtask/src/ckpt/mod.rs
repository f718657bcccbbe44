//! `cargo xtask ckpt`: offline tools for zero-rs checkpoints (`zero_burn::checkpoint`).
//!
//! The flags live here, in every build; the tools (feature `engine`) in [`tools`].

use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};

#[cfg(feature = "engine")]
mod tools;
#[cfg(all(test, feature = "engine"))]
pub(crate) use tools::gc;
#[cfg(feature = "engine")]
pub(crate) use tools::{enclosing_checkpoint, locate, run, same_place};

#[derive(Args, Debug)]
pub(crate) struct CkptArgs {
    #[command(subcommand)]
    command: CkptCommand,
}

#[derive(Subcommand, Debug)]
enum CkptCommand {
    /// Print a checkpoint: tag, step, plan, files (the manifest is checked against its commit
    /// record).
    Inspect {
        /// The checkpoint root (the checkpoint LATEST names), or one tag's directory in it.
        dir: PathBuf,
        /// Print the whole manifest as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Re-read and check every byte of a checkpoint (sizes, block crc32c, headers): of every
    /// committed tag in a root (and LATEST itself), or of one tag's directory. Each tag checked
    /// is printed; any bad one fails the command, naming them all.
    Verify {
        /// The checkpoint root (every committed tag), or one tag's directory in it.
        dir: PathBuf,
    },
    /// Delete old checkpoints: every committed tag but the newest `--keep` (never the one LATEST
    /// names), and the staging directories crashed saves left. Do not run it while a job saves.
    Gc {
        /// The checkpoint root.
        dir: PathBuf,
        /// Committed checkpoints to keep, newest first (LATEST's is always kept).
        #[arg(long, default_value_t = 1)]
        keep: usize,
        /// Print what would be deleted and delete nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Write the parameters as one safetensors file (burn's parameter paths as names).
    Export {
        /// The checkpoint root (the checkpoint LATEST names), or one tag's directory in it.
        dir: PathBuf,
        /// The output file.
        #[arg(long)]
        out: PathBuf,
        /// Element type: the fp32 weights (master), or rounded to bf16/f16 (the working weights).
        #[arg(long, value_enum, default_value = "f32")]
        dtype: Dtype,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Dtype {
    F32,
    Bf16,
    F16,
}
