//! Integration tests of the communicators, in one binary.
//!
//! The bodies in `common` are written once against the [`zero_comm::Communicator`] trait and take
//! a world factory, so the device backends can run the same checks (with the host loopback as the
//! oracle) by adding their own factory next to `host_world`. Whole tests shared with the device
//! binaries are in `bodies`, stamped here with `bodies::host`.

mod bodies;
mod collectives;
mod common;
mod device_codec;
mod failures;
mod group;
mod order;
mod quant_common;
mod split;
mod traffic;
