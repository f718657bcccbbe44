//! [`MpiComm`] over rsmpi: non-blocking MPI collectives polled against a timeout, the host
//! loopback's checks and reduction kernels, and the logical traffic of every call.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::thread;
use std::time::{Duration, Instant};

use mpi::collective::{CommunicatorCollectives as _, Root as _};
use mpi::datatype::{Partition, PartitionMut};
use mpi::environment::{Threading, Universe};
use mpi::request::{Request, Scope, scope};
use mpi::topology::Communicator as _;
use mpi::topology::{Color, SimpleCommunicator};
use zero_core::{Collective, Topology, TrafficTable};

use super::MpiOptions;
use crate::communicator::{Communicator, ReduceOrder, group_methods};
use crate::element::{Element, ReduceOp};
use crate::error::{Error, Op, Result};
use crate::host::HostBuffer;
use crate::host::kernels;
use crate::tally::Tally;
use crate::validate::{Desc, ar_chunk, validate};
use crate::wire::DESC_BYTES;

/// The exit status of a job this backend aborts.
const ABORT_CODE: i32 = 70;

/// The MPI library's state in this process: initialised once, finalised when the last
/// communicator drops.
struct Process {
    /// `None` when someone else initialised MPI (and will finalise it).
    _universe: Option<Universe>,
    /// The first failure of any communicator of this process, which poisons all of them.
    failed: Mutex<Option<String>>,
}

enum State {
    Uninit,
    Live(Weak<Process>),
    Finalized,
}

static STATE: Mutex<State> = Mutex::new(State::Uninit);

impl Drop for Process {
    fn drop(&mut self) {
        // Runs before `_universe` finalises MPI; MPI someone else initialised stays usable.
        if self._universe.is_some() {
            *STATE.lock().unwrap_or_else(PoisonError::into_inner) = State::Finalized;
        }
    }
}

impl Process {
    fn get() -> Result<Arc<Process>> {
        let mut state = STATE.lock().unwrap_or_else(PoisonError::into_inner);
        if let State::Live(w) = &*state
            && let Some(p) = w.upgrade()
        {
            return Ok(p);
        }
        if matches!(*state, State::Finalized) || mpi::is_finalized() {
            return Err(Error::Backend(
                "mpi: MPI was finalised in this process (its last communicator dropped) and \
                 cannot be initialised again"
                    .into(),
            ));
        }
        // MULTIPLE, so that communicators may be driven from several threads; SERIALIZED is
        // accepted (one thread at a time, as the module docs require then).
        let (universe, provided) = match mpi::initialize_with_threading(Threading::Multiple) {
            Some((u, provided)) => (Some(u), provided),
            None => (None, mpi::environment::threading_support()),
        };
        if matches!(provided, Threading::Single | Threading::Funneled) {
            return Err(Error::Backend(format!(
                "mpi: the library provides thread level {provided:?}; zero-comm needs \
                 MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE"
            )));
        }
        let p = Arc::new(Process {
            _universe: universe,
            failed: Mutex::new(None),
        });
        *state = State::Live(Arc::downgrade(&p));
        Ok(p)
    }

    fn failure(&self) -> Option<String> {
        self.failed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Keeps MPI initialised in this process until the guard drops, whatever communicators come and
/// go: a program that may end with an error holds one, so that dropping its last communicator
/// does not finalise MPI (which can wait for peers that wait for it) before it calls
/// [`abort_job`].
#[derive(Clone)]
pub struct MpiGuard {
    _process: Arc<Process>,
}

impl fmt::Debug for MpiGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MpiGuard")
    }
}

impl MpiGuard {
    /// Initialises MPI if needed and holds it.
    pub fn new() -> Result<MpiGuard> {
        Ok(MpiGuard {
            _process: Process::get()?,
        })
    }
}

/// Ends every process of the MPI job with status `code` (`MPI_Abort` on `MPI_COMM_WORLD`), or
/// just this process when MPI is not running. For a rank that stops with an error while its
/// peers may be waiting for it in a collective.
pub fn abort_job(code: i32) -> ! {
    if mpi::is_initialized() && !mpi::is_finalized() {
        SimpleCommunicator::world().abort(code)
    }
    std::process::exit(code)
}

/// Prints `e` and aborts the job: the end of a wait that MPI cannot cancel.
fn fatal(e: &Error) -> ! {
    say(&format!("zero-comm mpi: {e}; aborting the MPI job\n"));
    abort_job(ABORT_CODE)
}

/// Writes `line` to stderr in one write: `eprintln!` writes a formatted line in pieces, and
/// `mpirun`'s own abort notice, on the same pipe, could land between them (a pipe write up to
/// 4 KiB is atomic).
fn say(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// One rank of an MPI communicator: a duplicate of `MPI_COMM_WORLD`, or a communicator split
/// from one. Host buffers; see the [module docs](super).
pub struct MpiComm {
    // Declared first so that it is freed before `process` may finalise MPI.
    comm: SimpleCommunicator,
    process: Arc<Process>,
    topology: Arc<Topology>,
    rank: usize,
    members: Arc<[usize]>,
    timeout: Duration,
    check_peers: bool,
    order: ReduceOrder,
    traffic: TrafficTable,
    aborted: Option<String>,
    /// Where reductions receive the chunks they sum, kept between calls (a fresh buffer per call
    /// costs its page faults every time): as large as the largest reduction input so far.
    scratch: Vec<u64>,
}

// SAFETY: MPI is initialised at `MPI_THREAD_MULTIPLE` where the library provides it (OpenMPI
// does), so MPI may be called from any thread, on different communicators at once; `MpiComm` is
// not `Sync`, so one communicator is never driven by two threads. Where the library provides only
// `MPI_THREAD_SERIALIZED`, the module docs require one thread at a time per process.
unsafe impl Send for MpiComm {}

impl fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("world_size", &self.members.len())
            .field("global_rank", &self.global_rank())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        if thread::panicking() {
            say(&format!(
                "zero-comm mpi: rank {} panicked; aborting the MPI job so its peers do not wait\n",
                self.global_rank()
            ));
            abort_job(ABORT_CODE);
        }
    }
}

/// `slice` as bytes, checked against MPI's `int` count.
fn bytes<E: Element>(op: Op, slice: &[E]) -> Result<&[u8]> {
    fits(op, size_of_val(slice))?;
    Ok(bytemuck::cast_slice(slice))
}

fn bytes_mut<E: Element>(op: Op, slice: &mut [E]) -> Result<&mut [u8]> {
    fits(op, size_of_val(slice))?;
    Ok(bytemuck::cast_slice_mut(slice))
}

fn fits(op: Op, n: usize) -> Result<()> {
    if i32::try_from(n).is_err() {
        return Err(Error::Backend(format!(
            "mpi: {op} passes a buffer of {n} bytes, over MPI's limit of {} bytes per buffer; \
             use smaller buckets",
            i32::MAX
        )));
    }
    Ok(())
}

/// The scratch words as elements of `E` (8-byte words: aligned for every element type).
fn scratch_view<E: Element>(words: &mut [u64]) -> &mut [E] {
    bytemuck::cast_slice_mut(words)
}

/// Counts and displacements, in bytes, of the chunks `(offset, len)` (elements of `eb` bytes).
fn partition(chunks: impl Iterator<Item = (usize, usize)>, eb: usize) -> (Vec<i32>, Vec<i32>) {
    // Every chunk lies within a buffer already checked by `fits`, so the casts cannot overflow.
    chunks
        .map(|(off, len)| ((len * eb) as i32, (off * eb) as i32))
        .unzip()
}

impl MpiComm {
    /// This rank of a duplicate of `MPI_COMM_WORLD`, initialising MPI if needed. The topology's
    /// nodes come from MPI (shared-memory neighbours) unless
    /// [`ranks_per_node`](MpiOptions::ranks_per_node) says otherwise. Collective over the world.
    pub fn world(opts: MpiOptions) -> Result<MpiComm> {
        let process = Process::get()?;
        let comm = SimpleCommunicator::world().duplicate();
        let n = comm.size() as usize;
        let me = comm.rank() as usize;
        let mut c = MpiComm {
            comm,
            process,
            topology: Arc::new(Topology::single_node(n)?),
            rank: me,
            members: (0..n).collect(),
            timeout: opts.timeout,
            check_peers: opts.check_peers,
            order: opts.reduce_order,
            traffic: TrafficTable::new(),
            aborted: None,
            scratch: Vec::new(),
        };
        let per_node = match opts.ranks_per_node {
            Some(l) => l,
            None => c.ranks_per_node()?,
        };
        c.topology = Arc::new(Topology::new(n, per_node)?);
        Ok(c)
    }

    /// The timeout every wait of this communicator uses.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Ranks per node as MPI places them: equal contiguous blocks, or an error saying how not.
    fn ranks_per_node(&self) -> Result<usize> {
        let shared = self.comm.split_shared(0);
        let mine = [shared.size(), shared.rank()];
        let n = self.members.len();
        let mut all = vec![0i32; 2 * n];
        let start = Instant::now();
        scope(|sc| {
            let req = self
                .comm
                .immediate_all_gather_into(sc, &mine[..], &mut all[..]);
            self.wait(Op::Split, start, req);
        });
        let l = all[0];
        for (j, p) in all.chunks_exact(2).enumerate() {
            if p[0] != l || p[1] as usize != j % l.max(1) as usize {
                return Err(Error::Backend(format!(
                    "mpi: ranks are not placed in equal contiguous blocks per node (rank {j} is \
                     local rank {} of {} on its node, rank 0 has {l} on its node); launch with \
                     `--map-by slot` or set {}",
                    p[1],
                    p[0],
                    super::ENV_RANKS_PER_NODE
                )));
            }
        }
        Ok(l as usize)
    }

    /// Polls `req` until it completes; past the timeout, aborts the job (see the module docs).
    fn wait<'a, D: ?Sized, S: Scope<'a>>(
        &self,
        op: Op,
        start: Instant,
        mut req: Request<'a, D, S>,
    ) {
        let mut polls = 0u32;
        loop {
            req = match req.test() {
                Ok(_) => return,
                Err(r) => r,
            };
            let waited = start.elapsed();
            if waited >= self.timeout {
                let me = self.global_rank();
                fatal(&Error::Timeout {
                    op,
                    rank: me,
                    waited,
                    missing: self.members.iter().copied().filter(|&g| g != me).collect(),
                });
            }
            // Progress happens inside `MPI_Test`: poll often while the op is young, then back
            // off so that oversubscribed ranks leave their cores to the peers they wait for.
            polls += 1;
            if polls < 32 {
                std::hint::spin_loop();
            } else if waited < Duration::from_secs(1) {
                thread::yield_now();
            } else {
                thread::sleep(Duration::from_micros(100));
            }
        }
    }

    /// The prologue of every op: fails if aborted, then checks `desc` against every rank's (with
    /// `check_peers`, or when `all` is set) or against this rank's own lengths, and returns the
    /// descriptors it saw.
    fn open(&self, desc: Desc, all: bool) -> Result<Vec<Desc>> {
        let me = self.global_rank();
        if let Some(cause) = self.aborted.clone().or_else(|| self.process.failure()) {
            return Err(Error::Aborted {
                op: desc.op,
                rank: me,
                cause,
            });
        }
        let n = self.members.len();
        if !(self.check_peers || all) {
            validate(&[desc], &[me], n)?;
            return Ok(vec![desc]);
        }
        let mine = desc.to_bytes();
        let mut wire = vec![0u8; DESC_BYTES * n];
        let start = Instant::now();
        scope(|sc| {
            let req = self
                .comm
                .immediate_all_gather_into(sc, &mine[..], &mut wire[..]);
            self.wait(desc.op, start, req);
        });
        let calls = wire
            .chunks_exact(DESC_BYTES)
            .zip(self.members.iter())
            .map(|(b, &g)| Desc::from_bytes(b, g))
            .collect::<Result<Vec<_>>>()?;
        validate(&calls, &self.members, n)?;
        Ok(calls)
    }

    /// Records a call's traffic as counted at its MPI calls (see [`Tally`]).
    fn account(&mut self, desc: &Desc, tally: Tally) {
        if let Some(c) = desc.op.collective() {
            self.traffic
                .record(c, tally.traffic(&self.topology, &self.members));
        }
    }

    fn tally(&self) -> Tally {
        Tally::new(self.members.len(), self.rank)
    }

    /// `MPI_Iallgather` of `send` into `recv`, waited for. Nothing to move is no MPI call
    /// (OpenMPI rejects the equal dangling pointers of two empty buffers).
    fn gather_bytes(&self, op: Op, send: &[u8], recv: &mut [u8], tally: &mut Tally) {
        tally.all_gather(send.len(), recv.len());
        if recv.is_empty() {
            return;
        }
        let start = Instant::now();
        scope(|sc| {
            let req = self.comm.immediate_all_gather_into(sc, send, recv);
            self.wait(op, start, req);
        });
    }

    /// `MPI_Ialltoall` of `send` into `recv`, waited for.
    fn exchange_bytes(&self, op: Op, send: &[u8], recv: &mut [u8], tally: &mut Tally) {
        tally.all_to_all(send.len(), recv.len());
        if recv.is_empty() {
            return;
        }
        let start = Instant::now();
        scope(|sc| {
            let req = self.comm.immediate_all_to_all_into(sc, send, recv);
            self.wait(op, start, req);
        });
    }

    /// The scratch buffer, taken out of `self` (give it back with [`Self::put_scratch`]), with
    /// room for `len` elements of `E`.
    fn take_scratch<E: Element>(&mut self, len: usize) -> Vec<u64> {
        let mut s = std::mem::take(&mut self.scratch);
        let words = (len * size_of::<E>()).div_ceil(8);
        if s.len() < words {
            s.resize(words, 0);
        }
        s
    }

    fn put_scratch(&mut self, s: Vec<u64>) {
        self.scratch = s;
    }

    /// Sums the `n` chunks of `c` elements of `gathered` (chunk `j` from group rank `j`) into `out`.
    fn reduce_chunks<E: Element>(&self, gathered: &[E], out: &mut [E], op: ReduceOp) {
        let c = out.len();
        debug_assert_eq!(gathered.len(), c * self.members.len());
        let inputs: Vec<*const E> = (0..self.members.len())
            .map(|j| gathered.as_ptr().wrapping_add(j * c))
            .collect();
        // SAFETY: each input is a chunk of `c` elements inside `gathered`, which lives and is not
        // written during the call; `out` is a distinct buffer of `c` elements.
        unsafe { kernels::reduce(&inputs, out.as_mut_ptr(), c, op, self.order) };
    }
}

impl Communicator for MpiComm {
    type Buffer<E: Element> = HostBuffer<E>;

    group_methods!(topology);

    crate::host::host_buffer_methods!();

    fn all_gather<E: Element>(
        &mut self,
        send: &HostBuffer<E>,
        recv: &mut HostBuffer<E>,
    ) -> Result<()> {
        let d = Desc::of(Collective::AllGather, E::DTYPE, send.len(), recv.len());
        self.open(d, false)?;
        let s = bytes(d.op, send.as_slice())?;
        let r = bytes_mut(d.op, recv.as_mut_slice())?;
        let mut tally = self.tally();
        self.gather_bytes(d.op, s, r, &mut tally);
        self.account(&d, tally);
        Ok(())
    }

    fn all_gather_in_place<E: Element>(&mut self, buf: &mut HostBuffer<E>) -> Result<()> {
        let n = self.members.len();
        let c = buf.len() / n;
        let d = Desc {
            in_place: true,
            ..Desc::of(Collective::AllGather, E::DTYPE, c, buf.len())
        };
        self.open(d, false)?;
        let own = buf.as_slice()[self.rank * c..(self.rank + 1) * c].to_vec();
        let r = bytes_mut(d.op, buf.as_mut_slice())?;
        let mut tally = self.tally();
        self.gather_bytes(d.op, bytemuck::cast_slice(&own), r, &mut tally);
        self.account(&d, tally);
        Ok(())
    }

    fn reduce_scatter<E: Element>(
        &mut self,
        send: &HostBuffer<E>,
        recv: &mut HostBuffer<E>,
        op: ReduceOp,
    ) -> Result<()> {
        let d = Desc::of(Collective::ReduceScatter, E::DTYPE, send.len(), recv.len()).reduce(op);
        self.open(d, false)?;
        let s = bytes(d.op, send.as_slice())?;
        let mut scratch = self.take_scratch::<E>(send.len());
        let gathered = &mut scratch_view::<E>(&mut scratch)[..send.len()];
        let mut tally = self.tally();
        self.exchange_bytes(d.op, s, bytemuck::cast_slice_mut(gathered), &mut tally);
        self.reduce_chunks(gathered, recv.as_mut_slice(), op);
        self.put_scratch(scratch);
        self.account(&d, tally);
        Ok(())
    }

    fn all_reduce<E: Element>(&mut self, buf: &mut HostBuffer<E>, op: ReduceOp) -> Result<()> {
        let (n, me, len) = (self.members.len(), self.rank, buf.len());
        let d = Desc::of(Collective::AllReduce, E::DTYPE, len, len).reduce(op);
        self.open(d, false)?;
        let mut tally = self.tally();
        if len == 0 {
            self.account(&d, tally);
            return Ok(());
        }
        let eb = size_of::<E>();
        let (off, mine) = ar_chunk(len, n, me);
        // Reduce-scatter half: chunk `j` of every rank goes to rank `j`. Equal chunks take
        // MPI's plain all-to-all and all-gather (OpenMPI's varcount forms are several times slower).
        let even = len.is_multiple_of(n);
        let s = bytes(d.op, buf.as_slice())?;
        // The largest chunk, which every rank computes alike: all fail together or none.
        fits(d.op, n * ar_chunk(len, n, 0).1 * eb)?;
        // The scratch holds the received chunks, then this rank's reduced chunk.
        let mut scratch = self.take_scratch::<E>((n + 1) * mine);
        let (gathered, reduced) =
            scratch_view::<E>(&mut scratch)[..(n + 1) * mine].split_at_mut(n * mine);
        if even {
            self.exchange_bytes(d.op, s, bytemuck::cast_slice_mut(gathered), &mut tally);
        } else {
            let (send_counts, send_displs) = partition((0..n).map(|j| ar_chunk(len, n, j)), eb);
            let (recv_counts, recv_displs) = partition((0..n).map(|j| (j * mine, mine)), eb);
            tally.counts(&send_counts, &recv_counts);
            let send = Partition::new(s, send_counts, send_displs);
            let g: &mut [u8] = bytemuck::cast_slice_mut(gathered);
            let mut recv = PartitionMut::new(g, recv_counts, recv_displs);
            let start = Instant::now();
            scope(|sc| {
                let req = self
                    .comm
                    .immediate_all_to_all_varcount_into(sc, &send, &mut recv);
                self.wait(d.op, start, req);
            });
        }
        self.reduce_chunks(gathered, reduced, op);
        // All-gather half: every rank's reduced chunk to every rank, at its offset.
        let b = bytes_mut(d.op, buf.as_mut_slice())?;
        let r = bytemuck::cast_slice::<E, u8>(reduced);
        if even {
            self.gather_bytes(d.op, r, b, &mut tally);
        } else {
            let (counts, displs) = partition((0..n).map(|j| ar_chunk(len, n, j)), eb);
            debug_assert_eq!(displs[me] as usize, off * eb);
            tally.all_gather_counts(r.len(), &counts);
            let mut recv = PartitionMut::new(b, counts, displs);
            let start = Instant::now();
            scope(|sc| {
                let req = self
                    .comm
                    .immediate_all_gather_varcount_into(sc, r, &mut recv);
                self.wait(d.op, start, req);
            });
        }
        self.put_scratch(scratch);
        self.account(&d, tally);
        Ok(())
    }

    fn broadcast<E: Element>(&mut self, buf: &mut HostBuffer<E>, root: usize) -> Result<()> {
        let d = Desc::of(Collective::Broadcast, E::DTYPE, buf.len(), buf.len()).root(root);
        self.open(d, false)?;
        let b = bytes_mut(d.op, buf.as_mut_slice())?;
        let mut tally = self.tally();
        tally.broadcast(root, b.len());
        if !b.is_empty() {
            let start = Instant::now();
            let root = self.comm.process_at_rank(root as i32);
            scope(|sc| {
                let req = root.immediate_broadcast_into(sc, b);
                self.wait(d.op, start, req);
            });
        }
        self.account(&d, tally);
        Ok(())
    }

    fn all_to_all<E: Element>(
        &mut self,
        send: &HostBuffer<E>,
        recv: &mut HostBuffer<E>,
    ) -> Result<()> {
        let d = Desc::of(Collective::AllToAll, E::DTYPE, send.len(), recv.len());
        self.open(d, false)?;
        let s = bytes(d.op, send.as_slice())?;
        let r = bytes_mut(d.op, recv.as_mut_slice())?;
        let mut tally = self.tally();
        self.exchange_bytes(d.op, s, r, &mut tally);
        self.account(&d, tally);
        Ok(())
    }

    fn barrier(&mut self) -> Result<()> {
        let d = Desc::new(Collective::Barrier);
        self.open(d, false)?;
        let start = Instant::now();
        let req = self.comm.immediate_barrier();
        self.wait(d.op, start, req);
        self.account(&d, self.tally());
        Ok(())
    }

    fn split(&mut self, color: usize, key: usize) -> Result<MpiComm> {
        let d = Desc {
            color,
            key,
            ..Desc::new(Op::Split)
        };
        let calls = self.open(d, true)?;
        // The new group: the ranks of this colour, ordered by (key, rank). MPI gets the colours
        // numbered densely and the new rank as key, so no value needs to fit an `int`.
        let mut colors: Vec<usize> = calls.iter().map(|c| c.color).collect();
        colors.sort_unstable();
        colors.dedup();
        let dense = colors.binary_search(&color).unwrap_or_default();
        let mut group: Vec<usize> = (0..calls.len())
            .filter(|&j| calls[j].color == color)
            .collect();
        group.sort_by_key(|&j| (calls[j].key, j));
        let rank = group.iter().position(|&j| j == self.rank).unwrap_or(0);
        let members: Arc<[usize]> = group.iter().map(|&j| self.members[j]).collect();
        let comm = self
            .comm
            .split_by_color_with_key(Color::with_value(dense as i32), rank as i32)
            .ok_or_else(|| Error::Backend("mpi: MPI_Comm_split returned no communicator".into()))?;
        if comm.size() as usize != members.len() || comm.rank() as usize != rank {
            return Err(Error::Backend(format!(
                "mpi: MPI_Comm_split made rank {} of {}, expected rank {rank} of {}",
                comm.rank(),
                comm.size(),
                members.len()
            )));
        }
        Ok(MpiComm {
            comm,
            process: self.process.clone(),
            topology: self.topology.clone(),
            rank,
            members,
            timeout: self.timeout,
            check_peers: self.check_peers,
            order: self.order,
            traffic: TrafficTable::new(),
            aborted: None,
            scratch: Vec::new(),
        })
    }

    fn reduce_order(&self) -> Option<ReduceOrder> {
        Some(self.order)
    }

    fn traffic(&self) -> &TrafficTable {
        &self.traffic
    }

    fn abort(&mut self, cause: String) {
        self.aborted.get_or_insert(cause.clone());
        self.process
            .failed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert(cause);
    }
}
