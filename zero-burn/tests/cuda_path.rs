//! burn's CUDA backend (feature `cuda`): the driver guard everywhere, a burn-cuda computation on
//! a GPU.
//!
//! - Without a CUDA driver (this machine, CI) [`zero_burn::cuda::device`] is an error naming the
//!   driver, never a panic. On a machine with a driver that test records that it did not run.
//! - With feature `gpu-tests` (clippy builds it), `ZERO_GPU_TESTS=1` and a GPU: a matmul, a
//!   reduction and a softmax on burn-cuda equal burn-flex's within 1e-5. Not yet in
//!   `cargo xtask gpu-check`'s list (its bundle has no room for a burn-cuda program yet), so it
//!   has not run on a GPU.
#![cfg(feature = "cuda")]

mod common;

#[cfg(feature = "gpu-tests")]
use burn::tensor::activation::softmax;
#[cfg(feature = "gpu-tests")]
use burn::tensor::{Device, Tensor, TensorData};

fn driver_present() -> bool {
    zero_burn::cuda::gpu_count().is_ok()
}

#[test]
fn no_cuda_driver_is_a_clear_error_not_a_panic() {
    if driver_present() {
        common::record_skip(
            "no_cuda_driver_is_a_clear_error_not_a_panic",
            "this machine has a CUDA driver",
        );
        return;
    }
    let err = zero_burn::cuda::device(0).expect_err("no driver, no device");
    let msg = err.to_string();
    assert!(
        msg.contains("CUDA driver") && msg.contains("libcuda"),
        "{msg}"
    );
}

#[cfg(feature = "gpu-tests")]
#[test]
fn gpu_burn_cuda_computes_like_flex() {
    if std::env::var("ZERO_GPU_TESTS").as_deref() != Ok("1") || !driver_present() {
        eprintln!("skip gpu_burn_cuda_computes_like_flex: needs ZERO_GPU_TESTS=1 and a GPU");
        return;
    }
    let cuda = zero_burn::cuda::device(0).expect("a GPU");
    let a: Vec<f32> = (0..64 * 32)
        .map(|i| ((i * 7) % 13) as f32 / 13.0 - 0.5)
        .collect();
    let b: Vec<f32> = (0..32 * 16)
        .map(|i| ((i * 5) % 11) as f32 / 11.0 - 0.5)
        .collect();
    let run = |device: &Device| {
        let a = Tensor::<2>::from_data(TensorData::new(a.clone(), [64, 32]), device);
        let b = Tensor::<2>::from_data(TensorData::new(b.clone(), [32, 16]), device);
        let y = softmax(a.matmul(b), 1).sum_dim(0);
        y.into_data().try_to_vec::<f32>().expect("f32")
    };
    let (on_gpu, on_cpu) = (run(&cuda), run(&Device::flex()));
    let worst = on_gpu
        .iter()
        .zip(&on_cpu)
        .map(|(g, c)| (g - c).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= 1e-5, "burn-cuda vs flex: worst gap {worst}");
    if let Some(path) = std::env::var_os("ZERO_GPU_COOKIE") {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .expect("the cookie");
        writeln!(f, "gpu_burn_cuda_computes_like_flex ok").expect("the cookie");
    }
}
