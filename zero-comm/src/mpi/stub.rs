//! The stand-in built without the `mpi` feature: [`MpiComm::world`] returns
//! [`Error::NotCompiled`], so callers need no `cfg`. No value of [`MpiComm`] can exist.

use std::convert::Infallible;
use std::fmt;

use super::MpiOptions;
use crate::error::{Error, Result};
use crate::host::HostBuffer;

/// One rank of an MPI communicator. Without the `mpi` feature [`MpiComm::world`] returns
/// [`Error::NotCompiled`].
pub struct MpiComm {
    never: Infallible,
}

impl fmt::Debug for MpiComm {
    fn fmt(&self, _: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.never {}
    }
}

impl MpiComm {
    /// Returns [`Error::NotCompiled`].
    pub fn world(_opts: MpiOptions) -> Result<MpiComm> {
        Err(Error::NotCompiled { backend: "mpi" })
    }

    /// The timeout every wait of this communicator uses.
    pub fn timeout(&self) -> std::time::Duration {
        match self.never {}
    }
}

/// Holds MPI initialised. Without the `mpi` feature [`MpiGuard::new`] returns
/// [`Error::NotCompiled`].
#[derive(Debug, Clone)]
pub struct MpiGuard {
    never: Infallible,
}

impl MpiGuard {
    /// Returns [`Error::NotCompiled`].
    pub fn new() -> Result<MpiGuard> {
        let _ = |g: MpiGuard| match g.never {};
        Err(Error::NotCompiled { backend: "mpi" })
    }
}

/// Ends this process with status `code` (without the `mpi` feature there is no MPI job).
pub fn abort_job(code: i32) -> ! {
    std::process::exit(code)
}

crate::uninhabited::uninhabited_communicator!(MpiComm, HostBuffer);
