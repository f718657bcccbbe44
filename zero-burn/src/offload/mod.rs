//! The NVMe store: where `optimizer_placement = nvme` keeps each rank's optimizer state and
//! `param_placement = nvme` stage 3's parameter shard (ZeRO-Infinity's offload).
//!
//! - [`store`]: one file per unit under `nvme_path/rank{r}`, two slots each, in 4 KiB blocks
//!   whose CRC-32C is checked on every read. A failed write leaves the unit's last state whole;
//!   a short read, an IO error, a full disk or a changed byte is [`crate::Error::Offload`], naming
//!   the rank, the unit and the file.
//! - [`ring`]: the prefetch ring of `offload_buffer_count` buffers: the next unit is read and the
//!   last one written on IO threads while a unit is stepped, and no more units' state than the
//!   ring's buffers is ever in host memory.
//!
//! The optimizer's state ([`crate::trainer`]'s `opt_state`) and the parameter shard (its
//! `sharded` and `shard_disk`) page units in and out through it.
//! Checkpoints read and write the state through the same calls, so their format does not depend
//! on the placement, and a checkpoint moves between placements. IO is buffered (no direct IO).

mod ring;
mod store;

pub use ring::IoReport;
pub(crate) use ring::Ring;
pub(crate) use store::{Disk, Word};
