//! A rank file read in pieces: its header once, then any range of a tensor, each read together
//! with the checksum blocks that cover it and verified before a byte is used. The export streams
//! through it, so it never holds more than a header, a tensor and two blocks per piece.

use std::ops::Range;

use zero_core::CheckpointError;
use zero_core::checkpoint::{FileRecord, Manifest, ShardHeader};

use super::load::{expect_of, locate_file};
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
        let head = read_verified(store, &path, rec, 0..16.min(rec.bytes))?;
        let len = head
            .get(8..16)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u64::from_le_bytes);
        let end = len
            .checked_add(16)
            .filter(|&e| e <= rec.bytes)
            .unwrap_or(rec.bytes);
        let bytes = match read_verified(store, &path, rec, 0..end) {
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
    let block = rec.block_size.max(1);
    let (b0, b1) = (range.start / block, (range.end - 1) / block);
    let from = b0 * block;
    let to = ((b1 + 1) * block).min(rec.bytes);
    let bytes = store
        .read_range(path, from, to - from)?
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
    let (a, z) = ((range.start - from) as usize, (range.end - from) as usize);
    Ok(bytes[a..z].to_vec())
}
