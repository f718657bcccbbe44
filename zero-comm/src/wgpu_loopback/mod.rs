//! The wgpu loopback (feature `wgpu`): N ranks, one thread each, on **one** wgpu device and queue.
//!
//! Data lives in `wgpu::Buffer`s ([`WgpuBuffer`]); collectives move it with
//! `copy_buffer_to_buffer` (or a small shader where WebGPU's 4-byte copy alignment does not hold)
//! and reduce it with WGSL compute shaders. The contract, the validation, the failure behaviour
//! and the byte accounting are the host loopback's ([`crate::host`]), which is this backend's
//! oracle: results are bit-identical to it for every dtype (see [`ReduceOp`] for the order and
//! rounding, and `kernels.rs` for how the shaders keep them).
//!
//! - [`WgpuDevice`]: the shared device, queue and compiled kernels. [`WgpuDevice::new`] opens the
//!   default adapter (`WGPU_BACKEND` and the other `wgpu` environment variables apply);
//!   [`WgpuDevice::from_wgpu`] adopts a `wgpu::Device` and `wgpu::Queue` someone else created,
//!   e.g. burn-wgpu's (see below).
//! - [`WgpuWorld`]: the communicators of one world on one device. [`WgpuLoopback::launch`] runs a
//!   closure per rank on its own thread, like [`crate::host::HostLoopback::launch`].
//! - [`WgpuComm`] implements [`Communicator`] with [`WgpuBuffer`]s.
//!
//! # How an op runs
//!
//! As on the host: every rank posts a descriptor (op, dtype, lengths, root, and a pointer to the
//! [`WgpuBuffer`] peers read) at an arrival barrier of the shared rendezvous, every rank checks all
//! descriptors the same way (a mismatch fails every rank identically, before anything moves), then
//! each rank records the commands that produce *its own* output (copies from its peers' buffers, or
//! one reduction over every rank's input in group-rank order), submits them to the shared queue and
//! waits at a drain barrier. The queue executes submissions in order (WebGPU's rule, which wgpu
//! enforces with barriers), so once every rank has submitted, any later command (a download, the
//! next op, a peer overwriting its input) sees the op's results. An all-reduce has a second
//! barrier between its reduce-scatter and all-gather halves. Ops return once their commands are
//! submitted, not executed; [`download`](Communicator::download) and [`WgpuComm::synchronize`]
//! wait for the device.
//!
//! # Failures
//!
//! Exactly the host loopback's, from the same rendezvous code: a rank whose thread panics fails
//! the world ([`Error::PeerFailed`] naming it on every rank, promptly); a dropped communicator fails
//! its group; a rank that does not arrive within the timeout makes its peers return
//! [`Error::Timeout`] and aborts the world. In addition, a wgpu error while a rank records or
//! submits an op (out of memory, a lost device, a destroyed buffer) fails that rank with
//! [`Error::Backend`] and the world with [`FailureReason::Backend`] naming it. (A buffer of another
//! wgpu *instance* makes wgpu-core panic instead; the rank then fails as panicked.) wgpu errors are
//! caught in error scopes on the calling thread, so the device's uncaptured-error handler (which
//! an adopting library may own) never sees them.
//!
//! # Sharing a device with burn-wgpu (the zero-copy bridge)
//!
//! Create one `wgpu::Device` + `wgpu::Queue` and hand clones to both sides: cubecl-wgpu can adopt an
//! existing device (its `WgpuSetup { instance, adapter, device, queue, .. }` passed to
//! `init_device`), and this module adopts it with [`WgpuDevice::from_wgpu`] (or
//! [`WgpuWorld::from_wgpu`]). Then a tensor's storage (cubecl's resource for a handle: a buffer,
//! an offset and a size) becomes a [`WgpuBuffer`] with [`WgpuBuffer::from_wgpu`], and collectives
//! run on it in place. cubecl records work lazily: flush its stream before a collective that reads
//! its tensors. Everything then executes in queue order.

mod buffer;
mod kernels;
mod quantized;

use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::Duration;

use zero_core::{Collective, Topology, TrafficTable};

use crate::communicator::Communicator;
use crate::element::{Element, ReduceOp};
use crate::error::{Error, FailureReason, Op, Result};
use crate::host::loopback::{self, Loopback};
use crate::host::rendezvous::{Call, DrainGuard, ROOT_GROUP, RawPtr, World};
use crate::validate::{Desc, ar_chunk};
use kernels::{Batch, Core, Loc};

pub use buffer::{REQUIRED_USAGES, WgpuBuffer};
/// The `wgpu` this module is built against, so that callers adopt devices and wrap buffers of the
/// same version.
pub use wgpu;

use buffer::View;

/// The timeout of [`WgpuWorld::new`] callers who have no better idea.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// One wgpu device and queue with the loopback's kernels compiled for it, shared by every rank of
/// every world built on it.
#[derive(Debug)]
pub struct WgpuDevice {
    core: Core,
}

fn backend(e: impl fmt::Display) -> Error {
    Error::Backend(e.to_string())
}

impl WgpuDevice {
    /// Opens the default adapter ([`default_adapter`](Self::default_adapter)) and a device on it.
    pub fn new() -> Result<Arc<WgpuDevice>> {
        Self::from_adapter(&Self::default_adapter()?)
    }

    /// The adapter [`new`](Self::new) uses: wgpu's default choice among the compiled backends
    /// (Vulkan), honouring `WGPU_BACKEND`, `WGPU_ADAPTER_NAME` and the like. On a machine without a
    /// GPU, Mesa's lavapipe (`mesa-vulkan-drivers`) is a software Vulkan adapter that works. An
    /// error here means no adapter at all.
    pub fn default_adapter() -> Result<wgpu::Adapter> {
        let instance =
            wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            ..Default::default()
        }))
        .map_err(|e| Error::Backend(format!("wgpu loopback: no adapter: {e}")))
    }

    /// Opens a device on `adapter` with the adapter's own limits (large bindings mean fewer
    /// dispatches) and no optional features.
    pub fn from_adapter(adapter: &wgpu::Adapter) -> Result<Arc<WgpuDevice>> {
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("zero-comm wgpu loopback"),
            required_limits: adapter.limits(),
            ..Default::default()
        }))
        .map_err(|e| Error::Backend(format!("wgpu loopback: request_device: {e}")))?;
        Self::from_wgpu(device, queue)
    }

    /// Adopts an existing device and its queue (e.g. clones of burn-wgpu's): no optional feature
    /// is needed, and the kernels adapt to the device's limits. Compiles the kernels.
    pub fn from_wgpu(device: wgpu::Device, queue: wgpu::Queue) -> Result<Arc<WgpuDevice>> {
        let core = Core::new(device, queue).map_err(backend)?;
        Ok(Arc::new(WgpuDevice { core }))
    }

    /// The device.
    pub fn device(&self) -> &wgpu::Device {
        &self.core.device
    }

    /// The queue every rank submits to.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.core.queue
    }

    /// The adapter's description (name, driver, backend).
    pub fn adapter_info(&self) -> wgpu::AdapterInfo {
        self.core.device.adapter_info()
    }

    /// Waits at most `timeout` until every command submitted to the queue so far has executed.
    pub fn synchronize(&self, timeout: Duration) -> Result<()> {
        self.core.synchronize(timeout).map_err(backend)
    }
}

/// What the communicators of one world share: the rendezvous, the device, and the ranks that
/// failed in the backend (which the rendezvous records as failed ranks).
#[derive(Debug)]
struct Shared {
    world: Arc<World>,
    device: Arc<WgpuDevice>,
    backend_failures: Mutex<Vec<(usize, String)>>,
}

impl Shared {
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

/// The communicators of one wgpu loopback world, before they are handed to threads.
#[derive(Debug)]
pub struct WgpuWorld {
    device: Arc<WgpuDevice>,
    comms: Vec<WgpuComm>,
}

impl WgpuWorld {
    /// One communicator per rank of `topology` on a new device ([`WgpuDevice::new`]), all waiting
    /// at most `timeout` for their peers.
    pub fn new(topology: Topology, timeout: Duration) -> Result<WgpuWorld> {
        Ok(Self::with_device(WgpuDevice::new()?, topology, timeout))
    }

    /// Adopts an existing `wgpu` device and queue (see [`WgpuDevice::from_wgpu`]).
    pub fn from_wgpu(
        device: wgpu::Device,
        queue: wgpu::Queue,
        topology: Topology,
        timeout: Duration,
    ) -> Result<WgpuWorld> {
        Ok(Self::with_device(
            WgpuDevice::from_wgpu(device, queue)?,
            topology,
            timeout,
        ))
    }

    /// One communicator per rank of `topology` on `device`. Several worlds may share a device.
    pub fn with_device(
        device: Arc<WgpuDevice>,
        topology: Topology,
        timeout: Duration,
    ) -> WgpuWorld {
        let world = World::new(topology);
        let members = world.members(ROOT_GROUP);
        let shared = Arc::new(Shared {
            world,
            device: device.clone(),
            backend_failures: Mutex::new(Vec::new()),
        });
        let comms = (0..topology.world_size())
            .map(|rank| WgpuComm {
                shared: shared.clone(),
                group: ROOT_GROUP,
                rank,
                members: members.clone(),
                timeout,
                traffic: TrafficTable::new(),
                aborted: None,
                scratch: None,
                _not_sync: PhantomData,
            })
            .collect();
        WgpuWorld { device, comms }
    }

    /// The device every rank uses.
    pub fn device(&self) -> &Arc<WgpuDevice> {
        &self.device
    }

    /// The communicators, indexed by rank. Move each to its own thread.
    pub fn into_comms(self) -> Vec<WgpuComm> {
        self.comms
    }

    /// Runs `f` once per rank, each on its own scoped thread named `rank-<k>`, and returns each
    /// rank's result in rank order. A rank that panics yields `Err` with its panic payload (and its
    /// peers' pending collectives fail with [`Error::PeerFailed`]); it does not abort the process.
    pub fn launch<R, F>(self, f: F) -> Vec<thread::Result<R>>
    where
        R: Send,
        F: Fn(WgpuComm) -> R + Sync,
    {
        loopback::launch(self.comms, f)
    }
}

/// Shorthand for [`WgpuWorld::new`] followed by [`WgpuWorld::launch`].
#[derive(Debug)]
pub struct WgpuLoopback;

impl WgpuLoopback {
    /// Runs `f` on every rank of a fresh world on a new device; see [`WgpuWorld::launch`]. Fails
    /// only if the device cannot be opened.
    pub fn launch<R, F>(
        topology: Topology,
        timeout: Duration,
        f: F,
    ) -> Result<Vec<thread::Result<R>>>
    where
        R: Send,
        F: Fn(WgpuComm) -> R + Sync,
    {
        Ok(WgpuWorld::new(topology, timeout)?.launch(f))
    }
}

/// One rank of a wgpu loopback group. `Send`, not `Sync`: one thread drives it.
pub struct WgpuComm {
    shared: Arc<Shared>,
    group: usize,
    rank: usize,
    members: Arc<[usize]>,
    timeout: Duration,
    traffic: TrafficTable,
    aborted: Option<String>,
    /// `f32` accumulators of reductions and the bounce buffer of same-buffer copies; grown on
    /// demand up to one window.
    scratch: Option<wgpu::Buffer>,
    _not_sync: PhantomData<Cell<()>>,
}

impl fmt::Debug for WgpuComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fmt_comm(f, "WgpuComm")
    }
}

impl Drop for WgpuComm {
    fn drop(&mut self) {
        self.leave();
    }
}

/// The buffer a peer posted in its call descriptor.
///
/// # Safety
///
/// `call` must come from the arrival barrier of the op in progress, whose owner posted a pointer to
/// a live [`View`], and the reference must not outlive the op's last drain barrier: until then the
/// owner is blocked in the same op and keeps its buffer alive and unmodified (it only records
/// commands that read it).
unsafe fn peer<'a>(call: &Call) -> &'a View {
    // SAFETY: per the function's contract.
    unsafe { &*call.src.0.cast::<View>() }
}

fn post(view: &View) -> RawPtr {
    RawPtr(std::ptr::from_ref(view).cast())
}

fn loc(view: &View, elem: usize, es: usize) -> Loc<'_> {
    Loc {
        buffer: &view.buffer,
        byte: view.offset + (elem * es) as u64,
    }
}

impl WgpuComm {
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
    pub fn device(&self) -> &Arc<WgpuDevice> {
        &self.shared.device
    }

    /// Waits until every command submitted to the shared queue so far has executed (ops return
    /// once their commands are submitted). For benchmarks, or before reading buffers another way.
    pub fn synchronize(&self) -> Result<()> {
        self.shared.device.synchronize(self.timeout)
    }

    /// Wraps `len` elements of an existing buffer of this device, zero-copy; see
    /// [`WgpuBuffer::from_wgpu`].
    pub fn wrap<E: Element>(
        &self,
        buffer: wgpu::Buffer,
        offset: u64,
        len: usize,
    ) -> Result<WgpuBuffer<E>> {
        WgpuBuffer::from_wgpu(buffer, offset, len)
    }

    /// Fails this rank in the backend: records why, fails the world (peers get
    /// [`FailureReason::Backend`]) and aborts this communicator.
    fn fail_backend(&mut self, op: Op, msg: String) -> Error {
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
        mut work: impl FnMut(usize, &[Call], &mut [u64], &mut Batch<'_>),
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
                let mut batch = Batch::new(&shared.device.core);
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

    fn all_gather_impl<E: Element>(
        &mut self,
        src: &View,
        chunk: usize,
        in_place: bool,
        recv: &View,
        recv_len: usize,
    ) -> Result<()> {
        let me = self.rank;
        let es = size_of::<E>();
        let call = Call::new(
            Desc {
                dtype: Some(E::DTYPE),
                send_len: chunk,
                recv_len,
                in_place,
                ..Desc::new(Collective::AllGather)
            },
            post(src),
        );
        self.run(call, es, 1, |_, calls, reads, batch| {
            let c = chunk;
            for (j, cj) in calls.iter().enumerate() {
                if j == me && in_place {
                    continue;
                }
                let off = if cj.desc.in_place { j * c } else { 0 };
                // SAFETY: posted at this op's arrival; used before its drain barrier. Peer `j`'s
                // buffer holds `recv_len` (in place) or `c` elements (checked), so chunk `[off,
                // off + c)` is in bounds, and no rank writes it in this op: out-of-place send
                // buffers are never written, and an in-place rank writes only chunks other than its
                // own. We write only our chunk `j`, which nobody reads (in place, our own chunk
                // `me`, the one peers read, is skipped).
                let pj = unsafe { peer(cj) };
                batch.copy(loc(pj, off, es), loc(recv, j * c, es), (c * es) as u64);
                if j != me {
                    reads[j] += c as u64;
                }
            }
        })
    }
}

impl Loopback for WgpuComm {
    const NAME: &'static str = "wgpu loopback";

    fn world(&self) -> &Arc<World> {
        &self.shared.world
    }

    fn group(&self) -> usize {
        self.group
    }

    fn wait(&self) -> Duration {
        self.timeout
    }

    fn aborted(&self) -> Option<&String> {
        self.aborted.as_ref()
    }

    fn traffic_mut(&mut self) -> &mut TrafficTable {
        &mut self.traffic
    }

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

impl Communicator for WgpuComm {
    type Buffer<E: Element> = WgpuBuffer<E>;

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
        &self.shared.world.topology
    }

    fn alloc<E: Element>(&self, len: usize) -> Result<WgpuBuffer<E>> {
        let buffer = self
            .shared
            .device
            .core
            .alloc((len * size_of::<E>()) as u64)
            .map_err(backend)?;
        Ok(WgpuBuffer::owned(buffer, len))
    }

    fn upload<E: Element>(&self, src: &[E]) -> Result<WgpuBuffer<E>> {
        let buffer = self
            .shared
            .device
            .core
            .upload(bytemuck::cast_slice(src))
            .map_err(backend)?;
        Ok(WgpuBuffer::owned(buffer, src.len()))
    }

    fn upload_into<E: Element>(&self, src: &[E], dst: &mut WgpuBuffer<E>) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::BufferLength {
                what: "upload_into",
                buffer: dst.len(),
                host: src.len(),
            });
        }
        if src.is_empty() {
            return Ok(());
        }
        let bytes: &[u8] = bytemuck::cast_slice(src);
        let core = &self.shared.device.core;
        let buffer = &dst.view.buffer;
        let start = dst.view.offset;
        let end = start + bytes.len() as u64;
        // WebGPU writes whole 4-byte words: widen to the words that hold [start, end), keeping
        // the neighbours' bytes in the first and last word (a wrapped view may share them).
        let (a0, a1) = (start & !3, end.next_multiple_of(4));
        let mut window = vec![0u8; (a1 - a0) as usize];
        if a0 != start || a1 != end {
            let last = window.len() - 4;
            core.download(buffer, a0, &mut window[..4], self.timeout)
                .map_err(backend)?;
            core.download(buffer, a1 - 4, &mut window[last..], self.timeout)
                .map_err(backend)?;
        }
        window[(start - a0) as usize..][..bytes.len()].copy_from_slice(bytes);
        core.queue.write_buffer(buffer, a0, &window);
        Ok(())
    }

    fn download<E: Element>(&self, buf: &WgpuBuffer<E>, dst: &mut [E]) -> Result<()> {
        if dst.len() != buf.len() {
            return Err(Error::BufferLength {
                what: "download",
                buffer: buf.len(),
                host: dst.len(),
            });
        }
        self.shared
            .device
            .core
            .download(
                &buf.view.buffer,
                buf.view.offset,
                bytemuck::cast_slice_mut(dst),
                self.timeout,
            )
            .map_err(backend)
    }

    fn buffer_len<E: Element>(&self, buf: &WgpuBuffer<E>) -> usize {
        buf.len()
    }

    fn all_gather<E: Element>(
        &mut self,
        send: &WgpuBuffer<E>,
        recv: &mut WgpuBuffer<E>,
    ) -> Result<()> {
        let recv_len = recv.len();
        self.all_gather_impl::<E>(&send.view, send.len(), false, &recv.view, recv_len)
    }

    fn all_gather_in_place<E: Element>(&mut self, buf: &mut WgpuBuffer<E>) -> Result<()> {
        let len = buf.len();
        let view = &buf.view;
        self.all_gather_impl::<E>(view, len / self.members.len(), true, view, len)
    }

    fn reduce_scatter<E: Element>(
        &mut self,
        send: &WgpuBuffer<E>,
        recv: &mut WgpuBuffer<E>,
        op: ReduceOp,
    ) -> Result<()> {
        let me = self.rank;
        let es = size_of::<E>();
        let c = recv.len();
        let out = &recv.view;
        let call = Call::new(
            Desc {
                dtype: Some(E::DTYPE),
                reduce: Some(op),
                send_len: send.len(),
                recv_len: c,
                ..Desc::new(Collective::ReduceScatter)
            },
            post(&send.view),
        );
        self.run(call, es, 1, |_, calls, reads, batch| {
            if c > 0 {
                // SAFETY: posted at this op's arrival; used before its drain barrier. Every send
                // buffer holds `n · c` elements (checked), so chunk `me` is in bounds; send buffers
                // are never written during the op, and our receive buffer is read by no peer.
                let inputs: Vec<Loc<'_>> = calls
                    .iter()
                    .map(|cj| loc(unsafe { peer(cj) }, me * c, es))
                    .collect();
                batch.reduce(&inputs, loc(out, 0, es), c as u64, E::DTYPE, op);
            }
            for (j, r) in reads.iter_mut().enumerate() {
                if j != me {
                    *r += c as u64;
                }
            }
        })
    }

    fn all_reduce<E: Element>(&mut self, buf: &mut WgpuBuffer<E>, op: ReduceOp) -> Result<()> {
        let n = self.members.len();
        let me = self.rank;
        let es = size_of::<E>();
        let len = buf.len();
        let view = &buf.view;
        let call = Call::new(
            Desc {
                dtype: Some(E::DTYPE),
                reduce: Some(op),
                send_len: len,
                recv_len: len,
                ..Desc::new(Collective::AllReduce)
            },
            post(view),
        );
        self.run(call, es, 2, |step, calls, reads, batch| {
            if step == 0 {
                // Reduce-scatter half: reduce chunk `me` of every buffer into ours.
                let (off, cl) = ar_chunk(len, n, me);
                if cl > 0 {
                    // SAFETY: posted at this op's arrival; used before its drain barrier. Every
                    // buffer holds `len` elements (checked). In this step each rank writes only its
                    // own chunk of its own buffer and reads only that chunk of everyone's, so
                    // nobody writes the ranges we read except us, at exactly our input `me`, which
                    // `reduce` allows (it reads every input before writing).
                    let inputs: Vec<Loc<'_>> = calls
                        .iter()
                        .map(|cj| loc(unsafe { peer(cj) }, off, es))
                        .collect();
                    batch.reduce(&inputs, loc(view, off, es), cl as u64, E::DTYPE, op);
                }
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
                    // SAFETY: as above. In this step every rank reads only the owner's chunk of the
                    // owner's buffer (reduced in step 0, submitted before the barrier between the
                    // steps) and writes only non-owned chunks of its own.
                    let pj = unsafe { peer(cj) };
                    batch.copy(loc(pj, off, es), loc(view, off, es), (cl * es) as u64);
                    reads[j] += cl as u64;
                }
            }
        })
    }

    fn broadcast<E: Element>(&mut self, buf: &mut WgpuBuffer<E>, root: usize) -> Result<()> {
        let me = self.rank;
        let es = size_of::<E>();
        let len = buf.len();
        let view = &buf.view;
        let call = Call::new(
            Desc {
                dtype: Some(E::DTYPE),
                root: Some(root),
                send_len: len,
                recv_len: len,
                ..Desc::new(Collective::Broadcast)
            },
            post(view),
        );
        self.run(call, es, 1, |_, calls, reads, batch| {
            if me != root {
                // SAFETY: posted at this op's arrival; used before its drain barrier. The root's
                // buffer holds `len` elements (checked) and the root writes nothing; ours is read
                // by nobody.
                let pr = unsafe { peer(&calls[root]) };
                batch.copy(loc(pr, 0, es), loc(view, 0, es), (len * es) as u64);
                reads[root] += len as u64;
            }
        })
    }

    fn all_to_all<E: Element>(
        &mut self,
        send: &WgpuBuffer<E>,
        recv: &mut WgpuBuffer<E>,
    ) -> Result<()> {
        let n = self.members.len();
        let me = self.rank;
        let es = size_of::<E>();
        let len = send.len();
        let out = &recv.view;
        let call = Call::new(
            Desc {
                dtype: Some(E::DTYPE),
                send_len: len,
                recv_len: recv.len(),
                ..Desc::new(Collective::AllToAll)
            },
            post(&send.view),
        );
        self.run(call, es, 1, |_, calls, reads, batch| {
            let c = len / n;
            for (j, cj) in calls.iter().enumerate() {
                // SAFETY: posted at this op's arrival; used before its drain barrier. Every send
                // buffer holds `n · c` elements (checked) and is never written during the op; our
                // receive buffer is read by nobody.
                let pj = unsafe { peer(cj) };
                batch.copy(loc(pj, me * c, es), loc(out, j * c, es), (c * es) as u64);
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
            |_, _, _, _| {},
        )
    }

    fn split(&mut self, color: usize, key: usize) -> Result<WgpuComm> {
        let (group, members, rank) = self.split_group(color, key)?;
        Ok(WgpuComm {
            shared: self.shared.clone(),
            group,
            rank,
            members,
            timeout: self.timeout,
            traffic: TrafficTable::new(),
            aborted: None,
            scratch: None,
            _not_sync: PhantomData,
        })
    }

    fn traffic(&self) -> &TrafficTable {
        &self.traffic
    }

    fn abort(&mut self, cause: String) {
        self.aborted.get_or_insert(cause);
    }
}
