//! [`WgpuBuffer`]: typed elements in a range of a `wgpu::Buffer`.

use std::fmt;
use std::marker::PhantomData;

use crate::element::Element;
use crate::error::{Error, Result};

/// The usages every buffer a [`super::WgpuComm`] touches must have.
pub const REQUIRED_USAGES: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

/// The untyped part of a [`WgpuBuffer`]: the buffer and the byte offset of element 0. Peers read
/// this (through the rendezvous) to encode copies from it, whatever the element type.
#[derive(Clone, Debug)]
pub struct View {
    pub(crate) buffer: wgpu::Buffer,
    pub(crate) offset: u64,
}

/// `len` elements of type `E` stored in a `wgpu::Buffer` from byte `offset` on: the buffer type of
/// [`super::WgpuComm`].
///
/// Buffers made by the communicator ([`alloc`](crate::Communicator::alloc),
/// [`upload`](crate::Communicator::upload)) own a fresh `wgpu::Buffer` with
/// [`REQUIRED_USAGES`], sized to the elements rounded up to 4 bytes, at offset 0.
///
/// # The zero-copy bridge
///
/// [`WgpuBuffer::from_wgpu`] wraps *any* buffer of the communicator's device, e.g. the storage of a
/// burn-wgpu tensor (cubecl hands out a buffer, an offset and a size per tensor handle), so a
/// collective reads and writes that memory in place, with no upload or download. The wrapped range
/// must stay alive and must not be written by anyone else while a collective that uses it runs
/// (until the op returns); every command the loopback records goes to the device's one queue, in
/// order with any other work submitted to that queue. Work that another library has recorded but
/// not yet submitted (cubecl batches its commands) must be flushed before the collective, and
/// commands recorded afterwards see its results, since queue order is WebGPU's execution order.
///
/// The views passed to one op must not overlap each other, except as NCCL's in-place forms do: a
/// reduce-scatter whose output is exactly this rank's chunk of its input (the in-place all-gather
/// and all-reduce take one buffer anyway). Views of the *same* `wgpu::Buffer` are fine: the
/// loopback notices, and copies through a scratch buffer where WebGPU forbids a direct copy.
pub struct WgpuBuffer<E: Element> {
    pub(crate) view: View,
    len: usize,
    _e: PhantomData<E>,
}

impl<E: Element> WgpuBuffer<E> {
    pub(crate) fn owned(buffer: wgpu::Buffer, len: usize) -> Self {
        WgpuBuffer {
            view: View { buffer, offset: 0 },
            len,
            _e: PhantomData,
        }
    }

    /// Wraps `len` elements of an existing buffer starting at byte `offset` (zero-copy; see the
    /// type docs). The buffer must belong to the communicator's device (wgpu cannot tell here; a
    /// collective on a foreign buffer fails with a backend error, or panics in wgpu-core if the
    /// buffer comes from another `wgpu::Instance`) and have
    /// [`REQUIRED_USAGES`]; its size must be a multiple of 4 bytes (WebGPU's copy alignment) and
    /// `offset` a multiple of the element size. Any other alignment is handled.
    pub fn from_wgpu(buffer: wgpu::Buffer, offset: u64, len: usize) -> Result<Self> {
        let es = size_of::<E>() as u64;
        let bad = |why: String| Err(Error::Backend(format!("wgpu loopback: cannot wrap: {why}")));
        if !buffer.usage().contains(REQUIRED_USAGES) {
            return bad(format!(
                "buffer usages {:?} lack some of {REQUIRED_USAGES:?}",
                buffer.usage()
            ));
        }
        if !buffer.size().is_multiple_of(4) {
            return bad(format!(
                "buffer size {} is not a multiple of 4 bytes",
                buffer.size()
            ));
        }
        if !offset.is_multiple_of(es) {
            return bad(format!(
                "offset {offset} is not a multiple of the {}-byte {} element",
                es,
                E::DTYPE
            ));
        }
        let end = (len as u64)
            .checked_mul(es)
            .and_then(|b| b.checked_add(offset));
        match end {
            Some(end) if end <= buffer.size() => Ok(WgpuBuffer {
                view: View { buffer, offset },
                len,
                _e: PhantomData,
            }),
            _ => bad(format!(
                "{len} {} elements from byte {offset} exceed the buffer's {} bytes",
                E::DTYPE,
                buffer.size()
            )),
        }
    }

    /// The underlying `wgpu::Buffer` (shared handle; the elements start at [`offset`](Self::offset)).
    pub fn wgpu_buffer(&self) -> &wgpu::Buffer {
        &self.view.buffer
    }

    /// Byte offset of element 0 in [`wgpu_buffer`](Self::wgpu_buffer).
    pub fn offset(&self) -> u64 {
        self.view.offset
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size of the elements in bytes.
    pub fn byte_len(&self) -> u64 {
        (self.len * size_of::<E>()) as u64
    }

    /// Unwraps into `(buffer, offset, len)`, the arguments of [`from_wgpu`](Self::from_wgpu).
    pub fn into_parts(self) -> (wgpu::Buffer, u64, usize) {
        (self.view.buffer, self.view.offset, self.len)
    }
}

impl<E: Element> fmt::Debug for WgpuBuffer<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "WgpuBuffer<{}>[{}] at byte {} of a {}-byte buffer",
            E::DTYPE,
            self.len,
            self.view.offset,
            self.view.buffer.size()
        )
    }
}
