//! # zero-comm
//!
//! Communicators with an NCCL-shaped contract: host loopback (reference), wgpu loopback, NCCL via
//! cudarc; byte accounting per collective and link class (see `zero_core::traffic`).
//!
//! **May depend on:** zero-core, zero-quant, half, bytemuck, thiserror (wgpu and cudarc behind the
//! `wgpu` and `nccl` features). It knows nothing about burn.
//!
//! **Status:** being built (see README).
