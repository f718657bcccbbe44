//! A rank file read in pieces: its header once, then any range of a tensor, each read together
//! with the checksum blocks that cover it and verified before a byte is used. The export streams
//! through it, so it never holds more than a header, a tensor and two blocks per piece; a load
//! reads the other ranks' files (and all files on a reshard) through [`Ranged`].

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

/// A wanted tensor range: the tensor's name, its exact length in elements, the element range.
pub(crate) type Want = (String, u64, Range<usize>);

/// A saved rank file as a load reads it, by checksum blocks, each verified before anything is
/// restored. The bytes of the ranges to `hold` (the rank's new shard: its chunk of the weights
/// and of the optimizer state) are cut from their verified blocks and kept, and nothing else of
/// the blocks. The blocks of the ranges to `stream` (the other chunks of the weights a rank holds
/// whole: every unit at stages 0–2, stage 3's persistent ones, the frozen parameters) are read
/// and verified one block at a time and let go, then read and verified again as they are
/// restored, through one [`Reread`] cache for all files. So a load holds its shard, not the
/// whole weights, and reads the streamed parts twice.
pub(crate) struct Ranged {
    index: RankIndex,
    /// Verified bytes held to the restore, by their first byte in the file; disjoint, apart.
    held: BTreeMap<u64, Vec<u8>>,
}

impl Ranged {
    /// Reads the blocks of `index`'s file that `hold` lies in, keeping the bytes of `hold`, and
    /// verifies those that only `stream` lies in, keeping none; checks that every tensor exists
    /// with its length first.
    pub(crate) fn read(
        store: &dyn Storage,
        index: RankIndex,
        hold: &[Want],
        stream: &[Want],
    ) -> Result<Ranged> {
        let (rec, file) = (&index.rec, index.table.file());
        let block = rec.block_size.max(1);
        let mut held = BTreeMap::new();
        let mut verified = std::collections::BTreeSet::new();
        for want in merged(byte_ranges(&index, hold)?) {
            verified.extend(want.start / block..=(want.end - 1) / block);
            held.insert(want.start, read_verified(store, file, rec, want.clone())?);
        }
        for at in byte_ranges(&index, stream)? {
            for b in at.start / block..=(at.end - 1) / block {
                if verified.insert(b) {
                    read_blocks(store, file, rec, span(rec, b, b))?;
                }
            }
        }
        Ok(Ranged { index, held })
    }

    /// Checks that tensor `name` holds exactly `len` elements and has elements `range`.
    pub(crate) fn check(&self, name: &str, len: u64, range: Range<usize>) -> Result<()> {
        self.index.table.check(name, len, range)
    }

    /// Decodes elements `range` of tensor `name` (exactly `len` elements) into `dst`: from the
    /// held bytes when they cover it, else from `cache`'s last blocks when they do, else from
    /// the blocks it lies in, read and verified again (a file changed since [`Self::read`] fails
    /// here, naming it) and kept in `cache` for the next read.
    pub(crate) fn read_into(
        &self,
        store: &dyn Storage,
        cache: &Reread,
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
        if let Some((&s, b)) = self.held.range(..=at.start).next_back()
            && at.end <= s + b.len() as u64
        {
            decode_f32(&b[(at.start - s) as usize..(at.end - s) as usize], dst);
            return Ok(());
        }
        let (rec, file) = (&self.index.rec, self.index.table.file());
        let mut last = cache.0.borrow_mut();
        let hit = last
            .as_ref()
            .is_some_and(|(f, s, b)| f == file && *s <= at.start && at.end <= *s + b.len() as u64);
        if !hit {
            // Let the old blocks go before reading the new ones.
            *last = None;
            let blocks = covering(rec, &at);
            let from = blocks.start;
            *last = Some((
                file.to_owned(),
                from,
                read_blocks(store, file, rec, blocks)?,
            ));
        }
        if let Some((_, s, b)) = last.as_ref() {
            decode_f32(&b[(at.start - s) as usize..(at.end - s) as usize], dst);
        }
        Ok(())
    }
}

/// The blocks last read again by [`Ranged::read_into`], of whichever file: its name, their
/// first byte and their bytes. One for the whole load, so it holds one read's blocks at a time.
#[derive(Default)]
pub(crate) struct Reread(RefCell<Option<(String, u64, Vec<u8>)>>);

/// The non-empty byte ranges of `index`'s file that `wanted` lies in; every tensor checked to
/// exist with its length first.
fn byte_ranges(index: &RankIndex, wanted: &[Want]) -> Result<Vec<Range<u64>>> {
    let mut out = Vec::with_capacity(wanted.len());
    for (name, len, range) in wanted {
        if let Some(at) = index.table.locate(name, *len, range, range.len())?
            && !at.is_empty()
        {
            out.push(at);
        }
    }
    Ok(out)
}

/// `ranges` sorted, with those that overlap or touch joined.
fn merged(mut ranges: Vec<Range<u64>>) -> Vec<Range<u64>> {
    ranges.sort_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
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
    // Cut in place: never the blocks and the range both.
    let mut bytes = read_blocks(store, path, rec, blocks)?;
    bytes.truncate((range.end - from) as usize);
    bytes.drain(..(range.start - from) as usize);
    bytes.shrink_to_fit();
    Ok(bytes)
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
