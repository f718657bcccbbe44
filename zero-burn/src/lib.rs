//! # zero-burn
//!
//! **Role.** The burn integration: wraps any burn `Module` on an autodiff device into a
//! ZeRO-1/2/3 (+ZeRO++) data-parallel trainer that executes a `zero_core::Plan` with one
//! `zero_comm` communicator per rank.
//!
//! **May depend on:** zero-core, zero-comm, zero-quant and burn. It is the only library crate that
//! names burn types.
//!
//! **Status:** not built yet (see README's status table). This crate currently only fixes the
//! dependency edges and the pinned burn version.
