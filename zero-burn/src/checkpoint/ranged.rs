//! A rank file read in pieces: its header once, then any range of a tensor, each read together
//! with the checksum blocks that cover it and verified before a byte is used. The export streams
//! through it, so it never holds more than a header, a tensor and two blocks per piece; a
//! resharding load reads through [`Pieces`], every block it needs once, verified up front.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ops::Range;

use zero_core::CheckpointError;
use zero_core::checkpoint::{FileRecord, Manifest, ShardHeader};

use super::resolve::{expect_of, locate_file};
use super::shard::{TensorTable, check_block_count, decode_f32, foreign, identity};
use super::storage::Storage;
use crate::error::Result;

/// Saved rank `k`'s file: where its tensors are, its header verified.
pub(crate) struct RankIndex {
    rec: FileRecord,
    table: TensorTable,
}

impl RankIndex {
    /// Reads and verifies the header of saved rank `k`'s file of `tag` (the record, the exact
    /// size, the crc32c of every block the header spans, and its save, plan, rank and world).
    pub(crate) fn open(
        store: &dyn Storage,
        tag: &str,
        m: &Manifest,
        mpath: &str,
        k: usize,
    ) -> Result<RankIndex> {
        let (path, rec) = locate_file(store, tag, m, mpath, k)?;
        check_block_count(&path, rec)?;
        // The first block holds the header's length, and usually the whole header.
        let first = read_verified(store, &path, rec, 0..rec.block_size.max(16).min(rec.bytes))?;
        let len = first
            .get(8..16)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u64::from_le_bytes);
        let end = len
            .checked_add(16)
            .filter(|&e| e <= rec.bytes)
            .unwrap_or(rec.bytes);
        let whole = if end <= first.len() as u64 {
            Ok(first[..end as usize].to_vec())
        } else {
            read_verified(store, &path, rec, 0..end)
        };
        let bytes = match whole {
            Ok(b) => b,
            Err(e) => {
                // A readable header of another save or rank says more than a bad checksum.
                if let Ok(Some(raw)) = store.read_range(&path, 0, end)
                    && let Ok((h, _)) = ShardHeader::decode(&raw, &path)
                    && let Some(d) = identity(&h, &expect_of(m, k))
                {
                    return Err(foreign(path, d).into());
                }
                return Err(e);
            }
        };
        let (h, data) = ShardHeader::decode(&bytes, &path)?;
        if let Some(d) = identity(&h, &expect_of(m, k)) {
            return Err(foreign(path, d).into());
        }
        Ok(RankIndex {
            table: TensorTable::new(path, &h, data as u64, rec.bytes)?,
            rec: rec.clone(),
        })
    }

    /// Decodes elements `range` of tensor `name`, which must hold exactly `len` elements, into
    /// `dst`, reading and verifying only the blocks they lie in.
    pub(crate) fn read_into(
        &self,
        store: &dyn Storage,
        name: &str,
        len: u64,
        range: Range<usize>,
        dst: &mut [f32],
    ) -> Result<()> {
        if let Some(at) = self.table.locate(name, len, &range, dst.len())? {
            let bytes = read_verified(store, self.table.file(), &self.rec, at)?;
            decode_f32(&bytes, dst);
        }
        Ok(())
    }
}

/// The parts of saved rank file that a resharding load needs: every checksum block that one of
/// the wanted tensor ranges lies in, read once (contiguous blocks in one read) and verified
/// before anything is restored. A rank that needs a quarter of a file reads about a quarter.
pub(crate) struct Pieces {
    index: RankIndex,
    /// Verified blocks by number.
    blocks: BTreeMap<u64, Vec<u8>>,
}

impl Pieces {
    /// Reads the blocks of `index`'s file that `wanted` (tensor name, its exact length, the
    /// element range) lies in; checks that every tensor exists with its length first.
    pub(crate) fn read(
        store: &dyn Storage,
        index: RankIndex,
        wanted: &[(String, u64, Range<usize>)],
    ) -> Result<Pieces> {
        let block = index.rec.block_size.max(1);
        let need = needed_blocks(&index, wanted)?;
        let mut blocks = BTreeMap::new();
        for run in need.chunk_by(|a, b| a + 1 == *b) {
            let b0 = run[0];
            let bytes = span(&index.rec, b0, run[run.len() - 1]);
            let bytes = read_blocks(store, index.table.file(), &index.rec, bytes)?;
            for (i, chunk) in bytes.chunks(block as usize).enumerate() {
                blocks.insert(b0 + i as u64, chunk.to_vec());
            }
        }
        Ok(Pieces { index, blocks })
    }

    /// Checks that tensor `name` holds exactly `len` elements and has elements `range`.
    pub(crate) fn check(&self, name: &str, len: u64, range: Range<usize>) -> Result<()> {
        self.index.table.check(name, len, range)
    }

    /// Decodes elements `range` of tensor `name` (exactly `len` elements) into `dst` from the
    /// verified blocks.
    pub(crate) fn read_into(
        &self,
        name: &str,
        len: u64,
        range: Range<usize>,
        dst: &mut [f32],
    ) -> Result<()> {
        let Some(at) = self.index.table.locate(name, len, &range, dst.len())? else {
            return Ok(());
        };
        let block = self.index.rec.block_size.max(1);
        let mut bytes = Vec::with_capacity((at.end - at.start) as usize);
        let mut pos = at.start;
        while pos < at.end {
            let b = pos / block;
            let data = self.blocks.get(&b).ok_or_else(|| {
                crate::Error::Internal(format!(
                    "{}: block {b} was not read for tensor {name}",
                    self.index.table.file()
                ))
            })?;
            let off = (pos - b * block) as usize;
            let take = ((at.end - pos) as usize).min(data.len() - off);
            bytes.extend_from_slice(&data[off..off + take]);
            pos += take as u64;
        }
        decode_f32(&bytes, dst);
        Ok(())
    }
}

/// The checksum blocks of `index`'s file that `wanted` (tensor name, its exact length, the
/// element range) lies in, in order; every tensor checked to exist with its length first.
fn needed_blocks(index: &RankIndex, wanted: &[(String, u64, Range<usize>)]) -> Result<Vec<u64>> {
    let block = index.rec.block_size.max(1);
    let mut need = std::collections::BTreeSet::new();
    for (name, len, range) in wanted {
        if let Some(at) = index.table.locate(name, *len, range, range.len())?
            && !at.is_empty()
        {
            need.extend(at.start / block..=(at.end - 1) / block);
        }
    }
    Ok(need.into_iter().collect())
}

/// A saved rank file whose needed blocks were verified and let go ([`Streamed::verify`]): each
/// read reads the blocks it lies in again and verifies them again, keeping the last blocks read
/// for the next read. A load on the same plan at stages 0–2 reads the other ranks' files so, as
/// it restores the whole weights: it holds a few blocks of them at a time, not all of them, and
/// reads those parts twice.
pub(crate) struct Streamed {
    index: RankIndex,
    /// The last blocks read: their first byte and their bytes.
    last: RefCell<Option<(u64, Vec<u8>)>>,
}

impl Streamed {
    /// Reads and verifies, one block at a time, every block of `index`'s file that `wanted`
    /// lies in, holding none of them.
    pub(crate) fn verify(
        store: &dyn Storage,
        index: RankIndex,
        wanted: &[(String, u64, Range<usize>)],
    ) -> Result<Streamed> {
        for b in needed_blocks(&index, wanted)? {
            read_blocks(
                store,
                index.table.file(),
                &index.rec,
                span(&index.rec, b, b),
            )?;
        }
        Ok(Streamed {
            index,
            last: RefCell::new(None),
        })
    }

    /// Checks that tensor `name` holds exactly `len` elements and has elements `range`.
    pub(crate) fn check(&self, name: &str, len: u64, range: Range<usize>) -> Result<()> {
        self.index.table.check(name, len, range)
    }

    /// Decodes elements `range` of tensor `name` (exactly `len` elements) into `dst`, from the
    /// last blocks read when they hold them, else from the blocks they lie in, read and verified
    /// again (a file changed since [`Self::verify`] fails here, naming it).
    pub(crate) fn read_into(
        &self,
        store: &dyn Storage,
        name: &str,
        len: u64,
        range: Range<usize>,
        dst: &mut [f32],
    ) -> Result<()> {
        let Some(at) = self.index.table.locate(name, len, &range, dst.len())? else {
            return Ok(());
        };
        if at.is_empty() {
            return Ok(());
        }
        let mut last = self.last.borrow_mut();
        let held = |l: &Option<(u64, Vec<u8>)>| {
            l.as_ref()
                .is_some_and(|(s, b)| *s <= at.start && at.end <= *s + b.len() as u64)
        };
        if !held(&last) {
            let rec = &self.index.rec;
            let blocks = covering(rec, &at);
            let from = blocks.start;
            *last = Some((
                from,
                read_blocks(store, self.index.table.file(), rec, blocks)?,
            ));
        }
        if let Some((s, b)) = last.as_ref() {
            decode_f32(&b[(at.start - s) as usize..(at.end - s) as usize], dst);
        }
        Ok(())
    }
}

/// Bytes `range` of `path`, read with the whole checksum blocks that cover them, each block
/// checked against `rec` first.
fn read_verified(
    store: &dyn Storage,
    path: &str,
    rec: &FileRecord,
    range: Range<u64>,
) -> Result<Vec<u8>> {
    if range.is_empty() {
        return Ok(Vec::new());
    }
    let blocks = covering(rec, &range);
    let from = blocks.start;
    let bytes = read_blocks(store, path, rec, blocks)?;
    let (a, z) = ((range.start - from) as usize, (range.end - from) as usize);
    Ok(bytes[a..z].to_vec())
}

/// The bytes of checksum blocks `first..=last` of `rec`'s file (the last block may be shorter).
fn span(rec: &FileRecord, first: u64, last: u64) -> Range<u64> {
    let block = rec.block_size.max(1);
    first * block..((last + 1) * block).min(rec.bytes)
}

/// The bytes of the checksum blocks that non-empty byte range `bytes` lies in.
fn covering(rec: &FileRecord, bytes: &Range<u64>) -> Range<u64> {
    let block = rec.block_size.max(1);
    span(rec, bytes.start / block, (bytes.end - 1) / block)
}

/// Bytes `range` of `path`, which starts on a block boundary and ends on one (or at the end of
/// the file), each block checked against its crc32c in `rec`.
fn read_blocks(
    store: &dyn Storage,
    path: &str,
    rec: &FileRecord,
    range: Range<u64>,
) -> Result<Vec<u8>> {
    let block = rec.block_size.max(1);
    let b0 = range.start / block;
    let bytes = store
        .read_range(path, range.start, range.end - range.start)?
        .ok_or_else(|| CheckpointError::Missing { file: path.into() })?;
    for (i, chunk) in bytes.chunks(block as usize).enumerate() {
        let b = b0 + i as u64;
        let want = rec.block_crc32c.get(b as usize).copied().unwrap_or(0);
        let got = crc32c::crc32c(chunk);
        if got != want {
            let offset = b * block;
            return Err(CheckpointError::Checksum {
                file: path.into(),
                block: b,
                offset,
                end: offset + chunk.len() as u64,
                expected: want,
                found: got,
            }
            .into());
        }
    }
    Ok(bytes)
}
