//! # zero-comm
//!
//! Communicators for ZeRO-style sharded data parallelism, with an NCCL-shaped contract.
//!
//! **Role.** [`Communicator`] is the one interface the trainer (`zero-burn`) uses to move data
//! between ranks: all-gather (plus NCCL's in-place form), reduce-scatter, all-reduce, broadcast,
//! all-to-all, barrier, and `split` into sub-groups (hpZ's intra-node groups, qgZ's intra- and
//! cross-node groups). Backends are thin; the contract is checked in one place shared by every
//! backend, before anything moves:
//!
//! - [`host`]: the in-process host loopback, one thread per rank. Always built; the reference and
//!   the oracle for the other backends.
//! - `wgpu_loopback` (feature `wgpu`): N ranks on one wgpu adapter (Mesa's lavapipe in CI), data
//!   in `wgpu::Buffer`s, reductions in WGSL, bit-identical to the host loopback. It can adopt an
//!   existing device and wrap existing buffers (the zero-copy bridge to burn-wgpu).
//! - `device_loopback`: the collectives of the wgpu loopback and of the CUDA loopback
//!   (`nccl::CudaWorld`, feature `nccl`: N ranks on one GPU without NCCL), written once over the
//!   device's memory.
//! - [`mpi`] (feature `mpi`, rsmpi over OpenMPI): one rank per process, host buffers. MPI moves
//!   the chunks and the host kernels sum them, so results are bit-identical to the host loopback.
//!   Without the feature, [`mpi::MpiComm::world`] returns [`Error::NotCompiled`].
//! - [`nccl`] (feature `nccl`, via cudarc with dynamic loading): one rank per GPU, torchrun-style
//!   bootstrap. It compiles everywhere; without the feature, or without libcuda/libnccl at run
//!   time, constructors return an error ([`Error::NotCompiled`] or [`Error::Backend`]), never a
//!   panic. It has run on one H200 at world size 1 (`cargo xtask gpu-check`); never on several GPUs.
//! - [`quantized`]: qwZ's int8 all-gather and qgZ's int4 hierarchical all-to-all reduce-scatter
//!   over any communicator, and their device forms over a backend's
//!   [`DeviceCodec`](quantized::DeviceCodec) (WGSL, CUDA, or the host codecs).
//!
//! What the backends share, once: `validate.rs` (the call descriptors, the cross-rank checks
//! every backend runs before anything moves, the all-reduce chunking, the traffic of a call),
//! `wire.rs` (the 64-byte descriptor encoding of the process-separated backends, NCCL and MPI),
//! `tally.rs` (the bytes handed to MPI or NCCL, per peer) and `uninhabited.rs` (the one
//! `Communicator` impl of every backend stand-in that is not compiled in).
//!
//! **May depend on:** zero-core (topology, traffic accounting), zero-quant (codecs), half, bytemuck
//! and thiserror; wgpu/pollster, cudarc and rsmpi (`mpi`) only behind their features.
//!
//! **Architecture Invariant:** zero-comm knows nothing about burn, tensors or models: it moves
//! typed flat buffers ([`Element`]: `f32`, `bf16`, `f16`, `u8`) between ranks and counts the bytes.
//!
//! # NCCL's rules, which every backend assumes
//!
//! 1. Every rank of a group makes the same collective calls in the same order, with matching
//!    dtypes, reductions, roots and lengths (see the table on [`Communicator`]).
//! 2. One thread drives a communicator (`Send`, not `Sync`; collectives take `&mut self`). Batch
//!    several calls with [`Communicator::group`], an RAII guard, never by interleaving threads.
//! 3. After an error that is not a validation error, abort: nothing can be assumed about buffers
//!    of the failed op, and later calls fail. A failure on any rank (panic, timeout) poisons the
//!    whole world, sub-communicators included.
//!
//! # Determinism
//!
//! Reductions are rank-ordered and accumulate in `f32` with a single rounding ([`ReduceOp`]); an
//! all-reduce is a reduce-scatter followed by an all-gather over the same chunks. Results are
//! bit-identical across runs, thread timings and backends that honour the order. The host loopback
//! can sum over the canonical pairwise tree instead ([`ReduceOrder::PairwiseTree`],
//! [`host::HostWorld::with_reduce_order`]), which lets a trainer get the same bits for every world
//! size; NCCL honours neither order.
//!
//! # Accounting
//!
//! Every communicator **measures** what it moves into a [`zero_core::TrafficTable`] keyed by
//! [`zero_core::Collective`], using the convention of [`zero_core::traffic`]: per rank, as logical
//! per-peer exchange (bytes of this rank's data that end up on a peer are *sent*, bytes of a peer's
//! data that end up here are *received*, a rank's own chunk never counts), classified by the
//! [`zero_core::LinkClass`] between the two *global* ranks. Measurements equal the
//! [`zero_core::GroupView`] formulas exactly ([`Communicator::group_view`]), which is what lets the
//! trainer compare predicted and measured bytes with `==`.
//!
//! ```
//! use std::time::Duration;
//! use zero_comm::{Communicator, ReduceOp, host::HostLoopback};
//! use zero_core::{Collective, Topology};
//!
//! let topo = Topology::new(4, 2).unwrap(); // 2 nodes × 2 ranks
//! let results = HostLoopback::launch(topo, Duration::from_secs(5), |mut comm| {
//!     let mut x = vec![comm.rank() as f32; 6];
//!     comm.all_reduce_host(&mut x, ReduceOp::Sum).unwrap();
//!     let predicted = comm.group_view().all_reduce(6, 4);
//!     assert_eq!(comm.traffic().by_collective[&Collective::AllReduce], predicted);
//!     x
//! });
//! for r in results {
//!     assert_eq!(r.unwrap(), vec![6.0; 6]);
//! }
//! ```
//!
//! Sibling crates: `zero-core` (plans, topology, traffic formulas), `zero-quant` (codecs),
//! `zero-burn` (the trainer).

mod communicator;
#[cfg(any(feature = "wgpu", feature = "nccl"))]
pub mod device_loopback;
mod element;
mod error;
pub mod host;
pub mod mpi;
pub mod nccl;
pub mod quantized;
#[cfg(any(feature = "mpi", feature = "nccl"))]
mod tally;
mod uninhabited;
mod validate;
#[cfg(feature = "wgpu")]
pub mod wgpu_loopback;
mod wire;

pub use communicator::{Communicator, Group, ReduceOrder, pairwise_split};
pub use element::{DType, Element, ReduceOp};
pub use error::{Error, FailureReason, Op, Result};
