//! The demo's launcher on burn's wgpu backend (feature `wgpu`): [`train_wgpu`], the twin of
//! [`train_host`] with every rank's model and the wgpu loopback on one shared device.

use std::sync::Arc;

use zero_comm::Communicator;
use zero_core::Plan;

use crate::demo::data::{Corpus, TokenBatch};
#[cfg(doc)]
use crate::demo::run::train_host;
use crate::demo::run::{HostRun, RankResult, Tick, TrainOptions, engine_builder, run_rank};
use crate::device::{DeviceQuant, DeviceTensors};
use crate::error::{Error, Result};
use crate::launch::{Clones, Launch, WgpuShared};
#[cfg(doc)]
use crate::reduction::Reduction;
use crate::segmented::Segmented;

/// [`train_host`] on the GPU path (feature `wgpu`): every rank's model runs on burn's wgpu
/// backend and every collective on the wgpu loopback, both on `shared`'s one device. `model`
/// must live on [`WgpuShared::autodiff_device`].
///
/// Tensors reach the loopback through the zero-copy bridge ([`WgpuTensors::Bridge`]) in fp32:
/// units reduced every micro-step are packed from burn's gradient tensors on the device and
/// reduced there (qgZ with the WGSL codecs), only the rank's reduced chunk downloaded; weights
/// are gathered on the device (qwZ likewise) and installed from there, stage 3's pieces copied
/// from its device shard; fp16 rounds its gradients and moves its words on the device too.
/// qwZ and qgZ on 16-bit elements, and the gradients of `accumulate_before_reduce`, pass through
/// host memory: they upload their input and download the result. The loopback
/// reduces in rank order, so [`Reduction::CanonicalTree`] is rejected.
pub fn train_wgpu<M: Segmented<Batch = TokenBatch>>(
    shared: &WgpuShared,
    plan: Arc<Plan>,
    model: M,
    corpus: &dyn Corpus,
    options: TrainOptions,
    run: HostRun,
    on_step: &(dyn Fn(Tick) + Sync),
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
pub fn train_wgpu_with<M: Segmented<Batch = TokenBatch>>(
    shared: &WgpuShared,
    plan: Arc<Plan>,
    model: M,
    corpus: &dyn Corpus,
    options: TrainOptions,
    run: HostRun,
    on_step: &(dyn Fn(Tick) + Sync),
    grads: WgpuTensors,
) -> Result<Vec<RankResult<M>>> {
    if let Some(d) = model.devices().into_iter().find(|d| *d != shared.device()) {
        return Err(Error::Backend(format!(
            "the model lives on {d:?}; train_wgpu needs it on the shared device {:?}",
            shared.device()
        )));
    }
    let models = Clones::new(model, plan.world_size());
    // The WGSL codecs, compiled once for every rank.
    let quant = match grads {
        WgpuTensors::Bridge => {
            let d = shared.comm_device();
            let q = zero_quant::WgpuQuantizer::new(d.device().clone(), d.queue().clone())?;
            Some(Arc::new(q))
        }
        WgpuTensors::Host => None,
    };
    Launch::new(*plan.topology())
        .timeout(run.timeout)
        .reduction(options.reduction)
        .run_wgpu(shared, |comm| {
            let mine = models.take(comm.rank())?;
            let mut builder = engine_builder(&plan, comm, mine, options);
            if let Some(q) = quant.clone() {
                builder = builder
                    .device_tensors(Box::new(crate::bridge::BridgeTensors::new(
                        shared.comm_device().clone(),
                        shared.autodiff_device(),
                    )) as Box<dyn DeviceTensors<_>>)
                    .device_quant(q as Arc<dyn DeviceQuant<_>>);
            }
            run_rank(builder, corpus, options, run.clone(), on_step)
        })
}
