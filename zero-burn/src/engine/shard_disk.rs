//! Stage 3's parameter shard on NVMe (`param_placement = nvme`, ZeRO-Infinity's parameter
//! offload): each unit's chunk lives in the rank's store (`param{u}.bin`, see
//! [`crate::offload`]), and one unit at a time is in host memory: paged in for a gather, a step
//! or a checkpoint, and written back (through the ring, behind the caller) once it changed.
//! The caller holds the units' buffers; this type says which one is resident and moves values
//! between them and the store.

use std::path::Path;

use crate::error::Result;
use crate::offload::{Disk, IoReport, Ring, Word};

/// The store of one rank's shard and the unit paged in from it.
#[derive(Debug)]
pub(super) struct OnDisk<T: Word> {
    ring: Ring<T>,
    /// Values in the store, every unit's.
    elems: u64,
    /// The unit in host memory, and whether it changed since it was read.
    resident: Option<(usize, bool)>,
}

impl<T: Word> OnDisk<T> {
    /// Moves every unit of `units` (of `len` values each) into a new store in
    /// `root/rank{rank}`, with a ring of `buffers`, one unit at a time: `take` hands a unit's
    /// values over and leaves its buffer empty.
    pub(super) fn create<E>(
        (root, rank, buffers): (&Path, usize, usize),
        units: &mut [E],
        len: impl Fn(&E) -> usize,
        take: impl Fn(&mut E) -> Vec<T>,
    ) -> Result<Self> {
        let lens: Vec<_> = units.iter().map(|e| Some(len(e))).collect();
        let disk = Disk::create(root, rank, "param", &lens)?;
        for (u, e) in units.iter_mut().enumerate() {
            disk.write(u, &take(e))?;
        }
        Ok(OnDisk {
            ring: Ring::new(disk, buffers),
            elems: lens.iter().flatten().map(|&n| n as u64).sum(),
            resident: None,
        })
    }

    /// Bytes of the shard the store holds (all of it, whichever unit is paged in).
    pub(super) fn bytes(&self) -> u64 {
        self.elems * T::BYTES as u64
    }

    /// Makes unit `u` the one in host memory, read into `units[u]` by `put` (the unit paged in
    /// before it written back first if it changed, emptied by `take`), and starts reading `next`
    /// ahead. `changes`: the caller is about to change it, so it is written back on eviction.
    pub(super) fn page_in<E>(
        &mut self,
        units: &mut [E],
        (u, next): (usize, Option<usize>),
        changes: bool,
        take: impl Fn(&mut E) -> Vec<T>,
        put: impl Fn(Vec<T>) -> E,
    ) -> Result<()> {
        if let Some((r, dirty)) = self.resident.as_mut()
            && *r == u
        {
            *dirty |= changes;
            return Ok(());
        }
        self.evict(units, &take)?;
        units[u] = put(self.ring.load(u, next)?);
        self.resident = Some((u, changes));
        Ok(())
    }

    /// Makes unit `u` the one in host memory without reading it: the caller replaces all of it.
    pub(super) fn claim<E>(
        &mut self,
        units: &mut [E],
        u: usize,
        take: impl Fn(&mut E) -> Vec<T>,
    ) -> Result<()> {
        if self.resident.map(|(r, _)| r) != Some(u) {
            self.evict(units, &take)?;
        }
        self.resident = Some((u, true));
        Ok(())
    }

    /// Whether unit `u` is the one in host memory.
    pub(super) fn holds(&self, u: usize) -> bool {
        self.resident.is_some_and(|(r, _)| r == u)
    }

    /// Unit `u`'s values as the store holds them (the unit paged in, if it is, may be newer).
    pub(super) fn read(&self, u: usize) -> Result<Vec<T>> {
        self.ring.disk().read(u)
    }

    /// Empties the resident unit's buffer, writing it back if it changed.
    fn evict<E>(&mut self, units: &mut [E], take: &impl Fn(&mut E) -> Vec<T>) -> Result<()> {
        if let Some((r, dirty)) = self.resident.take() {
            let values = take(&mut units[r]);
            if dirty {
                self.ring.store(r, values)?;
            }
        }
        Ok(())
    }

    /// Writes the resident unit back if it changed and waits for every write: the store then
    /// holds the whole shard and host memory none of it.
    pub(super) fn settle<E>(
        &mut self,
        units: &mut [E],
        take: impl Fn(&mut E) -> Vec<T>,
    ) -> Result<()> {
        self.evict(units, &take)?;
        self.ring.flush()
    }

    /// What the store moved so far.
    pub(super) fn report(&self) -> IoReport {
        self.ring.report()
    }
}
