//! The MPI backend: [`MpiComm`], one rank per process, over rsmpi 0.8 (feature `mpi`; OpenMPI in
//! CI). Buffers are host `Vec`s ([`HostBuffer`](crate::host::HostBuffer)), so every host path of
//! the trainer runs on it unchanged.
//!
//! ```no_run
//! use zero_comm::{Communicator, ReduceOp, mpi::{MpiComm, MpiOptions}};
//!
//! // mpirun -n 4 ./my-trainer: the rank and world size come from MPI.
//! let mut comm = MpiComm::world(MpiOptions::from_env()?)?;
//! let mut grads = vec![1.0f32; 1 << 20];
//! comm.all_reduce_host(&mut grads, ReduceOp::Mean)?;
//! # Ok::<(), zero_comm::Error>(())
//! ```
//!
//! The module exists in every build. Without the `mpi` feature, [`MpiComm::world`] returns
//! [`Error::NotCompiled`], so callers need no `cfg`.
//!
//! # How it maps onto MPI
//!
//! MPI's own reductions (`MPI_Reduce_scatter`, `MPI_Allreduce`) sum in an order of the library's
//! choosing, so none is used. Data moves with MPI; the sums are the host loopback's kernels, over
//! the chunks in group-rank order (or the pairwise tree), so results are bit-identical to the host
//! loopback's for every dtype, world size and op.
//!
//! | op | MPI |
//! |---|---|
//! | all-gather (and in place) | `MPI_Iallgather` |
//! | reduce-scatter | `MPI_Ialltoall` of the chunks, then the host reduction of the `n` received chunks |
//! | all-reduce | `MPI_Ialltoallv` of the all-reduce chunks, the host reduction, then `MPI_Iallgatherv` |
//! | broadcast | `MPI_Ibcast` |
//! | all-to-all | `MPI_Ialltoall` |
//! | barrier | `MPI_Ibarrier` |
//! | split | the descriptor exchange (colour, key), then `MPI_Comm_split` with the colours numbered densely and the key the new rank |
//!
//! Reductions receive the `n` chunks they sum into a scratch buffer that the communicator keeps
//! between calls (as large as its largest reduction input so far, plus one chunk): memory the host
//! loopback, which reads its peers in place, does not need.
//!
//! Payloads travel as bytes, so every buffer an op passes to MPI (the whole receive buffer of an
//! all-gather, the whole buffer of an all-reduce) is limited to MPI's `int` count, 2 GiB - 1
//! bytes; a larger call fails on every rank before anything moves.
//!
//! # Checks, timeouts and failures
//!
//! - **Cross-rank validation.** With [`MpiOptions::check_peers`] (the default), every op first
//!   all-gathers a 64-byte descriptor of every rank's call and runs the host loopback's checks on
//!   all of them, so a mismatch fails on every rank with the same
//!   [`LengthMismatch`](crate::Error::LengthMismatch)/[`PeerMismatch`](crate::Error::PeerMismatch)
//!   before any data moves. Without it only this rank's own lengths are checked, and a mismatch
//!   between ranks is undefined behaviour in MPI.
//! - **No unbounded wait.** Every op is a non-blocking MPI collective polled against
//!   [`MpiOptions::timeout`] (each phase of an op on its own: the descriptor exchange, and each
//!   of an all-reduce's two data phases). MPI cannot cancel a collective that is in flight, and its buffers
//!   must stay alive until it completes, so a timeout cannot be returned as an error: the rank
//!   prints the [`Timeout`](crate::Error::Timeout) (naming itself, the op and the members it waited
//!   for) to stderr and calls `MPI_Abort`, which ends every process of the job with a non-zero
//!   status. A process that dies (a panic, `kill -9`) is noticed by the MPI runtime, which ends the
//!   job and names the rank (`mpirun noticed that process rank 1 … exited on signal 9`).
//! - **Panics.** A communicator dropped while its thread panics calls `MPI_Abort`, so its peers
//!   do not wait out their timeout. A program that ends with an error on one rank should call
//!   [`abort_job`] for the same reason: `MPI_Finalize` may wait for peers that are waiting for it.
//!
//! # Threads
//!
//! MPI is initialised asking for `MPI_THREAD_MULTIPLE` (OpenMPI provides it): a communicator may
//! move between threads (`Send`, not `Sync`), and different communicators may be driven by
//! different threads. A library that provides only `MPI_THREAD_SERIALIZED` is accepted; then the
//! process's communicators must not be driven by two threads at once (one rank per process,
//! driven by one thread, as the trainer does, satisfies that). MPI is finalised when the last
//! communicator (or [`MpiGuard`]) of the process drops, and cannot be initialised again.
//!
//! # Topology
//!
//! Node membership comes from `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`: ranks must be placed
//! in equal contiguous blocks per node (OpenMPI's default `--map-by slot` does that).
//! [`MpiOptions::ranks_per_node`] (`ZERO_RANKS_PER_NODE`) overrides it, which lets one machine
//! stand in for several nodes (tests, hpZ and qgZ on one box).

#[cfg(feature = "mpi")]
mod backend;
#[cfg(not(feature = "mpi"))]
mod stub;

#[cfg(feature = "mpi")]
use backend as imp;
#[cfg(not(feature = "mpi"))]
use stub as imp;

pub use imp::{MpiComm, MpiGuard, abort_job};

use std::time::Duration;

use crate::communicator::ReduceOrder;
use crate::error::{Error, Result};

/// Timeout of every MPI wait when nothing else is configured.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// Overrides [`MpiOptions::timeout`], in seconds (fractions allowed).
pub const ENV_TIMEOUT: &str = "ZERO_MPI_TIMEOUT_SECS";
/// Overrides [`MpiOptions::check_peers`]: `1` or `0`.
pub const ENV_CHECK_PEERS: &str = "ZERO_MPI_CHECK_PEERS";
/// Overrides [`MpiOptions::ranks_per_node`]: a positive integer that divides the world size.
pub const ENV_RANKS_PER_NODE: &str = "ZERO_RANKS_PER_NODE";
/// Whether this process was started by an MPI launcher (`mpirun`, `srun`), judged from the
/// variables OpenMPI, MPICH and Slurm's PMI set.
pub fn launched_by_mpi() -> bool {
    [
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "PMIX_RANK",
        "MPI_LOCALNRANKS",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some())
}

/// OpenMPI's launcher, ready to start `np` processes on this machine: `mpirun -n NP
/// --oversubscribe --bind-to none --allow-run-as-root` (more processes than cores are allowed, and
/// none is pinned: right for tests and for one-machine runs; a cluster run passes its own flags
/// and hostfile). Append the program and its arguments. `None` when no `mpirun` is on `PATH`.
pub fn mpirun(np: usize) -> Option<std::process::Command> {
    let found = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|d| d.join("mpirun").is_file()));
    if !found {
        return None;
    }
    let mut c = std::process::Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
        "-n",
    ])
    .arg(np.to_string());
    Some(c)
}

/// Options of an [`MpiComm`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MpiOptions {
    /// Longest wait for any op, from when it is issued. On expiry the job is aborted (see the
    /// [module docs](self)).
    pub timeout: Duration,
    /// Exchange a 64-byte call descriptor with every peer before each op, so that mismatched calls
    /// fail on every rank with a clear error before anything moves (one small all-gather per op).
    pub check_peers: bool,
    /// Ranks per node; `None` asks MPI which ranks share a node.
    pub ranks_per_node: Option<usize>,
    /// The order reductions sum in; see [`ReduceOrder`].
    pub reduce_order: ReduceOrder,
}

impl Default for MpiOptions {
    fn default() -> Self {
        MpiOptions {
            timeout: DEFAULT_TIMEOUT,
            check_peers: true,
            ranks_per_node: None,
            reduce_order: ReduceOrder::default(),
        }
    }
}

impl MpiOptions {
    /// The defaults, overridden by [`ENV_TIMEOUT`], [`ENV_CHECK_PEERS`] and
    /// [`ENV_RANKS_PER_NODE`]. A value that does not parse is an error naming the variable.
    pub fn from_env() -> Result<MpiOptions> {
        Self::default().with_env(|k| std::env::var(k).ok())
    }

    fn with_env(mut self, get: impl Fn(&str) -> Option<String>) -> Result<MpiOptions> {
        let bad = |var: &str, v: &str, want: &str| {
            Error::Backend(format!("mpi: {var}={v:?} is not {want}"))
        };
        if let Some(v) = get(ENV_TIMEOUT) {
            let secs: f64 = v
                .trim()
                .parse()
                .map_err(|_| bad(ENV_TIMEOUT, &v, "a number of seconds"))?;
            self.timeout = Duration::try_from_secs_f64(secs)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| bad(ENV_TIMEOUT, &v, "a positive number of seconds"))?;
        }
        if let Some(v) = get(ENV_CHECK_PEERS) {
            self.check_peers = match v.trim() {
                "1" | "true" => true,
                "0" | "false" => false,
                _ => return Err(bad(ENV_CHECK_PEERS, &v, "1 or 0")),
            };
        }
        if let Some(v) = get(ENV_RANKS_PER_NODE) {
            let l: usize = v
                .trim()
                .parse()
                .ok()
                .filter(|&l| l > 0)
                .ok_or_else(|| bad(ENV_RANKS_PER_NODE, &v, "a positive integer"))?;
            self.ranks_per_node = Some(l);
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_read_the_environment_and_name_bad_values() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let o = MpiOptions::default()
            .with_env(env(&[
                (ENV_TIMEOUT, "2.5"),
                (ENV_CHECK_PEERS, "0"),
                (ENV_RANKS_PER_NODE, "3"),
            ]))
            .unwrap();
        assert_eq!(o.timeout, Duration::from_millis(2500));
        assert!(!o.check_peers);
        assert_eq!(o.ranks_per_node, Some(3));
        for (k, v) in [
            (ENV_TIMEOUT, "soon"),
            (ENV_TIMEOUT, "0"),
            (ENV_CHECK_PEERS, "yes"),
            (ENV_RANKS_PER_NODE, "0"),
        ] {
            let e = MpiOptions::default()
                .with_env(|n| (n == k).then(|| v.to_string()))
                .unwrap_err()
                .to_string();
            assert!(e.contains(k) && e.contains(v), "{e}");
        }
    }
}
