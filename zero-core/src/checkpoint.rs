//! Checkpoint types, pure (no IO): the manifest, the rank-file header, the `LATEST` pointer, the
//! plan fingerprint and layout table, and the reshard map between two plans.
//!
//! A checkpoint is a directory `<root>/<tag>/` holding one shard file per rank and a
//! `MANIFEST.json` written last by rank 0; `<root>/LATEST` names the newest committed tag and the
//! manifest's crc32c. Each rank file holds, for every unit, only the **real** elements of the
//! rank's chunk (never padding), so its content does not depend on the padding of a world size,
//! and the parameters in no unit (frozen, stages 0–2) whole, each in one rank's file, spread over
//! the ranks by size ([`LooseParam`]).
//! The IO (staging, fsync, rename, verification) lives in `zero-burn`'s `checkpoint` module; the
//! checksums themselves are computed there too (this crate stays free of IO and of hashing
//! crates); here they are plain `u32` values.

mod layout;
mod manifest;
pub mod reshard;

pub use layout::{CkptLayout, LayoutEntry, LayoutUnit, LooseParam, Place, Saved, fingerprint};
pub use manifest::{
    ClientState, EngineScalars, FORMAT, FORMAT_VERSION, FileRecord, LatestPointer, LossScalerState,
    Manifest, SHARD_MAGIC, ShardHeader, TensorRecord,
};
pub use reshard::{CopyRun, Locator, Piece, copies, loose_copies};
