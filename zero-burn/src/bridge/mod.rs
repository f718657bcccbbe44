//! The zero-copy bridge between burn tensors on burn's wgpu backend and the wgpu loopback's
//! buffers (feature `wgpu`).
//!
//! With [`WgpuShared`](crate::WgpuShared), burn (cubecl-wgpu) and the wgpu loopback share
//! one `wgpu::Device` and one queue. Then:
//!
//! - [`tensor_buffer`] hands out a tensor's own storage as a
//!   [`WgpuBuffer<f32>`](zero_comm::wgpu_loopback::WgpuBuffer), **without a copy**: a collective
//!   reads it and writes it in place (e.g. an all-reduce of a gradient directly in burn's memory).
//! - [`tensor_from_buffer`] makes a fresh burn tensor from a loopback buffer with one
//!   device-to-device copy on the shared queue (cubecl cannot adopt a foreign `wgpu::Buffer`).
//!
//! # Ordering
//!
//! cubecl records its kernels lazily and submits them in batches. Asking cubecl for a tensor's
//! buffer (what [`tensor_buffer`] and [`tensor_from_buffer`] do) first submits the pending work of
//! the calling thread's stream and of the stream that produced the tensor to the queue, so every
//! command recorded afterwards (a collective, a copy) executes after the work that computed the
//! tensor: WebGPU runs a queue's submissions in order. In the other direction, collectives and
//! [`tensor_from_buffer`] submit their commands before returning, so any burn work recorded later
//! (even a read back to the host) sees their results. Call [`tensor_buffer`] after the tensor's
//! last producing op, preferably on the thread that produced it.
//!
//! # Pinning
//!
//! A [`TensorBuffer`] holds two pins for as long as it lives: cubecl's resource guard, which keeps
//! the memory range allocated and in place (never freed, handed out again or relocated), and a
//! clone of the tensor primitive, which keeps burn from mutating the storage in place (burn only
//! does so when it holds the last reference). Drop the [`TensorBuffer`] only after the last
//! collective that uses it has returned. The loopback's commands are then already submitted, so
//! burn's later reuse of the range executes after them.
//!
//! # Aliasing
//!
//! The buffer *is* the tensor's storage: what a collective writes into it, every tensor sharing
//! that storage sees (clones of the tensor, and views burn made of it without copying, such as
//! reshapes and contiguous slices). A tensor whose elements are not contiguous in row-major
//! order (a transposed tensor, a slice of columns) has no such range: [`tensor_buffer`] then
//! makes a contiguous copy on the device first ([`TensorBuffer::is_copy`]), and
//! [`TensorBuffer::tensor`] returns that copy, the tensor whose storage the buffer is.

use std::fmt;
use std::sync::Arc;

use burn::backend::Cube;
use burn::backend::wgpu::{AutoCompiler, WgpuResource};
use burn::tensor::{DType, Device, Tensor};
use zero_comm::Element;
use zero_comm::wgpu_loopback::{REQUIRED_USAGES, WgpuBuffer, WgpuComm, WgpuDevice, wgpu};

use crate::device::{DeviceTensors, WordBuffer};
use crate::error::{Error, Result};

mod words;

/// cubecl's server of the wgpu runtime burn's wgpu devices run on.
type Server = cubecl_wgpu::WgpuServer<AutoCompiler>;

/// cubecl's tensor primitive (the float primitive of burn's unfused cubecl backend).
type CubeTensor = burn::backend::wgpu::CubeTensor;

/// A pin that keeps cubecl memory in place; only its lifetime matters.
trait Pin: fmt::Debug + Send {}
impl<T: fmt::Debug + Send> Pin for T {}

/// The storage of a burn f32 tensor on burn's wgpu backend as a wgpu loopback buffer, zero-copy
/// (see the [module docs](self) for ordering, pinning and aliasing). Made by [`tensor_buffer`].
///
/// Pass [`buffer`](Self::buffer) or [`buffer_mut`](Self::buffer_mut) to the collectives of a
/// [`WgpuComm`] on the same device; they then read and write
/// the tensor's memory in place.
pub struct TensorBuffer {
    /// The elements, row-major: the tensor's storage range in cubecl's `wgpu::Buffer`.
    buffer: WgpuBuffer<f32>,
    /// The 1-D primitive whose storage `buffer` is (pins the storage against in-place mutation
    /// by burn, and backs [`tensor`](Self::tensor)).
    primitive: CubeTensor,
    /// cubecl's resource guard (pins the range against reuse and relocation).
    _resource: Box<dyn Pin>,
    /// The tensor's dims.
    shape: Vec<usize>,
    /// Whether `buffer` is a contiguous copy rather than the tensor's own storage.
    copied: bool,
}

impl fmt::Debug for TensorBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TensorBuffer")
            .field("buffer", &self.buffer)
            .field("shape", &self.shape)
            .field("copied", &self.copied)
            .finish_non_exhaustive()
    }
}

impl TensorBuffer {
    /// The elements as a loopback buffer (for collectives that read it, and downloads).
    pub fn buffer(&self) -> &WgpuBuffer<f32> {
        &self.buffer
    }

    /// The elements as a loopback buffer that collectives may write (in place in the tensor's
    /// storage).
    pub fn buffer_mut(&mut self) -> &mut WgpuBuffer<f32> {
        &mut self.buffer
    }

    /// The `wgpu::Buffer` holding the elements (one of cubecl's memory pages: other tensors live
    /// in the rest of it).
    pub fn wgpu_buffer(&self) -> &wgpu::Buffer {
        self.buffer.wgpu_buffer()
    }

    /// Byte offset of element 0 in [`wgpu_buffer`](Self::wgpu_buffer).
    pub fn offset(&self) -> u64 {
        self.buffer.offset()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.buffer.len()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.buffer.is_empty()
    }

    /// The tensor's dims.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Whether the buffer is a contiguous copy of a non-contiguous tensor instead of the tensor's
    /// own storage: writes then reach [`tensor`](Self::tensor), not the original tensor.
    pub fn is_copy(&self) -> bool {
        self.copied
    }

    /// A tensor (without autodiff, with the original dims) whose storage is this buffer: after a
    /// collective wrote into the buffer, it holds the result. `D` must be the original rank.
    pub fn tensor<const D: usize>(&self) -> Result<Tensor<D>> {
        let dims: [usize; D] = self.shape.as_slice().try_into().map_err(|_| {
            Error::Backend(format!(
                "bridge: the tensor has rank {}, not {D}",
                self.shape.len()
            ))
        })?;
        Ok(Tensor::<1>::from_primitive::<Cube>(self.primitive.clone()).reshape(dims))
    }
}

fn err(why: impl fmt::Display) -> Error {
    Error::Backend(format!("bridge: {why}"))
}

/// The cubecl primitive of a float tensor on burn's (unfused) cubecl backend, dropping any autodiff
/// association.
fn primitive<const D: usize>(t: Tensor<D>) -> Result<CubeTensor> {
    let device = t.device();
    t.inner().try_into_primitive::<Cube>().map_err(|e| {
        err(format!(
            "the tensor lives on {device:?}, not on burn's wgpu backend: {e:?}"
        ))
    })
}

/// cubecl's storage of `ct`: its `wgpu::Buffer` range and the guard that pins it. Submits the
/// pending work of the calling thread's stream and of `ct`'s stream to the queue first.
fn resource(ct: &CubeTensor) -> Result<(WgpuResource, Box<dyn Pin>)> {
    let managed = ct
        .client
        .get_resource::<Server>(ct.handle.clone())
        .map_err(|e| err(format!("cubecl has no wgpu buffer for the tensor: {e}")))?;
    let resource = managed.resource().clone();
    Ok((resource, Box::new(managed)))
}

/// The storage of `t`, an f32 tensor on burn's wgpu backend (with or without autodiff), as a
/// loopback buffer, zero-copy: see [`TensorBuffer`] and the [module docs](self).
///
/// A tensor whose elements are not contiguous in row-major order is first copied to a
/// contiguous tensor on the device ([`TensorBuffer::is_copy`]); a contiguous view at an offset
/// (e.g. a slice of rows) is handed out in place, at its offset.
///
/// # Errors
///
/// [`Error::Backend`] if `t` is not on burn's wgpu backend (e.g. a flex tensor, or fusion is on),
/// is not `f32` (e.g. quantized), or cubecl cannot name its buffer.
pub fn tensor_buffer<const D: usize>(t: &Tensor<D>) -> Result<TensorBuffer> {
    if t.dtype() != DType::F32 {
        return Err(err(format!(
            "only f32 tensors are bridged, not {:?}",
            t.dtype()
        )));
    }
    let shape = t.dims().to_vec();
    let len: usize = shape.iter().product();
    let original = primitive(t.clone())?;
    let in_place = original.is_contiguous() && !original.meta.is_tiled();
    drop(original);
    // A reshape of a contiguous tensor is a view of the same storage; of any other, a contiguous
    // copy (burn's reshape untiles and copies as needed).
    let ct = primitive(t.clone().reshape([len]))?;
    if ct.dtype != DType::F32 || ct.qparams.is_some() {
        return Err(err(format!(
            "only plain f32 tensors are bridged, not {:?}{}",
            ct.dtype,
            if ct.qparams.is_some() {
                " (quantized)"
            } else {
                ""
            }
        )));
    }
    if !ct.is_contiguous() || ct.meta.is_tiled() {
        return Err(err(format!(
            "the tensor is not contiguous after a reshape to 1-D: {ct:?}"
        )));
    }
    let (res, pin) = resource(&ct)?;
    let bytes = (len * size_of::<f32>()) as u64;
    if res.size < bytes {
        return Err(err(format!(
            "cubecl's range holds {} bytes, the tensor {bytes}",
            res.size
        )));
    }
    let buffer = WgpuBuffer::from_wgpu(res.buffer, res.offset, len)?;
    Ok(TensorBuffer {
        buffer,
        primitive: ct,
        _resource: pin,
        shape,
        copied: !in_place,
    })
}

/// A fresh f32 tensor of `shape` on `device` (burn's wgpu backend, with or without autodiff)
/// holding the elements of `src`, copied device-to-device on the shared queue: no host round trip.
/// `comm` is the loopback's side of the device burn's tensors live on
/// ([`WgpuShared::comm_device`](crate::WgpuShared::comm_device)). The copy is submitted
/// before this returns, so burn work on the tensor executes after it.
///
/// On an autodiff device the tensor has autodiff enabled but does not require gradients: call
/// `.require_grad()` for a parameter.
///
/// # Errors
///
/// [`Error::Backend`] if `shape` does not hold `src.len()` elements, `device` is not a wgpu device
/// of burn's, or wgpu rejects the copy (e.g. `src` lives on another device).
pub fn tensor_from_buffer<const D: usize>(
    src: &WgpuBuffer<f32>,
    shape: [usize; D],
    device: &Device,
    comm: &WgpuDevice,
) -> Result<Tensor<D>> {
    let len: usize = shape.iter().product();
    if len != src.len() {
        return Err(err(format!(
            "shape {shape:?} holds {len} elements, the buffer {}",
            src.len()
        )));
    }
    Ok(fill(comm, device, src, DType::F32, 0, len)?.reshape(shape))
}

/// A new flat tensor of `dtype` (whose elements are `E`s) on `device` holding `len` elements of
/// `src` from `offset`, copied on the device. It moves whole 4-byte words (WebGPU's copy
/// alignment): `len` 16-bit elements of an odd count also move the 2 bytes after them, within
/// both ranges (checked).
pub(super) fn fill<E: Element>(
    comm: &WgpuDevice,
    device: &Device,
    src: &WgpuBuffer<E>,
    dtype: DType,
    offset: usize,
    len: usize,
) -> Result<Tensor<1>> {
    crate::device::within("bridge", offset, len, src.len())?;
    let out = Tensor::<1>::empty([len], (device, dtype));
    if len > 0 {
        let at = src.offset() + (offset * size_of::<E>()) as u64;
        let padded = ((len * size_of::<E>()) as u64).next_multiple_of(4);
        if at + padded > src.wgpu_buffer().size() {
            return Err(err(format!(
                "{len} elements at byte {at} overrun a wgpu buffer of {} bytes",
                src.wgpu_buffer().size()
            )));
        }
        let ct = primitive(out.clone())?;
        let (dst, pin) = resource(&ct)?;
        if dst.size < padded {
            return Err(err(format!(
                "cubecl's range holds {} bytes, the copy {padded}",
                dst.size
            )));
        }
        copy_raw(
            comm,
            (src.wgpu_buffer(), at),
            (&dst.buffer, dst.offset),
            padded,
            "zero-burn bridge: buffer to tensor",
        )?;
        drop(pin);
    }
    Ok(out)
}

/// One `copy_buffer_to_buffer` of `bytes` from `(buffer, offset)` to `(buffer, offset)`,
/// submitted, with wgpu's validation and out-of-memory errors returned.
fn copy_raw(
    comm: &WgpuDevice,
    src: (&wgpu::Buffer, u64),
    dst: (&wgpu::Buffer, u64),
    bytes: u64,
    label: &str,
) -> Result<()> {
    let device = comm.device();
    let validation = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let oom = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
    let mut enc =
        device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) });
    enc.copy_buffer_to_buffer(src.0, src.1, dst.0, dst.1, bytes);
    comm.queue().submit([enc.finish()]);
    let oom = pollster::block_on(oom.pop());
    let validation = pollster::block_on(validation.pop());
    match oom.or(validation) {
        Some(e) => Err(err(format!("the device-to-device copy failed: {e}"))),
        None => Ok(()),
    }
}

/// The trainer's [`DeviceTensors`] hook on the wgpu path. Gradients: each gradient tensor's own
/// storage ([`tensor_buffer`], no copy to the host) is copied on the device into its unit's flat
/// buffer, which the loopback then reduces in place; only the rank's reduced chunk is downloaded.
/// Weights: a unit all-gathered into a loopback buffer becomes the model's tensors with one
/// device copy each ([`tensor_from_buffer`]).
#[derive(Clone, Debug)]
pub struct BridgeTensors {
    comm: Arc<WgpuDevice>,
    model: Device,
}

impl BridgeTensors {
    /// A hook on the loopback's side of the shared device
    /// ([`WgpuShared::comm_device`](crate::WgpuShared::comm_device)), making weights on
    /// `model`, the device the model lives on.
    pub fn new(comm: Arc<WgpuDevice>, model: Device) -> Self {
        BridgeTensors { comm, model }
    }

    /// A new zeroed buffer of `bytes` bytes (rounded up to WebGPU's 4-byte copy size).
    fn raw(&self, bytes: u64, label: &str) -> wgpu::Buffer {
        // WebGPU zero-initialises new buffers.
        self.comm.device().create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes.next_multiple_of(4).max(4),
            usage: REQUIRED_USAGES,
            mapped_at_creation: false,
        })
    }
}

impl DeviceTensors<WgpuComm> for BridgeTensors {
    fn zeros(&self, len: usize) -> Result<WgpuBuffer<f32>> {
        let buffer = self.raw(
            (len * size_of::<f32>()) as u64,
            "zero-burn bridge: unit gradients",
        );
        Ok(WgpuBuffer::from_wgpu(buffer, 0, len)?)
    }

    fn copy_in(&self, dst: &mut WgpuBuffer<f32>, offset: usize, grad: &Tensor<1>) -> Result<()> {
        let src = tensor_buffer(grad)?;
        if offset + src.len() > dst.len() {
            return Err(err(format!(
                "a gradient of {} elements at {offset} overruns its unit of {}",
                src.len(),
                dst.len()
            )));
        }
        if src.is_empty() {
            return Ok(());
        }
        let at = dst.offset() + (offset * size_of::<f32>()) as u64;
        // Submitted before `src` (and its pins) drops: burn's later reuse of the range runs
        // after the copy on the shared queue.
        copy_raw(
            &self.comm,
            (src.wgpu_buffer(), src.offset()),
            (dst.wgpu_buffer(), at),
            (src.len() * size_of::<f32>()) as u64,
            "zero-burn bridge: gradient into its unit",
        )
    }

    fn tensor_at(&self, src: &WgpuBuffer<f32>, offset: usize, len: usize) -> Result<Tensor<1>> {
        crate::device::within("bridge", offset, len, src.len())?;
        let at = src.offset() + (offset * size_of::<f32>()) as u64;
        let view = WgpuBuffer::from_wgpu(src.wgpu_buffer().clone(), at, len)?;
        tensor_from_buffer(&view, [len], &self.model, &self.comm)
    }

    fn moves_words(&self) -> bool {
        true
    }

    fn words_of(&self, t: &Tensor<1>) -> Result<WordBuffer<WgpuComm>> {
        WordBuffer::of_type(t, || self.copy_out(t), || self.copy_out(t))
    }

    fn tensor_of(
        &self,
        src: &WordBuffer<WgpuComm>,
        offset: usize,
        len: usize,
    ) -> Result<Tensor<1>> {
        src.visit(
            |b, dtype| self.copy_back(b, dtype, offset, len),
            |b, dtype| self.copy_back(b, dtype, offset, len),
        )
    }
}
