//! The demo's launcher on burn's CUDA backend (feature `cuda`): [`train_cuda`], the twin of
//! `train_wgpu`, with every rank's model on one GPU and the CUDA loopback's collectives in that
//! GPU's memory.

use std::sync::Arc;

use zero_comm::Communicator;
use zero_comm::nccl::CudaDevice;
use zero_core::Plan;

use crate::cuda::CudaTensors;
use crate::demo::data::{Corpus, TokenBatch};
use crate::demo::run::{HostRun, RankResult, Tick, TrainOptions, engine_builder, run_rank};
use crate::device::{DeviceQuant, DeviceTensors};
use crate::error::{Error, Result};
use crate::launch::{Clones, Launch};
use crate::segmented::Segmented;

/// `train_host` on the GPU: every rank's model runs on burn-cuda on GPU `gpu`, whose autodiff
/// device `model` must live on, and every collective on the CUDA loopback over the same GPU (N
/// ranks as threads, one stream, no NCCL).
///
/// Tensors reach the loopback through the CUDA bridge ([`CudaTensors`]): gradients are copied into
/// their unit's buffer on the device and reduced there (qgZ with zero-quant's CUDA codecs),
/// gathered units (qwZ likewise; bf16/fp16 as words) become the model's tensors with one device
/// copy each. The loopback reduces in rank order, so `Reduction::CanonicalTree` is rejected.
/// Never run on a GPU yet (`gpu_cuda_loopback_trains_like_host_staged` in `cargo xtask gpu-check`).
pub fn train_cuda<M: Segmented<Batch = TokenBatch>>(
    gpu: usize,
    plan: Arc<Plan>,
    model: M,
    corpus: &dyn Corpus,
    options: TrainOptions,
    run: HostRun,
    on_step: &(dyn Fn(Tick) + Sync),
) -> Result<Vec<RankResult<M>>> {
    let device = crate::cuda::device(gpu)?.autodiff();
    if let Some(d) = model.devices().into_iter().find(|d| *d != device) {
        return Err(Error::Backend(format!(
            "the model lives on {d:?}; train_cuda needs it on {device:?}"
        )));
    }
    let cuda = CudaDevice::new(gpu)?;
    let quant = Arc::new(zero_quant::CudaQuantizer::new(cuda.stream().clone())?);
    let models = Clones::new(model, plan.world_size());
    Launch::new(*plan.topology())
        .timeout(run.timeout)
        .reduction(options.reduction)
        .run_cuda(&cuda, |comm| {
            let mine = models.take(comm.rank())?;
            let hooks = CudaTensors::new(&comm, device.clone());
            let builder = engine_builder(&plan, comm, mine, options)
                .device_tensors(Box::new(hooks) as Box<dyn DeviceTensors<_>>)
                .device_quant(quant.clone() as Arc<dyn DeviceQuant<_>>);
            run_rank(builder, corpus, options, run.clone(), on_step)
        })
}
