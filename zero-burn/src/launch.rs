//! Running one closure per rank in this process: each closure gets its rank's communicator,
//! builds its [`crate::ZeroEngine`] and drives its own loop. A rank that fails (an error or a
//! panic) drops its communicator, which fails its peers' pending collectives fast with an error
//! naming it; [`Launch::run`] returns the first rank's error.

use std::sync::Mutex;
use std::thread;
use std::time::Duration;

use zero_comm::ReduceOrder;
use zero_comm::host::{HostComm, HostWorld};
use zero_core::Topology;

use crate::error::{Error, Result};
use crate::reduction::Reduction;

/// N ranks of `topology` on threads of this process, over the host loopback (and, with feature
/// `wgpu`, the wgpu loopback).
#[derive(Clone, Copy, Debug)]
#[must_use = "a Launch does nothing until `run`"]
pub struct Launch {
    topology: Topology,
    timeout: Duration,
    reduction: Reduction,
}

impl Launch {
    /// The ranks of `topology`; every collective waits at most 60 s for its peers.
    pub fn new(topology: Topology) -> Self {
        Launch {
            topology,
            timeout: Duration::from_secs(60),
            reduction: Reduction::RankOrdered,
        }
    }

    /// How long any collective waits for its peers before failing.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The order the loopback sums in: rank order, or the canonical pairwise tree that
    /// [`Reduction::CanonicalTree`] needs (engines built on these communicators then default
    /// to it).
    pub fn reduction(mut self, reduction: Reduction) -> Self {
        self.reduction = reduction;
        self
    }

    /// Runs `f` once per rank on the host loopback, each on its own thread, and returns the
    /// ranks' results in rank order, or the first failing rank's error (a panic becomes
    /// [`Error::RankPanicked`]).
    pub fn run<T, F>(self, f: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(HostComm) -> Result<T> + Sync,
    {
        if self.timeout.is_zero() {
            return Err(Error::Invalid {
                field: "timeout",
                got: "0 s".into(),
                expected: "a collective timeout above zero".into(),
            });
        }
        let order = match self.reduction {
            Reduction::RankOrdered => ReduceOrder::RankSequential,
            Reduction::CanonicalTree => ReduceOrder::PairwiseTree,
        };
        let results = HostWorld::new(self.topology, self.timeout)
            .with_reduce_order(order)
            .launch(f);
        collect(results)
    }

    /// [`Launch::run`] handing every rank its own clone of `model` (burn modules are `Send` but
    /// not `Sync`, so a closure cannot share one): every rank then starts from the same values.
    pub fn run_with<M, T, F>(self, model: &M, f: F) -> Result<Vec<T>>
    where
        M: Clone + Send,
        T: Send,
        F: Fn(HostComm, M) -> Result<T> + Sync,
    {
        let clones = Clones::new(model, self.topology.world_size());
        self.run(|comm| {
            let mine = clones.take(zero_comm::Communicator::rank(&comm))?;
            f(comm, mine)
        })
    }

    /// [`Launch::run`] on the wgpu loopback over `shared`'s device (feature `wgpu`): build each
    /// rank's model on [`WgpuShared::autodiff_device`]. The wgpu loopback sums in
    /// rank order only.
    #[cfg(feature = "wgpu")]
    pub fn run_wgpu<T, F>(self, shared: &WgpuShared, f: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(zero_comm::wgpu_loopback::WgpuComm) -> Result<T> + Sync,
    {
        if self.reduction == Reduction::CanonicalTree {
            return Err(Error::Invalid {
                field: "reduction",
                got: "canonical_tree on the wgpu loopback".into(),
                expected: "rank_ordered (the wgpu loopback sums in rank order)".into(),
            });
        }
        let world = zero_comm::wgpu_loopback::WgpuWorld::with_device(
            shared.comm_device().clone(),
            self.topology,
            self.timeout,
        );
        collect(world.launch(f))
    }
}

/// One clone of a value per rank, each taken once (a `Mutex` makes a `Send` value shareable).
#[derive(Debug)]
pub(crate) struct Clones<M>(Mutex<Vec<Option<M>>>);

impl<M: Clone> Clones<M> {
    pub(crate) fn new(model: &M, n: usize) -> Self {
        Clones(Mutex::new((0..n).map(|_| Some(model.clone())).collect()))
    }

    pub(crate) fn take(&self, rank: usize) -> Result<M> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(rank)
            .and_then(Option::take)
            .ok_or_else(|| Error::Invalid {
                field: "rank",
                got: format!("rank {rank} asking for its model twice or out of range"),
                expected: "each rank of the world once".into(),
            })
    }
}

/// Shorthand for `Launch::new(topology).run(f)`.
pub fn launch<T, F>(topology: Topology, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(HostComm) -> Result<T> + Sync,
{
    Launch::new(topology).run(f)
}

/// The ranks' results in rank order, or the first error (a panicking rank becomes
/// [`Error::RankPanicked`]). A rank whose peer failed first fails with a communication error
/// naming that peer; the first error in rank order is returned, so callers see a root cause when
/// the lowest failing rank is it.
fn collect<T>(results: Vec<thread::Result<Result<T>>>) -> Result<Vec<T>> {
    let mut out = Vec::with_capacity(results.len());
    let mut first_err = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(Ok(v)) => out.push(v),
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(p) => {
                let message = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                first_err.get_or_insert(Error::RankPanicked { rank, message });
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// burn's wgpu runtime and the wgpu loopback on **one** `wgpu::Device` and queue (feature
/// `wgpu`): burn initialises its runtime on the default adapter and hands back its handles
/// (`Device::wgpu_options().init_with_setup()`), and the loopback adopts them
/// ([`WgpuDevice::from_wgpu`](zero_comm::wgpu_loopback::WgpuDevice::from_wgpu)).
///
/// burn registers a runtime once per process, so this is a process-wide value:
/// [`WgpuShared::get`] opens it on first use and clones it afterwards.
#[cfg(feature = "wgpu")]
#[derive(Clone, Debug)]
pub struct WgpuShared {
    burn: burn::tensor::Device,
    comm: std::sync::Arc<zero_comm::wgpu_loopback::WgpuDevice>,
}

#[cfg(feature = "wgpu")]
impl WgpuShared {
    /// The process's shared device, opened on the first call. An error says why (no adapter,
    /// or burn's default wgpu runtime was already initialised by someone else); every later call
    /// returns the same error.
    pub fn get() -> Result<WgpuShared> {
        static SHARED: std::sync::OnceLock<std::result::Result<WgpuShared, String>> =
            std::sync::OnceLock::new();
        SHARED
            .get_or_init(|| {
                let (burn, setup) = burn::tensor::Device::wgpu_options()
                    .init_with_setup()
                    .map_err(|e| format!("burn's wgpu runtime: {e}"))?;
                let comm =
                    zero_comm::wgpu_loopback::WgpuDevice::from_wgpu(setup.device, setup.queue)
                        .map_err(|e| e.to_string())?;
                Ok(WgpuShared { burn, comm })
            })
            .clone()
            .map_err(Error::Backend)
    }

    /// burn's autodiff device on the shared `wgpu::Device`: build the model on it.
    pub fn autodiff_device(&self) -> burn::tensor::Device {
        self.burn.clone().autodiff()
    }

    /// burn's device (without autodiff) on the shared `wgpu::Device`.
    pub fn device(&self) -> burn::tensor::Device {
        self.burn.clone()
    }

    /// The loopback's side of the shared device.
    pub fn comm_device(&self) -> &std::sync::Arc<zero_comm::wgpu_loopback::WgpuDevice> {
        &self.comm
    }

    /// The adapter's name and driver, e.g. `llvmpipe (LLVM 15.0.6, 256 bits)` on lavapipe.
    pub fn adapter_name(&self) -> String {
        let info = self.comm.adapter_info();
        format!("{} ({}, {:?})", info.name, info.driver_info, info.backend)
    }
}
