//! An in-memory [`Storage`] that models the page cache, for crash tests.
//!
//! Files and directories are inodes. Every write, rename and creation changes only the volatile
//! view; `sync_file` makes a file's content durable and `sync_dir` a directory's entries. A
//! simulated crash ([`MemStorage::crash`]) throws the volatile view away and keeps what was
//! durable: a renamed file whose directory was never synced is back under its old name, a file
//! written but never synced is empty. [`MemStorage::fail_at`] makes the `k`-th mutating
//! operation (counted from 0 over all threads) fail, and every later one too, as a machine that
//! went down at that point; a failing write leaves half its bytes behind (a torn write), and a
//! failing append half of what it appends (a torn append: appends extend the file in place, as
//! `DirStorage`'s do).

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use super::storage::Storage;
use crate::error::{Error, Result};

#[derive(Clone, Debug)]
enum Node {
    File {
        data: Vec<u8>,
        durable: Vec<u8>,
    },
    Dir {
        children: BTreeMap<String, usize>,
        durable: BTreeMap<String, usize>,
    },
}

#[derive(Clone, Debug)]
struct State {
    nodes: Vec<Node>,
    ops: usize,
    fail_at: Option<usize>,
}

/// The crash-simulating in-memory store (cheap to clone: clones share the state; use
/// [`MemStorage::fork`] for an independent copy).
#[derive(Clone, Debug)]
pub struct MemStorage {
    state: Arc<Mutex<State>>,
}

impl Default for MemStorage {
    fn default() -> Self {
        MemStorage::new()
    }
}

fn fail(op: &'static str, path: &str, why: &str) -> Error {
    Error::Storage {
        op,
        path: path.into(),
        source: io::Error::other(why.to_string()),
    }
}

impl MemStorage {
    /// An empty store.
    pub fn new() -> Self {
        let root = Node::Dir {
            children: BTreeMap::new(),
            durable: BTreeMap::new(),
        };
        MemStorage {
            state: Arc::new(Mutex::new(State {
                nodes: vec![root],
                ops: 0,
                fail_at: None,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking test thread cannot leave the maps half-updated: recover the guard.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An independent copy of the current state (volatile and durable).
    pub fn fork(&self) -> MemStorage {
        MemStorage {
            state: Arc::new(Mutex::new(self.lock().clone())),
        }
    }

    /// Mutating operations so far.
    pub fn ops(&self) -> usize {
        self.lock().ops
    }

    /// Makes mutating operation `k` (and every later one) fail; `None` clears it.
    pub fn fail_at(&self, k: Option<usize>) {
        self.lock().fail_at = k;
    }

    /// Power loss: only durable content and entries survive. Clears `fail_at`.
    pub fn crash(&self) {
        let mut s = self.lock();
        for n in &mut s.nodes {
            match n {
                Node::File { data, durable } => *data = durable.clone(),
                Node::Dir { children, durable } => *children = durable.clone(),
            }
        }
        s.fail_at = None;
    }

    /// Flips bit `bit` of byte `at` of file `path` (volatile and durable), for corruption tests.
    pub fn flip(&self, path: &str, at: usize, bit: u8) -> Result<()> {
        self.edit(path, |d| {
            if let Some(b) = d.get_mut(at) {
                *b ^= 1 << (bit % 8);
            }
        })
    }

    /// Replaces file `path`'s content by `f` of it (volatile and durable), for corruption tests.
    pub fn edit(&self, path: &str, f: impl Fn(&mut Vec<u8>)) -> Result<()> {
        let mut s = self.lock();
        let id = resolve(&s, path).ok_or_else(|| fail("edit", path, "no such file"))?;
        match &mut s.nodes[id] {
            Node::File { data, durable } => {
                f(data);
                f(durable);
                Ok(())
            }
            Node::Dir { .. } => Err(fail("edit", path, "a directory")),
        }
    }

    /// Removes the entry `path` (volatile and durable), for missing-file tests.
    pub fn remove(&self, path: &str) -> Result<()> {
        let mut s = self.lock();
        let (dir, name) = split(path);
        let parent = resolve(&s, dir).ok_or_else(|| fail("remove", path, "no such dir"))?;
        if let Node::Dir { children, durable } = &mut s.nodes[parent] {
            children.remove(name);
            durable.remove(name);
        }
        Ok(())
    }

    /// Counts a mutating operation, failing it when the fault point is reached.
    fn begin(s: &mut State, op: &'static str, path: &str) -> Result<bool> {
        let k = s.ops;
        s.ops += 1;
        match s.fail_at {
            Some(f) if k > f => Err(fail(op, path, "simulated crash: the machine is down")),
            Some(f) if k == f => Ok(false),
            _ => Ok(true),
        }
    }
}

fn split(path: &str) -> (&str, &str) {
    match path.rfind('/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("", path),
    }
}

fn resolve(s: &State, path: &str) -> Option<usize> {
    let mut id = 0;
    for c in path.split('/').filter(|c| !c.is_empty()) {
        match &s.nodes[id] {
            Node::Dir { children, .. } => id = *children.get(c)?,
            Node::File { .. } => return None,
        }
    }
    Some(id)
}

fn children_mut(s: &mut State, id: usize) -> Option<&mut BTreeMap<String, usize>> {
    match &mut s.nodes[id] {
        Node::Dir { children, .. } => Some(children),
        Node::File { .. } => None,
    }
}

impl Storage for MemStorage {
    fn write(&self, path: &str, bytes: &[u8]) -> Result<()> {
        let mut s = self.lock();
        let go = Self::begin(&mut s, "write", path)?;
        let (dir, name) = split(path);
        let parent = resolve(&s, dir).ok_or_else(|| fail("write", path, "no such directory"))?;
        let existing = children_mut(&mut s, parent)
            .ok_or_else(|| fail("write", path, "parent is a file"))?
            .get(name)
            .copied();
        let content = if go {
            bytes.to_vec()
        } else {
            bytes[..bytes.len() / 2].to_vec()
        };
        match existing {
            Some(id) => match &mut s.nodes[id] {
                Node::File { data, .. } => *data = content,
                Node::Dir { .. } => return Err(fail("write", path, "is a directory")),
            },
            None => {
                let id = s.nodes.len();
                s.nodes.push(Node::File {
                    data: content,
                    durable: Vec::new(),
                });
                children_mut(&mut s, parent)
                    .ok_or_else(|| fail("write", path, "parent is a file"))?
                    .insert(name.into(), id);
            }
        }
        if go {
            Ok(())
        } else {
            Err(fail("write", path, "simulated crash mid-write"))
        }
    }

    fn sync_file(&self, path: &str) -> Result<()> {
        let mut s = self.lock();
        if !Self::begin(&mut s, "fsync", path)? {
            return Err(fail("fsync", path, "simulated crash"));
        }
        let id = resolve(&s, path).ok_or_else(|| fail("fsync", path, "no such file"))?;
        if let Node::File { data, durable } = &mut s.nodes[id] {
            *durable = data.clone();
        }
        Ok(())
    }

    fn rename(&self, from: &str, to: &str) -> Result<()> {
        let mut s = self.lock();
        if !Self::begin(&mut s, "rename", from)? {
            return Err(fail("rename", from, "simulated crash"));
        }
        let (fd, fname) = split(from);
        let (td, tname) = split(to);
        let fp = resolve(&s, fd).ok_or_else(|| fail("rename", from, "no such directory"))?;
        let tp = resolve(&s, td).ok_or_else(|| fail("rename", to, "no such directory"))?;
        let id = children_mut(&mut s, fp)
            .and_then(|c| c.remove(fname))
            .ok_or_else(|| fail("rename", from, "no such entry"))?;
        children_mut(&mut s, tp)
            .ok_or_else(|| fail("rename", to, "not a directory"))?
            .insert(tname.into(), id);
        Ok(())
    }

    fn sync_dir(&self, dir: &str) -> Result<()> {
        let mut s = self.lock();
        if !Self::begin(&mut s, "fsync", dir)? {
            return Err(fail("fsync", dir, "simulated crash"));
        }
        let id = resolve(&s, dir).ok_or_else(|| fail("fsync", dir, "no such directory"))?;
        if let Node::Dir { children, durable } = &mut s.nodes[id] {
            *durable = children.clone();
        }
        Ok(())
    }

    fn create_dir(&self, dir: &str) -> Result<()> {
        let mut s = self.lock();
        if !Self::begin(&mut s, "create_dir", dir)? {
            return Err(fail("create_dir", dir, "simulated crash"));
        }
        let mut id = 0;
        for c in dir.split('/').filter(|c| !c.is_empty()) {
            let next = children_mut(&mut s, id)
                .ok_or_else(|| fail("create_dir", dir, "a file is in the way"))?
                .get(c)
                .copied();
            id = match next {
                Some(n) => n,
                None => {
                    let n = s.nodes.len();
                    s.nodes.push(Node::Dir {
                        children: BTreeMap::new(),
                        durable: BTreeMap::new(),
                    });
                    children_mut(&mut s, id)
                        .ok_or_else(|| fail("create_dir", dir, "a file is in the way"))?
                        .insert(c.into(), n);
                    n
                }
            };
        }
        Ok(())
    }

    fn read(&self, path: &str) -> Result<Option<Vec<u8>>> {
        let s = self.lock();
        Ok(match resolve(&s, path).map(|id| &s.nodes[id]) {
            Some(Node::File { data, .. }) => Some(data.clone()),
            _ => None,
        })
    }

    fn size(&self, path: &str) -> Result<Option<u64>> {
        Ok(self.read(path)?.map(|d| d.len() as u64))
    }

    fn exists(&self, path: &str) -> Result<bool> {
        Ok(resolve(&self.lock(), path).is_some())
    }

    fn list(&self, dir: &str) -> Result<Vec<String>> {
        let s = self.lock();
        Ok(match resolve(&s, dir).map(|id| &s.nodes[id]) {
            Some(Node::Dir { children, .. }) => children.keys().cloned().collect(),
            _ => Vec::new(),
        })
    }

    fn append(&self, path: &str, bytes: &[u8]) -> Result<()> {
        let mut s = self.lock();
        let go = Self::begin(&mut s, "append", path)?;
        let id = resolve(&s, path).ok_or_else(|| fail("append", path, "no such file"))?;
        match &mut s.nodes[id] {
            Node::File { data, .. } if go => data.extend_from_slice(bytes),
            Node::File { data, .. } => {
                data.extend_from_slice(&bytes[..bytes.len() / 2]);
                return Err(fail("append", path, "simulated crash mid-append"));
            }
            Node::Dir { .. } => return Err(fail("append", path, "is a directory")),
        }
        Ok(())
    }
}
