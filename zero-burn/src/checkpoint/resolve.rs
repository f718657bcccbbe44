//! Finding a committed checkpoint and its files: the commit record (`LATEST` or a tag's
//! `COMMIT`), the manifest checked against it, and each saved rank's file located and checked
//! against its manifest record. Shared by the load, the ranged reader, the export and `verify`.

use zero_core::CheckpointError;
use zero_core::checkpoint::{FileRecord, LatestPointer, Manifest};

use super::COMMIT;
use super::shard::{Expect, ShardFile};
use super::storage::{Storage, join};
use crate::error::{Error, Result};

fn read(store: &dyn Storage, path: &str) -> Result<Vec<u8>> {
    store
        .read(path)?
        .ok_or_else(|| CheckpointError::Missing { file: path.into() }.into())
}

/// A reshard map's error for a parameter the manifest's layout saves nowhere, as an error about
/// the manifest `mpath`.
pub(super) fn in_manifest(e: zero_core::Error, mpath: &str) -> Error {
    match e {
        zero_core::Error::Checkpoint(c) if matches!(*c, CheckpointError::NotSharded { .. }) => {
            CheckpointError::Layout {
                file: mpath.into(),
                what: c.to_string(),
            }
            .into()
        }
        other => other.into(),
    }
}

/// The checkpoint `tag` names in `store` (`None`: the one `LATEST` names) and its manifest,
/// checked against its commit record: `LATEST`, or the `COMMIT` file a save writes into the tag's
/// directory before committing it (so an older tag verifies as well as the latest).
/// `(tag, manifest, manifest path)`.
pub(super) fn resolve(
    store: &dyn Storage,
    tag: Option<&str>,
) -> Result<(String, Manifest, String)> {
    let ptr = match tag {
        None => LatestPointer::parse(&read(store, "LATEST")?, "LATEST")?,
        Some(tag) => commit_record(store, tag)?,
    };
    let mpath = join(&ptr.tag, "MANIFEST.json");
    let mbytes = read(store, &mpath)?;
    if mbytes.len() as u64 != ptr.manifest_bytes {
        return Err(CheckpointError::Size {
            file: mpath,
            expected: ptr.manifest_bytes,
            found: mbytes.len() as u64,
        }
        .into());
    }
    let crc = crc32c::crc32c(&mbytes);
    if crc != ptr.manifest_crc32c {
        return Err(CheckpointError::Checksum {
            file: mpath,
            block: 0,
            offset: 0,
            end: mbytes.len() as u64,
            expected: ptr.manifest_crc32c,
            found: crc,
        }
        .into());
    }
    let m = Manifest::from_json(&mbytes, &mpath)?;
    if m.tag != ptr.tag {
        return Err(CheckpointError::Foreign {
            file: mpath,
            field: "tag".into(),
            expected: ptr.tag,
            found: m.tag,
        }
        .into());
    }
    Ok((ptr.tag, m, mpath))
}

/// The commit record of `tag`: its `COMMIT` file, or `LATEST` where it names the tag (a save made
/// before tags carried their own record).
fn commit_record(store: &dyn Storage, tag: &str) -> Result<LatestPointer> {
    let path = join(tag, COMMIT);
    if let Some(bytes) = store.read(&path)? {
        let ptr = LatestPointer::parse(&bytes, &path)?;
        if ptr.tag != tag {
            return Err(CheckpointError::Foreign {
                file: path,
                field: "tag".into(),
                expected: tag.into(),
                found: ptr.tag,
            }
            .into());
        }
        return Ok(ptr);
    }
    if let Some(bytes) = store.read("LATEST")?
        && let Ok(ptr) = LatestPointer::parse(&bytes, "LATEST")
        && ptr.tag == tag
    {
        return Ok(ptr);
    }
    // No record: not a committed checkpoint (absent, or a crashed save's leftovers).
    Err(CheckpointError::Missing { file: path }.into())
}

/// Reads saved rank `k`'s file and verifies it whole against the manifest (existence, exact
/// size, every block's crc32c, its header's save, plan, rank and world).
pub(super) fn open_file(
    store: &dyn Storage,
    tag: &str,
    m: &Manifest,
    mpath: &str,
    k: usize,
) -> Result<ShardFile> {
    let (path, rec) = locate_file(store, tag, m, mpath, k)?;
    let bytes = read(store, &path)?;
    ShardFile::verify(path, bytes, rec, &expect_of(m, k))
}

/// What saved rank `k`'s file of `m` must carry in its header.
pub(super) fn expect_of(m: &Manifest, k: usize) -> Expect<'_> {
    Expect {
        save_id: &m.save_id,
        fingerprint: &m.plan_fingerprint,
        rank: k,
        world_size: m.layout.world_size,
    }
}

/// Saved rank `k`'s file of `tag`: its path and manifest record, after checking that the record
/// names it and that the file exists with the recorded size.
pub(super) fn locate_file<'m>(
    store: &dyn Storage,
    tag: &str,
    m: &'m Manifest,
    mpath: &str,
    k: usize,
) -> Result<(String, &'m FileRecord)> {
    let sn = m.layout.world_size;
    let rec = m.files.get(k).ok_or_else(|| CheckpointError::Layout {
        file: mpath.into(),
        what: format!("no file record for rank {k}"),
    })?;
    let path = join(tag, &Manifest::rank_file(k, sn));
    if rec.path != Manifest::rank_file(k, sn) {
        return Err(CheckpointError::Layout {
            file: mpath.into(),
            what: format!("rank {k}'s file is recorded as {}", rec.path),
        }
        .into());
    }
    let size = store
        .size(&path)?
        .ok_or_else(|| CheckpointError::Missing { file: path.clone() })?;
    if size != rec.bytes {
        return Err(CheckpointError::Size {
            file: path,
            expected: rec.bytes,
            found: size,
        }
        .into());
    }
    Ok((path, rec))
}
