//! The files of the NVMe store: one per unit, two slots each, every block checksummed.
//!
//! Unit `u`'s file, `{prefix}{u}.bin` in the rank's folder (`unit` for the optimizer's state,
//! `param` for stage 3's parameter shard), holds two slots of `slot_bytes` each: the unit's
//! `len` [`Word`]s (f32 or 16-bit), little-endian, padded with zeros to whole [`BLOCK`]s, so both
//! slots start on a block boundary. A write goes to the slot not in use, and the unit adopts it
//! only once every byte is in the file: a failed write (a full disk, an IO error) leaves the
//! last state whole. The adopted slot's CRC-32C per block is kept in memory and every read is
//! checked against it, so a short file or a changed byte is an error naming the file and the
//! unit, never wrong values. IO is direct (`O_DIRECT`, past the page cache) where the file system
//! allows it: the buffers start on a block boundary and every offset and length is whole blocks.
//! Where it does not (the first open or transfer refused with `EINVAL`), the store says so
//! ([`Disk::direct`]) and goes on buffered. The files are scratch space for one run
//! (checkpoints are the durable copy): nothing is synced, and the files (and the folder, once empty) are removed when
//! the store is dropped.

use std::fs::{self, File, OpenOptions};
use std::io::{self, ErrorKind};
use std::marker::PhantomData;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::{Error, Result};

/// Bytes per block: the unit of alignment and of checksums.
pub(crate) const BLOCK: usize = 4096;

/// Bytes of one slot holding `len` values of `bytes` each: whole blocks.
fn slot_bytes(len: usize, bytes: usize) -> usize {
    (len * bytes).div_ceil(BLOCK) * BLOCK
}

/// A value the store holds: fixed-width, written little-endian, read back bit for bit.
pub(crate) trait Word: Copy + Send + Sync + 'static {
    /// Bytes on disk.
    const BYTES: usize;
    /// Writes the value's `BYTES` bytes into `dst`.
    fn put(self, dst: &mut [u8]);
    /// The value of `BYTES` bytes.
    fn get(src: &[u8]) -> Self;
}

impl Word for f32 {
    const BYTES: usize = 4;
    fn put(self, dst: &mut [u8]) {
        dst.copy_from_slice(&self.to_le_bytes());
    }
    fn get(src: &[u8]) -> Self {
        f32::from_le_bytes([src[0], src[1], src[2], src[3]])
    }
}

/// bf16/fp16 bits.
impl Word for u16 {
    const BYTES: usize = 2;
    fn put(self, dst: &mut [u8]) {
        dst.copy_from_slice(&self.to_le_bytes());
    }
    fn get(src: &[u8]) -> Self {
        u16::from_le_bytes([src[0], src[1]])
    }
}

/// A zeroed buffer of `len` bytes that starts on a block boundary, as direct IO asks of memory.
struct Aligned {
    raw: Vec<u8>,
    at: usize,
    len: usize,
}

impl Aligned {
    fn zeroed(len: usize) -> Self {
        let raw = vec![0u8; len + BLOCK];
        // `align_offset` may decline (`usize::MAX`): the buffer is then unaligned, direct IO
        // refuses it with EINVAL and the store goes on buffered.
        let at = raw.as_ptr().align_offset(BLOCK).min(BLOCK);
        Aligned { raw, at, len }
    }

    fn bytes(&self) -> &[u8] {
        &self.raw[self.at..self.at + self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.raw[self.at..self.at + self.len]
    }
}

/// Opens `path` past the page cache where the platform has direct IO.
fn open(path: &Path, write: bool, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(!write).write(write).create(write).truncate(false);
    #[cfg(target_os = "linux")]
    if direct {
        use std::os::unix::fs::OpenOptionsExt;
        o.custom_flags(libc::O_DIRECT);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = direct;
    o.open(path)
}

/// One unit's file and which slot holds its state.
#[derive(Debug)]
struct UnitFile {
    len: usize,
    /// The slot holding the state (0 or 1); `None` before the first write.
    slot: Option<usize>,
    /// That slot's CRC-32C per block.
    sums: Vec<u32>,
}

/// One rank's NVMe store of `T` values (see the module docs). Shared by the step and its IO
/// threads: each unit's slot and checksums sit behind a lock of their own.
#[derive(Debug)]
pub(crate) struct Disk<T = f32> {
    rank: usize,
    dir: PathBuf,
    prefix: &'static str,
    units: Vec<Option<Mutex<UnitFile>>>,
    read_bytes: AtomicU64,
    written_bytes: AtomicU64,
    /// Whether IO still goes past the page cache (cleared by the file system's first refusal).
    direct: AtomicBool,
    word: PhantomData<fn() -> T>,
}

impl<T: Word> Disk<T> {
    /// A store in `root/rank{rank}`, in files named `{prefix}{u}.bin`, for units of `lens[u]`
    /// values (`None`: the unit has no offloaded state). The folder is made if missing; no file
    /// is written yet.
    pub(crate) fn create(
        root: &Path,
        rank: usize,
        prefix: &'static str,
        lens: &[Option<usize>],
    ) -> Result<Self> {
        let dir = root.join(format!("rank{rank}"));
        fs::create_dir_all(&dir).map_err(|e| Error::Offload {
            rank,
            unit: None,
            path: dir.display().to_string(),
            what: format!("cannot make the store's folder: {e}"),
        })?;
        let unit = |len: &Option<usize>| {
            len.map(|len| {
                Mutex::new(UnitFile {
                    len,
                    slot: None,
                    sums: Vec::new(),
                })
            })
        };
        Ok(Disk {
            rank,
            dir,
            prefix,
            units: lens.iter().map(unit).collect(),
            read_bytes: AtomicU64::new(0),
            written_bytes: AtomicU64::new(0),
            direct: AtomicBool::new(cfg!(target_os = "linux")),
            word: PhantomData,
        })
    }

    /// The rank it belongs to.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// Unit `u`'s file.
    pub(crate) fn path(&self, u: usize) -> PathBuf {
        self.dir.join(format!("{}{u}.bin", self.prefix))
    }

    /// Bytes read and written so far.
    pub(crate) fn traffic(&self) -> (u64, u64) {
        (
            self.read_bytes.load(Ordering::Relaxed),
            self.written_bytes.load(Ordering::Relaxed),
        )
    }

    /// Whether the store's IO has gone past the page cache (direct IO) so far.
    pub(crate) fn direct(&self) -> bool {
        self.direct.load(Ordering::Relaxed)
    }

    /// Runs `op` on unit `u`'s file, opened direct while the file system allows it; its first
    /// `EINVAL` for direct IO (at the open or the transfer) turns the store buffered for good.
    fn with_file(
        &self,
        u: usize,
        write: bool,
        mut op: impl FnMut(&File) -> io::Result<()>,
    ) -> io::Result<()> {
        let path = self.path(u);
        if self.direct() {
            let refused = |e: &io::Error| e.kind() == ErrorKind::InvalidInput;
            match open(&path, write, true).and_then(|f| op(&f)) {
                Err(e) if refused(&e) => self.direct.store(false, Ordering::Relaxed),
                done => return done,
            }
        }
        op(&open(&path, write, false)?)
    }

    fn error(&self, u: usize, what: String) -> Error {
        Error::Offload {
            rank: self.rank,
            unit: Some(u),
            path: self.path(u).display().to_string(),
            what,
        }
    }

    fn unit(&self, u: usize) -> Result<std::sync::MutexGuard<'_, UnitFile>> {
        let cell = self.units.get(u).and_then(Option::as_ref);
        let cell = cell.ok_or_else(|| self.error(u, "the unit has no offloaded state".into()))?;
        // A panic elsewhere while the lock was held cannot leave the slot half-adopted: the
        // slot and its sums are set together, after the write.
        Ok(cell.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Writes `values`, unit `u`'s whole state, to its free slot and adopts it.
    pub(crate) fn write(&self, u: usize, values: &[T]) -> Result<()> {
        let mut f = self.unit(u)?;
        if values.len() != f.len {
            let what = format!("{} values written, the unit holds {}", values.len(), f.len);
            return Err(self.error(u, what));
        }
        let bytes = slot_bytes(f.len, T::BYTES);
        let mut buf = Aligned::zeroed(bytes);
        for (dst, v) in buf.bytes_mut().chunks_exact_mut(T::BYTES).zip(values) {
            v.put(dst);
        }
        let slot = f.slot.map_or(0, |s| 1 - s);
        self.with_file(u, true, |file| {
            file.write_all_at(buf.bytes(), (slot * bytes) as u64)
        })
        .map_err(|e| self.error(u, format!("writing slot {slot}: {e}")))?;
        f.sums = buf
            .bytes()
            .chunks_exact(BLOCK)
            .map(crc32c::crc32c)
            .collect();
        f.slot = Some(slot);
        self.written_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Unit `u`'s whole state, every block checked against its checksum.
    pub(crate) fn read(&self, u: usize) -> Result<Vec<T>> {
        let f = self.unit(u)?;
        let Some(slot) = f.slot else {
            return Err(self.error(u, "read before the unit was first written".into()));
        };
        let bytes = slot_bytes(f.len, T::BYTES);
        let end = ((slot + 1) * bytes) as u64;
        let short = |len: u64| {
            let what =
                format!("slot {slot} ends at byte {end}, the file at {len} (it was truncated)");
            io::Error::new(ErrorKind::UnexpectedEof, what)
        };
        let mut buf = Aligned::zeroed(bytes);
        self.with_file(u, false, |file| {
            // Direct IO stops at the end of the file without an error: check the length first.
            let len = file.metadata()?.len();
            if len < end {
                return Err(short(len));
            }
            file.read_exact_at(buf.bytes_mut(), (slot * bytes) as u64)
        })
        .map_err(|e| match e.kind() {
            ErrorKind::UnexpectedEof => self.error(u, format!("short read: {e}")),
            _ => self.error(u, format!("reading slot {slot}: {e}")),
        })?;
        let buf = buf.bytes();
        for (b, (block, want)) in buf.chunks_exact(BLOCK).zip(&f.sums).enumerate() {
            if crc32c::crc32c(block) != *want {
                let at = slot * bytes + b * BLOCK;
                let what = format!(
                    "block {b} of slot {slot} (bytes {at}..{}) fails its CRC-32C check: the \
                     file changed under the run",
                    at + BLOCK
                );
                return Err(self.error(u, what));
            }
        }
        self.read_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(buf.chunks_exact(T::BYTES).take(f.len).map(T::get).collect())
    }
}

impl<T> Drop for Disk<T> {
    fn drop(&mut self) {
        // Scratch space: best effort, a failure leaves files for the user to remove. The folder
        // goes once the rank's other store has removed its files too.
        for u in 0..self.units.len() {
            let _ = fs::remove_file(self.dir.join(format!("{}{u}.bin", self.prefix)));
        }
        let _ = fs::remove_dir(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, k: f32) -> Vec<f32> {
        (0..len).map(|i| i as f32 * k - 3.5).collect()
    }

    fn disk(dir: &Path, lens: &[Option<usize>]) -> Disk {
        Disk::create(dir, 1, "unit", lens).expect("a store in a temporary folder")
    }

    #[test]
    fn values_come_back_bit_for_bit_from_either_slot() {
        let tmp = tempfile::tempdir().unwrap();
        let d = disk(tmp.path(), &[Some(1500), None, Some(1)]);
        for k in [0.25f32, -1.0, f32::MIN_POSITIVE] {
            d.write(0, &values(1500, k)).unwrap();
            d.write(2, &[k]).unwrap();
            let back = d.read(0).unwrap();
            assert!(
                back.iter()
                    .zip(values(1500, k))
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
            assert_eq!(d.read(2).unwrap(), [k]);
        }
        // Two slots of two blocks each (1500 f32 = 6000 bytes).
        assert_eq!(fs::metadata(d.path(0)).unwrap().len(), 4 * BLOCK as u64);
        assert_eq!(d.traffic(), (3 * (8192 + 4096), 3 * (8192 + 4096)));
        assert!(d.read(1).is_err(), "a unit without offloaded state");
        assert!(d.write(0, &[1.0]).is_err(), "the wrong length");
        drop(d);
        assert!(
            !tmp.path().join("rank1").exists(),
            "the store's folder is removed"
        );
    }

    #[test]
    fn sixteen_bit_words_share_the_folder_and_leave_with_their_store() {
        let tmp = tempfile::tempdir().unwrap();
        let f = disk(tmp.path(), &[Some(3000)]);
        let h = Disk::<u16>::create(tmp.path(), 1, "param", &[Some(3000)]).unwrap();
        let words: Vec<u16> = (0..3000).map(|i| (i as u16).wrapping_mul(40503)).collect();
        f.write(0, &values(3000, 1.0)).unwrap();
        h.write(0, &[7; 3000]).unwrap();
        h.write(0, &words).unwrap();
        assert_eq!(
            h.read(0).unwrap(),
            words,
            "every bit pattern, NaNs' included"
        );
        // Two slots of 6000 bytes rounded to two blocks each.
        assert_eq!(fs::metadata(h.path(0)).unwrap().len(), 4 * BLOCK as u64);
        assert!(h.path(0).ends_with("rank1/param0.bin"));
        drop(h);
        assert!(!tmp.path().join("rank1/param0.bin").exists());
        assert_eq!(
            f.read(0).unwrap(),
            values(3000, 1.0),
            "the other store's files stay"
        );
        drop(f);
        assert!(
            !tmp.path().join("rank1").exists(),
            "the empty folder is removed"
        );
    }

    #[test]
    fn io_is_direct_where_the_file_system_allows_it() {
        let tmp = tempfile::tempdir().unwrap();
        // The oracle: one aligned block written to a file opened with O_DIRECT, by hand.
        let probe = tmp.path().join("probe.bin");
        let block = Aligned::zeroed(BLOCK);
        let allowed = open(&probe, true, true).and_then(|f| f.write_all_at(block.bytes(), 0));
        let d = disk(tmp.path(), &[Some(3000)]);
        d.write(0, &values(3000, 1.0)).unwrap();
        assert_eq!(d.read(0).unwrap(), values(3000, 1.0));
        match allowed {
            Ok(()) => assert!(
                d.direct(),
                "the file system takes direct IO, the store did not"
            ),
            Err(e) => {
                assert!(
                    !d.direct(),
                    "direct IO was refused ({e}), the store says it is direct"
                );
                let why = format!("this file system refuses direct IO ({e}); IO ran buffered");
                zero_testkit::record_skip!("", &why);
            }
        }
    }

    #[test]
    fn a_flipped_byte_is_found_and_named() {
        let tmp = tempfile::tempdir().unwrap();
        let d = disk(tmp.path(), &[Some(3000)]);
        d.write(0, &values(3000, 1.0)).unwrap();
        let f = OpenOptions::new().write(true).open(d.path(0)).unwrap();
        f.write_all_at(&[0x5a], 5000).unwrap();
        let e = d.read(0).unwrap_err().to_string();
        assert!(
            e.contains("block 1 of slot 0") && e.contains("CRC-32C"),
            "{e}"
        );
        assert!(e.contains("unit0.bin") && e.contains("rank 1"), "{e}");
    }

    #[test]
    fn a_truncated_file_is_a_short_read() {
        let tmp = tempfile::tempdir().unwrap();
        let d = disk(tmp.path(), &[Some(3000)]);
        d.write(0, &values(3000, 1.0)).unwrap();
        d.write(0, &values(3000, 2.0)).unwrap();
        let f = OpenOptions::new().write(true).open(d.path(0)).unwrap();
        f.set_len(3 * BLOCK as u64 + 10).unwrap();
        let e = d.read(0).unwrap_err().to_string();
        assert!(e.contains("short read") && e.contains("slot 1"), "{e}");
    }

    #[test]
    fn a_full_disk_keeps_the_last_state_whole() {
        if !Path::new("/dev/full").exists() {
            zero_testkit::record_skip!("", "no /dev/full on this machine");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let d = disk(tmp.path(), &[Some(100)]);
        d.write(0, &values(100, 1.0)).unwrap();
        // The unit's file becomes the kernel's full device: every write fails with ENOSPC.
        let kept = tmp.path().join("kept.bin");
        fs::rename(d.path(0), &kept).unwrap();
        std::os::unix::fs::symlink("/dev/full", d.path(0)).unwrap();
        let e = d.write(0, &values(100, 2.0)).unwrap_err().to_string();
        assert!(
            e.contains("No space left on device") && e.contains("unit 0"),
            "{e}"
        );
        fs::remove_file(d.path(0)).unwrap();
        fs::rename(&kept, d.path(0)).unwrap();
        assert_eq!(
            d.read(0).unwrap(),
            values(100, 1.0),
            "the last state, whole"
        );
    }
}
