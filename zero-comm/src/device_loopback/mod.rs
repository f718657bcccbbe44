//! The device loopbacks: N ranks, one thread each, on **one** device with one in-order queue (a
//! wgpu queue, a CUDA stream), with data in device buffers. The collective algorithms are written
//! here once, over the device's [`Memory`]: copies from peers' buffers and rank-ordered
//! reductions. The devices add only their memory and kernels (`wgpu_loopback`,
//! `nccl::backend::loopback`, whose `CudaWorld`, `CudaComm` and `CudaDevice` `nccl` re-exports).
//!
//! The contract, the validation, the failure behaviour and the byte accounting are the host
//! loopback's ([`crate::host`]), which is the oracle: results are bit-identical to it (see
//! [`ReduceOp`](crate::ReduceOp) for the order and rounding).
//!
//! # How an op runs
//!
//! As on the host: every rank posts a descriptor (op, dtype, lengths, root, and a pointer to the
//! buffer peers read) at an arrival barrier of the shared rendezvous, every rank checks all
//! descriptors the same way (a mismatch fails every rank identically, before anything moves), then
//! each rank records the commands that produce *its own* output (copies from its peers' buffers,
//! or one reduction over every rank's input in group-rank order), submits them to the shared queue
//! and waits at a drain barrier. The queue executes submissions in order, so once every rank has
//! submitted, any later command (a download, the next op, a peer overwriting its input) sees the
//! op's results. An all-reduce has a second barrier between its reduce-scatter and all-gather
//! halves. Ops return once their commands are submitted, not executed;
//! [`download`](Communicator::download) and [`LoopbackComm::synchronize`] wait for the device.
//!
//! # Failures
//!
//! Exactly the host loopback's, from the same rendezvous code: a rank whose thread panics fails
//! the world ([`Error::PeerFailed`] naming it on every rank, promptly); a dropped communicator fails
//! its group; a rank that does not arrive within the timeout makes its peers return
//! [`Error::Timeout`] and aborts the world. In addition, a device error while a rank records or
//! submits an op (out of memory, a lost device) fails that rank with [`Error::Backend`] and the
//! world with [`FailureReason::Backend`] naming it.

mod memory;
mod ops;

use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::Duration;

use zero_core::{Topology, TrafficTable};

use crate::communicator::Communicator;
use crate::error::{Error, FailureReason, Op, Result};
use crate::host::loopback::{self, Loopback, loopback_fields};
use crate::host::rendezvous::{Call, DrainGuard, ROOT_GROUP, RawPtr, World};

pub use memory::Memory;
pub(crate) use memory::{Loc, Recorder, Sealed};

/// What the communicators of one world share: the rendezvous, the device, and the ranks that
/// failed in the backend (which the rendezvous records as failed ranks).
#[derive(Debug)]
pub(crate) struct Shared<M> {
    pub(crate) world: Arc<World>,
    pub(crate) device: Arc<M>,
    backend_failures: Mutex<Vec<(usize, String)>>,
}

impl<M> Shared<M> {
    fn backend_failure(&self, rank: usize) -> Option<String> {
        let failures = self
            .backend_failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        failures
            .iter()
            .find(|(r, _)| *r == rank)
            .map(|(_, m)| m.clone())
    }
}

/// The communicators of one loopback world on device `M`, before they are handed to threads.
#[derive(Debug)]
pub struct LoopbackWorld<M: Memory> {
    device: Arc<M>,
    comms: Vec<LoopbackComm<M>>,
}

impl<M: Memory> LoopbackWorld<M> {
    /// One communicator per rank of `topology` on `device`, all waiting at most `timeout` for their
    /// peers. Several worlds may share a device.
    pub fn with_device(device: Arc<M>, topology: Topology, timeout: Duration) -> LoopbackWorld<M> {
        let world = World::new(topology);
        let members = world.members(ROOT_GROUP);
        let shared = Arc::new(Shared {
            world,
            device: device.clone(),
            backend_failures: Mutex::new(Vec::new()),
        });
        let comms = (0..topology.world_size())
            .map(|rank| LoopbackComm {
                shared: shared.clone(),
                group: ROOT_GROUP,
                rank,
                members: members.clone(),
                timeout,
                traffic: TrafficTable::new(),
                aborted: None,
                scratch: M::Scratch::default(),
                _not_sync: PhantomData,
            })
            .collect();
        LoopbackWorld { device, comms }
    }

    /// The device every rank uses.
    pub fn device(&self) -> &Arc<M> {
        &self.device
    }

    /// The communicators, indexed by rank. Move each to its own thread.
    pub fn into_comms(self) -> Vec<LoopbackComm<M>> {
        self.comms
    }

    /// Runs `f` once per rank, each on its own scoped thread named `rank-<k>`, and returns each
    /// rank's result in rank order. A rank that panics yields `Err` with its panic payload (and its
    /// peers' pending collectives fail with [`Error::PeerFailed`]); it does not abort the process.
    pub fn launch<R, F>(self, f: F) -> Vec<thread::Result<R>>
    where
        R: Send,
        F: Fn(LoopbackComm<M>) -> R + Sync,
    {
        loopback::launch(self.comms, f)
    }
}

/// One rank of a device loopback group. `Send`, not `Sync`: one thread drives it.
pub struct LoopbackComm<M: Memory> {
    pub(crate) shared: Arc<Shared<M>>,
    group: usize,
    rank: usize,
    members: Arc<[usize]>,
    timeout: Duration,
    traffic: TrafficTable,
    aborted: Option<String>,
    /// Reduction accumulators and bounce buffers, grown on demand.
    pub(crate) scratch: M::Scratch,
    _not_sync: PhantomData<Cell<()>>,
}

impl<M: Memory> fmt::Debug for LoopbackComm<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fmt_comm(f, M::COMM)
    }
}

impl<M: Memory> Drop for LoopbackComm<M> {
    fn drop(&mut self) {
        self.leave();
    }
}

/// The buffer a peer posted in its call descriptor.
///
/// # Safety
///
/// `call` must come from the arrival barrier of the op in progress, whose owner posted a pointer to
/// a live view (of type `V`), and the reference must not outlive the op's last drain barrier: until
/// then the owner is blocked in the same op and keeps its buffer alive and unmodified (it only
/// records commands that read it).
unsafe fn peer<'a, V>(call: &Call) -> &'a V {
    // SAFETY: per the function's contract.
    unsafe { &*call.src.0.cast::<V>() }
}

fn post<V>(view: &V) -> RawPtr {
    RawPtr(std::ptr::from_ref(view).cast())
}

fn loc<V>(view: &V, elem: usize, es: usize) -> Loc<'_, V> {
    Loc {
        view,
        byte: (elem * es) as u64,
    }
}

impl<M: Memory> LoopbackComm<M> {
    /// The timeout every wait of this communicator uses (rendezvous and downloads).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Changes the timeout of this communicator (not of its peers or of communicators already split
    /// from it).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The device this communicator runs on.
    pub fn device(&self) -> &Arc<M> {
        &self.shared.device
    }

    /// Waits until every command submitted to the shared queue so far has executed (ops return
    /// once their commands are submitted). For benchmarks, or before reading buffers another way.
    pub fn synchronize(&self) -> Result<()> {
        self.shared.device.synchronize(self.timeout)
    }

    /// Fails this rank in the backend: records why, fails the world (peers get
    /// [`FailureReason::Backend`]) and aborts this communicator.
    pub(crate) fn fail_backend(&mut self, op: Op, msg: String) -> Error {
        let me = self.global_rank();
        self.shared
            .backend_failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((me, msg.clone()));
        self.shared.world.leave(self.group, me, true);
        let e = Error::Backend(format!("{op} on rank {me}: {msg}"));
        self.aborted.get_or_insert_with(|| e.to_string());
        e
    }

    /// Runs one op: arrival barrier, identical validation on every rank, then `steps` steps, each
    /// recording this rank's commands (`work(step, calls, reads, batch)`), submitting them and
    /// waiting at a drain barrier; then traffic accounting.
    ///
    /// `work` records commands that read peers' buffers (through the views in `calls`) and write
    /// this rank's output; in each step it must only write ranges that no peer reads in that step.
    /// `reads[j]` counts the elements read from group rank `j`.
    fn run(
        &mut self,
        call: Call,
        elem_bytes: usize,
        steps: usize,
        mut work: impl FnMut(usize, &[Call], &mut [u64], &mut M::Batch<'_>),
    ) -> Result<()> {
        let op = call.desc.op;
        let (published, calls) = self.open(call)?;

        let mut reads = vec![0u64; self.members.len()];
        let mut failure = None;
        let shared = &*self.shared;
        let scratch = &mut self.scratch;
        let guard = DrainGuard::new(&shared.world, self.group, self.rank, op, steps);
        let last = guard.run(published, &mut reads, |step, reads| {
            if failure.is_none() {
                let mut batch = shared.device.batch();
                work(step, &calls, reads, &mut batch);
                if let Err(e) = batch.submit(scratch) {
                    failure = Some(e);
                }
            }
        });
        if let Some(msg) = failure {
            return Err(self.fail_backend(op, msg));
        }
        self.account(op, &last, elem_bytes, &reads);
        Ok(())
    }
}

impl<M: Memory> Loopback for LoopbackComm<M> {
    const NAME: &'static str = M::NAME;

    loopback_fields!(shared.world);

    /// Turns a rendezvous error into this backend's: a rank that failed in the backend is
    /// recorded by the rendezvous as failed; name the real reason.
    fn translate(&self, e: Error) -> Error {
        match e {
            Error::PeerFailed {
                op,
                rank,
                failed_rank,
                reason: FailureReason::Panicked,
            } => {
                let reason = self
                    .shared
                    .backend_failure(failed_rank)
                    .map_or(FailureReason::Panicked, FailureReason::Backend);
                Error::PeerFailed {
                    op,
                    rank,
                    failed_rank,
                    reason,
                }
            }
            e => e,
        }
    }
}
