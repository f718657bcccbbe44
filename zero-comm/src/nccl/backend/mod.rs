//! The real backend (feature `nccl`): [`NcclComm`] over cudarc's CUDA driver and NCCL bindings.

mod ffi;
pub(super) mod kernels;

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
use crate::validate::{Desc, measure, validate};
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

/// Device memory holding `E`s, for [`NcclComm`]: a `CudaSlice<u8>` of at least one byte (CUDA
/// cannot allocate zero) and the element count.
///
/// Stored as bytes because [`Element`] is sealed and does not imply cudarc's `DeviceRepr`; the
/// typed views ([`view`](Self::view)) exist for the four element types, which all are.
pub struct NcclBuffer<E: Element> {
    bytes: CudaSlice<u8>,
    len: usize,
    _e: PhantomData<E>,
}

impl<E: Element> fmt::Debug for NcclBuffer<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NcclBuffer<{}>[{}] on cuda:{}",
            E::DTYPE,
            self.len,
            self.bytes.ordinal()
        )
    }
}

impl<E: Element> NcclBuffer<E> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn num_bytes(&self) -> usize {
        self.len * size_of::<E>()
    }

    /// The allocation, as bytes (at least one byte, even when the buffer is empty).
    pub fn as_bytes(&self) -> &CudaSlice<u8> {
        &self.bytes
    }

    /// The allocation, as bytes, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.bytes
    }

    /// The elements as a typed device view (for kernels or copies of the caller's own).
    pub fn view(&self) -> CudaView<'_, E>
    where
        E: DeviceRepr,
    {
        // SAFETY: the allocation holds `len` elements of `E` (it was created for them), and `E`
        // is plain data.
        unsafe { self.bytes.transmute::<E>(self.len) }
            .expect("an NcclBuffer always holds its elements")
    }

    /// The elements as a typed mutable device view.
    pub fn view_mut(&mut self) -> CudaViewMut<'_, E>
    where
        E: DeviceRepr,
    {
        let len = self.len;
        // SAFETY: as in `view`.
        unsafe { self.bytes.transmute_mut::<E>(len) }
            .expect("an NcclBuffer always holds its elements")
    }

    /// Takes over a cudarc slice (no copy). Its stream should be the communicator's, or the
    /// caller orders the two streams (see the module docs).
    pub fn from_cuda_slice(slice: CudaSlice<E>) -> Self
    where
        E: DeviceRepr,
    {
        let stream = slice.stream().clone();
        let len = slice.len();
        if len == 0 {
            // Keep the "at least one byte" invariant; the empty slice is freed on drop.
            if let Ok(bytes) = stream.alloc_zeros::<u8>(1) {
                return NcclBuffer {
                    bytes,
                    len: 0,
                    _e: PhantomData,
                };
            }
        }
        let ptr = slice.leak();
        // SAFETY: `ptr` is the allocation `slice` owned, `len * size_of::<E>()` bytes long, now
        // owned by the new slice (which frees it on drop).
        let bytes = unsafe { stream.upgrade_device_ptr::<u8>(ptr, len * size_of::<E>()) };
        NcclBuffer {
            bytes,
            len,
            _e: PhantomData,
        }
    }

    /// Gives the allocation back as a typed cudarc slice (no copy).
    pub fn into_cuda_slice(self) -> CudaSlice<E>
    where
        E: DeviceRepr,
    {
        let stream = self.bytes.stream().clone();
        let len = self.len;
        let ptr = self.bytes.leak();
        // SAFETY: the allocation holds at least `len` elements of `E` and is owned by the new
        // slice from here on.
        unsafe { stream.upgrade_device_ptr::<E>(ptr, len) }
    }
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

    /// Pops completed collectives; with `block`, waits for all of them. A collective still
    /// running `timeout` after it was issued aborts the communicator with [`Error::Timeout`].
    fn drain(&self, block: bool) -> Result<()> {
        let mut backoff = Backoff::default();
        loop {
            let (op, issued, done) = {
                let st = self.state.borrow();
                match st.pending.front() {
                    None => return Ok(()),
                    Some(p) => (p.op, p.issued, p.event.try_is_complete()),
                }
            };
            match done {
                Ok(true) => {
                    self.state.borrow_mut().pending.pop_front();
                    continue;
                }
                Ok(false) => {}
                Err(e) => return Err(self.fail_driver(op, "waiting for completion", e)),
            }
            // Still running: an asynchronous NCCL error (a peer died) ends the wait early.
            let h = match self.state.borrow().raw.as_ref() {
                Some(r) => r.ptr(),
                None => return Ok(()),
            };
            match ffi::async_state(h) {
                Ok(sys::ncclResult_t::ncclSuccess) | Ok(sys::ncclResult_t::ncclInProgress) => {}
                Ok(e) => {
                    let m = ffi::describe("ncclCommGetAsyncError", e, h);
                    return Err(self.fail(op, Fail::Nccl(m)));
                }
                Err(f) => return Err(self.fail(op, f)),
            }
            let waited = issued.elapsed();
            if waited >= self.opts.timeout {
                return Err(self.fail(op, Fail::Timeout(waited)));
            }
            if !block {
                return Ok(());
            }
            backoff.pause();
        }
    }

    /// Calls NCCL (`f(comm, stream)`) and settles the result; any failure aborts.
    fn call(
        &self,
        op: Op,
        name: &str,
        f: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> sys::ncclResult_t,
    ) -> Result<()> {
        let h = self.handle(op)?;
        self.bind()?;
        let started = Instant::now();
        let code = f(h, self.cu_stream());
        ffi::settle(code, name, h, started, self.opts.timeout).map_err(|e| self.fail(op, e))
    }

    /// Validation before anything moves: with [`NcclOptions::check_peers`] (outside groups) every
    /// rank's descriptor, so every rank reaches the host loopback's verdict; else this rank's own.
    fn begin(&self, d: &Desc) -> Result<()> {
        self.ensure_usable(d.op)?;
        let n = self.members.len();
        let in_group = self.state.borrow().group_depth > 0;
        // Also at n = 1, where it is cheap, so that one GPU exercises the path.
        if self.opts.check_peers && !in_group {
            let all = self.exchange_descs(d)?;
            validate(&all, &self.members, n)
        } else {
            validate(std::slice::from_ref(d), &[self.me()], n)
        }
    }

    /// All-gathers every rank's descriptor (control traffic, not counted in the table).
    fn exchange_descs(&self, d: &Desc) -> Result<Vec<Desc>> {
        let op = d.op;
        let n = self.members.len();
        // The upload below synchronises the stream, so first wait (with the timeout) for whatever
        // is still running on it.
        self.drain(true)?;
        let send = self
            .stream
            .clone_htod(&d.to_bytes()[..])
            .map_err(|e| self.fail_driver(op, "uploading the call descriptor", e))?;
        let mut recv = self
            .stream
            .alloc_zeros::<u8>(DESC_BYTES * n)
            .map_err(|e| self.fail_driver(op, "allocating the descriptor exchange", e))?;
        {
            let (sp, _gs) = send.device_ptr(&self.stream);
            let (rp, _gr) = recv.device_ptr_mut(&self.stream);
            self.call(op, "ncclAllGather (call descriptors)", |h, s| {
                // SAFETY: `send` holds DESC_BYTES bytes and `recv` n times that, both on this
                // communicator's device and alive until the wait below completes.
                unsafe {
                    sys::ncclAllGather(
                        sp as *const c_void,
                        rp as *mut c_void,
                        DESC_BYTES,
                        sys::ncclDataType_t::ncclUint8,
                        h,
                        s,
                    )
                }
            })?;
        }
        self.push_pending(op)?;
        self.drain(true)?;
        let host = self
            .stream
            .clone_dtoh(&recv)
            .map_err(|e| self.fail_driver(op, "downloading the call descriptors", e))?;
        host.chunks_exact(DESC_BYTES)
            .enumerate()
            .map(|(j, b)| Desc::from_bytes(b, self.global_rank_of(j)))
            .collect::<Result<Vec<_>>>()
            .inspect_err(|e| self.abort_with(&e.to_string()))
    }

    fn push_pending(&self, op: Op) -> Result<()> {
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| self.fail_driver(op, "recording the completion event", e))?;
        self.state.borrow_mut().pending.push_back(Pending {
            op,
            event,
            issued: Instant::now(),
        });
        Ok(())
    }

    /// After an op was enqueued: records its traffic, then (outside groups) its completion event,
    /// waiting for it in [`WaitMode::Eager`].
    fn finish<E: Element>(&mut self, d: &Desc) -> Result<()> {
        if let Some(c) = d.op.collective() {
            let t = measure(&self.topology, &self.members, self.rank, d, size_of::<E>());
            self.traffic.record(c, t);
        }
        self.issued(d.op)
    }

    fn issued(&self, op: Op) -> Result<()> {
        {
            let mut st = self.state.borrow_mut();
            if st.group_depth > 0 {
                st.group_first_op.get_or_insert(op);
                return Ok(());
            }
        }
        self.push_pending(op)?;
        let many = self.state.borrow().pending.len() > MAX_PENDING;
        match self.opts.wait {
            WaitMode::Eager => self.drain(true),
            WaitMode::Lazy => self.drain(many),
        }
    }

    /// `Mean` = NCCL `Sum`, then this division, in stream order (after the group inside one).
    fn divide(&self, op: Op, ptr: CUdeviceptr, len: usize, dtype: DType) -> Result<()> {
        {
            let mut st = self.state.borrow_mut();
            if st.group_depth > 0 {
                st.deferred.push(Deferred { ptr, len, dtype });
                return Ok(());
            }
        }
        let n = self.members.len() as f32;
        self.kernels
            .divide(&self.ctx, &self.stream, ptr, len, dtype, n)
            .map_err(|e| {
                let e = Error::Backend(format!("{op} on rank {}: {e}", self.me()));
                self.abort_with(&e.to_string());
                e
            })
    }

    fn check_buffer<E: Element>(&self, op: Op, b: &NcclBuffer<E>) -> Result<()> {
        if b.bytes.ordinal() != self.ctx.ordinal() {
            return Err(Error::Backend(format!(
                "nccl: {op} on rank {}: a buffer lives on cuda:{}, the communicator on cuda:{}",
                self.me(),
                b.bytes.ordinal(),
                self.ctx.ordinal()
            )));
        }
        Ok(())
    }

    fn all_gather_impl<E: Element>(
        &mut self,
        send: Option<&NcclBuffer<E>>,
        recv: &mut NcclBuffer<E>,
    ) -> Result<()> {
        let op = Op::from(Collective::AllGather);
        let n = self.members.len();
        let in_place = send.is_none();
        let chunk = match send {
            Some(s) => s.len,
            None => recv.len / n,
        };
        let d = Desc {
            dtype: Some(E::DTYPE),
            send_len: chunk,
            recv_len: recv.len,
            in_place,
            ..Desc::new(op)
        };
        self.begin(&d)?;
        if let Some(s) = send {
            self.check_buffer(op, s)?;
        }
        self.check_buffer(op, recv)?;
        if chunk > 0 {
            let offset = (self.rank * chunk * size_of::<E>()) as u64;
            let guard_s = send.map(|s| s.bytes.device_ptr(&self.stream));
            let (rp, _gr) = recv.bytes.device_ptr_mut(&self.stream);
            let sp = guard_s.as_ref().map_or(rp + offset, |(p, _)| *p);
            self.call(op, "ncclAllGather", |h, s| {
                // SAFETY: lengths validated: `send` holds `chunk` elements (in place: at
                // `rank · chunk` inside `recv`, NCCL's in-place layout) and `recv` `n · chunk`;
                // both stay alive and stream-ordered on this communicator's stream.
                unsafe {
                    sys::ncclAllGather(
                        sp as *const c_void,
                        rp as *mut c_void,
                        chunk,
                        nccl_dtype(E::DTYPE),
                        h,
                        s,
                    )
                }
            })?;
        }
        self.finish::<E>(&d)
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

impl Communicator for NcclComm {
    type Buffer<E: Element> = NcclBuffer<E>;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.members.len()
    }

    fn global_rank(&self) -> usize {
        self.me()
    }

    fn members(&self) -> &[usize] {
        &self.members
    }

    fn topology(&self) -> &Topology {
        &self.topology
    }

    fn alloc<E: Element>(&self, len: usize) -> Result<NcclBuffer<E>> {
        let bytes = (len * size_of::<E>()).max(1);
        let bytes = self
            .stream
            .alloc_zeros::<u8>(bytes)
            .map_err(|e| driver(&format!("allocating {bytes} bytes"), e))?;
        Ok(NcclBuffer {
            bytes,
            len,
            _e: PhantomData,
        })
    }

    fn upload<E: Element>(&self, src: &[E]) -> Result<NcclBuffer<E>> {
        let mut buf = self.alloc::<E>(src.len())?;
        if !src.is_empty() {
            // A copy from pageable memory synchronises the stream: wait for it with a timeout
            // first, so a hung collective cannot block the copy forever.
            self.drain(true)?;
            let n = buf.num_bytes();
            let mut dst = buf.bytes.slice_mut(0..n);
            self.stream
                .memcpy_htod(bytemuck::cast_slice::<E, u8>(src), &mut dst)
                .map_err(|e| driver("upload", e))?;
        }
        Ok(buf)
    }

    fn upload_into<E: Element>(&self, src: &[E], dst: &mut NcclBuffer<E>) -> Result<()> {
        if src.len() != dst.len {
            return Err(Error::BufferLength {
                what: "upload_into",
                buffer: dst.len,
                host: src.len(),
            });
        }
        if src.is_empty() {
            return Ok(());
        }
        // As in `upload`: the copy synchronises the stream, so first wait with a timeout.
        self.drain(true)?;
        let n = dst.num_bytes();
        let mut bytes = dst.bytes.slice_mut(0..n);
        self.stream
            .memcpy_htod(bytemuck::cast_slice::<E, u8>(src), &mut bytes)
            .map_err(|e| driver("upload_into", e))
    }

    fn download<E: Element>(&self, buf: &NcclBuffer<E>, dst: &mut [E]) -> Result<()> {
        if dst.len() != buf.len {
            return Err(Error::BufferLength {
                what: "download",
                buffer: buf.len,
                host: dst.len(),
            });
        }
        self.drain(true)?;
        if buf.len == 0 {
            return Ok(());
        }
        let src = buf.bytes.slice(0..buf.num_bytes());
        self.stream
            .memcpy_dtoh(&src, bytemuck::cast_slice_mut::<E, u8>(dst))
            .map_err(|e| driver("download", e))?;
        // A device-to-pageable copy returns once done; make sure anyway.
        self.stream.synchronize().map_err(|e| driver("download", e))
    }

    fn buffer_len<E: Element>(&self, buf: &NcclBuffer<E>) -> usize {
        buf.len
    }

    fn all_gather<E: Element>(
        &mut self,
        send: &NcclBuffer<E>,
        recv: &mut NcclBuffer<E>,
    ) -> Result<()> {
        self.all_gather_impl(Some(send), recv)
    }

    fn all_gather_in_place<E: Element>(&mut self, buf: &mut NcclBuffer<E>) -> Result<()> {
        self.all_gather_impl(None, buf)
    }

    fn reduce_scatter<E: Element>(
        &mut self,
        send: &NcclBuffer<E>,
        recv: &mut NcclBuffer<E>,
        op: ReduceOp,
    ) -> Result<()> {
        let o = Op::from(Collective::ReduceScatter);
        let d = Desc {
            dtype: Some(E::DTYPE),
            reduce: Some(op),
            send_len: send.len,
            recv_len: recv.len,
            ..Desc::new(o)
        };
        self.begin(&d)?;
        self.check_buffer(o, send)?;
        self.check_buffer(o, recv)?;
        let c = recv.len;
        if c > 0 {
            let (sp, _gs) = send.bytes.device_ptr(&self.stream);
            let (rp, _gr) = recv.bytes.device_ptr_mut(&self.stream);
            self.call(o, "ncclReduceScatter", |h, s| {
                // SAFETY: validated `send = n · c`, `recv = c`; distinct live buffers on this
                // communicator's stream.
                unsafe {
                    sys::ncclReduceScatter(
                        sp as *const c_void,
                        rp as *mut c_void,
                        c,
                        nccl_dtype(E::DTYPE),
                        sys::ncclRedOp_t::ncclSum,
                        h,
                        s,
                    )
                }
            })?;
            if op == ReduceOp::Mean {
                self.divide(o, rp, c, E::DTYPE)?;
            }
        }
        self.finish::<E>(&d)
    }

    fn all_reduce<E: Element>(&mut self, buf: &mut NcclBuffer<E>, op: ReduceOp) -> Result<()> {
        let o = Op::from(Collective::AllReduce);
        let len = buf.len;
        let d = Desc {
            dtype: Some(E::DTYPE),
            reduce: Some(op),
            send_len: len,
            recv_len: len,
            ..Desc::new(o)
        };
        self.begin(&d)?;
        self.check_buffer(o, buf)?;
        if len > 0 {
            let (p, _g) = buf.bytes.device_ptr_mut(&self.stream);
            self.call(o, "ncclAllReduce", |h, s| {
                // SAFETY: in place on `len` live elements on this communicator's stream.
                unsafe {
                    sys::ncclAllReduce(
                        p as *const c_void,
                        p as *mut c_void,
                        len,
                        nccl_dtype(E::DTYPE),
                        sys::ncclRedOp_t::ncclSum,
                        h,
                        s,
                    )
                }
            })?;
            if op == ReduceOp::Mean {
                self.divide(o, p, len, E::DTYPE)?;
            }
        }
        self.finish::<E>(&d)
    }

    fn broadcast<E: Element>(&mut self, buf: &mut NcclBuffer<E>, root: usize) -> Result<()> {
        let o = Op::from(Collective::Broadcast);
        let len = buf.len;
        let d = Desc {
            dtype: Some(E::DTYPE),
            root: Some(root),
            send_len: len,
            recv_len: len,
            ..Desc::new(o)
        };
        self.begin(&d)?;
        self.check_buffer(o, buf)?;
        if len > 0 {
            // `root < n ≤ i32::MAX` after validation and init.
            let r = root as c_int;
            let (p, _g) = buf.bytes.device_ptr_mut(&self.stream);
            self.call(o, "ncclBroadcast", |h, s| {
                // SAFETY: in place on `len` live elements on this communicator's stream.
                unsafe {
                    sys::ncclBroadcast(
                        p as *const c_void,
                        p as *mut c_void,
                        len,
                        nccl_dtype(E::DTYPE),
                        r,
                        h,
                        s,
                    )
                }
            })?;
        }
        self.finish::<E>(&d)
    }

    fn all_to_all<E: Element>(
        &mut self,
        send: &NcclBuffer<E>,
        recv: &mut NcclBuffer<E>,
    ) -> Result<()> {
        let o = Op::from(Collective::AllToAll);
        let d = Desc {
            dtype: Some(E::DTYPE),
            send_len: send.len,
            recv_len: recv.len,
            ..Desc::new(o)
        };
        self.begin(&d)?;
        self.check_buffer(o, send)?;
        self.check_buffer(o, recv)?;
        let n = self.members.len();
        let c = send.len / n;
        if c > 0 {
            let eb = size_of::<E>();
            let cb = (c * eb) as u64;
            let me = self.rank;
            let (sp, _gs) = send.bytes.device_ptr(&self.stream);
            let (rp, _gr) = recv.bytes.device_ptr_mut(&self.stream);
            self.bind()?;
            // Own chunk: a device copy, stream-ordered like the rest.
            // SAFETY: both ranges lie inside their (validated) buffers and do not overlap.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    rp + me as u64 * cb,
                    sp + me as u64 * cb,
                    c * eb,
                    self.stream.cu_stream(),
                )
            }
            .map_err(|e| self.fail_driver(o, "copying the own chunk", e))?;
            if n > 1 {
                let h = self.handle(o)?;
                let started = Instant::now();
                let dt = nccl_dtype(E::DTYPE);
                let stream = self.cu_stream();
                // SAFETY: group calls are thread-local bookkeeping.
                let start = unsafe { sys::ncclGroupStart() };
                ffi::settle(start, "ncclGroupStart", h, started, self.opts.timeout)
                    .map_err(|f| self.fail(o, f))?;
                let mut first: Option<(&str, sys::ncclResult_t)> = None;
                for j in (0..n).filter(|&j| j != me) {
                    let peer = j as c_int;
                    let off = j as u64 * cb;
                    // SAFETY: chunk `j` of each buffer is in bounds (validated lengths); the
                    // buffers outlive the group, which ends below.
                    let s = unsafe {
                        sys::ncclSend((sp + off) as *const c_void, c, dt, peer, h, stream)
                    };
                    // SAFETY: as above.
                    let r =
                        unsafe { sys::ncclRecv((rp + off) as *mut c_void, c, dt, peer, h, stream) };
                    for (name, code) in [("ncclSend", s), ("ncclRecv", r)] {
                        // Inside a group a call only queues; `ncclGroupEnd` reports progress.
                        let queued = matches!(
                            code,
                            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
                        );
                        if !queued && first.is_none() {
                            first = Some((name, code));
                        }
                    }
                }
                // SAFETY: closes the group opened above, whatever happened inside it.
                let end = unsafe { sys::ncclGroupEnd() };
                if let Some((name, code)) = first {
                    return Err(self.fail(o, Fail::Nccl(ffi::describe(name, code, h))));
                }
                ffi::settle(
                    end,
                    "ncclGroupEnd (all-to-all)",
                    h,
                    started,
                    self.opts.timeout,
                )
                .map_err(|f| self.fail(o, f))?;
            }
        }
        self.finish::<E>(&d)
    }

    fn barrier(&mut self) -> Result<()> {
        let o = Op::from(Collective::Barrier);
        let d = Desc::new(o);
        self.begin(&d)?;
        if self.state.borrow().group_depth > 0 {
            return Err(Error::Backend("nccl: barrier inside a group".into()));
        }
        let mut one = self
            .stream
            .alloc_zeros::<u8>(1)
            .map_err(|e| self.fail_driver(o, "allocating the barrier byte", e))?;
        {
            let (p, _g) = one.device_ptr_mut(&self.stream);
            self.call(o, "ncclAllReduce (barrier)", |h, s| {
                // SAFETY: one live byte on this communicator's stream.
                unsafe {
                    sys::ncclAllReduce(
                        p as *const c_void,
                        p as *mut c_void,
                        1,
                        sys::ncclDataType_t::ncclUint8,
                        sys::ncclRedOp_t::ncclSum,
                        h,
                        s,
                    )
                }
            })?;
        }
        self.finish::<u8>(&d)?;
        // A barrier returns only once every rank arrived, whatever the wait mode.
        self.drain(true)
    }

    fn split(&mut self, color: usize, key: usize) -> Result<NcclComm> {
        let op = Op::Split;
        self.ensure_usable(op)?;
        if self.state.borrow().group_depth > 0 {
            return Err(Error::Backend("nccl: split inside a group".into()));
        }
        let libs = ffi::libs()?;
        if !libs.split {
            let (a, b, c) = libs.version;
            return Err(Error::Backend(format!(
                "nccl: split needs ncclCommSplit (NCCL 2.18 or newer); the loaded libnccl is {a}.{b}.{c}"
            )));
        }
        let n = self.members.len();
        let d = Desc {
            color,
            key,
            ..Desc::new(op)
        };
        // Every rank needs every rank's (color, key) to know its new group's members.
        let all = self.exchange_descs(&d)?;
        validate(&all, &self.members, n)?;
        let limit = i32::MAX as usize;
        if let Some(j) = all.iter().position(|c| c.color > limit || c.key > limit) {
            return Err(Error::Backend(format!(
                "nccl: split: rank {} passed color {} and key {}; NCCL takes values up to {limit}",
                self.global_rank_of(j),
                all[j].color,
                all[j].key
            )));
        }
        let mut group: Vec<usize> = (0..n).filter(|&j| all[j].color == color).collect();
        group.sort_by_key(|&j| (all[j].key, j));
        let new_rank = group
            .iter()
            .position(|&j| j == self.rank)
            .ok_or_else(|| Error::Backend("nccl: split lost this rank".into()))?;
        let members: Arc<[usize]> = group.iter().map(|&j| self.members[j]).collect();

        let h = self.handle(op)?;
        self.bind()?;
        let raw = ffi::split(h, color as c_int, key as c_int, self.opts.timeout)
            .map_err(|f| self.fail(op, f))?;
        let (count, user_rank) = ffi::count_and_rank(raw.ptr()).map_err(|f| self.fail(op, f))?;
        if (count, user_rank) != (members.len(), new_rank) {
            let m = format!(
                "ncclCommSplit made rank {user_rank} of {count}, expected rank {new_rank} of {} \
                 (members {members:?})",
                members.len()
            );
            return Err(self.fail(op, Fail::Nccl(m)));
        }
        Ok(NcclComm {
            ctx: self.ctx.clone(),
            stream: self.stream.clone(),
            kernels: self.kernels.clone(),
            world: self.world.clone(),
            state: RefCell::new(State {
                raw: Some(raw),
                ..State::default()
            }),
            rank: new_rank,
            members,
            topology: self.topology,
            opts: self.opts.clone(),
            nonblocking: self.nonblocking,
            traffic: TrafficTable::new(),
        })
    }

    fn traffic(&self) -> &TrafficTable {
        &self.traffic
    }

    fn abort(&mut self, cause: String) {
        self.abort_with(&cause);
    }

    fn group_start(&mut self) -> Result<()> {
        // SAFETY: thread-local bookkeeping in NCCL; the library is loaded (a communicator exists).
        let code = unsafe { sys::ncclGroupStart() };
        if code != sys::ncclResult_t::ncclSuccess {
            return Err(Error::Backend(format!(
                "nccl: {}",
                ffi::describe("ncclGroupStart", code, std::ptr::null_mut())
            )));
        }
        let mut st = self.state.borrow_mut();
        st.group_depth += 1;
        Ok(())
    }

    fn group_end(&mut self) -> Result<()> {
        let (outermost, op) = {
            let mut st = self.state.borrow_mut();
            if st.group_depth == 0 {
                return Err(Error::Backend("nccl: group_end without group_start".into()));
            }
            st.group_depth -= 1;
            let outermost = st.group_depth == 0;
            let op = if outermost {
                st.group_first_op.take()
            } else {
                st.group_first_op
            };
            (outermost, op)
        };
        let started = Instant::now();
        let _ = self.bind();
        // SAFETY: closes the group opened by `group_start`.
        let code = unsafe { sys::ncclGroupEnd() };
        let report = op.unwrap_or(Op::Collective(Collective::Barrier));
        let h = self
            .state
            .borrow()
            .raw
            .as_ref()
            .map_or(std::ptr::null_mut(), RawComm::ptr);
        let mut result = ffi::settle(code, "ncclGroupEnd", h, started, self.opts.timeout)
            .map_err(|f| self.fail(report, f));
        if outermost {
            // An abort requested inside the group takes effect now that NCCL is done with it.
            let (late_abort, deferred) = {
                let mut st = self.state.borrow_mut();
                let late = st.aborted.is_some().then(|| st.raw.take());
                (late, std::mem::take(&mut st.deferred))
            };
            if let Some(raw) = late_abort {
                drop(raw);
                if result.is_ok()
                    && let Some(cause) = self.state.borrow().aborted.clone()
                {
                    result = Err(self.aborted_err(report, cause));
                }
            }
            if result.is_ok() {
                for Deferred { ptr, len, dtype } in deferred {
                    result = self.divide(report, ptr, len, dtype);
                    if result.is_err() {
                        break;
                    }
                }
            }
            if result.is_ok() && op.is_some() {
                result = self.issued(report);
            }
        }
        result
    }
}
