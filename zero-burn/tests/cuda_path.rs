//! burn's CUDA backend (feature `cuda`): the driver guard everywhere, a burn-cuda computation and
//! the trainer on a GPU.
//!
//! - Without a CUDA driver (this machine, CI) [`zero_burn::cuda::device`], and a job on
//!   [`Backend::Cuda`], are errors naming the driver, never a panic. On a machine with a driver
//!   these tests record that they did not run.
//! - With feature `gpu-tests` (clippy builds it), `ZERO_GPU_TESTS=1` and a GPU: a matmul, a
//!   reduction and a softmax on burn-cuda equal burn-flex's within 1e-5; ZeRO-3 over 2 in-process
//!   ranks on the GPU (host loopback) gives stage 0's losses bit for bit (in fp32, and in bf16
//!   and fp16, whose stage-3 shard the GPU rounds), with the traffic the
//!   plan books, and flex's within 1e-3 (relative); over NCCL at world size 1, and over the CUDA
//!   loopback at world size 2, the CUDA bridge (`cuda::CudaTensors`) gives the host-staged path's
//!   bits. `cargo xtask gpu-check` runs them (a program of its own); they have not run on a GPU
//!   yet.
#![cfg(feature = "cuda")]

mod common;

use zero_burn::demo::job::{Backend, JobConfig, run_job};

#[cfg(feature = "gpu-tests")]
use gpu_prelude::*;

/// What the GPU tests use.
#[cfg(feature = "gpu-tests")]
mod gpu_prelude {
    pub(crate) use std::sync::Arc;
    pub(crate) use std::time::Duration;

    pub(crate) use burn::tensor::activation::softmax;
    pub(crate) use burn::tensor::{Device, Tensor, TensorData};
    pub(crate) use zero_burn::cuda::CudaTensors;
    pub(crate) use zero_burn::demo::data::MarkovLanguage;
    pub(crate) use zero_burn::demo::run::{
        HostRun, TrainOptions, Work, corpus_step, engine_builder,
    };
    pub(crate) use zero_burn::demo::train::{On, train};
    pub(crate) use zero_burn::optim::Optimizer;
    pub(crate) use zero_burn::{DeviceQuant, plan_for};
    pub(crate) use zero_comm::nccl::{NcclComm, NcclOptions};
    pub(crate) use zero_core::{Precision, Topology, ZeroConfig};
    pub(crate) use zero_quant::CudaQuantizer;
    pub(crate) use zero_testkit::cookie::passed as cookie;
}

fn driver_present() -> bool {
    zero_burn::cuda::gpu_count().is_ok()
}

#[test]
fn no_cuda_driver_is_a_clear_error_not_a_panic() {
    if driver_present() {
        zero_testkit::record_skip!(
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

/// A small job on the CUDA backend: `world_size` in-process ranks at `stage`, without ZeRO++.
fn cuda_job(stage: u8, steps: u64) -> JobConfig {
    let mut job = JobConfig::default_job();
    job.backend = Backend::Cuda;
    job.world_size = 2;
    job.ranks_per_node = 2;
    job.steps = steps;
    job.micro_batch = 2;
    job.zero.stage = stage;
    job.zero.quantized_weights = false;
    job.zero.quantized_gradients = false;
    job.zero.hpz_partition_size = 1;
    job.zero.checkpoint_activations = Some(false);
    job
}

#[test]
fn a_cuda_job_without_a_driver_fails_naming_it() {
    if driver_present() {
        zero_testkit::record_skip!(
            "a_cuda_job_without_a_driver_fails_naming_it",
            "this machine has a CUDA driver",
        );
        return;
    }
    let err = run_job(&cuda_job(3, 1), &|_| {}).expect_err("no driver, no CUDA job");
    let msg = err.to_string();
    assert!(
        msg.contains("CUDA driver") && msg.contains("libcuda"),
        "{msg}"
    );
    let check = zero_burn::demo::job::check(&cuda_job(0, 1)).expect_err("checked first");
    assert_eq!(check.to_string(), msg);
}

#[cfg(feature = "gpu-tests")]
fn gpu_gate(name: &str) -> bool {
    if !zero_testkit::cookie::gpu_tests() {
        eprintln!("skip {name}: needs ZERO_GPU_TESTS=1 and a GPU");
        return false;
    }
    // Asked to run on a GPU (gpu-check), a machine without one is a failure, not a skip.
    if let Err(e) = zero_burn::cuda::gpu_count().and_then(|n| {
        (n > 0).then_some(()).ok_or(zero_burn::Error::Backend(
            "the CUDA driver sees no GPU".into(),
        ))
    }) {
        panic!("{name}: ZERO_GPU_TESTS=1 but burn-cuda cannot run here: {e}");
    }
    true
}

#[cfg(feature = "gpu-tests")]
#[test]
fn gpu_zero3_on_cuda_equals_stage0_bit_for_bit() {
    const NAME: &str = "gpu_zero3_on_cuda_equals_stage0_bit_for_bit";
    if !gpu_gate(NAME) {
        return;
    }
    let run = |stage| run_job(&cuda_job(stage, 4), &|_| {}).expect("a CUDA job");
    let (zero, three) = (run(0), run(3));
    let bits = |l: &[f32]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&zero.loss),
        bits(&three.loss),
        "stage 3 vs stage 0 on the GPU"
    );
    assert!(three.loss.iter().all(|l| l.is_finite()));
    assert!(
        three.loss[3] < three.loss[0],
        "the loss falls: {:?}",
        three.loss
    );
    assert!(
        zero.comm_matches_plan && three.comm_matches_plan,
        "traffic differs from the plan"
    );
    // In bf16 and fp16 stage 3's shard lives on the GPU, rounded there from the device master;
    // stage 0 rounds in host memory with `half`: the same bits.
    for precision in [zero_core::Precision::Bf16, zero_core::Precision::Fp16] {
        let run = |stage| {
            let mut job = cuda_job(stage, 4);
            job.zero.precision = precision;
            run_job(&job, &|_| {}).expect("a 16-bit CUDA job")
        };
        let (zero, three) = (run(0), run(3));
        assert_eq!(
            bits(&zero.loss),
            bits(&three.loss),
            "{precision:?}: stage 3 (its shard rounded on the GPU) vs stage 0"
        );
    }
    // The same job on flex: the GPU's kernels round differently, within a stated bound.
    let flex = run_job(
        &JobConfig {
            backend: Backend::Host,
            ..cuda_job(3, 4)
        },
        &|_| {},
    )
    .expect("the flex job");
    let worst = three
        .loss
        .iter()
        .zip(&flex.loss)
        .map(|(g, c)| (g - c).abs() / c.abs().max(1.0))
        .fold(0.0f32, f32::max);
    assert!(
        worst <= 1e-3,
        "CUDA vs flex losses: worst relative gap {worst:.2e}"
    );
    let device = three.device_peak_per_rank.first().copied().unwrap_or(0);
    assert!(device > 0, "the GPU's pools count the state");
    println!(
        "ZERO_GPU_TRAIN burn-cuda ZeRO-3 N=2: losses {:?}, {:.1} tokens/s, worst gap to flex \
         {worst:.2e}, device pools' peak {device} B",
        three.loss, three.tokens_per_sec
    );
    cookie(NAME);
}

#[cfg(feature = "gpu-tests")]
#[test]
fn gpu_burn_cuda_computes_like_flex() {
    if !gpu_gate("gpu_burn_cuda_computes_like_flex") {
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
    cookie("gpu_burn_cuda_computes_like_flex");
}

/// The default job's model, its corpus and the options of the bridge tests, once test `name` may
/// run ([`gpu_gate`]).
#[cfg(feature = "gpu-tests")]
fn bridge_setup(name: &str) -> Option<(JobConfig, MarkovLanguage, TrainOptions)> {
    if !gpu_gate(name) {
        return None;
    }
    let job = JobConfig::default_job();
    let corpus = MarkovLanguage::new(job.model.vocab, 5).expect("a corpus");
    let options = TrainOptions {
        lr: job.lr,
        optimizer: Optimizer::default(),
        micro_batch: 2,
        seq: job.model.context,
        reduction: zero_burn::Reduction::RankOrdered,
    };
    Some((job, corpus, options))
}

/// ZeRO at `stage` for the bridge tests, with qwZ and qgZ where `zpp`, in `precision`.
#[cfg(feature = "gpu-tests")]
fn bridge_zero(stage: u8, zpp: bool, precision: Precision) -> ZeroConfig {
    ZeroConfig {
        stage,
        param_persistence_threshold: 256,
        quantized_weights: zpp,
        quantized_gradients: zpp,
        precision,
        optimizer: Optimizer::default().kind(),
        ..ZeroConfig::default()
    }
}

/// The CUDA bridge over NCCL (`cuda::CudaTensors`, with NCCL's CUDA codecs as `DeviceQuant`) on
/// one GPU at world size 1: ZeRO-3 (plain, with qwZ and qgZ, and in bf16, whose shard's words
/// NCCL gathers as bytes on the device) gives the host-staged path's losses and final parameters
/// bit for bit (the same kernels on the same values; only where the bytes travel differs), with
/// the traffic the plan books.
#[cfg(feature = "gpu-tests")]
#[test]
fn gpu_nccl_on_cuda_bridged_equals_host_staged() {
    const NAME: &str = "gpu_nccl_on_cuda_bridged_equals_host_staged";
    let Some((job, corpus, options)) = bridge_setup(NAME) else {
        return;
    };
    for (zpp, precision) in [
        (false, Precision::Fp32),
        (true, Precision::Fp32),
        (false, Precision::Bf16),
    ] {
        let what = format!("zpp={zpp} {precision:?}");
        let train = |bridged: bool| {
            let device = zero_burn::cuda::device(0).expect("a GPU").autodiff();
            let model = job.model.init(&device, 11);
            let zero = bridge_zero(3, zpp, precision);
            let topology = Topology::new(1, 1).expect("a topology");
            let plan = Arc::new(plan_for(&model, topology, &zero).expect("a plan"));
            let comm = NcclComm::single(0, NcclOptions::default()).expect("NCCL on GPU 0");
            let hooks = CudaTensors::new(&comm, device.clone());
            let quant = CudaQuantizer::new(comm.stream().clone()).expect("the CUDA codecs");
            let mut builder = engine_builder(&plan, comm, model, options);
            if bridged {
                builder = builder
                    .device_tensors(Box::new(hooks))
                    .device_quant(Arc::new(quant) as Arc<dyn DeviceQuant<_>>);
            }
            let mut engine = builder.build().expect("an engine");
            let losses: Vec<u32> = (0..3)
                .map(|_| {
                    let out = corpus_step(&mut engine, &corpus, &options).expect("a step");
                    out.loss.to_bits()
                })
                .collect();
            assert!(engine.report().traffic_matches_plan(), "{what}: traffic");
            let params = engine.gather_all_params().expect("the parameters");
            let bits: Vec<u32> = params.iter().flatten().map(|v| v.to_bits()).collect();
            (losses, bits, engine.report().device_weight_bytes)
        };
        let (bridged, staged) = (train(true), train(false));
        assert_eq!(bridged.0, staged.0, "{what}: losses");
        assert!(bridged.1 == staged.1, "{what}: parameters");
        assert!(
            bridged.2 > 0,
            "{what}: weights installed from NCCL's memory"
        );
        assert_eq!(staged.2, 0, "{what}: the staged path");
    }
    cookie(NAME);
}

/// The CUDA loopback with the CUDA bridge (`demo::train::train` on `On::Cuda`): 2 in-process ranks
/// on one GPU with their collectives in its memory give the host-staged path's losses and final
/// parameters bit for bit (the same models on the same GPU, the host loopback moving the bytes
/// through host memory, both summing in rank order in f32), with the traffic the plan books, every
/// gradient packed on the device and gathered weights installed from the loopback's memory. Stages
/// 0 and 3 (plain, accumulation, hpZ, ZeRO++), and bf16 and fp16 at stage 3.
#[cfg(feature = "gpu-tests")]
#[test]
fn gpu_cuda_loopback_trains_like_host_staged() {
    const NAME: &str = "gpu_cuda_loopback_trains_like_host_staged";
    let Some((job, corpus, options)) = bridge_setup(NAME) else {
        return;
    };
    let run = HostRun {
        steps: 3,
        timeout: Duration::from_secs(120),
        keep_final_params: true,
        checkpoint: None,
    };
    // (stage, accumulation, hpZ, qwZ + qgZ, precision)
    for (stage, ga, hpz, zpp, precision) in [
        (0u8, 1u32, 1, false, Precision::Fp32),
        (3, 2, 1, false, Precision::Fp32),
        (3, 1, 2, true, Precision::Fp32),
        (3, 1, 1, false, Precision::Bf16),
        (3, 2, 2, false, Precision::Fp16),
    ] {
        let what = format!("stage {stage} ga {ga} hpz {hpz} zpp {zpp} {precision:?}");
        let train = |bridged: bool| {
            let device = zero_burn::cuda::device(0).expect("a GPU").autodiff();
            let model = job.model.init(&device, 11);
            let zero = ZeroConfig {
                gradient_accumulation_steps: ga,
                hpz_partition_size: hpz,
                ..bridge_zero(stage, zpp, precision)
            };
            let topology = Topology::new(2, 2).expect("a topology");
            let plan = Arc::new(plan_for(&model, topology, &zero).expect("a plan"));
            let on = if bridged { On::Cuda(0) } else { On::Host };
            let r = train(on, plan.clone(), model, Work::new(&corpus, options, &run))
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            for x in &r {
                let want = common::planned_traffic(&plan, x.rank, run.steps);
                assert_eq!(x.traffic, want, "{what}: rank {} traffic", x.rank);
            }
            r
        };
        let (bridged, staged) = (train(true), train(false));
        for (a, b) in bridged.iter().zip(&staged) {
            assert_eq!(a.losses, b.losses, "{what}: losses");
            assert!(
                common::bits(&a.final_params) == common::bits(&b.final_params),
                "{what}: parameters"
            );
            assert!(
                a.device_grad_bytes > 0,
                "{what}: gradients packed on the device"
            );
            assert_eq!(a.device_weight_bytes > 0, stage >= 1, "{what}: weights");
            assert_eq!(
                (b.device_grad_bytes, b.device_weight_bytes),
                (0, 0),
                "{what}: the staged path"
            );
        }
        println!(
            "ZERO_GPU_TRAIN CUDA loopback {what}: losses {:?}, {:.3} s/step",
            bridged[0].losses,
            bridged[0].step_seconds.iter().sum::<f64>() / run.steps as f64
        );
    }
    cookie(NAME);
}
