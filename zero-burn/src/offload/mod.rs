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
//! The optimizer's state ([`crate::engine`]'s `opt_state`) and the parameter shard (its
//! `sharded` and `shard_disk`) page units in and out through it.
//! Checkpoints read and write the state through the same calls, so their format does not depend
//! on the placement, and a checkpoint moves between placements. IO is direct (`O_DIRECT`) where
//! the file system allows it, buffered where it does not; [`IoReport::direct_io`] says which.

mod ring;
mod store;

pub use ring::IoReport;
pub(crate) use ring::Ring;
pub(crate) use store::{Disk, Word};

/// What [`time_store`] measured.
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct StoreTimes {
    /// Bytes written, then read back.
    pub bytes: u64,
    /// Seconds writing every unit.
    pub write_secs: f64,
    /// Seconds reading them all back, checksums checked (the values' check not timed).
    pub read_secs: f64,
    /// Whether the IO went past the page cache.
    pub direct_io: bool,
}

/// The store's own bandwidth, for `examples/store_bench.rs`: `units` units of `len` f32 each
/// (the same values) written once into a store under `dir`, then read back, one after another
/// on this thread (no ring), every value checked. The store's files are removed on return.
#[doc(hidden)]
pub fn time_store(dir: &std::path::Path, units: usize, len: usize) -> crate::Result<StoreTimes> {
    let disk = Disk::<f32>::create(dir, 0, "bench", &vec![Some(len); units])?;
    let values: Vec<f32> = (0..len).map(|i| i as f32).collect();
    let t = std::time::Instant::now();
    for u in 0..units {
        disk.write(u, &values)?;
    }
    let write_secs = t.elapsed().as_secs_f64();
    // Only the store's reads are timed, not the check of what they return.
    let mut read_secs = 0.0;
    for u in 0..units {
        let t = std::time::Instant::now();
        let back = disk.read(u)?;
        read_secs += t.elapsed().as_secs_f64();
        if back != values {
            return Err(crate::Error::Offload {
                rank: 0,
                unit: Some(u),
                path: disk.path(u).display().to_string(),
                what: "the unit came back changed".into(),
            });
        }
    }
    let (read, written) = disk.traffic();
    debug_assert_eq!(read, written);
    Ok(StoreTimes {
        bytes: written,
        write_secs,
        read_secs,
        direct_io: disk.direct(),
    })
}
