//! The in-process host loopback: one thread per rank, one shared rendezvous, zero-copy reads.
//!
//! This is the reference backend. It is always built, needs no device, and is the oracle the GPU
//! backends are tested against.
//!
//! - [`HostWorld::new`] creates the communicators of one world; drive each from its own thread.
//! - [`HostLoopback::launch`] does that for you: one scoped thread per rank, each rank's result (or
//!   its panic) returned in rank order.
//! - [`HostComm`] implements [`Communicator`] with [`HostBuffer`]s (host `Vec`s).
//!
//! # How an op runs
//!
//! Each rank posts a descriptor (op, dtype, lengths, root, and a raw pointer to the memory peers
//! must read) and waits until every rank of the group has posted. Every rank then checks all the
//! descriptors the same way; on any disagreement every rank returns the same error and nothing
//! moves. Otherwise each rank computes *its own* output by reading its peers' memory directly (no
//! intermediate copy), and waits at a completion barrier so that no rank returns, and frees or
//! overwrites its buffers, while a peer still reads them. An all-reduce has one more barrier between
//! its reduce-scatter and all-gather halves. Reductions read the inputs in rank order, so results
//! do not depend on thread timing.
//!
//! # Reduction order
//!
//! Reductions sum in rank order by default ([`ReduceOrder::RankSequential`]).
//! [`HostWorld::with_reduce_order`] switches a whole world (and every communicator split from it)
//! to [`ReduceOrder::PairwiseTree`], the canonical tree that makes a trainer's sums independent of
//! the world size; [`Communicator::reduce_order`] reports the choice.
//!
//! # Failures
//!
//! - A rank whose thread panics fails the whole world (every communicator split from it): every
//!   pending and later op on every other rank returns [`Error::PeerFailed`] naming it.
//! - A rank that drops a communicator without panicking leaves that communicator's group: pending
//!   and later ops of the group's other members fail with [`Error::PeerFailed`]. Other groups go on.
//! - A rank that does not arrive within the timeout makes the waiting ranks return
//!   [`Error::Timeout`] listing the missing ranks; the world is then aborted and every later call
//!   fails fast with [`Error::Aborted`].

pub(crate) mod kernels;
pub(crate) mod loopback;
pub mod probe;
pub(crate) mod rendezvous;

use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use zero_core::{Collective, Topology, TrafficTable};

use crate::communicator::{Communicator, ReduceOrder, group_methods};
use crate::element::{Element, ReduceOp};
use crate::error::{Error, Result};
use crate::validate::{Desc, ar_chunk};
use loopback::{Loopback, loopback_fields};
use rendezvous::{Call, DrainGuard, ROOT_GROUP, RawPtr, World};

/// The timeout of [`HostWorld::new`] callers who have no better idea.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// A host buffer: a `Vec<E>` owned by one rank.
#[derive(Clone, PartialEq)]
pub struct HostBuffer<E: Element> {
    data: Vec<E>,
}

impl<E: Element> HostBuffer<E> {
    /// Wraps `data`.
    pub fn from_vec(data: Vec<E>) -> Self {
        HostBuffer { data }
    }

    /// The elements.
    pub fn into_vec(self) -> Vec<E> {
        self.data
    }

    /// The elements.
    pub fn as_slice(&self) -> &[E] {
        &self.data
    }

    /// The elements, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [E] {
        &mut self.data
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

impl<E: Element> HostBuffer<E> {
    /// `download`: copies the buffer into `dst`, which must have its length.
    pub(crate) fn copy_to(&self, dst: &mut [E]) -> Result<()> {
        if dst.len() != self.len() {
            return Err(Error::BufferLength {
                what: "download",
                buffer: self.len(),
                host: dst.len(),
            });
        }
        dst.copy_from_slice(&self.data);
        Ok(())
    }

    /// `upload_into`: overwrites the buffer with `src`, which must have its length.
    pub(crate) fn copy_from(&mut self, src: &[E]) -> Result<()> {
        if src.len() != self.len() {
            return Err(Error::BufferLength {
                what: "upload_into",
                buffer: self.len(),
                host: src.len(),
            });
        }
        self.data.copy_from_slice(src);
        Ok(())
    }
}

impl<E: Element> From<Vec<E>> for HostBuffer<E> {
    fn from(data: Vec<E>) -> Self {
        HostBuffer { data }
    }
}

impl<E: Element> fmt::Debug for HostBuffer<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostBuffer<{}>[{}]", E::DTYPE, self.data.len())
    }
}

/// The communicators of one in-process world, before they are handed to threads.
#[derive(Debug)]
pub struct HostWorld {
    comms: Vec<HostComm>,
}

impl HostWorld {
    /// One communicator per rank of `topology`, all waiting at most `timeout` for their peers.
    pub fn new(topology: Topology, timeout: Duration) -> HostWorld {
        let world = World::new(topology);
        let members = world.members(ROOT_GROUP);
        let comms = (0..topology.world_size())
            .map(|rank| HostComm {
                world: world.clone(),
                group: ROOT_GROUP,
                rank,
                members: members.clone(),
                timeout,
                order: ReduceOrder::default(),
                traffic: TrafficTable::new(),
                aborted: None,
                _not_sync: PhantomData,
            })
            .collect();
        HostWorld { comms }
    }

    /// Makes every reduction of this world (and of communicators later split from it) sum in
    /// `order`; the default is [`ReduceOrder::RankSequential`]. Set per world, so the ranks cannot
    /// disagree.
    pub fn with_reduce_order(mut self, order: ReduceOrder) -> HostWorld {
        for c in &mut self.comms {
            c.order = order;
        }
        self
    }

    /// The communicators, indexed by rank. Move each to its own thread.
    pub fn into_comms(self) -> Vec<HostComm> {
        self.comms
    }

    /// Runs `f` once per rank, each on its own scoped thread named `rank-<k>`, and returns each
    /// rank's result in rank order. A rank that panics yields `Err` with its panic payload (and its
    /// peers' pending collectives fail with [`Error::PeerFailed`]); it does not abort the process.
    pub fn launch<R, F>(self, f: F) -> Vec<thread::Result<R>>
    where
        R: Send,
        F: Fn(HostComm) -> R + Sync,
    {
        loopback::launch(self.comms, f)
    }
}

/// Shorthand for [`HostWorld::new`] followed by [`HostWorld::launch`].
#[derive(Debug)]
pub struct HostLoopback;

impl HostLoopback {
    /// Runs `f` on every rank of a fresh world; see [`HostWorld::launch`].
    pub fn launch<R, F>(topology: Topology, timeout: Duration, f: F) -> Vec<thread::Result<R>>
    where
        R: Send,
        F: Fn(HostComm) -> R + Sync,
    {
        HostWorld::new(topology, timeout).launch(f)
    }
}

/// One rank of a host loopback group. `Send`, not `Sync`: one thread drives it.
pub struct HostComm {
    world: Arc<World>,
    group: usize,
    rank: usize,
    members: Arc<[usize]>,
    timeout: Duration,
    order: ReduceOrder,
    traffic: TrafficTable,
    aborted: Option<String>,
    _not_sync: PhantomData<Cell<()>>,
}

impl fmt::Debug for HostComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fmt_comm(f, "HostComm")
    }
}

impl Drop for HostComm {
    fn drop(&mut self) {
        self.leave();
    }
}

impl HostComm {
    /// The timeout every wait of this communicator uses.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Changes the timeout of this communicator (not of its peers or of communicators already split
    /// from it).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Runs one op: arrival barrier, identical validation on every rank, then `steps` copy steps
    /// (`work(step, calls, reads)`), each followed by a drain barrier, then traffic accounting.
    ///
    /// `work` reads peers' memory through the pointers in `calls` and writes this rank's output; it
    /// must only touch, in each step, ranges that no peer accesses in that step (documented at each
    /// call site). `reads[j]` counts the elements read from group rank `j`.
    fn run(
        &mut self,
        call: Call,
        elem_bytes: usize,
        steps: usize,
        mut work: impl FnMut(usize, &[Call], &mut [u64]),
    ) -> Result<()> {
        let op = call.desc.op;
        let (published, calls) = self.open(call)?;

        let mut reads = vec![0u64; self.members.len()];
        let guard = DrainGuard::new(&self.world, self.group, self.rank, op, steps);
        let last = guard.run(published, &mut reads, |step, reads| {
            work(step, &calls, reads)
        });
        self.account(op, &last, elem_bytes, &reads);
        Ok(())
    }

    fn all_gather_impl<E: Element>(
        &mut self,
        src: *const E,
        chunk: usize,
        in_place: bool,
        recv: *mut E,
        recv_len: usize,
    ) -> Result<()> {
        let me = self.rank;
        let call = Call::new(
            Desc {
                in_place,
                ..Desc::of(Collective::AllGather, E::DTYPE, chunk, recv_len)
            },
            RawPtr(src.cast()),
        );
        self.run(call, size_of::<E>(), 1, |_, calls, reads| {
            let c = chunk;
            for (j, cj) in calls.iter().enumerate() {
                if j == me && in_place {
                    continue;
                }
                let off = if cj.desc.in_place { j * c } else { 0 };
                // SAFETY: peer `j` posted `src` valid for `recv_len` (in place) or `send_len` (= c)
                // elements, checked above, so `[off, off + c)` is in bounds; it keeps them alive
                // and unwritten until the drain barrier: an out-of-place peer never writes its send
                // buffer, an in-place peer writes only chunks other than its own `j`. We write only
                // our own `recv` at chunk `j`, which no peer reads (in place: we skip our chunk
                // `me`, the one peers read). Own chunk out of place is a local copy between our own
                // distinct buffers.
                unsafe { kernels::copy(cj.src.0.cast::<E>().add(off), recv.add(j * c), c) };
                if j != me {
                    reads[j] += c as u64;
                }
            }
        })
    }
}

impl Loopback for HostComm {
    const NAME: &'static str = "host loopback";

    loopback_fields!(world);
}

/// The buffer methods of a communicator whose buffers are [`HostBuffer`]s (the host loopback, MPI),
/// and its host-slice collectives without the trait's copies: the output buffer is host memory
/// already, so it is returned as it is (one allocation and one pass over the output fewer per
/// call than `download_vec`), and an owned vector is the buffer itself (no copy in).
macro_rules! host_buffer_methods {
    () => {
        fn alloc<E: Element>(&self, len: usize) -> Result<HostBuffer<E>> {
            Ok(HostBuffer::from_vec(vec![E::zeroed(); len]))
        }

        fn upload<E: Element>(&self, src: &[E]) -> Result<HostBuffer<E>> {
            Ok(HostBuffer::from_vec(src.to_vec()))
        }

        fn download<E: Element>(&self, buf: &HostBuffer<E>, dst: &mut [E]) -> Result<()> {
            buf.copy_to(dst)
        }

        fn upload_into<E: Element>(&self, src: &[E], dst: &mut HostBuffer<E>) -> Result<()> {
            dst.copy_from(src)
        }

        fn buffer_len<E: Element>(&self, buf: &HostBuffer<E>) -> usize {
            buf.len()
        }

        fn all_gather_host<E: Element>(&mut self, send: &[E]) -> Result<Vec<E>> {
            self.all_gather_vec(send.to_vec())
        }

        fn reduce_scatter_host<E: Element>(&mut self, send: &[E], op: ReduceOp) -> Result<Vec<E>> {
            self.reduce_scatter_vec(send.to_vec(), op)
        }

        fn all_reduce_vec<E: Element>(&mut self, data: Vec<E>, op: ReduceOp) -> Result<Vec<E>> {
            let mut b = HostBuffer::from_vec(data);
            self.all_reduce(&mut b, op)?;
            Ok(b.into_vec())
        }

        fn all_gather_vec<E: Element>(&mut self, send: Vec<E>) -> Result<Vec<E>> {
            let s = HostBuffer::from_vec(send);
            let mut r = self.alloc(s.len() * self.world_size())?;
            self.all_gather(&s, &mut r)?;
            Ok(r.into_vec())
        }

        fn reduce_scatter_vec<E: Element>(&mut self, send: Vec<E>, op: ReduceOp) -> Result<Vec<E>> {
            let s = HostBuffer::from_vec(send);
            let mut r = self.alloc(s.len() / self.world_size())?;
            self.reduce_scatter(&s, &mut r, op)?;
            Ok(r.into_vec())
        }
    };
}
#[cfg_attr(not(feature = "mpi"), allow(unused_imports))]
pub(crate) use host_buffer_methods;

impl Communicator for HostComm {
    type Buffer<E: Element> = HostBuffer<E>;

    group_methods!(world.topology);

    host_buffer_methods!();

    fn all_gather<E: Element>(
        &mut self,
        send: &HostBuffer<E>,
        recv: &mut HostBuffer<E>,
    ) -> Result<()> {
        let recv_len = recv.len();
        self.all_gather_impl(
            send.data.as_ptr(),
            send.len(),
            false,
            recv.data.as_mut_ptr(),
            recv_len,
        )
    }

    fn all_gather_in_place<E: Element>(&mut self, buf: &mut HostBuffer<E>) -> Result<()> {
        let len = buf.len();
        let p = buf.data.as_mut_ptr();
        self.all_gather_impl(p.cast_const(), len / self.members.len(), true, p, len)
    }

    fn reduce_scatter<E: Element>(
        &mut self,
        send: &HostBuffer<E>,
        recv: &mut HostBuffer<E>,
        op: ReduceOp,
    ) -> Result<()> {
        let me = self.rank;
        let order = self.order;
        let c = recv.len();
        let out = recv.data.as_mut_ptr();
        let call = Call::new(
            Desc::of(Collective::ReduceScatter, E::DTYPE, send.len(), c).reduce(op),
            RawPtr(send.data.as_ptr().cast()),
        );
        self.run(call, size_of::<E>(), 1, |_, calls, reads| {
            let inputs: Vec<*const E> = calls
                .iter()
                .map(|cj| cj.src.0.cast::<E>().wrapping_add(me * c))
                .collect();
            // SAFETY: every peer's send buffer holds `n · c` elements (checked), so chunk `me` is
            // in bounds; send buffers are never written during the op. `out` is our own receive
            // buffer, distinct from every send buffer and read by no peer.
            unsafe { kernels::reduce(&inputs, out, c, op, order) };
            for (j, r) in reads.iter_mut().enumerate() {
                if j != me {
                    *r += c as u64;
                }
            }
        })
    }

    fn all_reduce<E: Element>(&mut self, buf: &mut HostBuffer<E>, op: ReduceOp) -> Result<()> {
        let n = self.members.len();
        let me = self.rank;
        let order = self.order;
        let len = buf.len();
        let p = buf.data.as_mut_ptr();
        let call = Call::new(
            Desc::of(Collective::AllReduce, E::DTYPE, len, len).reduce(op),
            RawPtr(p.cast_const().cast()),
        );
        self.run(call, size_of::<E>(), 2, |step, calls, reads| {
            if step == 0 {
                // Reduce-scatter half: reduce chunk `me` of every buffer into ours.
                let (off, cl) = ar_chunk(len, n, me);
                let inputs: Vec<*const E> = calls
                    .iter()
                    .map(|cj| cj.src.0.cast::<E>().wrapping_add(off))
                    .collect();
                // SAFETY: every buffer holds `len` elements (checked) and chunk `me` lies within it.
                // In this step each rank writes only its own chunk of its own buffer and reads
                // only that chunk of the others', so nobody writes the ranges we read and nobody
                // else touches our chunk `me`. `out` starts exactly at our own input `inputs[me]`,
                // which `reduce` allows.
                unsafe { kernels::reduce(&inputs, p.add(off), cl, op, order) };
                for (j, r) in reads.iter_mut().enumerate() {
                    if j != me {
                        *r += cl as u64;
                    }
                }
            } else {
                // All-gather half: copy each peer's reduced chunk into ours.
                for (j, cj) in calls.iter().enumerate() {
                    if j == me {
                        continue;
                    }
                    let (off, cl) = ar_chunk(len, n, j);
                    // SAFETY: in this step every rank reads only the owner's chunk of the owner's
                    // buffer (finished before the barrier between the steps) and writes only
                    // non-owned chunks of its own, so chunk `j` of peer `j` is not written, and
                    // chunk `j` of ours is read by nobody.
                    unsafe { kernels::copy(cj.src.0.cast::<E>().add(off), p.add(off), cl) };
                    reads[j] += cl as u64;
                }
            }
        })
    }

    fn broadcast<E: Element>(&mut self, buf: &mut HostBuffer<E>, root: usize) -> Result<()> {
        let me = self.rank;
        let len = buf.len();
        let p = buf.data.as_mut_ptr();
        let call = Call::new(
            Desc::of(Collective::Broadcast, E::DTYPE, len, len).root(root),
            RawPtr(p.cast_const().cast()),
        );
        self.run(call, size_of::<E>(), 1, |_, calls, reads| {
            if me != root {
                // SAFETY: the root's buffer holds `len` elements (checked) and the root writes
                // nothing; ours is read by nobody (only the root's is).
                unsafe { kernels::copy(calls[root].src.0.cast::<E>(), p, len) };
                reads[root] += len as u64;
            }
        })
    }

    fn all_to_all<E: Element>(
        &mut self,
        send: &HostBuffer<E>,
        recv: &mut HostBuffer<E>,
    ) -> Result<()> {
        let n = self.members.len();
        let me = self.rank;
        let len = send.len();
        let out = recv.data.as_mut_ptr();
        let call = Call::new(
            Desc::of(Collective::AllToAll, E::DTYPE, len, recv.len()),
            RawPtr(send.data.as_ptr().cast()),
        );
        self.run(call, size_of::<E>(), 1, |_, calls, reads| {
            let c = len / n;
            for (j, cj) in calls.iter().enumerate() {
                // SAFETY: every send buffer holds `n · c` elements (checked) and is never written
                // during the op; our receive buffer is distinct from every send buffer and read by
                // nobody.
                unsafe { kernels::copy(cj.src.0.cast::<E>().add(me * c), out.add(j * c), c) };
                if j != me {
                    reads[j] += c as u64;
                }
            }
        })
    }

    fn barrier(&mut self) -> Result<()> {
        self.run(
            Call::from(Desc::new(Collective::Barrier)),
            0,
            0,
            |_, _, _| {},
        )
    }

    fn split(&mut self, color: usize, key: usize) -> Result<HostComm> {
        let (group, members, rank) = self.split_group(color, key)?;
        Ok(HostComm {
            world: self.world.clone(),
            group,
            rank,
            members,
            timeout: self.timeout,
            order: self.order,
            traffic: TrafficTable::new(),
            aborted: None,
            _not_sync: PhantomData,
        })
    }

    fn reduce_order(&self) -> Option<ReduceOrder> {
        Some(self.order)
    }

    fn traffic(&self) -> &TrafficTable {
        &self.traffic
    }

    fn abort(&mut self, cause: String) {
        self.aborted.get_or_insert(cause);
    }
}
