//! burn's CUDA backend (feature `cuda`): a device to build the model on, or a clear error.
//!
//! burn-cuda loads the CUDA driver (`libcuda.so`) at run time on a device thread of its own,
//! which panics when the driver is missing. [`device`] checks for the driver and the GPU first,
//! so a machine without them gets an error naming what is missing.
//!
//! What works here: burn-cuda builds and links (offline with `.ci/llvm-sdk.sh`), [`device`]
//! guards it, and the demo trains on it ([`Backend::Cuda`](crate::demo::job::Backend::Cuda):
//! the model, the optimizer's state, the shard and accumulators on the GPU; in-process ranks'
//! collectives on the CUDA loopback in its memory, one process per GPU's over NCCL in its memory
//! (`run_job_rank_cuda`). [`CudaTensors`] is the trainer's
//! [`DeviceTensors`](crate::DeviceTensors) hook over NCCL or the CUDA loopback: gradients and
//! gathered weights (fp32, or bf16/fp16 words) move between burn-cuda tensors and their device
//! buffers on the device. None of it has run on a GPU yet; see STATUS.md.

use burn::tensor::Device;

use crate::error::{Error, Result};

mod bridge;

pub use bridge::CudaTensors;

/// burn's CUDA device `index` (without autodiff: call `.autodiff()` to train on it), after
/// checking that this machine has a CUDA driver and a GPU of that index.
pub fn device(index: usize) -> Result<Device> {
    let count = gpu_count()?;
    if index >= count {
        return Err(Error::Invalid {
            field: "cuda device",
            got: index.to_string(),
            expected: format!("an index below {count}, the number of GPUs the driver sees"),
        });
    }
    Ok(Device::cuda(index))
}

/// The GPUs the CUDA driver sees; an error when there is no driver or it fails to start.
pub fn gpu_count() -> Result<usize> {
    // SAFETY: only tries to load libcuda (dlopen); no CUDA function is called.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::Backend(
            "no CUDA driver on this machine (libcuda.so could not be loaded); burn's CUDA \
             backend needs an NVIDIA GPU and its driver"
                .into(),
        ));
    }
    let count = cudarc::driver::result::init()
        .and_then(|()| cudarc::driver::result::device::get_count())
        .map_err(|e| Error::Backend(format!("the CUDA driver failed to start: {e}")))?;
    Ok(usize::try_from(count).unwrap_or(0))
}
