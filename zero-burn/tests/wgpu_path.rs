//! The wgpu path (feature `wgpu`): the trainer on burn's wgpu backend with the wgpu loopback, both
//! on one `wgpu::Device` (`demo::train::train` on `On::Wgpu`), against the reference path (flex CPU
//! backend, host loopback) on the same job: losses per step within a stated tolerance, and measured
//! traffic and model-state bytes equal to the plan exactly.
//!
//! Runs on any wgpu adapter (Mesa lavapipe on CPU-only machines). Without one each test records
//! that it did not run (`record_skip`) and returns, which `cargo xtask test` counts and fails on
//! unless `--allow-device-skips`; `ZERO_REQUIRE_WGPU=1` makes a missing adapter fail the test
//! itself (CI sets it after installing `mesa-vulkan-drivers`).
#![cfg(feature = "wgpu")]

mod common;

use common::shared;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::Device;
use zero_burn::demo::data::MarkovLanguage;
use zero_burn::demo::gpt::{Gpt, GptConfig};
use zero_burn::demo::job::JobConfig;
use zero_burn::demo::run::{HostRun, RankResult, TrainOptions, Work};
use zero_burn::demo::train::{On, WgpuTensors, train};
use zero_burn::optim::Optimizer;
use zero_burn::{Error, MeasuredMemory, Reduction, plan_for};
use zero_core::{Plan, Precision, Topology, ZeroConfig};

const STEPS: u64 = 8;

/// Relative loss gap allowed per step: |Δ| ≤ TOL · max(1, |loss|). The kernels differ (cubecl's
/// matmul and reductions vs flex's), so the paths agree only up to f32 rounding. Measured on
/// lavapipe: at most 1.1e-5 over these 8 steps (each test prints its worst gap); TOL leaves 9x.
const TOL: f32 = 1e-4;

/// The default job's model (GPT-style, d_model 64, 4 blocks, 4 heads, context 32, vocab 64).
fn model_config() -> GptConfig {
    JobConfig::default_job().model
}

/// The default job's batch and learning rate.
fn options() -> TrainOptions {
    let job = JobConfig::default_job();
    TrainOptions {
        lr: job.lr,
        optimizer: Optimizer::default(),
        micro_batch: job.micro_batch,
        seq: model_config().context,
        reduction: Reduction::RankOrdered,
    }
}

fn run_config() -> HostRun {
    HostRun {
        steps: STEPS,
        timeout: Duration::from_secs(120),
        keep_final_params: false,
        checkpoint: None,
    }
}

fn plan(model: &Gpt, stage: u8) -> Arc<Plan> {
    let zero = ZeroConfig {
        stage,
        param_persistence_threshold: 256,
        prefetch_bucket_size: 0,
        optimizer: Optimizer::default().kind(),
        ..ZeroConfig::default()
    };
    Arc::new(plan_for(model, Topology::new(2, 2).unwrap(), &zero).unwrap())
}

/// I8 on the wgpu path: measured traffic and model-state bytes equal the plan, per rank.
fn check_plan(plan: &Plan, results: &[RankResult<Gpt>], what: &str) {
    for r in results {
        let want = common::planned_traffic(plan, r.rank, STEPS);
        assert_eq!(r.traffic, want, "{what}: rank {} traffic", r.rank);
        assert_eq!(
            r.memory.model_states(),
            MeasuredMemory::planned_model_states(&plan.memory()),
            "{what}: rank {} model-state bytes",
            r.rank
        );
    }
}

/// Trains the same job on both paths at world size 2 and compares them.
fn wgpu_matches_flex(test: &str, stage: u8) {
    let Some(shared) = shared(test) else {
        return;
    };
    let corpus = MarkovLanguage::new(model_config().vocab, 5).unwrap();

    let cpu = model_config().init(&Device::flex().autodiff(), 11);
    let cpu_plan = plan(&cpu, stage);
    let t = Instant::now();
    let want = train(
        On::Host,
        cpu_plan.clone(),
        cpu,
        Work::new(&corpus, options(), &run_config()),
    )
    .unwrap();
    let cpu_secs = t.elapsed().as_secs_f64();
    check_plan(&cpu_plan, &want, "flex");

    let gpu = model_config().init(&shared.autodiff_device(), 11);
    let gpu_plan = plan(&gpu, stage);
    assert_eq!(
        gpu_plan.model(),
        cpu_plan.model(),
        "the same model on both devices"
    );
    let t = Instant::now();
    let got = train(
        On::Wgpu(shared.clone(), WgpuTensors::Bridge),
        gpu_plan.clone(),
        gpu,
        Work::new(&corpus, options(), &run_config()),
    )
    .unwrap();
    let gpu_secs = t.elapsed().as_secs_f64();
    check_plan(&gpu_plan, &got, "wgpu");

    let mut worst = 0f32;
    for (g, w) in got.iter().zip(&want) {
        for (s, (a, b)) in g.losses.iter().zip(&w.losses).enumerate() {
            let gap = (a - b).abs() / b.abs().max(1.0);
            worst = worst.max(gap);
            assert!(
                gap <= TOL,
                "stage {stage}, rank {}, step {s}: wgpu {a} vs flex {b} (relative gap {gap:.2e} > {TOL:.0e})",
                g.rank
            );
        }
    }
    let first = want[0].losses[0];
    let last = want[0].losses[STEPS as usize - 1];
    assert!(last < first, "it learns: {first} -> {last}");
    // On stdout: `cargo xtask gpu-check` collects these lines.
    println!(
        "{test} on {}: worst relative loss gap {worst:.2e} over {STEPS} steps; \
         flex+host {cpu_secs:.2} s, wgpu+wgpu loopback {gpu_secs:.2} s ({:.3} s/step)",
        shared.adapter_name(),
        gpu_secs / STEPS as f64
    );
}

#[test]
fn zero3_on_wgpu_matches_flex() {
    wgpu_matches_flex("zero3_on_wgpu_matches_flex", 3);
}

#[test]
fn zero1_on_wgpu_matches_flex() {
    wgpu_matches_flex("zero1_on_wgpu_matches_flex", 1);
}

/// The zero-copy bridge (gradients packed and reduced on the device, only the reduced chunk
/// downloaded; units gathered on the device and installed from there) against the host-staged
/// wgpu path (every gradient read back, packed on the host, uploaded; every gathered unit
/// downloaded and uploaded again): the same kernels on the same values, so the same bits,
/// at every stage, with accumulation, hpZ, `overlap_comm` (device buffers gathered and reduced
/// on the communication thread) and ZeRO++ (qwZ and qgZ on the device with the WGSL codecs, which
/// give the host codecs' bits); traffic equals the plan on both.
#[test]
fn bridged_tensors_give_the_bits_of_host_staged_ones() {
    let Some(shared) = shared("bridged_tensors_give_the_bits_of_host_staged_ones") else {
        return;
    };
    let corpus = MarkovLanguage::new(model_config().vocab, 5).unwrap();
    let run = HostRun {
        steps: 3,
        timeout: Duration::from_secs(120),
        keep_final_params: true,
        checkpoint: None,
    };
    // (stage, accumulation, hpZ, overlap, qwZ + qgZ, precision). In fp16 the gradients are
    // rounded and reduced, and the weights gathered, as 16-bit words on the device (lavapipe has
    // 16-bit floats).
    for (stage, ga, hpz, overlap, zpp, precision) in [
        (0u8, 1u32, 1, false, false, Precision::Fp32),
        (1, 2, 1, false, false, Precision::Fp32),
        (2, 1, 1, true, false, Precision::Fp32),
        (3, 2, 1, false, false, Precision::Fp32),
        (3, 1, 2, true, false, Precision::Fp32),
        (3, 2, 2, false, true, Precision::Fp32),
        (0, 1, 1, false, false, Precision::Fp16),
        (2, 2, 1, true, false, Precision::Fp16),
        (3, 2, 1, false, false, Precision::Fp16),
        (3, 1, 2, true, false, Precision::Fp16),
    ] {
        let train = |grads| {
            let gpu = model_config().init(&shared.autodiff_device(), 11);
            let zero = ZeroConfig {
                gradient_accumulation_steps: ga,
                hpz_partition_size: hpz,
                overlap_comm: overlap,
                quantized_weights: zpp,
                quantized_gradients: zpp,
                precision,
                ..plan(&gpu, stage).config().clone()
            };
            let p = Arc::new(plan_for(&gpu, Topology::new(2, 2).unwrap(), &zero).unwrap());
            let r = train(
                On::Wgpu(shared.clone(), grads),
                p.clone(),
                gpu,
                Work::new(&corpus, options(), &run),
            )
            .unwrap();
            for x in &r {
                let want = common::planned_traffic(&p, x.rank, run.steps);
                assert_eq!(x.traffic, want, "stage {stage}: rank {} traffic", x.rank);
            }
            r
        };
        let t = Instant::now();
        let bridged = train(WgpuTensors::Bridge);
        let bridged_secs = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let staged = train(WgpuTensors::Host);
        let staged_secs = t.elapsed().as_secs_f64();
        println!(
            "ZERO_WGPU_BRIDGE stage={stage} ga={ga} hpz={hpz} overlap={overlap} zpp={zpp} \
             {precision:?} steps={} \
             bridged_s={bridged_secs:.3} staged_s={staged_secs:.3} on {}",
            run.steps,
            shared.adapter_name()
        );
        // Every gradient of every micro-step went through the bridge (no qgZ, reduced every
        // micro-step; fp16 rounded on the device), and none on the staged path.
        let numel: usize = plan(&model_config().init(&shared.autodiff_device(), 11), stage)
            .model()
            .params
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.shape.iter().product::<usize>())
            .sum();
        let width = if precision == Precision::Fp32 { 4 } else { 2 };
        let want = width * numel as u64 * run.steps * u64::from(ga);
        for (a, b) in bridged.iter().zip(&staged) {
            assert_eq!(a.device_grad_bytes, want, "stage {stage}: bridged bytes");
            assert_eq!(b.device_grad_bytes, 0, "stage {stage}: staged bytes");
            // Stages 1–3 install every gathered unit (after the step, and at stage 3 for each
            // use) from the loopback's memory, fp16 words too; stage 0 gathers nothing.
            assert_eq!(
                a.device_weight_bytes > 0,
                stage >= 1,
                "stage {stage}: weights"
            );
            assert_eq!(b.device_weight_bytes, 0, "stage {stage}: staged weights");
            assert_eq!(
                a.losses, b.losses,
                "stage {stage} ga {ga} {precision:?}: losses"
            );
            assert!(
                common::bits(&a.final_params) == common::bits(&b.final_params),
                "stage {stage} ga {ga} {precision:?}: parameters"
            );
        }
        assert!(bridged[0].losses[2] < bridged[0].losses[0], "it learns");
    }
}

#[test]
fn a_model_off_the_shared_device_is_rejected() {
    let Some(shared) = shared("a_model_off_the_shared_device_is_rejected") else {
        return;
    };
    let cpu = model_config().init(&Device::flex().autodiff(), 1);
    let p = plan(&cpu, 3);
    let corpus = MarkovLanguage::new(model_config().vocab, 5).unwrap();
    let err = train(
        On::Wgpu(shared.clone(), WgpuTensors::Bridge),
        p,
        cpu,
        Work::new(&corpus, options(), &run_config()),
    )
    .expect_err("a flex model on the wgpu path");
    assert!(
        matches!(err.root_cause(), Error::Backend(m) if m.contains("shared device")),
        "{err}"
    );
}

/// `cargo xtask train --backend wgpu`'s path: the embedded default job (ZeRO-3 + qwZ + hpZ + qgZ,
/// 4 ranks as 2 nodes of 2) through `run_job` on the wgpu backend matches the plan and the host
/// backend's losses.
#[test]
fn the_default_job_runs_on_the_wgpu_backend() {
    if shared("the_default_job_runs_on_the_wgpu_backend").is_none() {
        return;
    }
    let host = JobConfig {
        steps: 3,
        ..JobConfig::default_job()
    };
    let wgpu = JobConfig {
        backend: zero_burn::demo::job::Backend::Wgpu,
        ..host.clone()
    };
    let want = zero_burn::demo::job::run_job(&host, &|_| {}).unwrap();
    let got = zero_burn::demo::job::run_job(&wgpu, &|_| {}).unwrap();
    assert!(got.comm_matches_plan, "traffic differs from the plan");
    assert!(
        got.memory_matches_plan,
        "model-state bytes differ from the plan"
    );
    for (s, (g, w)) in got.loss.iter().zip(&want.loss).enumerate() {
        let gap = (g - w).abs() / w.abs().max(1.0);
        assert!(
            gap <= 1e-4,
            "step {s}: wgpu {g} vs host {w} (relative gap {gap:.1e})"
        );
    }
}

/// Checkpoints on the wgpu path (the bridge, the default): 2 steps, save, a fresh world loads
/// and runs 2 more, bit-identical to 4 uninterrupted steps (losses and every final parameter),
/// at stage 1 and at stage 3.
#[test]
fn a_checkpoint_resumes_bit_identically_on_the_wgpu_path() {
    use zero_burn::checkpoint::MemStorage;
    use zero_burn::demo::run::Checkpointing;
    let Some(shared) = shared("a_checkpoint_resumes_bit_identically_on_the_wgpu_path") else {
        return;
    };
    let corpus = MarkovLanguage::new(model_config().vocab, 5).unwrap();
    for stage in [1u8, 3] {
        let train = |steps: u64, checkpoint: Option<Checkpointing>| {
            let gpu = model_config().init(&shared.autodiff_device(), 11);
            let run = HostRun {
                steps,
                timeout: Duration::from_secs(120),
                keep_final_params: true,
                checkpoint,
            };
            train(
                On::Wgpu(shared.clone(), WgpuTensors::Bridge),
                plan(&gpu, stage),
                gpu,
                Work::new(&corpus, options(), &run),
            )
            .unwrap()
        };
        let whole = train(4, None);
        let store: Arc<dyn zero_burn::checkpoint::Storage> = Arc::new(MemStorage::new());
        let ckpt = |save: bool| Checkpointing {
            save: save.then(|| store.clone()),
            save_every: 0,
            resume: (!save).then(|| store.clone()),
            resume_tag: None,
            reshard: false,
        };
        let first = train(2, Some(ckpt(true)));
        assert_eq!(first[0].saves.len(), 1, "stage {stage}: one save");
        let rest = train(4, Some(ckpt(false)));
        for ((w, a), b) in whole.iter().zip(&first).zip(&rest) {
            assert_eq!(b.first_step, 2, "stage {stage}: resumed at step 2");
            let resumed: Vec<f32> = a.losses.iter().chain(&b.losses).copied().collect();
            assert_eq!(resumed, w.losses, "stage {stage}: rank {} losses", w.rank);
            assert!(
                common::bits(&b.final_params) == common::bits(&w.final_params),
                "stage {stage}: rank {} parameters",
                w.rank
            );
        }
    }
}
