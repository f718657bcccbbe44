//! The demo's one in-process launcher: [`train`] runs one thread per rank, every rank from a
//! clone of the model, on the compute and collectives [`On`] names.

use std::sync::Arc;

use zero_comm::Communicator;
use zero_core::Plan;

use crate::demo::data::TokenBatch;
use crate::demo::run::{RankResult, Work, engine_builder, run_rank};
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use crate::device::{DeviceQuant, DeviceTensors};
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use crate::error::Error;
use crate::error::Result;
use crate::launch::{Clones, Launch};
#[cfg(doc)]
use crate::reduction::Reduction;
use crate::segmented::Segmented;

/// Where [`train`]'s in-process ranks compute and where their collectives run.
#[derive(Clone, Debug)]
pub enum On {
    /// burn's flex CPU backend and the host loopback, which sums in the order
    /// `options.reduction` needs (rank order, or the pairwise tree for
    /// [`Reduction::CanonicalTree`]).
    Host,
    /// burn's wgpu backend and the wgpu loopback, both on the shared device (feature `wgpu`);
    /// the model must live on [`WgpuShared::autodiff_device`](crate::WgpuShared::autodiff_device).
    ///
    /// With [`WgpuTensors::Bridge`], tensors reach the loopback through the zero-copy bridge in
    /// fp32: units reduced every micro-step are packed from burn's gradient tensors on the device
    /// and reduced there (qgZ with the WGSL codecs), only the rank's reduced chunk downloaded;
    /// weights are gathered on the device (qwZ likewise) and installed from there, stage 3's
    /// pieces copied from its device shard; fp16 rounds its gradients and moves its words on the
    /// device too. qwZ and qgZ on 16-bit elements, and the gradients of
    /// `accumulate_before_reduce`, pass through host memory. The loopback reduces in rank order,
    /// so [`Reduction::CanonicalTree`] is rejected.
    #[cfg(feature = "wgpu")]
    Wgpu(crate::WgpuShared, WgpuTensors),
    /// burn-cuda on GPU `gpu`, whose autodiff device the model must live on, and the CUDA
    /// loopback over the same GPU (feature `cuda`; N ranks as threads, one stream, no NCCL).
    /// Tensors reach the loopback through the CUDA bridge ([`crate::cuda::CudaTensors`]):
    /// gradients are copied into their unit's buffer on the device and reduced there (qgZ with
    /// zero-quant's CUDA codecs); gathered units (qwZ likewise; bf16/fp16 as words) become the
    /// model's tensors with one device copy each. Never run on a GPU yet
    /// (`gpu_cuda_loopback_trains_like_host_staged` in `cargo xtask gpu-check`).
    #[cfg(feature = "cuda")]
    Cuda(usize),
}

/// How [`On::Wgpu`] moves burn tensors to and from the loopback.
#[cfg(feature = "wgpu")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgpuTensors {
    /// Through the zero-copy bridge ([`crate::bridge::BridgeTensors`]), where fp32 allows: see
    /// [`On::Wgpu`]. The default.
    Bridge,
    /// Through host memory: every gradient is read back, packed on the host and uploaded, every
    /// gathered unit downloaded and uploaded again.
    Host,
}

/// Does `work` with one thread per rank [`On`] the given backend. Every rank starts from a clone
/// of `model`.
pub fn train<M: Segmented<Batch = TokenBatch>>(
    on: On,
    plan: Arc<Plan>,
    model: M,
    work: Work<'_>,
) -> Result<Vec<RankResult<M>>> {
    let options = work.options;
    let launch = Launch::new(*plan.topology())
        .timeout(work.run.timeout)
        .reduction(options.reduction);
    match on {
        On::Host => {
            let models = Clones::new(model, plan.world_size());
            launch.run(|comm| {
                let mine = models.take(comm.rank())?;
                let builder = engine_builder(&plan, comm, mine, options);
                run_rank(builder, work)
            })
        }
        #[cfg(feature = "wgpu")]
        On::Wgpu(shared, tensors) => {
            on_device(&model, &shared.device(), "the shared device")?;
            let models = Clones::new(model, plan.world_size());
            // The WGSL codecs, compiled once for every rank.
            let quant = match tensors {
                WgpuTensors::Bridge => {
                    let d = shared.comm_device();
                    let q = zero_quant::WgpuQuantizer::new(d.device().clone(), d.queue().clone())?;
                    Some(Arc::new(q))
                }
                WgpuTensors::Host => None,
            };
            launch.run_wgpu(&shared, |comm| {
                let mine = models.take(comm.rank())?;
                let mut builder = engine_builder(&plan, comm, mine, options);
                if let Some(q) = quant.clone() {
                    let bridge = crate::bridge::BridgeTensors::new(
                        shared.comm_device().clone(),
                        shared.autodiff_device(),
                    );
                    builder = builder
                        .device_tensors(Box::new(bridge) as Box<dyn DeviceTensors<_>>)
                        .device_quant(q as Arc<dyn DeviceQuant<_>>);
                }
                run_rank(builder, work)
            })
        }
        #[cfg(feature = "cuda")]
        On::Cuda(gpu) => {
            let device = crate::cuda::device(gpu)?.autodiff();
            on_device(&model, &device, "its GPU")?;
            let cuda = zero_comm::nccl::CudaDevice::new(gpu)?;
            let quant = Arc::new(zero_quant::CudaQuantizer::new(cuda.stream().clone())?);
            let models = Clones::new(model, plan.world_size());
            launch.run_cuda(&cuda, |comm| {
                let mine = models.take(comm.rank())?;
                let hooks = crate::cuda::CudaTensors::new(&comm, device.clone());
                let builder = engine_builder(&plan, comm, mine, options)
                    .device_tensors(Box::new(hooks) as Box<dyn DeviceTensors<_>>)
                    .device_quant(quant.clone() as Arc<dyn DeviceQuant<_>>);
                run_rank(builder, work)
            })
        }
    }
}

/// [`Error::Backend`] unless every tensor of `model` lives on `device` (`what` names it).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn on_device<M: Segmented>(model: &M, device: &burn::tensor::Device, what: &str) -> Result<()> {
    match model.devices().into_iter().find(|d| d != device) {
        Some(d) => Err(Error::Backend(format!(
            "the model lives on {d:?}; training there needs it on {what} {device:?}"
        ))),
        None => Ok(()),
    }
}
