//! The trainer over NCCL (feature `nccl`): ZeRO-3 on one GPU with every collective through NCCL,
//! against the same job on the host loopback, uninterrupted and across a checkpoint.
//!
//! One GPU allows one NCCL rank (NCCL refuses two ranks on one device), so this is world size 1,
//! where NCCL's results are exact: the run must be **bit-identical** to the host loopback's, and
//! its measured traffic must equal the plan. The model computes on burn's flex (CPU) backend
//! (burn-cuda's path is `cuda_path.rs`'s), so parameters and gradients are staged through host
//! memory around each collective.
//!
//! It runs with the `gpu-tests` feature and `ZERO_GPU_TESTS=1` (what `cargo xtask gpu-check`
//! sets) and otherwise prints why it skips; with `ZERO_GPU_TESTS=1` on a machine where NCCL
//! cannot run it fails, naming why. When it passes it appends its name to the gpu-check cookie
//! (`$ZERO_GPU_COOKIE`).
#![cfg(feature = "nccl")]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::Device;
use zero_burn::checkpoint::DirStorage;
use zero_burn::demo::data::{Corpus, MarkovLanguage};
use zero_burn::demo::gpt::{Gpt, GptConfig};
use zero_burn::demo::run::{HostRun, RankResult, TrainOptions, Work, corpus_step, engine_builder};
use zero_burn::demo::train::{On, train};
use zero_burn::optim::Optimizer;
use zero_burn::reduction::Reduction;
use zero_comm::nccl::{NcclComm, NcclOptions};
use zero_core::{Plan, Topology, ZeroConfig};

const STEPS: u64 = 20;

use zero_testkit::cookie::passed as cookie;

fn gpu_ready(test: &str) -> bool {
    if !cfg!(feature = "gpu-tests") {
        eprintln!("skip {test}: built without the gpu-tests feature");
        return false;
    }
    if std::env::var("ZERO_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("skip {test}: ZERO_GPU_TESTS=1 is not set");
        return false;
    }
    // Asked to run on a GPU (gpu-check), a machine that cannot is a failure, not a skip.
    match zero_comm::nccl::probe() {
        Ok(rt) if rt.devices > 0 => true,
        Ok(_) => panic!("{test}: ZERO_GPU_TESTS=1 but the CUDA driver sees no device"),
        Err(e) => panic!("{test}: ZERO_GPU_TESTS=1 but NCCL cannot run here: {e}"),
    }
}

type Setup = (MarkovLanguage, Arc<Plan>, TrainOptions, Gpt);

/// The default job's model and data at world size 1, ZeRO-3.
fn setup() -> Setup {
    let corpus = MarkovLanguage::new(64, 7).unwrap();
    let cfg = GptConfig {
        vocab: corpus.vocab(),
        ..zero_burn::demo::job::JobConfig::default_job().model
    };
    let model = cfg.init(&Device::flex().autodiff(), 7);
    let optimizer = Optimizer::default();
    let zero = ZeroConfig {
        stage: 3,
        param_persistence_threshold: 1024,
        prefetch_bucket_size: 0,
        optimizer: optimizer.kind(),
        ..ZeroConfig::default()
    };
    let plan = Arc::new(zero_burn::plan_for(&model, Topology::new(1, 1).unwrap(), &zero).unwrap());
    let options = TrainOptions {
        lr: 3e-3,
        optimizer,
        micro_batch: 8,
        seq: cfg.context,
        reduction: Reduction::RankOrdered,
    };
    (corpus, plan, options, model)
}

/// [`STEPS`] steps of the job on the host loopback, keeping the final parameters.
fn host_reference(
    corpus: &MarkovLanguage,
    plan: &Arc<Plan>,
    options: TrainOptions,
    model: &Gpt,
) -> Vec<RankResult<Gpt>> {
    let run = HostRun {
        steps: STEPS,
        timeout: Duration::from_secs(60),
        keep_final_params: true,
        checkpoint: None,
    };
    train(
        On::Host,
        plan.clone(),
        model.clone(),
        Work::new(corpus, options, &run),
    )
    .unwrap()
}

/// [`setup`] and its [`host_reference`] run, once test `test` may run ([`gpu_ready`]).
fn gpu_setup(test: &str) -> Option<(Setup, RankResult<Gpt>)> {
    if !gpu_ready(test) {
        return None;
    }
    let (corpus, plan, options, model) = setup();
    let want = host_reference(&corpus, &plan, options, &model).swap_remove(0);
    Some(((corpus, plan, options, model), want))
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `params` are the reference run's final parameters, bit for bit.
fn assert_final_params(params: &[Vec<f32>], want: &RankResult<Gpt>, what: &str) {
    assert_eq!(params.len(), want.final_params.len());
    for (i, (a, b)) in params.iter().zip(&want.final_params).enumerate() {
        assert!(bits(a) == bits(b), "parameter {i} differs {what}");
    }
}

#[test]
fn zero3_over_nccl_is_bit_identical_to_the_host_loopback() {
    let test = "zero3_over_nccl_is_bit_identical_to_the_host_loopback";
    let Some(((corpus, plan, options, model), want)) = gpu_setup(test) else {
        return;
    };

    // Synchronous, then overlapped: the collectives on the trainer's communication thread,
    // which must bind the CUDA context there.
    for overlap in [false, true] {
        let zero = ZeroConfig {
            overlap_comm: overlap,
            ..plan.config().clone()
        };
        let plan = Arc::new(zero_burn::plan_for(&model, *plan.topology(), &zero).unwrap());
        let comm = NcclComm::single(0, NcclOptions::default()).unwrap();
        let mut trainer = engine_builder(&plan, comm, model.clone(), options)
            .build()
            .unwrap();
        let t = Instant::now();
        let mut got = Vec::new();
        for _ in 0..STEPS {
            got.push(corpus_step(&mut trainer, &corpus, &options).unwrap().loss);
        }
        let secs = t.elapsed().as_secs_f64();
        assert_eq!(
            bits(&got),
            bits(&want.losses),
            "losses (overlap {overlap}): nccl {got:?} vs host {:?}",
            want.losses
        );
        assert_eq!(trainer.traffic(), common::planned_traffic(&plan, 0, STEPS));
        // (Gathering every parameter is extra traffic, so it comes after the traffic check.)
        let params = trainer.gather_all_params().unwrap();
        let what = format!("after {STEPS} steps (overlap {overlap})");
        assert_final_params(&params, &want, &what);
        assert!(
            got[STEPS as usize - 1] < got[0] - 0.1,
            "the loss must fall: {got:?}"
        );
        println!(
            "ZERO_GPU_TRAIN overlap={overlap} steps={STEPS} loss_first={:.4} loss_last={:.4} \
             secs={secs:.2}",
            got[0],
            got[STEPS as usize - 1]
        );
    }
    cookie(test);
}

/// A checkpoint on the NCCL path: half the steps, save, a fresh NCCL engine loads and
/// runs the rest; every loss and final parameter equals the host loopback's uninterrupted run.
#[test]
fn a_checkpoint_over_nccl_resumes_bit_identically() {
    let test = "a_checkpoint_over_nccl_resumes_bit_identically";
    let Some(((corpus, plan, options, model), want)) = gpu_setup(test) else {
        return;
    };
    let tmp = tempfile::Builder::new()
        .prefix("zero-nccl-ckpt-")
        .tempdir()
        .expect("a temp dir");
    let dir = tmp.path().to_path_buf();
    let store = DirStorage::new(&dir).unwrap();
    let engine = || {
        let comm = NcclComm::single(0, NcclOptions::default()).unwrap();
        engine_builder(&plan, comm, model.clone(), options)
            .build()
            .unwrap()
    };
    let mut got = Vec::new();
    let mut first = engine();
    while first.steps() < STEPS / 2 {
        got.push(corpus_step(&mut first, &corpus, &options).unwrap().loss);
    }
    first
        .save(&store, serde_json::json!({ "at": STEPS / 2 }))
        .unwrap();
    drop(first);
    let mut second = engine();
    let loaded = second.load(&store).unwrap();
    assert_eq!(loaded.step, STEPS / 2);
    assert_eq!(loaded.client_state, serde_json::json!({ "at": STEPS / 2 }));
    while second.steps() < STEPS {
        got.push(corpus_step(&mut second, &corpus, &options).unwrap().loss);
    }
    assert_eq!(bits(&got), bits(&want.losses), "losses across the resume");
    let params = second.gather_all_params().unwrap();
    assert_final_params(&params, &want, "after the resume");
    println!("ZERO_GPU_CKPT steps={STEPS} saved_at={} ok", STEPS / 2);
    cookie(test);
}
