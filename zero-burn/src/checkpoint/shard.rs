//! One rank file: encoding (header, f32 tensors, block checksums) and verified decoding.

use std::collections::HashMap;

use zero_core::CheckpointError;
use zero_core::checkpoint::{FORMAT_VERSION, FileRecord, Saved, ShardHeader};

use crate::error::Result;

/// Bytes per checksum block.
pub(crate) const BLOCK: u64 = 1 << 20;

/// The per-block crc32c of a byte stream fed in pieces: what [`block_crcs`] gives for the
/// concatenation.
pub(crate) struct BlockSums {
    block: u64,
    crcs: Vec<u32>,
    cur: u32,
    filled: u64,
    /// Bytes fed so far.
    pub(crate) total: u64,
}

impl BlockSums {
    pub(crate) fn new(block: u64) -> Self {
        BlockSums {
            block: block.max(1),
            crcs: Vec::new(),
            cur: 0,
            filled: 0,
            total: 0,
        }
    }

    /// Feeds the next bytes of the stream.
    pub(crate) fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let room = (self.block - self.filled) as usize;
            let (now, rest) = bytes.split_at(room.min(bytes.len()));
            self.cur = crc32c::crc32c_append(self.cur, now);
            self.filled += now.len() as u64;
            self.total += now.len() as u64;
            if self.filled == self.block {
                self.crcs.push(self.cur);
                (self.cur, self.filled) = (0, 0);
            }
            bytes = rest;
        }
    }

    /// The crc32c of every block (the last may be shorter).
    pub(crate) fn finish(mut self) -> Vec<u32> {
        if self.filled > 0 {
            self.crcs.push(self.cur);
        }
        self.crcs
    }
}

/// What a verified rank file must carry.
pub(crate) struct Expect<'a> {
    pub(crate) save_id: &'a str,
    pub(crate) fingerprint: &'a str,
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
}

/// The first header field of `h` that differs from `expect`: `(field, expected, found)`.
pub(crate) fn identity(
    h: &ShardHeader,
    expect: &Expect<'_>,
) -> Option<(&'static str, String, String)> {
    let checks = [
        (
            "format_version",
            FORMAT_VERSION.to_string(),
            h.format_version.to_string(),
        ),
        ("save_id", expect.save_id.to_string(), h.save_id.clone()),
        (
            "plan_fingerprint",
            expect.fingerprint.to_string(),
            h.plan_fingerprint.clone(),
        ),
        ("rank", expect.rank.to_string(), h.rank.to_string()),
        (
            "world_size",
            expect.world_size.to_string(),
            h.world_size.to_string(),
        ),
    ];
    checks.into_iter().find(|(_, a, b)| a != b)
}

/// The error for a file whose header names another save, rank, world or plan.
pub(crate) fn foreign(
    file: String,
    (field, expected, found): (&str, String, String),
) -> CheckpointError {
    CheckpointError::Foreign {
        file,
        field: field.into(),
        expected,
        found,
    }
}

/// Where a rank file's tensors are: its header's table, each tensor checked to lie inside the
/// file. Shared by the whole-file reader ([`ShardFile`]) and the ranged one (`ranged.rs`).
pub(crate) struct TensorTable {
    file: String,
    /// Byte offset of the data section.
    data: u64,
    /// Tensor name → (byte offset in the data section, elements).
    tensors: HashMap<String, (u64, u64)>,
}

impl TensorTable {
    /// The table of header `h` of `file`, whose data section starts at `data` and whose size is
    /// `file_bytes`.
    pub(crate) fn new(file: String, h: &ShardHeader, data: u64, file_bytes: u64) -> Result<Self> {
        let room = file_bytes.saturating_sub(data);
        let mut tensors = HashMap::new();
        for t in &h.tensors {
            let end = t.len.checked_mul(4).and_then(|b| b.checked_add(t.offset));
            if end.is_none_or(|e| e > room) {
                return Err(CheckpointError::Layout {
                    file,
                    what: format!(
                        "tensor {} ({} elements at {}) exceeds the file",
                        t.name, t.len, t.offset
                    ),
                }
                .into());
            }
            tensors.insert(t.name.clone(), (t.offset, t.len));
        }
        Ok(TensorTable {
            file,
            data,
            tensors,
        })
    }

    /// The file's name (for errors).
    pub(crate) fn file(&self) -> &str {
        &self.file
    }

    /// Checks that tensor `name` holds exactly `len` elements and has elements `range`.
    pub(crate) fn check(&self, name: &str, len: u64, range: std::ops::Range<usize>) -> Result<()> {
        let n = range.len();
        self.locate(name, len, &range, n).map(|_| ())
    }

    /// The file's byte range of elements `range` of tensor `name` (`None`: an absent tensor of
    /// no elements, which a save omits), after checking that it holds exactly `len` elements and
    /// that `range` fits `dst_len` slots.
    pub(crate) fn locate(
        &self,
        name: &str,
        len: u64,
        range: &std::ops::Range<usize>,
        dst_len: usize,
    ) -> Result<Option<std::ops::Range<u64>>> {
        let layout = |what: String| {
            Err(CheckpointError::Layout {
                file: self.file.clone(),
                what,
            }
            .into())
        };
        if dst_len != range.len() {
            return layout(format!(
                "elements {range:?} of tensor {name} do not fit {dst_len} slots"
            ));
        }
        let Some(&(offset, n)) = self.tensors.get(name) else {
            if len == 0 && range.is_empty() {
                return Ok(None);
            }
            return layout(format!("tensor {name} is missing"));
        };
        if n != len {
            return layout(format!("tensor {name} has {n} elements, expected {len}"));
        }
        if range.start > range.end || range.end as u64 > n {
            return layout(format!(
                "elements {range:?} of tensor {name} ({n} elements) are out of range"
            ));
        }
        let start = self.data + offset + 4 * range.start as u64;
        Ok(Some(start..start + 4 * range.len() as u64))
    }
}

/// Checks that a file record lists one checksum per block.
pub(crate) fn check_block_count(file: &str, rec: &FileRecord) -> Result<()> {
    let block = rec.block_size.max(1);
    if rec.block_crc32c.len() as u64 == rec.bytes.div_ceil(block) {
        return Ok(());
    }
    Err(CheckpointError::Layout {
        file: file.into(),
        what: format!(
            "the manifest lists {} block checksums for {} bytes in blocks of {block}",
            rec.block_crc32c.len(),
            rec.bytes
        ),
    }
    .into())
}

/// Decodes little-endian f32s from `src` into `dst`.
pub(crate) fn decode_f32(src: &[u8], dst: &mut [f32]) {
    for (d, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// A rank file whose every byte has been checked against its record.
pub(crate) struct ShardFile {
    bytes: Vec<u8>,
    table: TensorTable,
}

impl ShardFile {
    /// Checks `bytes` (read from `file`) against its manifest record (exact size, every block's
    /// crc32c) and its header against `expect`, before anything is used.
    pub(crate) fn verify(
        file: String,
        bytes: Vec<u8>,
        rec: &FileRecord,
        expect: &Expect<'_>,
    ) -> Result<ShardFile> {
        if bytes.len() as u64 != rec.bytes {
            return Err(CheckpointError::Size {
                file,
                expected: rec.bytes,
                found: bytes.len() as u64,
            }
            .into());
        }
        check_block_count(&file, rec)?;
        let block = rec.block_size.max(1);
        let identity = |h: &ShardHeader| identity(h, expect);
        for (i, (chunk, &want)) in bytes
            .chunks(block as usize)
            .zip(&rec.block_crc32c)
            .enumerate()
        {
            let got = crc32c::crc32c(chunk);
            if got != want {
                // A readable header of another save or rank says more than a bad checksum.
                if let Ok((h, _)) = ShardHeader::decode(&bytes, &file)
                    && let Some(d) = identity(&h)
                {
                    return Err(foreign(file, d).into());
                }
                let offset = i as u64 * block;
                return Err(CheckpointError::Checksum {
                    file,
                    block: i as u64,
                    offset,
                    end: offset + chunk.len() as u64,
                    expected: want,
                    found: got,
                }
                .into());
            }
        }
        let (h, data) = ShardHeader::decode(&bytes, &file)?;
        if let Some(d) = identity(&h) {
            return Err(foreign(file, d).into());
        }
        let table = TensorTable::new(file, &h, data as u64, bytes.len() as u64)?;
        Ok(ShardFile { bytes, table })
    }

    /// Checks that tensor `name` holds exactly `len` elements and has elements `range`.
    pub(crate) fn check(&self, name: &str, len: u64, range: std::ops::Range<usize>) -> Result<()> {
        self.table.check(name, len, range)
    }

    /// Decodes elements `range` of tensor `name`, which must hold exactly `len` elements, into
    /// `dst` (of the range's length), straight from the file's bytes.
    pub(crate) fn read_into(
        &self,
        name: &str,
        len: u64,
        range: std::ops::Range<usize>,
        dst: &mut [f32],
    ) -> Result<()> {
        if let Some(at) = self.table.locate(name, len, &range, dst.len())? {
            decode_f32(&self.bytes[at.start as usize..at.end as usize], dst);
        }
        Ok(())
    }
}

/// The name of tensor `t`'s state `state` in a rank file: `w/u00003` for the rank's chunk of
/// unit 3, `w/p00012` for parameter 12 held whole (loose).
pub(crate) fn name(state: &str, t: Saved) -> String {
    match t {
        Saved::Unit(u) => format!("{state}/u{u:05}"),
        Saved::Loose(p) => format!("{state}/p{p:05}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// crc32c of every `block`-byte block of `bytes` (the last may be shorter).
    fn block_crcs(bytes: &[u8], block: u64) -> Vec<u32> {
        bytes.chunks(block as usize).map(crc32c::crc32c).collect()
    }

    #[test]
    fn block_sums_fed_in_pieces_equal_the_whole_streams() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        for block in [1u64, 7, 64, 4096, 20_000] {
            for cut in [1usize, 3, 100, 4095, 9_999] {
                let mut s = BlockSums::new(block);
                for piece in bytes.chunks(cut) {
                    s.feed(piece);
                }
                assert_eq!(s.total, bytes.len() as u64);
                assert_eq!(
                    s.finish(),
                    block_crcs(&bytes, block),
                    "block {block}, cut {cut}"
                );
            }
        }
        assert!(BlockSums::new(8).finish().is_empty());
    }
}
