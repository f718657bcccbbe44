//! The prefetch ring over the NVMe store: reads ahead and writes behind on IO threads, with at
//! most `buffers` units' state in host memory at once.
//!
//! The caller steps units one at a time. [`Ring::load`] hands over unit `u` (read ahead if it was
//! asked for, else read now) and starts reading the next unit; [`Ring::store`] starts writing a
//! stepped unit back. One buffer is the unit being stepped, one the unit read ahead, the rest
//! writes in flight: when all are taken, the oldest write is waited for. A read of a unit waits
//! for that unit's write first, so it always sees its last state. [`Ring::flush`] waits for every
//! write and drops the read ahead: at a step boundary the store is the only copy. An IO error
//! surfaces at the next call, naming its unit and file (the store keeps that unit's last state
//! whole).

use std::collections::VecDeque;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::store::{Disk, Word};
use crate::{Error, Result};

type Job<T> = (usize, JoinHandle<Result<T>>);

/// The ring of one rank's store (see the module docs).
#[derive(Debug)]
pub(crate) struct Ring<T: Word = f32> {
    disk: Arc<Disk<T>>,
    buffers: usize,
    ahead: Option<Job<Vec<T>>>,
    writes: VecDeque<Job<()>>,
    /// Time the step spent waiting for IO.
    waited: Duration,
    /// The most buffers in host memory at once.
    peak: usize,
}

/// What a ring moved, and the time the step waited for it.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct IoReport {
    /// Bytes read from the store.
    pub read_bytes: u64,
    /// Bytes written to it.
    pub written_bytes: u64,
    /// Seconds the step waited for IO (reads not yet ahead, writes holding the ring's buffers).
    pub wait_secs: f64,
    /// The most units' state in host memory at once (at most the ring's buffers).
    pub peak_buffers: usize,
    /// Whether the IO went past the page cache (direct IO) or, where the file system refused
    /// that, through it.
    #[serde(default)]
    pub direct_io: bool,
}

impl IoReport {
    /// Two stores' reports as one: bytes and waits summed, buffers held at once summed, direct
    /// only if both were.
    pub fn plus(self, other: IoReport) -> IoReport {
        IoReport {
            read_bytes: self.read_bytes + other.read_bytes,
            written_bytes: self.written_bytes + other.written_bytes,
            wait_secs: self.wait_secs + other.wait_secs,
            peak_buffers: self.peak_buffers + other.peak_buffers,
            direct_io: self.direct_io && other.direct_io,
        }
    }
}

fn join<T, W: Word>(disk: &Disk<W>, (u, job): Job<T>) -> Result<T> {
    job.join().unwrap_or_else(|_| {
        Err(Error::Offload {
            rank: disk.rank(),
            unit: Some(u),
            path: disk.path(u).display().to_string(),
            what: "its IO thread panicked".into(),
        })
    })
}

impl<T: Word> Ring<T> {
    /// A ring of `buffers` (at least 3) over `disk`.
    pub(crate) fn new(disk: Disk<T>, buffers: usize) -> Self {
        Ring {
            disk: Arc::new(disk),
            buffers: buffers.max(3),
            ahead: None,
            writes: VecDeque::new(),
            waited: Duration::ZERO,
            peak: 0,
        }
    }

    /// The store.
    pub(crate) fn disk(&self) -> &Disk<T> {
        &self.disk
    }

    /// What moved so far.
    pub(crate) fn report(&self) -> IoReport {
        let (read_bytes, written_bytes) = self.disk.traffic();
        IoReport {
            read_bytes,
            written_bytes,
            wait_secs: self.waited.as_secs_f64(),
            peak_buffers: self.peak,
            direct_io: self.disk.direct(),
        }
    }

    /// Waits for `job`, counting the wait.
    fn wait<R>(&mut self, job: Job<R>) -> Result<R> {
        let t = Instant::now();
        let out = join(&self.disk, job);
        self.waited += t.elapsed();
        out
    }

    /// Waits for the in-flight write of `u`, if any.
    fn settle(&mut self, u: usize) -> Result<()> {
        let mine = |w: &VecDeque<Job<()>>| w.iter().position(|(w, _)| *w == u);
        while let Some(job) = mine(&self.writes).and_then(|i| self.writes.remove(i)) {
            self.wait(job)?;
        }
        Ok(())
    }

    /// Waits for the oldest writes until `more` buffers are free beside the one being stepped.
    fn make_room(&mut self, more: usize) -> Result<()> {
        while 1 + usize::from(self.ahead.is_some()) + self.writes.len() + more > self.buffers {
            let Some(job) = self.writes.pop_front() else {
                break;
            };
            self.wait(job)?;
        }
        let held = 1 + usize::from(self.ahead.is_some()) + self.writes.len() + more;
        self.peak = self.peak.max(held.min(self.buffers));
        Ok(())
    }

    /// Unit `u`'s state; starts reading `next` ahead.
    pub(crate) fn load(&mut self, u: usize, next: Option<usize>) -> Result<Vec<T>> {
        let values = match self.ahead.take() {
            Some(job) if job.0 == u => self.wait(job)?,
            other => {
                if let Some(stale) = other {
                    self.wait(stale)?;
                }
                self.settle(u)?;
                let t = Instant::now();
                let v = self.disk.read(u);
                self.waited += t.elapsed();
                v?
            }
        };
        if let Some(next) = next.filter(|&n| n != u) {
            self.settle(next)?;
            self.make_room(1)?;
            let disk = Arc::clone(&self.disk);
            self.ahead = Some((next, std::thread::spawn(move || disk.read(next))));
        }
        Ok(values)
    }

    /// Starts writing `values`, unit `u`'s stepped state, back.
    pub(crate) fn store(&mut self, u: usize, values: Vec<T>) -> Result<()> {
        self.settle(u)?;
        // The buffer being handed over stops being the stepped one: room for it as a write.
        self.make_room(0)?;
        let disk = Arc::clone(&self.disk);
        let job = std::thread::spawn(move || disk.write(u, &values));
        self.writes.push_back((u, job));
        Ok(())
    }

    /// Waits for every write and drops the read ahead.
    pub(crate) fn flush(&mut self) -> Result<()> {
        let ahead = self.ahead.take().map(|job| self.wait(job));
        while let Some(job) = self.writes.pop_front() {
            self.wait(job)?;
        }
        ahead.transpose().map(drop)
    }
}

impl<T: Word> Drop for Ring<T> {
    fn drop(&mut self) {
        // The IO threads hold the store; they end before it is removed.
        let _ = self.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_unit_comes_back_as_written_within_the_ring() {
        let tmp = tempfile::tempdir().unwrap();
        let lens: Vec<_> = (0..9).map(|u| Some(700 + u)).collect();
        let disk = Disk::create(tmp.path(), 0, "unit", &lens).unwrap();
        for (u, len) in lens.iter().enumerate() {
            disk.write(u, &vec![u as f32; len.unwrap()]).unwrap();
        }
        let mut ring = Ring::new(disk, 3);
        for step in 1..=3 {
            for u in 0..9 {
                let next = (u + 1 < 9).then_some(u + 1);
                let mut v = ring.load(u, next).unwrap();
                let want = (u + 9 * (step - 1)) as f32;
                assert!(v.iter().all(|&x| x == want), "step {step} unit {u}");
                v.iter_mut().for_each(|x| *x += 9.0);
                ring.store(u, v).unwrap();
            }
            ring.flush().unwrap();
        }
        let r = ring.report();
        assert_eq!(r.peak_buffers, 3, "the ring holds at most its buffers");
        let bytes = |k: u64| k * 4096;
        assert_eq!((r.read_bytes, r.written_bytes), (bytes(27), bytes(9 + 27)));
    }

    #[test]
    fn a_write_error_surfaces_at_the_next_call_naming_its_unit() {
        let tmp = tempfile::tempdir().unwrap();
        let disk = Disk::create(tmp.path(), 0, "unit", &[Some(10), Some(10)]).unwrap();
        disk.write(0, &[1.0; 10]).unwrap();
        disk.write(1, &[1.0; 10]).unwrap();
        let mut ring = Ring::new(disk, 3);
        let v = ring.load(0, Some(1)).unwrap();
        // The wrong length: the store refuses the write on its IO thread.
        ring.store(0, v[..5].to_vec()).unwrap();
        let e = ring.flush().unwrap_err().to_string();
        assert!(
            e.contains("unit 0") && e.contains("5 values written"),
            "{e}"
        );
        assert_eq!(ring.load(0, None).unwrap(), [1.0; 10], "the last state");
    }
}
