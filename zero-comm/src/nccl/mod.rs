//! The NCCL backend: [`NcclComm`], one rank per GPU, over cudarc 0.19's CUDA driver and NCCL
//! bindings (feature `nccl`), plus the torchrun-style [`bootstrap`].
//!
//! The module exists in every build. Without the `nccl` feature, [`NcclComm`] and [`NcclBuffer`]
//! are stand-ins whose constructors return [`Error::NotCompiled`](crate::Error::NotCompiled)
//! (candle's dummy-backend pattern), so callers need no `cfg`. With it, nothing links against
//! CUDA at build time (cudarc's `dynamic-loading`): libcuda and libnccl are probed at run time
//! ([`probe`]), and a machine without them gets an [`Error::Backend`](crate::Error::Backend)
//! naming what is missing, never a panic.
//!
//! ```no_run
//! use zero_comm::{Communicator, ReduceOp, nccl::NcclComm};
//!
//! // torchrun --nproc-per-node 8 ...: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//! // MASTER_ADDR and MASTER_PORT come from the launcher.
//! let mut comm = NcclComm::from_env()?;
//! let mut grads = comm.upload(&vec![1.0f32; 1 << 20])?;
//! comm.all_reduce(&mut grads, ReduceOp::Mean)?;
//! let host = comm.download_vec(&grads)?;
//! # Ok::<(), zero_comm::Error>(())
//! ```
//!
//! The same module holds the CUDA loopback (`CudaWorld`, `CudaComm`, `CudaDevice`; feature
//! `nccl`): N ranks as threads on one GPU and one stream, with [`NcclBuffer`]s and no NCCL, so one
//! GPU can run any world size. Its collectives are the device loopbacks' (`device_loopback`); its
//! reduction is hand-written PTX that sums in rank order in `f32`
//! and rounds once, like the host loopback.
//!
//! # How it maps onto NCCL
//!
//! | op | NCCL |
//! |---|---|
//! | all-gather (and in place, at `rank · c`) | `ncclAllGather` |
//! | reduce-scatter, all-reduce | `ncclReduceScatter`, `ncclAllReduce` with `ncclSum` (then the mean kernel) |
//! | broadcast | `ncclBroadcast` in place |
//! | all-to-all | `ncclSend`/`ncclRecv` to every peer inside `ncclGroupStart`/`ncclGroupEnd`; the own chunk is a device copy |
//! | barrier | a one-byte `ncclAllReduce`, waited for |
//! | split | an all-gather of every rank's `(color, key)` (to know the members), then `ncclCommSplit` (NCCL ≥ 2.18); the child shares the parent's stream |
//! | [`group`](crate::Communicator::group) | `ncclGroupStart` … `ncclGroupEnd`, an RAII guard (cudarc's `group!` macro unwraps; it is not used) |
//!
//! Every op runs on the communicator's own CUDA stream (`NcclComm::stream`, with the `nccl` feature); communicators split
//! from it share that stream. Buffers made by the communicator (`alloc`, `upload`) live on it, so
//! stream order alone orders them. cudarc's per-buffer events (which let *other* streams wait for
//! a buffer) are recorded when an op is issued; inside a group that is before `ncclGroupEnd`
//! launches the work, so another stream that reads a group's buffers must wait for
//! `NcclComm::stream` (or [`NcclComm::synchronize`]) after the group, not for the buffers.
//!
//! # Deviations from the contract, and why
//!
//! **Reductions are not bit-exact.** The host loopback sums in rank order
//! in `f32` with one rounding. NCCL picks the summation order per chunk from its ring or tree
//! algorithm, and adds 16-bit types in their own precision at each step. So for `n ≥ 3` ranks a
//! `Sum` differs from the host's in the last bits: about `1e-6` relative for `f32` (a few ulp,
//! growing like `log n` to `n`), a few of their own ulp for `bf16`/`f16`. An all-reduce is also
//! no longer bit-equal to a reduce-scatter followed by an all-gather. With `n = 1` every result
//! is exact, for every dtype. With `n = 2`, where the one addition commutes, results are
//! expected to match the host's except in rare double-rounding and subnormal cases (not yet
//! measured on a GPU).
//!
//! **`Mean` is `Sum` followed by a division kernel, not `ncclAvg`.** After the NCCL sum, a small
//! hand-written PTX kernel (JIT-compiled by the driver, no NVRTC) divides each element by `n` in
//! `f32` (`div.rn`, a true division) and rounds once to the element type: the host's final step.
//! `ncclAvg` on floating types pre-multiplies every input by `1/n` rounded to the element type;
//! for `bf16` and `n = 3` that scalar alone is off by up to `2⁻⁹` relative, a bias that no
//! summation order explains. Inside a [`group`](crate::Communicator::group), the divisions are
//! enqueued after `ncclGroupEnd`, when the sums they follow are.
//!
//! **Validation needs a round trip.** NCCL checks nothing across ranks (and cudarc's safe layer
//! checks no lengths). With [`NcclOptions::check_peers`] (the default) every collective first
//! all-gathers a 64-byte descriptor of every rank's call and runs the host loopback's checks on
//! all of them, so a mismatch fails on every rank with the same
//! [`LengthMismatch`](crate::Error::LengthMismatch)/[`PeerMismatch`](crate::Error::PeerMismatch),
//! before anything moves. That costs one tiny collective and a host sync per op. Inside groups,
//! or with `check_peers` off, only this rank's own lengths are checked; a mismatch between ranks
//! then hangs until the timeout.
//!
//! **Asynchronous errors and timeouts.** Each collective (or group) records a CUDA event after its
//! work. Waits poll that event and `ncclCommGetAsyncError` together, so a peer that failed
//! (`ncclRemoteError`, a network error) ends the wait with
//! [`Error::Backend`](crate::Error::Backend) carrying NCCL's code, its string and
//! `ncclGetLastError`. A collective not complete [`NcclOptions::timeout`] after it was issued
//! fails with [`Error::Timeout`](crate::Error::Timeout). NCCL cannot tell which peer is late, so
//! `missing` lists every other member. Either way the communicator is aborted (`ncclCommAbort`,
//! which stops its kernels), later calls fail with [`Error::Aborted`](crate::Error::Aborted), and
//! so do the other communicators of the same world in this process at their next call. With
//! [`WaitMode::Eager`] (the default) each collective waits for itself. With [`WaitMode::Lazy`] it
//! returns once enqueued, and its deadline is checked at every later call and waited out by
//! `download`, `upload`, `barrier`, [`NcclComm::synchronize`] and drop. Communicators are created
//! in NCCL's non-blocking mode ([`NcclOptions::nonblocking`]), so init, split and NCCL's lazy
//! connection setup return `ncclInProgress` and are polled under the same timeout instead of
//! blocking the thread inside NCCL.
//!
//! **Traffic is logical, as everywhere.** Each op records, per peer, the bytes of this rank's data
//! that end up there and of its data that end up here, classified by the link between the two
//! global ranks: the [`zero_core::traffic`] convention, equal to the
//! [`GroupView`](zero_core::GroupView) formulas by `==`. It is computed from the call's arguments,
//! since NCCL does not report what its rings and trees put on the wire; that matches the
//! convention's totals for all-gather and reduce-scatter, not hop by hop.
//!
//! # What cudarc 0.19.10 does not allow, and what is done instead
//!
//! - `cudarc::nccl::safe::Comm` hides its raw `ncclComm_t`, so neither `ncclCommGetAsyncError` nor
//!   `ncclCommSplit` can be called on it; its `Drop` `expect`s `ncclCommAbort` to succeed and its
//!   `Group` unwraps `ncclGroupEnd`. The backend owns the handle itself and calls the `sys` layer.
//! - `result::comm_split` is only compiled for the CUDA 12.2–12.5 features; with `cuda-12080` the
//!   backend calls `sys::ncclCommSplit` directly. There is no `NCCL_CONFIG_INITIALIZER`: the
//!   non-blocking `ncclConfig_t` is built by hand (magic, size, version, undefined fields).
//! - cudarc's dynamic loader panics on a missing library or symbol. Both libraries and every
//!   symbol called are probed first; the optional ones degrade: without `ncclCommInitRankConfig`
//!   (NCCL < 2.14) communicators are blocking and init can wait forever; without `ncclCommSplit`
//!   (NCCL < 2.18) `split` fails with a clear error. Construction also runs under `catch_unwind`.
//! - cudarc looks for `libnccl.so` and `libnccl.so.{9,10,11,12,1}` but not `libnccl.so.2`, the
//!   runtime's name in Debian packages and pip wheels: a `libnccl.so` symlink (or the dev package)
//!   is needed. `cargo xtask gpu-check` makes the symlink.
//! - Result codes are a Rust enum generated for NCCL 2.30; a newer library returning a code the
//!   enum lacks would be undefined behaviour. No current NCCL does.
//! - There is no watchdog thread: with [`WaitMode::Lazy`], a rank busy in host code notices a late
//!   collective only at its next call on the communicator. An aborting watchdog would race the
//!   owning thread on the handle, which NCCL does not make safe.
//! - Dropping a healthy communicator waits (up to the timeout) for its enqueued work, then aborts
//!   the handle, like cudarc, rather than `ncclCommDestroy`, which can block on peers.
//!
//! # Handing burn's device memory to this communicator (sketch)
//!
//! burn's CUDA backend runs on cubecl-cuda, which drives the GPU through cudarc 0.19 too. A
//! trainer that keeps parameters and gradients as burn tensors could hand them over without a
//! host round trip:
//!
//! 1. From the tensor's cubecl handle, get the resource's raw `CUdeviceptr`, byte length and the
//!    `CUstream` it is written on (cubecl's `ComputeClient` resolves a handle to its storage
//!    resource), after flushing the client so the writes are enqueued.
//! 2. Order the two streams: record an event on burn's stream and make `NcclComm::stream` wait
//!    for it (or, simpler, create the communicator's work on burn's stream by wrapping it with
//!    `CudaContext::wrap_borrowed_stream`, which would need a constructor taking a stream).
//! 3. Run the collective on a *borrowed* view of that memory. [`NcclBuffer`] owns its allocation
//!    (it frees on drop), so this needs a non-owning `NcclView<'a, E>` built from `(ptr, len)` by
//!    an `unsafe` constructor whose contract is "valid for `'a`, on this device, not used by
//!    burn until the returned event completes"; the collectives would take
//!    `impl AsDevicePtr<E>` instead of `&NcclBuffer<E>`.
//! 4. Record an event on the communicator's stream and make burn's stream wait for it before burn
//!    reads the result.
//!
//! Until then, `NcclBuffer::from_cuda_slice`/`NcclBuffer::into_cuda_slice` move owned cudarc
//! slices in and out without a copy, and `upload`/`download` go through the host.

pub mod bootstrap;
mod options;

#[cfg(feature = "nccl")]
mod backend;

#[cfg(feature = "nccl")]
mod quantized;
#[cfg(not(feature = "nccl"))]
mod stub;

#[cfg(feature = "nccl")]
use backend as imp;
#[cfg(not(feature = "nccl"))]
use stub as imp;

pub use bootstrap::{LaunchEnv, UniqueId};
pub use imp::{NcclBuffer, NcclComm};
pub use options::{
    DEFAULT_TIMEOUT, ENV_CHECK_PEERS, ENV_DEVICE, ENV_NONBLOCKING, ENV_TIMEOUT, ENV_WAIT,
    NcclOptions, WaitMode,
};

/// The cudarc this backend is built on, for callers that exchange device memory with it.
#[cfg(feature = "nccl")]
pub use backend::loopback::{CudaComm, CudaDevice, CudaWorld};
#[cfg(feature = "nccl")]
pub use cudarc;
#[cfg(feature = "nccl")]
pub use quantized::OnCuda;

/// What [`probe`] found on this machine.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Runtime {
    /// Visible CUDA devices.
    pub devices: usize,
    /// `(major, minor, patch)` of the loaded libnccl.
    pub nccl_version: (u32, u32, u32),
    /// `(major, minor)` CUDA version the driver supports.
    pub cuda_driver_version: (u32, u32),
    /// Whether libnccl has `ncclCommSplit` (NCCL ≥ 2.18), which `split` needs.
    pub comm_split: bool,
    /// Whether libnccl has `ncclCommInitRankConfig` (NCCL ≥ 2.14), which non-blocking mode needs.
    pub nonblocking_init: bool,
}

/// Checks libcuda, libnccl and the devices without calling anything that can panic. `Err` says
/// what is missing ([`Error::NotCompiled`](crate::Error::NotCompiled) without the `nccl` feature).
pub fn probe() -> crate::Result<Runtime> {
    imp::probe()
}
