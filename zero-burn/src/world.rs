//! Launching N ranks in one process: on the host loopback ([`train_host`]), or (feature `wgpu`)
//! on burn's wgpu backend with the wgpu loopback on one shared device (`train_wgpu`).

use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use zero_comm::Communicator;
use zero_comm::ReduceOrder;
use zero_comm::host::HostWorld;
use zero_core::{Plan, TrafficTable};

use crate::data::Corpus;
use crate::error::{Error, Result};
use crate::model::Segmented;
use crate::reduction::{Reduction, canonical_sum};
use crate::trainer::{DeviceQuant, DeviceTensors, MeasuredMemory, RankTrainer, TrainOptions};

/// What one rank reports after training.
#[derive(Debug)]
pub struct RankResult<M> {
    /// The rank.
    pub rank: usize,
    /// This rank's mean loss per step.
    pub losses: Vec<f32>,
    /// This rank's unscaled loss of each micro-step, per step (for [`global_losses`]).
    pub micro_losses: Vec<Vec<f32>>,
    /// Per step: skipped (fp16 overflow) or not, and the loss scale.
    pub step_info: Vec<crate::StepInfo>,
    /// Traffic measured over all steps.
    pub traffic: TrafficTable,
    /// Peak measured memory.
    pub memory: MeasuredMemory,
    /// The final model (stage 3: gather units released).
    pub model: M,
    /// Every parameter's final values, indexed like the plan's model (for equivalence checks);
    /// empty unless [`HostRun::keep_final_params`].
    pub final_params: Vec<Vec<f32>>,
    /// Gradient bytes a [`DeviceTensors`] hook packed in the communicator's memory (never read
    /// back to the host); 0 on the host path.
    pub device_grad_bytes: u64,
    /// Weight bytes a [`DeviceTensors`] hook installed in the model straight from the
    /// communicator's memory; 0 on the host path.
    pub device_weight_bytes: u64,
}

/// How long to run and what to keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostRun {
    /// Optimizer steps.
    pub steps: u64,
    /// Timeout of every collective.
    pub timeout: Duration,
    /// Gather every parameter at the end into [`RankResult::final_params`].
    pub keep_final_params: bool,
}

/// Trains `steps` optimizer steps with one thread per rank on the host loopback. Every rank starts
/// from a clone of `model`. The loopback sums in the order `options.reduction` needs (rank order,
/// or the pairwise tree for [`Reduction::CanonicalTree`]). `on_step(step, mean_loss)` is called by rank 0 after each step.
pub fn train_host<M: Segmented>(
    plan: Arc<Plan>,
    model: M,
    corpus: &dyn Corpus,
    options: TrainOptions,
    run: HostRun,
    on_step: &(dyn Fn(u64, f32) + Sync),
) -> Result<Vec<RankResult<M>>> {
    let order = match options.reduction {
        Reduction::RankOrdered => ReduceOrder::RankSequential,
        Reduction::CanonicalTree => ReduceOrder::PairwiseTree,
    };
    let models = RankModels::new(&model, plan.world_size());
    let results = HostWorld::new(*plan.topology(), run.timeout)
        .with_reduce_order(order)
        .launch(|comm| {
            let mine = models.take(comm.rank())?;
            run_rank(
                plan.clone(),
                comm,
                mine,
                corpus,
                options,
                run,
                on_step,
                None,
            )
        });
    collect(results)
}

/// burn modules are Send but not Sync: each rank takes its own clone through a mutex.
struct RankModels<M>(Mutex<Vec<Option<M>>>);

impl<M: Clone> RankModels<M> {
    fn new(model: &M, n: usize) -> Self {
        RankModels(Mutex::new((0..n).map(|_| Some(model.clone())).collect()))
    }

    fn take(&self, rank: usize) -> Result<M> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())[rank]
            .take()
            .ok_or_else(|| Error::Model(format!("rank {rank} launched twice")))
    }
}

/// A rank's device hooks: tensors to and from the communicator's memory, and ZeRO++'s codecs
/// there.
struct Device<C: Communicator> {
    tensors: Box<dyn DeviceTensors<C>>,
    quant: Option<Box<dyn DeviceQuant<C>>>,
}

/// One rank's whole run, on any communicator: `run.steps` steps, then its report. `hook` packs
/// tensors and ZeRO++'s codecs into the communicator's memory (see [`DeviceTensors`], [`DeviceQuant`]).
#[allow(clippy::too_many_arguments)]
fn run_rank<C: Communicator, M: Segmented>(
    plan: Arc<Plan>,
    comm: C,
    model: M,
    corpus: &dyn Corpus,
    options: TrainOptions,
    run: HostRun,
    on_step: &(dyn Fn(u64, f32) + Sync),
    hook: Option<Device<C>>,
) -> Result<RankResult<M>> {
    let mut t = RankTrainer::new(plan, comm, model, options)?;
    if let Some(hook) = hook {
        t = t.with_device_tensors(hook.tensors);
        if let Some(q) = hook.quant {
            t = t.with_device_quant(q);
        }
    }
    let mut losses = Vec::with_capacity(run.steps as usize);
    let mut micro_losses = Vec::with_capacity(run.steps as usize);
    let mut step_info = Vec::with_capacity(run.steps as usize);
    for s in 0..run.steps {
        let l = t.train_step(corpus)?;
        if t.rank() == 0 {
            on_step(s, l);
        }
        losses.push(l);
        micro_losses.push(t.last_micro_losses().to_vec());
        step_info.push(t.last_step());
    }
    let traffic = t.traffic();
    // Gathering every parameter costs a full copy per rank: only on request.
    let final_params = if run.keep_final_params {
        t.gather_all_params()?
    } else {
        Vec::new()
    };
    Ok(RankResult {
        rank: t.rank(),
        losses,
        micro_losses,
        step_info,
        traffic,
        memory: t.measured_memory(),
        device_grad_bytes: t.device_grad_bytes(),
        device_weight_bytes: t.device_weight_bytes(),
        model: t.model().clone(),
        final_params,
    })
}

/// The ranks' results in rank order, or the first error (a panicking rank becomes
/// [`Error::RankPanicked`]).
fn collect<M>(results: Vec<thread::Result<Result<RankResult<M>>>>) -> Result<Vec<RankResult<M>>> {
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

/// The global loss of every step: the canonical pairwise-tree sum of all `N·A` micro-batch losses,
/// numbered `a·N + rank` like the data, divided once by `N·A`. With
/// [`Reduction::CanonicalTree`] it is bit-identical across the world sizes the gradients are (see
/// [`crate::reduction`]); ranks' [`RankResult::losses`] are per-rank means.
pub fn global_losses<M>(results: &[RankResult<M>]) -> Vec<f32> {
    let Some(first) = results.first() else {
        return Vec::new();
    };
    (0..first.micro_losses.len())
        .map(|s| {
            let a = first.micro_losses[s].len();
            let leaves: Vec<f32> = (0..a)
                .flat_map(|m| results.iter().map(move |r| r.micro_losses[s][m]))
                .collect();
            canonical_sum(&leaves) / leaves.len() as f32
        })
        .collect()
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
    comm: Arc<zero_comm::wgpu_loopback::WgpuDevice>,
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

    /// The loopback's side of the shared device.
    pub fn comm_device(&self) -> &Arc<zero_comm::wgpu_loopback::WgpuDevice> {
        &self.comm
    }

    /// The adapter's name and driver, e.g. `llvmpipe (LLVM 15.0.6, 256 bits)` on lavapipe.
    pub fn adapter_name(&self) -> String {
        let info = self.comm.adapter_info();
        format!("{} ({}, {:?})", info.name, info.driver_info, info.backend)
    }
}

/// [`train_host`] on the GPU path (feature `wgpu`): every rank's model runs on burn's wgpu
/// backend and every collective on the wgpu loopback, both on `shared`'s one device. `model`
/// must live on [`WgpuShared::autodiff_device`].
///
/// Tensors reach the loopback through the zero-copy bridge ([`WgpuTensors::Bridge`]) in fp32:
/// units reduced every micro-step are packed from burn's gradient tensors on the device and
/// reduced there (qgZ with the WGSL codecs), only the rank's reduced chunk downloaded; weights
/// are gathered on the device (qwZ likewise) and installed from there, only the rank's chunk
/// uploaded. The trainer keeps its shards, gradient accumulator and optimizer state in host
/// memory, so the other collectives (16-bit or deferred) upload their input and download the
/// result: a host round trip. The loopback reduces in rank order, so
/// [`Reduction::CanonicalTree`] is rejected.
#[cfg(feature = "wgpu")]
pub fn train_wgpu<M: Segmented>(
    shared: &WgpuShared,
    plan: Arc<Plan>,
    model: M,
    corpus: &dyn Corpus,
    options: TrainOptions,
    run: HostRun,
    on_step: &(dyn Fn(u64, f32) + Sync),
) -> Result<Vec<RankResult<M>>> {
    train_wgpu_with(
        shared,
        plan,
        model,
        corpus,
        options,
        run,
        on_step,
        WgpuTensors::Bridge,
    )
}

/// How [`train_wgpu_with`] moves burn tensors to and from the loopback.
#[cfg(feature = "wgpu")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgpuTensors {
    /// Through the zero-copy bridge ([`crate::bridge::BridgeTensors`]), where fp32 allows: see
    /// [`train_wgpu`]. The default.
    Bridge,
    /// Through host memory: every gradient is read back, packed on the host and uploaded, every
    /// gathered unit downloaded and uploaded again.
    Host,
}

/// [`train_wgpu`] choosing how tensors reach the loopback.
#[allow(clippy::too_many_arguments)]
#[cfg(feature = "wgpu")]
pub fn train_wgpu_with<M: Segmented>(
    shared: &WgpuShared,
    plan: Arc<Plan>,
    model: M,
    corpus: &dyn Corpus,
    options: TrainOptions,
    run: HostRun,
    on_step: &(dyn Fn(u64, f32) + Sync),
    grads: WgpuTensors,
) -> Result<Vec<RankResult<M>>> {
    if let Some(d) = model.devices().into_iter().find(|d| *d != shared.burn) {
        return Err(Error::Model(format!(
            "the model lives on {d:?}; train_wgpu needs it on the shared device {:?}",
            shared.burn
        )));
    }
    let models = RankModels::new(&model, plan.world_size());
    // The WGSL codecs, compiled once for every rank.
    let quant = match grads {
        WgpuTensors::Bridge => Some(crate::bridge::BridgeQuant::new(&shared.comm)?),
        WgpuTensors::Host => None,
    };
    let world = zero_comm::wgpu_loopback::WgpuWorld::with_device(
        shared.comm.clone(),
        *plan.topology(),
        run.timeout,
    );
    let results = world.launch(|comm| {
        let mine = models.take(comm.rank())?;
        let hook = quant.clone().map(|q| Device {
            tensors: Box::new(crate::bridge::BridgeTensors::new(
                shared.comm.clone(),
                shared.autodiff_device(),
            )) as Box<dyn DeviceTensors<_>>,
            quant: Some(Box::new(q) as Box<dyn DeviceQuant<_>>),
        });
        run_rank(
            plan.clone(),
            comm,
            mine,
            corpus,
            options,
            run,
            on_step,
            hook,
        )
    });
    collect(results)
}
