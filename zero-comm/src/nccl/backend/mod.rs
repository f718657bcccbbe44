//! The real backend (feature `nccl`): [`NcclComm`] over cudarc's CUDA driver and NCCL bindings.

mod buffer;
mod calls;
mod collectives;
mod ffi;
pub(super) mod finish;
pub(super) mod kernels;
pub(super) mod loopback;

pub use buffer::NcclBuffer;

use std::cell::RefCell;
use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
    DeviceRepr, DriverError,
};
use cudarc::nccl::sys;
use zero_core::{Collective, Topology, TrafficTable};

use super::Runtime;
use super::bootstrap::{self, LaunchEnv, UniqueId};
use super::options::{NcclOptions, WaitMode};
use crate::communicator::Communicator;
use crate::element::{DType, Element, ReduceOp};
use crate::error::{Error, Op, Result};
use crate::tally::Tally;
use crate::validate::{Desc, validate};
use crate::wire::DESC_BYTES;
use ffi::{Backoff, Fail, RawComm};

/// Most collectives a [`WaitMode::Lazy`] communicator keeps in flight before waiting for the
/// oldest.
const MAX_PENDING: usize = 1024;

pub(super) fn probe() -> Result<Runtime> {
    ffi::guarded("probing CUDA and NCCL", ffi::runtime)
}

pub(super) fn unique_id() -> Result<UniqueId> {
    ffi::guarded("ncclGetUniqueId", ffi::unique_id)
}

/// The NCCL collectives [`NcclComm::issue`] calls (the reductions sum).
#[derive(Clone, Copy)]
enum Raw {
    AllGather,
    ReduceScatter,
    AllReduce,
    /// From this root rank of the communicator.
    Broadcast(c_int),
}

impl Raw {
    /// The NCCL function it calls.
    fn name(self) -> &'static str {
        match self {
            Raw::AllGather => "ncclAllGather",
            Raw::ReduceScatter => "ncclReduceScatter",
            Raw::AllReduce => "ncclAllReduce",
            Raw::Broadcast(_) => "ncclBroadcast",
        }
    }
}

fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::U8 => sys::ncclDataType_t::ncclUint8,
    }
}

fn driver(what: &str, e: DriverError) -> Error {
    Error::Backend(format!("cuda: {what}: {e}"))
}

/// Failure state shared by a world communicator and every communicator split from it (in this
/// process), as with the host loopback: an abort in one fails the others at their next call.
#[derive(Debug, Default)]
struct WorldState {
    failure: Mutex<Option<String>>,
}

impl WorldState {
    fn get(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn set(&self, cause: &str) {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert_with(|| cause.to_string());
    }
}

/// A collective enqueued on the stream, not yet seen complete.
struct Pending {
    op: Op,
    event: CudaEvent,
    issued: Instant,
}

/// A mean division queued inside a group, launched after `ncclGroupEnd` (when the reduction it
/// follows is actually enqueued).
struct Deferred {
    ptr: CUdeviceptr,
    len: usize,
    dtype: DType,
}

#[derive(Default)]
struct State {
    /// `None` once aborted (outside a group; inside one, the abort waits for `ncclGroupEnd`).
    raw: Option<RawComm>,
    pending: VecDeque<Pending>,
    aborted: Option<String>,
    group_depth: usize,
    group_first_op: Option<Op>,
    deferred: Vec<Deferred>,
}

/// One rank of an NCCL communicator: one process (or thread) per GPU, device-resident
/// [`NcclBuffer`]s. See the [module docs](super) for the contract and its deviations.
pub struct NcclComm {
    // First, so the NCCL handle is aborted before the stream and context references go.
    state: RefCell<State>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Arc<kernels::MeanKernels>,
    world: Arc<WorldState>,
    rank: usize,
    members: Arc<[usize]>,
    topology: Topology,
    opts: NcclOptions,
    nonblocking: bool,
    traffic: TrafficTable,
}

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.state.borrow();
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world_size", &self.members.len())
            .field("global_rank", &self.global_rank())
            .field("device", &self.ctx.ordinal())
            .field("nonblocking", &self.nonblocking)
            .field("options", &self.opts)
            .field("pending", &st.pending.len())
            .field("aborted", &st.aborted)
            .finish_non_exhaustive()
    }
}

impl NcclComm {
    /// One rank of the world that the launch variables describe (see [`bootstrap`]), with
    /// [`NcclOptions::from_env`]. Rank 0 makes the unique id and serves it at
    /// `MASTER_ADDR:MASTER_PORT`; the GPU is `LOCAL_RANK` unless `ZERO_NCCL_DEVICE` says otherwise.
    pub fn from_env() -> Result<NcclComm> {
        let env = LaunchEnv::from_env()?;
        let opts = NcclOptions::from_env()?;
        NcclComm::new(&env, opts)
    }

    /// One rank of the world `env` describes. Probes libcuda, libnccl and the device first, so a
    /// machine without them gets an error (never a panic) before the rendezvous.
    pub fn new(env: &LaunchEnv, opts: NcclOptions) -> Result<NcclComm> {
        let topology = env.topology()?;
        let device = opts.device.unwrap_or(env.local_rank);
        check_device(device, env.local_rank)?;
        let id = bootstrap::exchange_unique_id(env, opts.timeout, unique_id)?;
        NcclComm::from_unique_id(&id, env.rank, topology, device, opts)
    }

    /// A world of one rank on `device`, with no rendezvous.
    pub fn single(device: usize, opts: NcclOptions) -> Result<NcclComm> {
        check_device(device, device)?;
        let id = unique_id()?;
        NcclComm::from_unique_id(&id, 0, Topology::single_node(1)?, device, opts)
    }

    /// Makes a fresh NCCL unique id (rank 0's job; ship it to the others yourself, or use
    /// [`new`](Self::new)).
    pub fn unique_id() -> Result<UniqueId> {
        unique_id()
    }

    /// Rank `rank` of `topology.world_size()` ranks that share `id`, on CUDA device `device`.
    /// Every rank must call this (NCCL's init is collective); it waits at most `opts.timeout` in
    /// non-blocking mode, forever in blocking mode.
    pub fn from_unique_id(
        id: &UniqueId,
        rank: usize,
        topology: Topology,
        device: usize,
        opts: NcclOptions,
    ) -> Result<NcclComm> {
        let world = topology.world_size();
        if rank >= world {
            return Err(Error::Backend(format!(
                "nccl: rank {rank} is not below the world size {world}"
            )));
        }
        check_device(device, device)?;
        ffi::guarded("creating the communicator", || {
            let ctx = CudaContext::new(device).map_err(|e| driver("CudaContext::new", e))?;
            let stream = ctx
                .new_stream()
                .map_err(|e| driver("creating the communicator's stream", e))?;
            ctx.bind_to_thread()
                .map_err(|e| driver("binding the context", e))?;
            let (raw, nonblocking) =
                ffi::init_rank(id, rank, world, opts.nonblocking, opts.timeout)?;
            Ok(NcclComm {
                ctx,
                stream,
                kernels: Arc::default(),
                world: Arc::default(),
                state: RefCell::new(State {
                    raw: Some(raw),
                    ..State::default()
                }),
                rank,
                members: (0..world).collect(),
                topology,
                opts,
                nonblocking,
                traffic: TrafficTable::new(),
            })
        })
    }

    /// The CUDA stream every collective and copy of this communicator runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The CUDA context (the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The CUDA device ordinal.
    pub fn device(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The options in force.
    pub fn options(&self) -> &NcclOptions {
        &self.opts
    }

    /// Changes the timeout of later waits.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.opts.timeout = timeout;
    }

    /// Changes when later collectives return.
    pub fn set_wait(&mut self, wait: WaitMode) {
        self.opts.wait = wait;
    }

    /// Turns the exchange of call descriptors before each collective on or off. Every rank of the
    /// group must make the same choice, in the same place of its call sequence.
    pub fn set_check_peers(&mut self, on: bool) {
        self.opts.check_peers = on;
    }

    /// Whether the communicator was created in NCCL's non-blocking mode.
    pub fn is_nonblocking(&self) -> bool {
        self.nonblocking
    }

    /// Whether the communicator is aborted.
    pub fn is_aborted(&self) -> bool {
        self.state.borrow().aborted.is_some()
    }

    /// Waits (at most the timeout per collective) until every enqueued collective completed.
    pub fn synchronize(&mut self) -> Result<()> {
        self.drain(true)
    }

    fn global_rank_of(&self, j: usize) -> usize {
        self.members[j]
    }

    fn me(&self) -> usize {
        self.global_rank_of(self.rank)
    }

    fn cu_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("binding the context", e))
    }

    fn aborted_err(&self, op: Op, cause: String) -> Error {
        Error::Aborted {
            op,
            rank: self.me(),
            cause,
        }
    }

    fn timeout_err(&self, op: Op, waited: Duration) -> Error {
        Error::Timeout {
            op,
            rank: self.me(),
            waited,
            // NCCL cannot tell which peer is late: every other member is a suspect.
            missing: (0..self.members.len())
                .filter(|&j| j != self.rank)
                .map(|j| self.global_rank_of(j))
                .collect(),
        }
    }

    /// Aborts this communicator (and marks its world failed). Inside a group the NCCL handle is
    /// kept until `ncclGroupEnd`, which still references it.
    fn abort_with(&self, cause: &str) {
        let raw = {
            let mut st = self.state.borrow_mut();
            st.aborted.get_or_insert_with(|| cause.to_string());
            st.pending.clear();
            st.deferred.clear();
            if st.group_depth == 0 {
                st.raw.take()
            } else {
                None
            }
        };
        if raw.is_some() {
            let _ = self.bind();
        }
        drop(raw); // ncclCommAbort
        self.world.set(cause);
    }

    /// Turns a failed wait or call into an error, aborting the communicator.
    fn fail(&self, op: Op, f: Fail) -> Error {
        let err = match f {
            Fail::Nccl(m) => Error::Backend(format!(
                "nccl: {op} on rank {}: {m}; communicator aborted",
                self.me()
            )),
            Fail::Timeout(w) => self.timeout_err(op, w),
        };
        self.abort_with(&err.to_string());
        err
    }

    fn fail_driver(&self, op: Op, what: &str, e: DriverError) -> Error {
        let err = Error::Backend(format!(
            "cuda: {op} on rank {}: {what}: {e}; communicator aborted",
            self.me()
        ));
        self.abort_with(&err.to_string());
        err
    }

    /// The live handle, or the abort that ended it.
    fn handle(&self, op: Op) -> Result<sys::ncclComm_t> {
        let st = self.state.borrow();
        if let Some(cause) = &st.aborted {
            return Err(self.aborted_err(op, cause.clone()));
        }
        match &st.raw {
            Some(r) => Ok(r.ptr()),
            None => Err(self.aborted_err(op, "communicator released".into())),
        }
    }

    /// Before an op: not aborted (here or in the world), no asynchronous NCCL error, no overdue
    /// collective.
    fn ensure_usable(&self, op: Op) -> Result<sys::ncclComm_t> {
        let h = self.handle(op)?;
        if let Some(cause) = self.world.get() {
            self.abort_with(&cause);
            return Err(self.aborted_err(op, cause));
        }
        match ffi::async_state(h) {
            Ok(sys::ncclResult_t::ncclSuccess) => {}
            Ok(sys::ncclResult_t::ncclInProgress) => {
                ffi::wait_ready(h, "a previous call", Instant::now(), self.opts.timeout)
                    .map_err(|f| self.fail(op, f))?;
            }
            Ok(e) => {
                let m = ffi::describe("ncclCommGetAsyncError", e, h);
                return Err(self.fail(op, Fail::Nccl(m)));
            }
            Err(f) => return Err(self.fail(op, f)),
        }
        self.drain(false)?;
        self.handle(op)
    }
}

fn check_device(device: usize, local_rank: usize) -> Result<()> {
    let rt = probe()?;
    if device >= rt.devices {
        return Err(Error::Backend(format!(
            "nccl: device {device} (LOCAL_RANK {local_rank}) requested, but only {} CUDA device(s) \
             are visible (check CUDA_VISIBLE_DEVICES)",
            rt.devices
        )));
    }
    Ok(())
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Let enqueued work finish (bounded by the timeout) so peers are not left waiting on a
        // collective this rank aborted; then `RawComm`'s drop aborts the handle, which is local.
        if !std::thread::panicking() && self.state.get_mut().aborted.is_none() {
            let _ = self.drain(true);
        }
        let _ = self.bind();
    }
}
