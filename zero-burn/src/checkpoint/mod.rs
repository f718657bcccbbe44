//! Sharded, crash-safe, verified checkpoints of a [`ZeroEngine`].
//!
//! **Layout.** `<root>/LATEST` names the newest committed tag and the crc32c and length of its
//! manifest. `<root>/step-NNNNNNNN/` holds one file per rank (`rank-RRRRR-of-NNNNN.zrs`: a JSON
//! header naming the save, rank, world and plan, then f32 tensors `w/uUUUUU`, `m/…`, `v/…`: the
//! real elements of the rank's chunk of every unit, never padding; and `w/pPPPPP`, a parameter
//! in no unit (frozen at stages 0–2) whole, each in one rank's file, spread over the ranks by
//! size), `MANIFEST.json`
//! ([`zero_core::checkpoint::Manifest`]: the explicit parameter → unit → offset table, the plan
//! fingerprint, the engine's scalars, the caller's state, and every file's size and per-MiB
//! crc32c) and [`COMMIT`] (the line `LATEST` gets, so the tag verifies after `LATEST` moves on).
//! What is derived is never written: 16-bit working weights (the master rounded), hpZ
//! secondaries, gathered copies, and the gradient accumulators, which are empty at a step
//! boundary.
//!
//! **Save** ([`ZeroEngine::save`], collective). (1) The ranks all-gather a digest (step, counts,
//! plan) and rank 0's save id; any disagreement fails every rank. (2) Each rank writes its file
//! into `.staging-<tag>-<id>/` with the crash-safe recipe (temp name, fsync, rename, fsync of
//! the directory) and (3) the ranks all-gather their file records or errors: any error fails the
//! save on every rank, leaving the previous `LATEST` in place. (4) Rank 0 writes the manifest
//! and then `COMMIT` into the staging directory, renames it to the tag, fsyncs the root, writes
//! `LATEST` by the same recipe, and every rank learns the outcome. Collectives have the
//! communicator's timeouts and a dead rank fails its peers fast, so no rank hangs. A committed
//! tag is never rewritten. Saving between micro-steps is refused, though `ZeroEngine::step` runs
//! all of a step's micro-steps, so the public API cannot get there.
//!
//! **Load** ([`ZeroEngine::load`], [`ZeroEngine::load_with`] for a tag; collective). The commit
//! record (`LATEST`, or the tag's `COMMIT`) is parsed and the manifest's length and crc32c
//! checked against it; the manifest's parameters (names, shapes, dtypes, trainable flags), plan
//! fingerprint, optimizer and reduction must equal the engine's; every rank file this rank reads
//! is checked for its exact size, the crc32c of every block it reads (all of them for its own
//! file on the same plan) and its header (save id, rank, world, plan). Only when every rank has
//! verified everything does any state change; then the fp32 state (frozen parameters included,
//! whatever values the model was built with) is restored and the derived state recomputed, so
//! the run continues bit-identically. On the same plan a rank holds its own file, while the
//! blocks it needs of the other ranks' files (the other chunks of the units it holds whole, and
//! loose parameters) are verified and let go, then read and verified again as they are restored:
//! no rank holds more than its shard and a few blocks. A file changed in between (a committed
//! checkpoint is never rewritten) fails the load at that read, naming it, with the engine's state
//! partly restored: build a fresh engine. A checkpoint of another plan is refused with
//! [`zero_core::CheckpointError::PlanMismatch`] unless the load asks to reshard
//! ([`ZeroEngine::load_resharded`]).
//!
//! # Files
//!
//! - `storage.rs`: the `Storage` seam (a few operations on paths under a root), `DirStorage`
//!   (POSIX directories) and the crash-safe `put`.
//! - `mem.rs`: `MemStorage`, which models the page cache for crash tests.
//! - `save.rs` and `load.rs`: the collective save and the verified load (same plan or
//!   resharded).
//! - `resolve.rs`: the commit record (`LATEST` or a tag's `COMMIT`), the manifest checked against
//!   it, and each saved rank's file located and checked.
//! - `shard.rs`: one rank file: header, f32 tensors, block checksums; verified decoding.
//! - `ranged.rs`: a rank file read in verified pieces (`Ranged`).
//! - `export.rs` and `import.rs`: safetensors out (`export_safetensors`, offline, streamed) and in
//!   (`init_from_safetensors`).

mod export;
mod import;
mod load;
mod mem;
mod ranged;
mod resolve;
mod save;
mod shard;
mod storage;

pub use export::{ExportDtype, ExportReport, export_safetensors};
pub use import::init_from_safetensors;
pub use mem::MemStorage;
pub use storage::{DirStorage, Storage, join, put};
pub use zero_core::checkpoint::ClientState;

use zero_comm::Communicator;
use zero_core::checkpoint::{EngineScalars, LossScalerState};

use crate::engine::{Scalars, ZeroEngine};
use crate::error::Result;
use crate::segmented::Segmented;

/// What a save did on this rank.
#[derive(Clone, Debug, PartialEq)]
pub struct SaveReport {
    /// The committed tag (`step-NNNNNNNN`).
    pub tag: String,
    /// Bytes this rank wrote (its rank file).
    pub bytes: u64,
    /// Wall time of the whole collective save on this rank.
    pub seconds: f64,
}

/// What a load restored.
#[derive(Clone, Debug, PartialEq)]
pub struct Loaded {
    /// The tag loaded.
    pub tag: String,
    /// The optimizer step the engine continues from.
    pub step: u64,
    /// The caller's state, as handed to the save.
    pub client_state: ClientState,
}

impl<C: Communicator, M: Segmented> ZeroEngine<C, M> {
    /// Saves a checkpoint of this rank's shard into `store` and, on rank 0, commits it; every rank
    /// must call it at the same step. `client_state` (data position, epoch, ...) comes back from
    /// [`Self::load`]. An error on any rank fails the save on every rank and leaves the previous
    /// `LATEST` in place. Its collectives are booked as
    /// [`RankReport::other_traffic`](crate::RankReport::other_traffic).
    pub fn save(&mut self, store: &dyn Storage, client_state: ClientState) -> Result<SaveReport> {
        self.core.check_restored()?;
        self.untracked(|e| save::save(e, store, client_state))
    }

    /// Loads the checkpoint `LATEST` names in `store` (saved with the same plan) after verifying
    /// every byte this rank reads, on every rank, before any state changes. Collective. Parts of
    /// other ranks' files are read and verified again as they are restored; should one change
    /// in between (or a rank fail its restore), every rank fails the load and refuses steps and
    /// saves ([`crate::Error::PartlyRestored`]) until a load succeeds.
    pub fn load(&mut self, store: &dyn Storage) -> Result<Loaded> {
        self.load_with(store, &LoadOptions::default())
    }

    /// [`Self::load`] of a checkpoint saved with any plan of the same model (another world
    /// size, ranks per node, stage, bucket sizes, hpZ or precision) and the same optimizer:
    /// each rank reads the checksum blocks of the saved files that hold its part
    /// ([`zero_core::checkpoint::copies`], [`zero_core::checkpoint::loose_copies`]) and
    /// verifies them. The restored fp32 state equals the saved one element for element, frozen
    /// parameters included, whichever stages the two plans are (a frozen parameter replicated
    /// at stages 0–2 and sharded in a stage-3 unit are moved both ways).
    pub fn load_resharded(&mut self, store: &dyn Storage) -> Result<Loaded> {
        self.load_with(
            store,
            &LoadOptions {
                reshard: true,
                ..LoadOptions::default()
            },
        )
    }

    /// [`Self::load`] with options: which checkpoint (a tag, verified against the `COMMIT`
    /// record it was saved with, or `LATEST`'s) and whether another plan's may be resharded.
    pub fn load_with(&mut self, store: &dyn Storage, options: &LoadOptions) -> Result<Loaded> {
        self.untracked(|e| load::load(e, store, options))
    }
}

/// What [`ZeroEngine::load_with`] loads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// The checkpoint's tag (`step-NNNNNNNN`); `None`: the one `LATEST` names.
    pub tag: Option<String>,
    /// Whether a checkpoint saved with another plan may be loaded (resharded); without it one is
    /// refused with [`zero_core::CheckpointError::PlanMismatch`].
    pub reshard: bool,
}

/// The name of a tag's commit record inside its directory: the same line as `LATEST` (tag,
/// manifest crc32c, manifest bytes), written before the tag is committed.
pub const COMMIT: &str = "COMMIT";

/// The manifest of the checkpoint `tag` names in `store` (`None`: `LATEST`'s), checked against
/// its commit record's length and crc32c; `(tag, manifest)`.
pub fn read_manifest(
    store: &dyn Storage,
    tag: Option<&str>,
) -> Result<(String, zero_core::checkpoint::Manifest)> {
    let (tag, m, _) = resolve::resolve(store, tag)?;
    Ok((tag, m))
}

/// What [`verify`] checked.
#[derive(Clone, Debug, PartialEq)]
pub struct VerifyReport {
    /// The checkpoint's tag.
    pub tag: String,
    /// Rank files verified.
    pub files: usize,
    /// Their bytes.
    pub bytes: u64,
}

/// Verifies every byte of the checkpoint `tag` names (`None`: `LATEST`'s), offline: the
/// manifest against its commit record, then every rank file (existence, exact size, every
/// block's crc32c, header).
pub fn verify(store: &dyn Storage, tag: Option<&str>) -> Result<VerifyReport> {
    let (tag, m, mpath) = resolve::resolve(store, tag)?;
    for k in 0..m.files.len() {
        resolve::open_file(store, &tag, &m, &mpath, k)?;
    }
    Ok(VerifyReport {
        tag,
        files: m.files.len(),
        bytes: m.files.iter().map(|f| f.bytes).sum(),
    })
}

/// The engine's scalars as the manifest records them.
fn engine_scalars<C: Communicator, M: Segmented>(e: &ZeroEngine<C, M>) -> EngineScalars {
    let Scalars {
        step,
        opt_steps,
        skipped,
        scaler,
    } = e.core.ckpt_scalars();
    let (opt, reduction) = e.core.ckpt_options();
    EngineScalars {
        step,
        opt_steps,
        skipped,
        // Debug prints f32 hyper-parameters exactly (shortest round-trip form).
        optimizer: serde_json::Value::String(format!("{opt:?}")),
        optimizer_states: opt.state_buffers(),
        reduction: format!("{reduction:?}"),
        loss_scaler: scaler.map(|(scale, hysteresis, iter, last_overflow)| LossScalerState {
            scale_bits: scale.to_bits(),
            scale: Some(scale.to_string()),
            hysteresis,
            iter,
            last_overflow,
        }),
    }
}

/// Every rank's bytes (of any length): lengths first, then the bytes padded to the longest.
pub(crate) fn all_gather_bytes<C: Communicator>(comm: &mut C, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
    let lens = comm.all_gather_host(&(mine.len() as u64).to_le_bytes())?;
    let lens: Vec<usize> = lens
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as usize)
        .collect();
    let max = lens.iter().copied().max().unwrap_or(0);
    let mut padded = mine.to_vec();
    padded.resize(max, 0);
    let all = comm.all_gather_host(&padded)?;
    Ok(lens
        .iter()
        .enumerate()
        .map(|(r, &l)| all[r * max..r * max + l].to_vec())
        .collect())
}

/// One phase of a collective `action` agreed by every rank: `local` when every rank succeeded,
/// else this rank's own error or the first failing rank's, named.
pub(crate) fn agree<C: Communicator, T>(
    comm: &mut C,
    action: &'static str,
    local: Result<T>,
) -> Result<T> {
    let msg = status_bytes(local.as_ref().map(|_| Vec::new()));
    let all = match all_gather_bytes(comm, &msg) {
        Ok(all) => all,
        Err(err) => return Err(local.err().unwrap_or(err)),
    };
    let failure = statuses(&all)
        .into_iter()
        .enumerate()
        .find_map(|(r, st)| st.err().map(|cause| (r, cause)));
    match failure {
        Some((r, cause)) => Err(failed(action, r, cause, local)),
        None => local,
    }
}

/// This rank's error if it failed itself, else the peer's failure.
fn failed<T>(action: &'static str, rank: usize, cause: String, local: Result<T>) -> crate::Error {
    match local {
        Err(e) => e,
        Ok(_) => crate::Error::CheckpointFailed {
            action,
            rank,
            cause,
        },
    }
}

/// A rank's status for the others: `0` and a body, or `1` and its error's message.
fn status_bytes(r: std::result::Result<Vec<u8>, &crate::Error>) -> Vec<u8> {
    match r {
        Ok(mut body) => {
            body.insert(0, 0);
            body
        }
        Err(e) => {
            let mut out = vec![1];
            out.extend_from_slice(e.full_message().as_bytes());
            out
        }
    }
}

/// Parses what [`status_bytes`] made, per rank.
fn statuses(all: &[Vec<u8>]) -> Vec<std::result::Result<&[u8], String>> {
    all.iter()
        .map(|b| match b.split_first() {
            Some((0, body)) => Ok(body),
            Some((_, msg)) => Err(String::from_utf8_lossy(msg).into_owned()),
            None => Err("sent no status".into()),
        })
        .collect()
}
