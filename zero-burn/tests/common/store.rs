//! A store around [`MemStorage`] that lets a test see, or change, what every read returns, and
//! fail a write or an append.

use zero_burn::Result;
use zero_burn::checkpoint::{MemStorage, Storage};

/// Called with the path, the offset of a ranged read (`None`: a whole-file read) and its result.
pub(crate) type ReadHook = Box<dyn Fn(&str, Option<u64>, &mut Option<Vec<u8>>) + Send + Sync>;

/// Called with the path of every write and every append before it happens; an error (or a
/// panic) fails it.
pub(crate) type WriteHook = Box<dyn Fn(&str) -> Result<()> + Send + Sync>;

/// [`MemStorage`] with a [`ReadHook`] on every read and a [`WriteHook`] before every write and
/// append.
pub(crate) struct Hooked {
    pub(crate) inner: MemStorage,
    hook: ReadHook,
    write: WriteHook,
}

impl Hooked {
    pub(crate) fn new(inner: MemStorage, hook: ReadHook) -> Self {
        Hooked {
            inner,
            hook,
            write: Box::new(|_| Ok(())),
        }
    }

    /// The same store, with `write` called before every write.
    pub(crate) fn on_write(self, write: WriteHook) -> Self {
        Hooked { write, ..self }
    }
}

impl std::fmt::Debug for Hooked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooked")
            .field("inner", &self.inner)
            .finish()
    }
}

impl Storage for Hooked {
    fn write(&self, path: &str, bytes: &[u8]) -> Result<()> {
        (self.write)(path)?;
        self.inner.write(path, bytes)
    }
    fn sync_file(&self, path: &str) -> Result<()> {
        self.inner.sync_file(path)
    }
    fn rename(&self, from: &str, to: &str) -> Result<()> {
        self.inner.rename(from, to)
    }
    fn sync_dir(&self, dir: &str) -> Result<()> {
        self.inner.sync_dir(dir)
    }
    fn create_dir(&self, dir: &str) -> Result<()> {
        self.inner.create_dir(dir)
    }
    fn read(&self, path: &str) -> Result<Option<Vec<u8>>> {
        let mut got = self.inner.read(path)?;
        (self.hook)(path, None, &mut got);
        Ok(got)
    }
    fn size(&self, path: &str) -> Result<Option<u64>> {
        self.inner.size(path)
    }
    fn exists(&self, path: &str) -> Result<bool> {
        self.inner.exists(path)
    }
    fn list(&self, dir: &str) -> Result<Vec<String>> {
        self.inner.list(dir)
    }
    fn read_range(&self, path: &str, offset: u64, len: u64) -> Result<Option<Vec<u8>>> {
        let mut got = self.inner.read_range(path, offset, len)?;
        (self.hook)(path, Some(offset), &mut got);
        Ok(got)
    }
    fn append(&self, path: &str, bytes: &[u8]) -> Result<()> {
        (self.write)(path)?;
        self.inner.append(path, bytes)
    }
}
