//! Running one closure per rank in this process: each closure gets its rank's communicator,
//! builds its [`crate::ZeroEngine`] and drives its own loop. A rank that fails (an error or a
//! panic) drops its communicator, which fails its peers' pending collectives fast with an error
//! naming it; [`Launch::run`] returns the root cause, naming its rank ([`Error::RankFailed`]).

use std::sync::Mutex;
use std::thread;
use std::time::Duration;

use burn::module::Module;
use burn::tensor::Device;
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
    /// ranks' results in rank order, or [`Error::RankFailed`]: the root cause (the first error in
    /// rank order that is not a consequence of another rank's failure; a panic is
    /// [`Error::RankPanicked`]) and the other ranks' errors.
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

    /// [`Launch::run`] handing every rank its own deep copy of `model` (see [`deep_copy`]):
    /// every rank then starts from the same values and shares no state with another.
    pub fn run_with<M, T, F>(self, model: &M, f: F) -> Result<Vec<T>>
    where
        M: Module,
        T: Send,
        F: Fn(HostComm, M) -> Result<T> + Sync,
    {
        let clones = Clones::new(model.clone(), self.topology.world_size());
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
        self.on_device(shared.comm_device().clone(), f)
    }

    /// [`Launch::run`] on the CUDA loopback over `device`'s GPU and stream (feature `cuda`):
    /// build each rank's model on burn-cuda's device of the same GPU. The CUDA loopback sums in
    /// rank order only.
    #[cfg(feature = "cuda")]
    pub fn run_cuda<T, F>(
        self,
        device: &std::sync::Arc<zero_comm::nccl::CudaDevice>,
        f: F,
    ) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(zero_comm::nccl::CudaComm) -> Result<T> + Sync,
    {
        self.on_device(device.clone(), f)
    }

    /// [`Launch::run`] on a device loopback over `device`, which sums in rank order only.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    fn on_device<M, T, F>(self, device: std::sync::Arc<M>, f: F) -> Result<Vec<T>>
    where
        M: zero_comm::device_loopback::Memory,
        T: Send,
        F: Fn(zero_comm::device_loopback::LoopbackComm<M>) -> Result<T> + Sync,
    {
        if self.reduction == Reduction::CanonicalTree {
            return Err(Error::Invalid {
                field: "reduction",
                got: format!("canonical_tree on the {}", M::NAME),
                expected: format!("rank_ordered (the {} sums in rank order)", M::NAME),
            });
        }
        let world = zero_comm::device_loopback::LoopbackWorld::with_device(
            device,
            self.topology,
            self.timeout,
        );
        collect(world.launch(f))
    }
}

/// A copy of `model` that shares no mutable state with it.
///
/// burn's `clone()` of a module shares its buffers: a `RunningState` (BatchNorm's running
/// statistics) is an `Arc` that both clones update, so ranks handed clones would write each
/// other's statistics. The copy is the module made `valid()` (fresh buffers holding the same
/// values) and, on an autodiff device, `train()` again (each parameter's training state
/// restored). Tensors are immutable values and stay shared. A module of the caller's own whose
/// `valid()` keeps state shared is not made independent by this.
pub fn deep_copy<M: Module>(model: &M) -> M {
    let copy = model.valid();
    if model.devices().iter().any(Device::is_autodiff) {
        copy.train()
    } else {
        copy
    }
}

/// One deep copy of a module per rank, each taken once (a `Mutex` makes a `Send` value
/// shareable). The module itself is dropped: once every rank has sharded its copy, the weights
/// they shared are freed (at stage 3 no rank holds them whole).
#[derive(Debug)]
pub(crate) struct Clones<M>(Mutex<Vec<Option<M>>>);

impl<M: Module> Clones<M> {
    pub(crate) fn new(model: M, n: usize) -> Self {
        Clones(Mutex::new(
            (0..n).map(|_| Some(deep_copy(&model))).collect(),
        ))
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

/// The ranks' results in rank order, or [`Error::RankFailed`] with the root cause: the first
/// error in rank order that is not a consequence of another rank's failure (a rank whose peer
/// failed first fails with a communication error naming that peer; see
/// [`Error::is_consequence_on`]), or the first error when every one is a consequence. A panicking
/// rank's error is [`Error::RankPanicked`]. The other ranks' errors follow as consequences.
fn collect<T>(results: Vec<thread::Result<Result<T>>>) -> Result<Vec<T>> {
    let mut out = Vec::with_capacity(results.len());
    let mut errors: Vec<(usize, Error)> = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(Ok(v)) => out.push(v),
            Ok(Err(e)) => errors.push((rank, e)),
            Err(p) => {
                let message = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                errors.push((rank, Error::RankPanicked { rank, message }));
            }
        }
    }
    if errors.is_empty() {
        return Ok(out);
    }
    let root = errors
        .iter()
        .position(|(rank, e)| !e.is_consequence_on(*rank))
        .unwrap_or(0);
    let (rank, source) = errors.remove(root);
    Err(Error::RankFailed {
        rank,
        source: Box::new(source),
        consequences: errors
            .into_iter()
            .map(|(r, e)| (r, e.full_message()))
            .collect(),
    })
}

/// The variables that name a process's rank on its node, in the order they are read: torchrun's
/// and `cargo xtask launch`'s, OpenMPI's, MPICH's, Slurm's.
pub const LOCAL_RANK_VARS: [&str; 4] = [
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "SLURM_LOCALID",
];

/// This process's rank on its node, which picks its GPU: the first of [`LOCAL_RANK_VARS`] that
/// is set, or 0 when none is (a process on its own, or in-process ranks sharing one device). A
/// value that is not a number is an error naming the variable.
pub fn local_rank() -> Result<usize> {
    local_rank_from(|var| std::env::var(var).ok())
}

/// [`local_rank`] from the variables `get` returns.
fn local_rank_from(get: impl Fn(&str) -> Option<String>) -> Result<usize> {
    for var in LOCAL_RANK_VARS {
        if let Some(v) = get(var) {
            return v.trim().parse().map_err(|_| Error::Invalid {
                field: "local rank",
                got: format!("{var}={v:?}"),
                expected: "a rank on this node: 0, 1, 2, ...".into(),
            });
        }
    }
    Ok(0)
}

/// The discrete GPU a process with local rank `local` opens when the machine has `discrete`
/// of them: the `local`-th (modulo their number) when there are two or more and
/// `CUBECL_WGPU_DEFAULT_DEVICE` does not choose (`overridden`); otherwise `None`, wgpu's default
/// adapter.
#[cfg(feature = "wgpu")]
fn discrete_gpu_for(discrete: usize, local: usize, overridden: bool) -> Option<usize> {
    (discrete >= 2 && !overridden).then(|| local % discrete)
}

/// The discrete GPUs wgpu sees.
#[cfg(feature = "wgpu")]
fn discrete_gpus() -> usize {
    use burn::tensor::wgpu::wgpu;
    let adapters =
        pollster::block_on(wgpu::Instance::default().enumerate_adapters(wgpu::Backends::all()));
    adapters
        .iter()
        .filter(|a| a.get_info().device_type == wgpu::DeviceType::DiscreteGpu)
        .count()
}

/// burn's wgpu runtime and the wgpu loopback on **one** `wgpu::Device` and queue (feature
/// `wgpu`): burn initialises its runtime on the process's adapter (the discrete GPU of its
/// [`local_rank`] on a machine with several, else the default one) and hands back its handles
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
                let options = burn::tensor::Device::wgpu_options();
                let options = match discrete_gpu_for(
                    discrete_gpus(),
                    local_rank().map_err(|e| e.to_string())?,
                    std::env::var_os("CUBECL_WGPU_DEFAULT_DEVICE").is_some(),
                ) {
                    Some(i) => options.device_kind(burn::tensor::DeviceKind::DiscreteGpu(i)),
                    None => options,
                };
                let (burn, setup) = options
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_local_rank_comes_from_the_first_launcher_variable_set() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |var: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == var)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(local_rank_from(env(&[])).unwrap(), 0);
        assert_eq!(local_rank_from(env(&[("SLURM_LOCALID", "3")])).unwrap(), 3);
        // torchrun's (and `cargo xtask launch`'s) wins over OpenMPI's.
        let both = env(&[("OMPI_COMM_WORLD_LOCAL_RANK", "1"), ("LOCAL_RANK", "2")]);
        assert_eq!(local_rank_from(both).unwrap(), 2);
        let err = local_rank_from(env(&[("LOCAL_RANK", "two")])).unwrap_err();
        assert!(err.to_string().contains("LOCAL_RANK=\"two\""), "{err}");
    }

    #[cfg(feature = "wgpu")]
    #[test]
    fn each_local_rank_gets_its_own_discrete_gpu() {
        // No discrete GPU (lavapipe, integrated) or one: wgpu's default adapter.
        assert_eq!(discrete_gpu_for(0, 3, false), None);
        assert_eq!(discrete_gpu_for(1, 0, false), None);
        // Several: the local rank's, wrapping when there are more processes than GPUs.
        assert_eq!(discrete_gpu_for(4, 2, false), Some(2));
        assert_eq!(discrete_gpu_for(4, 5, false), Some(1));
        // CUBECL_WGPU_DEFAULT_DEVICE chooses instead.
        assert_eq!(discrete_gpu_for(4, 2, true), None);
    }
}
