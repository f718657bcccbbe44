//! The storage seam: a few primitive operations on paths relative to a checkpoint root, the
//! POSIX directory implementation, and the crash-safe `put` built on them.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Where checkpoints live. Paths are relative to the store's root, `/`-separated; `""` is the
/// root itself. Implementations must make [`Storage::rename`] atomic for the commit protocol
/// (POSIX rename within one file system); durability comes only from the `sync_*` calls.
pub trait Storage: Send + Sync + std::fmt::Debug {
    /// Creates (or truncates) the file `path` and writes `bytes` to it.
    fn write(&self, path: &str, bytes: &[u8]) -> Result<()>;
    /// Makes `path`'s content durable (`fsync`).
    fn sync_file(&self, path: &str) -> Result<()>;
    /// Atomically renames a file or directory (replacing a file `to`).
    fn rename(&self, from: &str, to: &str) -> Result<()>;
    /// Makes `dir`'s entries durable (`fsync` of the directory).
    fn sync_dir(&self, dir: &str) -> Result<()>;
    /// Creates `dir` and its parents (no error if it exists).
    fn create_dir(&self, dir: &str) -> Result<()>;
    /// The whole content of `path`; `Ok(None)` when it does not exist.
    fn read(&self, path: &str) -> Result<Option<Vec<u8>>>;
    /// The size of `path` in bytes; `Ok(None)` when it does not exist.
    fn size(&self, path: &str) -> Result<Option<u64>>;
    /// Whether `path` (a file or a directory) exists.
    fn exists(&self, path: &str) -> Result<bool>;
    /// The names in directory `dir`, sorted (empty when it does not exist).
    fn list(&self, dir: &str) -> Result<Vec<String>>;

    /// Bytes `offset..offset + len` of `path`; `Ok(None)` when it does not exist, an error when
    /// it is shorter. The default reads the whole file; a store that can seek reads only those.
    fn read_range(&self, path: &str, offset: u64, len: u64) -> Result<Option<Vec<u8>>> {
        let Some(bytes) = self.read(path)? else {
            return Ok(None);
        };
        let end = offset.checked_add(len).filter(|&e| e <= bytes.len() as u64);
        match end {
            Some(end) => Ok(Some(bytes[offset as usize..end as usize].to_vec())),
            None => Err(short(path, offset, len)),
        }
    }

    /// Appends `bytes` to the file `path` (which [`Storage::write`] created). The default
    /// rewrites the whole file; a store that can append writes only `bytes`.
    fn append(&self, path: &str, bytes: &[u8]) -> Result<()> {
        let mut all = self.read(path)?.unwrap_or_default();
        all.extend_from_slice(bytes);
        self.write(path, &all)
    }
}

/// The error for a ranged read past the end of `path`.
fn short(path: &str, offset: u64, len: u64) -> Error {
    Error::Storage {
        op: "read",
        path: path.into(),
        source: io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "bytes {offset}..{} are past the end of the file",
                offset + len
            ),
        ),
    }
}

/// Joins a directory and a name (`""` is the root).
pub fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

/// The crash-safe write of one file (Pillai et al.'s recipe): write `dir/name.tmp`, fsync it,
/// rename it to `dir/name`, fsync `dir`. A reader sees the old file or the complete new one.
pub fn put(store: &dyn Storage, dir: &str, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = join(dir, &format!("{name}.tmp"));
    store.write(&tmp, bytes)?;
    store.sync_file(&tmp)?;
    store.rename(&tmp, &join(dir, name))?;
    store.sync_dir(dir)
}

/// A checkpoint root on a POSIX file system.
#[derive(Clone, Debug)]
pub struct DirStorage {
    root: PathBuf,
}

impl DirStorage {
    /// A store rooted at `root` (created if missing).
    pub fn new(root: impl Into<PathBuf>) -> Result<Self> {
        let root = root.into();
        fs::create_dir_all(&root).map_err(|e| io_err("create_dir", &root, e))?;
        Ok(DirStorage { root })
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn path(&self, p: &str) -> Result<PathBuf> {
        if p.split('/').any(|c| c == ".." || c.starts_with('/')) || p.starts_with('/') {
            return Err(Error::Storage {
                op: "resolve",
                path: p.into(),
                source: io::Error::new(io::ErrorKind::InvalidInput, "path leaves the root"),
            });
        }
        Ok(if p.is_empty() {
            self.root.clone()
        } else {
            self.root.join(p)
        })
    }
}

fn io_err(op: &'static str, path: &Path, source: io::Error) -> Error {
    Error::Storage {
        op,
        path: path.display().to_string(),
        source,
    }
}

impl Storage for DirStorage {
    fn write(&self, path: &str, bytes: &[u8]) -> Result<()> {
        let p = self.path(path)?;
        let mut f = fs::File::create(&p).map_err(|e| io_err("create", &p, e))?;
        f.write_all(bytes).map_err(|e| io_err("write", &p, e))
    }

    fn sync_file(&self, path: &str) -> Result<()> {
        let p = self.path(path)?;
        let f = fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .map_err(|e| io_err("open", &p, e))?;
        // An fsync error is fatal for the save: never retried (Linux may drop the pages).
        f.sync_all().map_err(|e| io_err("fsync", &p, e))
    }

    fn rename(&self, from: &str, to: &str) -> Result<()> {
        let (a, b) = (self.path(from)?, self.path(to)?);
        fs::rename(&a, &b).map_err(|e| io_err("rename", &a, e))
    }

    fn sync_dir(&self, dir: &str) -> Result<()> {
        let p = self.path(dir)?;
        let f = fs::File::open(&p).map_err(|e| io_err("open", &p, e))?;
        f.sync_all().map_err(|e| io_err("fsync", &p, e))
    }

    fn create_dir(&self, dir: &str) -> Result<()> {
        let p = self.path(dir)?;
        fs::create_dir_all(&p).map_err(|e| io_err("create_dir", &p, e))
    }

    fn read(&self, path: &str) -> Result<Option<Vec<u8>>> {
        let p = self.path(path)?;
        match fs::read(&p) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err("read", &p, e)),
        }
    }

    fn read_range(&self, path: &str, offset: u64, len: u64) -> Result<Option<Vec<u8>>> {
        use std::io::{Read, Seek, SeekFrom};
        let p = self.path(path)?;
        let mut f = match fs::File::open(&p) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err("open", &p, e)),
        };
        let mut buf = vec![0u8; usize::try_from(len).map_err(|_| short(path, offset, len))?];
        f.seek(SeekFrom::Start(offset))
            .map_err(|e| io_err("seek", &p, e))?;
        match f.read_exact(&mut buf) {
            Ok(()) => Ok(Some(buf)),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Err(short(path, offset, len)),
            Err(e) => Err(io_err("read", &p, e)),
        }
    }

    fn append(&self, path: &str, bytes: &[u8]) -> Result<()> {
        let p = self.path(path)?;
        let mut f = fs::OpenOptions::new()
            .append(true)
            .open(&p)
            .map_err(|e| io_err("open", &p, e))?;
        f.write_all(bytes).map_err(|e| io_err("write", &p, e))
    }

    fn size(&self, path: &str) -> Result<Option<u64>> {
        let p = self.path(path)?;
        match fs::metadata(&p) {
            Ok(m) => Ok(Some(m.len())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err("stat", &p, e)),
        }
    }

    fn exists(&self, path: &str) -> Result<bool> {
        Ok(self.path(path)?.exists())
    }

    fn list(&self, dir: &str) -> Result<Vec<String>> {
        let p = self.path(dir)?;
        let rd = match fs::read_dir(&p) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err("read_dir", &p, e)),
        };
        let mut out = Vec::new();
        for e in rd {
            let e = e.map_err(|e| io_err("read_dir", &p, e))?;
            out.push(e.file_name().to_string_lossy().into_owned());
        }
        out.sort();
        Ok(out)
    }
}
