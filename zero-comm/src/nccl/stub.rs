//! The stand-in built without the `nccl` feature (candle's dummy-backend pattern): the same types
//! and methods, whose constructors return [`Error::NotCompiled`], so callers need no `cfg`.
//! Values of these types cannot exist, so every other method is unreachable by construction.

use std::convert::Infallible;
use std::fmt;
use std::marker::PhantomData;
use std::time::Duration;

use zero_core::Topology;

use super::Runtime;
use super::bootstrap::{LaunchEnv, UniqueId};
use super::options::{NcclOptions, WaitMode};
use crate::element::Element;
use crate::error::{Error, Result};

fn not_compiled<T>() -> Result<T> {
    Err(Error::NotCompiled { backend: "nccl" })
}

pub(super) fn probe() -> Result<Runtime> {
    not_compiled()
}

/// Device memory holding `E`s. Without the `nccl` feature no value of this type can exist.
pub struct NcclBuffer<E: Element> {
    never: Infallible,
    _e: PhantomData<E>,
}

impl<E: Element> fmt::Debug for NcclBuffer<E> {
    fn fmt(&self, _: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.never {}
    }
}

impl<E: Element> NcclBuffer<E> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self.never {}
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        match self.never {}
    }
}

/// One rank of an NCCL communicator. Without the `nccl` feature every constructor returns
/// [`Error::NotCompiled`].
pub struct NcclComm {
    never: Infallible,
}

impl fmt::Debug for NcclComm {
    fn fmt(&self, _: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.never {}
    }
}

impl NcclComm {
    /// Returns [`Error::NotCompiled`].
    pub fn from_env() -> Result<NcclComm> {
        not_compiled()
    }

    /// Returns [`Error::NotCompiled`].
    pub fn new(_env: &LaunchEnv, _opts: NcclOptions) -> Result<NcclComm> {
        not_compiled()
    }

    /// Returns [`Error::NotCompiled`].
    pub fn single(_device: usize, _opts: NcclOptions) -> Result<NcclComm> {
        not_compiled()
    }

    /// Returns [`Error::NotCompiled`].
    pub fn unique_id() -> Result<UniqueId> {
        not_compiled()
    }

    /// Returns [`Error::NotCompiled`].
    pub fn from_unique_id(
        _id: &UniqueId,
        _rank: usize,
        _topology: Topology,
        _device: usize,
        _opts: NcclOptions,
    ) -> Result<NcclComm> {
        not_compiled()
    }

    /// The CUDA device ordinal.
    pub fn device(&self) -> usize {
        match self.never {}
    }

    /// The options in force.
    pub fn options(&self) -> &NcclOptions {
        match self.never {}
    }

    /// Changes the timeout of later waits.
    pub fn set_timeout(&mut self, _timeout: Duration) {
        match self.never {}
    }

    /// Changes when later collectives return.
    pub fn set_wait(&mut self, _wait: WaitMode) {
        match self.never {}
    }

    /// Turns the exchange of call descriptors on or off.
    pub fn set_check_peers(&mut self, _on: bool) {
        match self.never {}
    }

    /// Whether the communicator was created in NCCL's non-blocking mode.
    pub fn is_nonblocking(&self) -> bool {
        match self.never {}
    }

    /// Whether the communicator is aborted.
    pub fn is_aborted(&self) -> bool {
        match self.never {}
    }

    /// Waits until every enqueued collective completed.
    pub fn synchronize(&mut self) -> Result<()> {
        match self.never {}
    }
}

crate::uninhabited::uninhabited_communicator!(NcclComm, NcclBuffer);
