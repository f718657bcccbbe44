//! The backend-neutral contract: [`Communicator`], and the [`Group`] guard that batches calls.

use std::fmt;

use zero_core::{GroupView, Topology, TrafficTable};

use crate::element::{Element, ReduceOp};
use crate::error::Result;

/// One rank of a group of ranks that run collectives together, modelled on an NCCL communicator.
///
/// # Rules (NCCL's, restated)
///
/// - **Same calls, same order, on every rank.** Every rank of the group must make every collective
///   call (including [`split`](Communicator::split) and [`barrier`](Communicator::barrier)) in the
///   same order, with matching dtypes, reductions, roots and lengths. Backends that can detect a
///   mismatch (the host loopback always does) report it on every rank before any data moves; others
///   may hang until their timeout.
/// - **One thread per communicator.** A communicator is `Send` but deliberately not required to be
///   `Sync`: exactly one thread drives it, and collectives take `&mut self`. A thread that drives
///   several communicators must never block in one while a peer waits for it in another.
/// - **Abort after an error.** After any error other than a validation error (the variants that
///   [`crate::Error`] lists as detected before anything moves), nothing can be assumed about the data, and
///   later calls fail. Rebuild the world.
///
/// # Buffers and lengths
///
/// Collectives work on backend-resident [`Buffer`](Communicator::Buffer)s: a host `Vec` for the
/// host loopback, device memory for the GPU backends. Lengths are in elements. For a group of `n`:
///
/// | op | lengths |
/// |---|---|
/// | [`all_gather`](Communicator::all_gather) | `recv = n · send`; rank `k`'s data lands at `[k·c, (k+1)·c)` |
/// | [`all_gather_in_place`](Communicator::all_gather_in_place) | `buf = n · c`; own chunk already at `[rank·c, (rank+1)·c)` |
/// | [`reduce_scatter`](Communicator::reduce_scatter) | `send = n · recv`; rank `k` gets the reduction of chunk `k` |
/// | [`all_reduce`](Communicator::all_reduce) | any length, equal on every rank |
/// | [`broadcast`](Communicator::broadcast) | any length, equal on every rank |
/// | [`all_to_all`](Communicator::all_to_all) | `send = recv = len`, `len % n == 0`; chunk `j` of rank `k`'s send lands in chunk `k` of rank `j`'s recv |
///
/// Reductions follow [`ReduceOp`]: `f32` accumulation, one rounding, and by default rank-ordered
/// (`((x₀ + x₁) + x₂) + …`). The host loopback can instead sum over the canonical pairwise tree
/// ([`ReduceOrder::PairwiseTree`], chosen per world); [`reduce_order`](Communicator::reduce_order)
/// says which order a communicator promises. NCCL cannot honour either order (its rings and trees
/// depend on the topology and the NCCL version) and promises none; the wgpu loopback reduces in
/// rank order, bit for bit like the host's default, but does not report an order. An all-reduce
/// runs as a reduce-scatter over chunks `k` of `len/n` elements plus one for `k < len % n`,
/// followed by an all-gather of those chunks, so its bits equal a reduce-scatter's on the same
/// elements.
///
/// # Accounting
///
/// Every communicator measures what it moves into a [`TrafficTable`] (see [`zero_core::traffic`]
/// for the convention: logical per-peer exchange, per rank, split by the link class between the two
/// global ranks), so measurements compare with [`GroupView`] predictions by `==`.
pub trait Communicator: Send {
    /// Backend-resident memory holding `E`s.
    type Buffer<E: Element>: Send;

    /// This rank's index in the group, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// This rank's index in the world the group was (transitively) split from, i.e. in
    /// [`topology`](Communicator::topology).
    fn global_rank(&self) -> usize;

    /// The global rank of each group member, indexed by group rank.
    fn members(&self) -> &[usize];

    /// The topology of the whole world (global ranks, nodes, link classes).
    fn topology(&self) -> &Topology;

    /// A zero-filled buffer of `len` elements.
    fn alloc<E: Element>(&self, len: usize) -> Result<Self::Buffer<E>>;

    /// A buffer holding a copy of `src`.
    fn upload<E: Element>(&self, src: &[E]) -> Result<Self::Buffer<E>>;

    /// Copies `buf` into `dst` (waiting for pending work on it). `dst.len()` must equal the buffer's.
    fn download<E: Element>(&self, buf: &Self::Buffer<E>, dst: &mut [E]) -> Result<()>;

    /// Copies `src` into the existing buffer `dst`, ordered after work already issued on it, with
    /// no allocation (a trainer reuses its staging buffers step after step). `src.len()` must
    /// equal the buffer's; a buffer that wraps part of a larger one (wgpu's `from_wgpu`) keeps
    /// the bytes around it.
    fn upload_into<E: Element>(&self, src: &[E], dst: &mut Self::Buffer<E>) -> Result<()>;

    /// Number of elements in `buf`.
    fn buffer_len<E: Element>(&self, buf: &Self::Buffer<E>) -> usize;

    /// Gathers every rank's `send` into `recv`, rank `k`'s at `[k·c, (k+1)·c)` with `c = send.len`.
    fn all_gather<E: Element>(
        &mut self,
        send: &Self::Buffer<E>,
        recv: &mut Self::Buffer<E>,
    ) -> Result<()>;

    /// In-place all-gather: `buf` has `n·c` elements and this rank's chunk is already at
    /// `[rank·c, (rank+1)·c)` (NCCL's in-place layout, which is ZeRO's flat-buffer sharding).
    fn all_gather_in_place<E: Element>(&mut self, buf: &mut Self::Buffer<E>) -> Result<()>;

    /// Reduces chunk `k` (of `c = recv.len` elements) of every rank's `send` into rank `k`'s `recv`.
    fn reduce_scatter<E: Element>(
        &mut self,
        send: &Self::Buffer<E>,
        recv: &mut Self::Buffer<E>,
        op: ReduceOp,
    ) -> Result<()>;

    /// Reduces `buf` across ranks, in place, leaving the same result on every rank.
    fn all_reduce<E: Element>(&mut self, buf: &mut Self::Buffer<E>, op: ReduceOp) -> Result<()>;

    /// Copies group rank `root`'s `buf` into every other rank's `buf`.
    fn broadcast<E: Element>(&mut self, buf: &mut Self::Buffer<E>, root: usize) -> Result<()>;

    /// Equal-split all-to-all: chunk `j` of this rank's `send` goes to chunk `rank` of rank `j`'s
    /// `recv`.
    fn all_to_all<E: Element>(
        &mut self,
        send: &Self::Buffer<E>,
        recv: &mut Self::Buffer<E>,
    ) -> Result<()>;

    /// Returns once every rank of the group has called it.
    fn barrier(&mut self) -> Result<()>;

    /// `MPI_Comm_split`: a collective over this group. Ranks that pass the same `color` form a new
    /// communicator, ordered by `(key, rank)`. The new communicator shares the world's failure state
    /// and keeps its own traffic table.
    fn split(&mut self, color: usize, key: usize) -> Result<Self>
    where
        Self: Sized;

    /// The summation order this communicator's reductions promise, or `None` when it promises
    /// none (the default: NCCL, whose order depends on its algorithm choice, and any backend that
    /// does not say). Only a backend that returns `Some` may be relied on for results that are
    /// bit-identical across world sizes (see [`ReduceOrder::PairwiseTree`]).
    fn reduce_order(&self) -> Option<ReduceOrder> {
        None
    }

    /// Cumulative traffic of this rank on this communicator (sub-communicators count their own).
    fn traffic(&self) -> &TrafficTable;

    /// Marks this communicator aborted: every later call fails with [`crate::Error::Aborted`] naming
    /// `cause`. Used by [`Group`] when a group dropped without [`Group::finish`] fails.
    fn abort(&mut self, cause: String);

    /// Called by [`Group`] before its first queued op runs (NCCL: `ncclGroupStart`).
    fn group_start(&mut self) -> Result<()> {
        Ok(())
    }

    /// Called by [`Group`] after its last queued op was issued (NCCL: `ncclGroupEnd`).
    fn group_end(&mut self) -> Result<()> {
        Ok(())
    }

    /// Opens a group: ops queued on the returned guard are issued together when it finishes or
    /// drops, and their buffers stay borrowed until then. See [`Group`].
    fn group(&mut self) -> Group<'_, Self>
    where
        Self: Sized,
    {
        Group {
            comm: self,
            ops: Vec::new(),
        }
    }

    /// The group as a [`GroupView`], for predicting traffic with zero-core's formulas.
    fn group_view(&self) -> GroupView<'_> {
        GroupView {
            topology: self.topology(),
            members: self.members(),
            me: self.rank(),
        }
    }

    /// Downloads `buf` into a new `Vec`.
    fn download_vec<E: Element>(&self, buf: &Self::Buffer<E>) -> Result<Vec<E>> {
        let mut out = vec![E::zeroed(); self.buffer_len(buf)];
        self.download(buf, &mut out)?;
        Ok(out)
    }

    /// [`all_gather`](Communicator::all_gather) of a host slice.
    fn all_gather_host<E: Element>(&mut self, send: &[E]) -> Result<Vec<E>> {
        let s = self.upload(send)?;
        let mut r = self.alloc(send.len() * self.world_size())?;
        self.all_gather(&s, &mut r)?;
        self.download_vec(&r)
    }

    /// [`reduce_scatter`](Communicator::reduce_scatter) of a host slice (`send.len() / n` out).
    fn reduce_scatter_host<E: Element>(&mut self, send: &[E], op: ReduceOp) -> Result<Vec<E>> {
        let s = self.upload(send)?;
        let mut r = self.alloc(send.len() / self.world_size())?;
        self.reduce_scatter(&s, &mut r, op)?;
        self.download_vec(&r)
    }

    /// [`all_reduce`](Communicator::all_reduce) of a host slice, in place.
    fn all_reduce_host<E: Element>(&mut self, data: &mut [E], op: ReduceOp) -> Result<()> {
        let mut b = self.upload(data)?;
        self.all_reduce(&mut b, op)?;
        self.download(&b, data)
    }

    /// [`all_reduce_host`](Communicator::all_reduce_host) of an owned vector, returned reduced. A
    /// communicator whose buffers are host memory reduces the vector itself, with no copy in or
    /// out.
    fn all_reduce_vec<E: Element>(&mut self, mut data: Vec<E>, op: ReduceOp) -> Result<Vec<E>> {
        self.all_reduce_host(&mut data, op)?;
        Ok(data)
    }

    /// [`all_gather_host`](Communicator::all_gather_host) of an owned vector. A communicator whose
    /// buffers are host memory sends the vector itself, with no copy in.
    fn all_gather_vec<E: Element>(&mut self, send: Vec<E>) -> Result<Vec<E>> {
        self.all_gather_host(&send)
    }

    /// [`reduce_scatter_host`](Communicator::reduce_scatter_host) of an owned vector. A
    /// communicator whose buffers are host memory sends the vector itself, with no copy in.
    fn reduce_scatter_vec<E: Element>(&mut self, send: Vec<E>, op: ReduceOp) -> Result<Vec<E>> {
        self.reduce_scatter_host(&send, op)
    }

    /// [`broadcast`](Communicator::broadcast) of a host slice, in place.
    fn broadcast_host<E: Element>(&mut self, data: &mut [E], root: usize) -> Result<()> {
        let mut b = self.upload(data)?;
        self.broadcast(&mut b, root)?;
        self.download(&b, data)
    }

    /// [`all_to_all`](Communicator::all_to_all) of a host slice.
    fn all_to_all_host<E: Element>(&mut self, send: &[E]) -> Result<Vec<E>> {
        let s = self.upload(send)?;
        let mut r = self.alloc(send.len())?;
        self.all_to_all(&s, &mut r)?;
        self.download_vec(&r)
    }
}

type QueuedOp<'g, C> = Box<dyn FnOnce(&mut C) -> Result<()> + 'g>;

/// The order in which a reduction combines the `n` ranks' inputs (each element independently,
/// accumulating in `f32` and rounding once, as [`ReduceOp`] says).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ReduceOrder {
    /// `((x₀ + x₁) + x₂) + … + xₙ₋₁`: the host loopback's default, and the wgpu loopback's order.
    #[default]
    RankSequential,
    /// The canonical pairwise tree: the sum over ranks `[lo, hi)` is the sum over `[lo, mid)` plus
    /// the sum over `[mid, hi)`, with `mid = lo + `[`pairwise_split`]`(hi - lo)` (the largest power
    /// of two strictly below `hi - lo`).
    ///
    /// Every aligned block of `2^k` leaves is a subtree of this tree, and the tree over the blocks
    /// is the same rule over the block count. So `G` groups of `n` consecutive leaves, each summed
    /// by this tree and then combined by this tree, give the tree over all `G·n` leaves whenever
    /// `n` is a power of two or `G = 1`: a trainer that numbers micro-batches `a·n + rank` sums the
    /// same tree for every world size `n` that is a power of two. Only the host loopback
    /// implements it; NCCL cannot honour it.
    PairwiseTree,
}

/// Where [`ReduceOrder::PairwiseTree`] splits a range of `len ≥ 2` leaves: the largest power of
/// two strictly less than `len` (so the left part is a full power-of-two subtree).
///
/// ```
/// use zero_comm::pairwise_split;
/// assert_eq!([2, 3, 4, 5, 8, 9].map(pairwise_split), [1, 2, 2, 4, 4, 8]);
/// ```
///
/// # Panics
///
/// If `len < 2` (there is nothing to split).
pub fn pairwise_split(len: usize) -> usize {
    assert!(
        len >= 2,
        "a pairwise split needs at least 2 leaves, got {len}"
    );
    1 << (usize::BITS - 1 - (len - 1).leading_zeros())
}

/// A batch of collectives issued together, NCCL-group style, as an RAII guard.
///
/// Ops queued on the guard borrow their buffers for the guard's lifetime `'g`, so the results
/// cannot be read (and inputs cannot be changed) before the group has run: the borrow checker
/// enforces what NCCL only documents. The group runs on [`finish`](Group::finish), which returns
/// the first error, or on drop, so an early `?` cannot leave it open; an error seen on drop aborts
/// the communicator ([`Communicator::abort`]) so the next call reports it. A group dropped while
/// its thread panics is discarded (the rank is failing anyway).
///
/// Backends with streams (NCCL) issue the queued ops between `ncclGroupStart` and `ncclGroupEnd`
/// and return once they are enqueued, so communication overlaps whatever the caller does next until
/// it downloads a result. The host loopback runs them one after another, synchronously, when the
/// group ends.
///
/// ```compile_fail
/// use zero_comm::{Communicator, host::HostWorld};
/// # let topo = zero_core::Topology::single_node(1).unwrap();
/// let mut comm = HostWorld::new(topo, std::time::Duration::from_secs(1)).into_comms().remove(0);
/// let send = comm.upload(&[1.0f32]).unwrap();
/// let mut recv = comm.alloc::<f32>(1).unwrap();
/// let mut group = comm.group();
/// group.all_gather(&send, &mut recv);
/// let early = recv.as_slice()[0]; // error: `recv` is still borrowed by the open group
/// group.finish().unwrap();
/// ```
///
/// The same lines with the read moved after [`finish`](Group::finish) compile and run (so the
/// example above fails for the borrow alone):
///
/// ```
/// use zero_comm::{Communicator, host::HostWorld};
/// # let topo = zero_core::Topology::single_node(1).unwrap();
/// let mut comm = HostWorld::new(topo, std::time::Duration::from_secs(1)).into_comms().remove(0);
/// let send = comm.upload(&[1.0f32]).unwrap();
/// let mut recv = comm.alloc::<f32>(1).unwrap();
/// let mut group = comm.group();
/// group.all_gather(&send, &mut recv);
/// group.finish().unwrap();
/// let late = recv.as_slice()[0];
/// assert_eq!(late, 1.0);
/// ```
pub struct Group<'g, C: Communicator + 'g> {
    comm: &'g mut C,
    ops: Vec<QueuedOp<'g, C>>,
}

impl<C: Communicator> fmt::Debug for Group<'_, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.comm.rank())
            .field("queued", &self.ops.len())
            .finish()
    }
}

impl<'g, C: Communicator + 'g> Group<'g, C> {
    fn push(&mut self, op: impl FnOnce(&mut C) -> Result<()> + 'g) -> &mut Self {
        self.ops.push(Box::new(op));
        self
    }

    /// Number of queued ops.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Queues [`Communicator::all_gather`].
    pub fn all_gather<E: Element>(
        &mut self,
        send: &'g C::Buffer<E>,
        recv: &'g mut C::Buffer<E>,
    ) -> &mut Self {
        self.push(move |c| c.all_gather(send, recv))
    }

    /// Queues [`Communicator::all_gather_in_place`].
    pub fn all_gather_in_place<E: Element>(&mut self, buf: &'g mut C::Buffer<E>) -> &mut Self {
        self.push(move |c| c.all_gather_in_place(buf))
    }

    /// Queues [`Communicator::reduce_scatter`].
    pub fn reduce_scatter<E: Element>(
        &mut self,
        send: &'g C::Buffer<E>,
        recv: &'g mut C::Buffer<E>,
        op: ReduceOp,
    ) -> &mut Self {
        self.push(move |c| c.reduce_scatter(send, recv, op))
    }

    /// Queues [`Communicator::all_reduce`].
    pub fn all_reduce<E: Element>(&mut self, buf: &'g mut C::Buffer<E>, op: ReduceOp) -> &mut Self {
        self.push(move |c| c.all_reduce(buf, op))
    }

    /// Queues [`Communicator::broadcast`].
    pub fn broadcast<E: Element>(&mut self, buf: &'g mut C::Buffer<E>, root: usize) -> &mut Self {
        self.push(move |c| c.broadcast(buf, root))
    }

    /// Queues [`Communicator::all_to_all`].
    pub fn all_to_all<E: Element>(
        &mut self,
        send: &'g C::Buffer<E>,
        recv: &'g mut C::Buffer<E>,
    ) -> &mut Self {
        self.push(move |c| c.all_to_all(send, recv))
    }

    /// Issues every queued op and returns the first error. After an error the remaining ops are
    /// not issued (on any rank, when the error is one every rank detects).
    pub fn finish(mut self) -> Result<()> {
        self.run()
    }

    fn run(&mut self) -> Result<()> {
        let ops = std::mem::take(&mut self.ops);
        if ops.is_empty() {
            return Ok(());
        }
        self.comm.group_start()?;
        let mut result = Ok(());
        for op in ops {
            result = op(self.comm);
            if result.is_err() {
                break;
            }
        }
        let end = self.comm.group_end();
        result.and(end)
    }
}

impl<'g, C: Communicator + 'g> Drop for Group<'g, C> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.ops.clear();
            return;
        }
        if let Err(e) = self.run() {
            self.comm
                .abort(format!("a group dropped without finish() failed: {e}"));
        }
    }
}

/// The group accessors of a communicator that keeps its group rank in `self.rank` and its members'
/// global ranks in `self.members`, with the world's topology at the field path given.
macro_rules! group_methods {
    ($($topology:ident).+) => {
        fn rank(&self) -> usize {
            self.rank
        }

        fn world_size(&self) -> usize {
            self.members.len()
        }

        fn global_rank(&self) -> usize {
            self.members[self.rank]
        }

        fn members(&self) -> &[usize] {
            &self.members
        }

        fn topology(&self) -> &Topology {
            &self.$($topology).+
        }
    };
}
pub(crate) use group_methods;
