//! What a loopback world needs from its device memory ([`Memory`]), sealed: the crate implements
//! it for its devices (wgpu, CUDA), and the collective algorithms in this folder are written once
//! over it.

use std::fmt;
use std::time::Duration;

use crate::element::{DType, Element, ReduceOp};
use crate::error::Result;

/// A location in device memory: a buffer's untyped part and a byte offset from its element 0.
#[derive(Debug)]
pub struct Loc<'a, V> {
    /// The buffer.
    pub view: &'a V,
    /// Bytes from the buffer's element 0.
    pub byte: u64,
}

impl<V> Clone for Loc<'_, V> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<V> Copy for Loc<'_, V> {}

/// The commands one rank records for one step of a collective, submitted together.
pub trait Recorder<V, S> {
    /// Copies `bytes` bytes from `src` to `dst` (non-overlapping ranges; the buffers may be the
    /// same).
    fn copy(&mut self, src: Loc<'_, V>, dst: Loc<'_, V>, bytes: u64);

    /// `out[i] = op(inputs[0][i], inputs[1][i], …)` for `count` elements of `dtype`: widened to
    /// `f32`, summed in input order, rounded once (see [`ReduceOp`]). `out` must not overlap any
    /// input except exactly (same location, as an all-reduce's own chunk).
    fn reduce(
        &mut self,
        inputs: &[Loc<'_, V>],
        out: Loc<'_, V>,
        count: u64,
        dtype: DType,
        op: ReduceOp,
    );

    /// Hands the commands to the device, in order after everything submitted before. `scratch`
    /// is the rank's scratch memory, grown if the commands need more. Returns once the commands
    /// are queued, not executed.
    fn submit(self, scratch: &mut S) -> std::result::Result<(), String>;
}

/// Keeps [`Memory`] to this crate's devices: the collectives' safety rests on their contract.
pub trait Sealed {}

/// One device, shared by every rank of a loopback world: its buffers, its one in-order queue (or
/// stream) and the kernels that copy and reduce. Implemented by this crate's devices only.
pub trait Memory: Sealed + fmt::Debug + Send + Sync + Sized + 'static {
    /// The backend's name in error messages, e.g. `"wgpu loopback"`.
    const NAME: &'static str;
    /// The communicator's name in `Debug`, e.g. `"WgpuComm"`.
    const COMM: &'static str;
    /// A buffer's untyped part, which peers read through the rendezvous.
    type View: Sync;
    /// `len` elements of `E` in device memory.
    type Buffer<E: Element>: Send;
    /// A rank's scratch memory (reduction accumulators, bounce buffers).
    type Scratch: Default + Send;
    /// The commands of one step.
    type Batch<'a>: Recorder<Self::View, Self::Scratch>
    where
        Self: 'a;

    /// The untyped part of `buf`.
    fn view<E: Element>(buf: &Self::Buffer<E>) -> &Self::View;
    /// The number of elements of `buf`.
    fn len<E: Element>(buf: &Self::Buffer<E>) -> usize;
    /// An empty batch of commands.
    fn batch(&self) -> Self::Batch<'_>;
    /// `len` zeroed elements.
    fn alloc<E: Element>(&self, len: usize) -> Result<Self::Buffer<E>>;
    /// A copy of `src`, waiting at most `timeout` for the queue where the copy must.
    fn upload<E: Element>(&self, src: &[E], timeout: Duration) -> Result<Self::Buffer<E>>;
    /// Overwrites `dst` (of the same length) with `src`, in queue order, waiting at most `timeout`
    /// for the queue where the copy must.
    fn upload_into<E: Element>(
        &self,
        src: &[E],
        dst: &mut Self::Buffer<E>,
        timeout: Duration,
    ) -> Result<()>;
    /// Waits for the queue and copies `buf` (of the same length) into `dst`.
    fn download<E: Element>(
        &self,
        buf: &Self::Buffer<E>,
        dst: &mut [E],
        timeout: Duration,
    ) -> Result<()>;
    /// Waits at most `timeout` until everything queued so far has executed.
    fn synchronize(&self, timeout: Duration) -> Result<()>;
}
