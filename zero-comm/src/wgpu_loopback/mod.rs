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
//! - [`WgpuComm`] implements [`Communicator`](crate::Communicator) with [`WgpuBuffer`]s.
//!
//! # How an op runs, and failures
//!
//! As in every device loopback ([`crate::device_loopback`]): collectives are recorded as copies
//! and reductions into one command buffer per rank and step, submitted to the shared queue, which
//! executes submissions in order (WebGPU's rule, which wgpu enforces with barriers). The failure
//! behaviour is the host loopback's. In addition, a wgpu error while a rank records or submits an
//! op (out of memory, a lost device, a destroyed buffer) fails that rank with [`Error::Backend`]
//! and the world with [`FailureReason::Backend`](crate::FailureReason::Backend) naming it. (A
//! buffer of another wgpu *instance* makes wgpu-core panic instead; the rank then fails as
//! panicked.) wgpu errors are caught in error scopes on the calling thread, so the device's
//! uncaptured-error handler (which an adopting library may own) never sees them.
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

mod batch;
mod buffer;
mod core;
mod kernels;
mod quantized;

use std::fmt;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use zero_core::Topology;

use crate::device_loopback::{self, LoopbackComm, LoopbackWorld, Memory, Recorder, Sealed};
use crate::element::{DType, Element, ReduceOp};
use crate::error::{Error, Result};
use batch::Batch;
use core::Core;

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

/// The communicators of one wgpu loopback world, before they are handed to threads.
pub type WgpuWorld = LoopbackWorld<WgpuDevice>;

/// One rank of a wgpu loopback group ([`Communicator`](crate::Communicator) with [`WgpuBuffer`]s).
/// `Send`, not `Sync`: one thread drives it.
pub type WgpuComm = LoopbackComm<WgpuDevice>;

impl LoopbackWorld<WgpuDevice> {
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

impl LoopbackComm<WgpuDevice> {
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
}

fn at(loc: device_loopback::Loc<'_, View>) -> batch::Loc<'_> {
    batch::Loc {
        buffer: &loc.view.buffer,
        byte: loc.view.offset + loc.byte,
    }
}

impl Recorder<View, Option<wgpu::Buffer>> for Batch<'_> {
    fn copy(
        &mut self,
        src: device_loopback::Loc<'_, View>,
        dst: device_loopback::Loc<'_, View>,
        bytes: u64,
    ) {
        Batch::copy(self, at(src), at(dst), bytes);
    }

    fn reduce(
        &mut self,
        inputs: &[device_loopback::Loc<'_, View>],
        out: device_loopback::Loc<'_, View>,
        count: u64,
        dtype: DType,
        op: ReduceOp,
    ) {
        let inputs: Vec<_> = inputs.iter().map(|&x| at(x)).collect();
        Batch::reduce(self, &inputs, at(out), count, dtype, op);
    }

    fn submit(self, scratch: &mut Option<wgpu::Buffer>) -> std::result::Result<(), String> {
        Batch::submit(self, scratch)
    }
}

impl Sealed for WgpuDevice {}

impl Memory for WgpuDevice {
    const NAME: &'static str = "wgpu loopback";
    const COMM: &'static str = "WgpuComm";
    type View = View;
    type Buffer<E: Element> = WgpuBuffer<E>;
    type Scratch = Option<wgpu::Buffer>;
    type Batch<'a> = Batch<'a>;

    fn view<E: Element>(buf: &WgpuBuffer<E>) -> &View {
        &buf.view
    }

    fn len<E: Element>(buf: &WgpuBuffer<E>) -> usize {
        buf.len()
    }

    fn batch(&self) -> Batch<'_> {
        Batch::new(&self.core)
    }

    fn alloc<E: Element>(&self, len: usize) -> Result<WgpuBuffer<E>> {
        let buffer = self
            .core
            .alloc((len * size_of::<E>()) as u64)
            .map_err(backend)?;
        Ok(WgpuBuffer::owned(buffer, len))
    }

    fn upload<E: Element>(&self, src: &[E], _timeout: Duration) -> Result<WgpuBuffer<E>> {
        let buffer = self
            .core
            .upload(bytemuck::cast_slice(src))
            .map_err(backend)?;
        Ok(WgpuBuffer::owned(buffer, src.len()))
    }

    fn upload_into<E: Element>(
        &self,
        src: &[E],
        dst: &mut WgpuBuffer<E>,
        timeout: Duration,
    ) -> Result<()> {
        let bytes: &[u8] = bytemuck::cast_slice(src);
        let core = &self.core;
        let buffer = &dst.view.buffer;
        let start = dst.view.offset;
        let end = start + bytes.len() as u64;
        // WebGPU writes whole 4-byte words: widen to the words that hold [start, end), keeping
        // the neighbours' bytes in the first and last word (a wrapped view may share them).
        let (a0, a1) = (start & !3, end.next_multiple_of(4));
        let mut window = vec![0u8; (a1 - a0) as usize];
        if a0 != start || a1 != end {
            let last = window.len() - 4;
            core.download(buffer, a0, &mut window[..4], timeout)
                .map_err(backend)?;
            core.download(buffer, a1 - 4, &mut window[last..], timeout)
                .map_err(backend)?;
        }
        window[(start - a0) as usize..][..bytes.len()].copy_from_slice(bytes);
        core.queue.write_buffer(buffer, a0, &window);
        Ok(())
    }

    fn download<E: Element>(
        &self,
        buf: &WgpuBuffer<E>,
        dst: &mut [E],
        timeout: Duration,
    ) -> Result<()> {
        self.core
            .download(
                &buf.view.buffer,
                buf.view.offset,
                bytemuck::cast_slice_mut(dst),
                timeout,
            )
            .map_err(backend)
    }

    fn synchronize(&self, timeout: Duration) -> Result<()> {
        WgpuDevice::synchronize(self, timeout)
    }
}
