//! Whole test bodies shared by the host binary (`tests/comm`) and the device binaries: each is
//! written once, generic over the [`Communicator`], and takes the backend's [`World`]. A binary
//! declares its `#[test]`s with [`stamp!`], naming its own backend, so the same checks run on every
//! backend under the same names; where the backends' tests differ (world shapes, a timeout), the
//! difference is an argument of the body.

use std::thread;
use std::time::Duration;

use zero_comm::Communicator;
use zero_comm::host::{HostComm, HostWorld};
use zero_core::Topology;

pub(crate) mod collectives;
pub(crate) mod failures;
pub(crate) mod groups;
pub(crate) mod mismatch;

/// Builds the communicators of one world, indexed by rank, each waiting at most the timeout.
pub(crate) type World<C> = fn(Topology, Duration) -> Vec<C>;

/// The host loopback as a backend of [`stamp!`]: always there.
pub(crate) fn host() -> Option<World<HostComm>> {
    Some(|topology, timeout| HostWorld::new(topology, timeout).into_comms())
}

/// Runs `f` on every rank, one thread each (named `rank-<global rank>`), and returns each rank's
/// result or panic, by rank.
pub(crate) fn launch<C: Communicator, R: Send>(
    comms: Vec<C>,
    f: impl Fn(C) -> R + Sync,
) -> Vec<thread::Result<R>> {
    let f = &f;
    thread::scope(|s| {
        let spawn = |c: C| {
            let name = format!("rank-{}", c.global_rank());
            thread::Builder::new()
                .name(name)
                .spawn_scoped(s, move || f(c))
        };
        let handles: Vec<_> = comms.into_iter().map(spawn).collect();
        let join = |h: std::io::Result<thread::ScopedJoinHandle<'_, R>>| {
            h.expect("spawn a rank thread").join()
        };
        handles.into_iter().map(join).collect()
    })
}

/// Declares one `#[test] fn name()` per shared body `$bodies::name`, run on `$backend`: a function
/// returning the backend's [`World`], or `None` after recording that the test did not run (a device
/// backend without its device), in which case the test returns at once. The body gets the world
/// first, then the arguments written after its name.
///
/// ```text
/// stamp! { host, shared:
///     a_panicking_rank_fails_its_peers_promptly(topo(4, 4));
/// }
/// ```
macro_rules! stamp {
    ($backend:ident, $bodies:ident: $($name:ident($($arg:expr),* $(,)?);)+) => {
        $(
            #[test]
            fn $name() {
                let Some(world) = $backend() else {
                    return;
                };
                $bodies::$name(world $(, $arg)*);
            }
        )+
    };
}
pub(crate) use stamp;
