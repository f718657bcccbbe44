//! burn-train's `Learner` over the engine's sharded optimizer step (`zero_burn::learner`): a
//! classifier written for plain burn-train (its own `TrainStep`, `InferenceStep`, burn's
//! `DataLoader`, `LossMetric`, the file metric logger, the model checkpointer) trains under
//! `SupervisedTraining` on two in-process ranks at stages 0–2. Oracle: the same model, data
//! order and optimizer through the engine's own loop (`ZeroEngine::step`): the weights are
//! bit-identical, and the losses burn-train's metric logger wrote equal the engine's.
#![cfg(feature = "burn-train")]

mod common;

use std::path::Path;
use std::time::Duration;

use burn::module::Module;
use burn::module::ParamGroup;
use burn::optim::lr_scheduler::constant::ConstantLr;
use burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::optim::lr_scheduler::module_lr_scheduler::{ModuleLearningRate, ModuleLrScheduler};
use burn::tensor::Device;
use burn_train::logger::{FileMetricLogger, MetricLogger};
use burn_train::metric::store::Split;
use burn_train::metric::{LossMetric, NumericEntry};
use burn_train::{ClassificationOutput, InferenceStep, SupervisedTraining, TrainOutput, TrainStep};
use zero_burn::learner::{Sharded, single_learning_rate};
use zero_burn::{Error, Launch, Optimizer, Whole, ZeroEngine};
use zero_core::{Precision, Topology, ZeroConfig};

use common::points::{B, Point, PointBatch, ResMlp, bits, cross_entropy, loader, points, values};

/// The user's model, written for plain burn-train: nothing zero-rs-specific.
#[derive(Module, Debug)]
struct Classifier {
    net: ResMlp,
}

impl Classifier {
    fn classify(&self, b: PointBatch) -> ClassificationOutput {
        let logits = self.net.forward(b.x);
        let loss = cross_entropy(logits.clone(), b.y.clone());
        ClassificationOutput::new(loss, logits, b.y)
    }
}

impl TrainStep for Classifier {
    type Input = PointBatch;
    type Output = ClassificationOutput;

    fn step(&self, b: PointBatch) -> TrainOutput<ClassificationOutput> {
        let item = self.classify(b);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Classifier {
    type Input = PointBatch;
    type Output = ClassificationOutput;

    fn step(&self, b: PointBatch) -> ClassificationOutput {
        self.classify(b)
    }
}

/// The engine's view of the same model: one segment, the same loss.
fn whole() -> Whole<
    Classifier,
    PointBatch,
    impl Fn(&Classifier, &PointBatch) -> burn::tensor::Tensor<1> + Clone + Send + 'static,
> {
    let model = Classifier {
        net: ResMlp::new(&Device::flex().autodiff()),
    };
    Whole::new(model, |m: &Classifier, b: &PointBatch| {
        cross_entropy(m.net.forward(b.x.clone()), b.y.clone())
    })
}

const N: usize = 2;
const EPOCHS: usize = 2;
/// Optimizer steps per epoch.
const STEPS: usize = 4;
const LR: f64 = 2e-2;

/// Rank `rank`'s points: global batch `s·N + rank` of every step `s` of an epoch.
fn rank_points(all: &[Point], rank: usize) -> Vec<Point> {
    all.chunks_exact(B)
        .enumerate()
        .filter(|(k, _)| k % N == rank)
        .flat_map(|(_, c)| c.to_vec())
        .collect()
}

fn cfg(stage: u8) -> ZeroConfig {
    ZeroConfig {
        stage,
        gradient_accumulation_steps: 1,
        ..Default::default()
    }
}

fn optimizer() -> Optimizer {
    Optimizer::AdamW {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    }
}

/// What a rank ended with: the weights, and its loss per optimizer step.
struct Ran {
    params: Vec<Vec<f32>>,
    losses: Vec<f64>,
    steps: u64,
}

/// A fresh temporary directory for `tag`, removed when the returned guard drops.
fn dir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("zero-burn-train-{tag}-"))
        .tempdir()
        .expect("a temp dir")
}

/// Every rank under burn-train's `SupervisedTraining`, the engine stepping the optimizer.
fn with_learner(stage: u8, root: &Path) -> Vec<Ran> {
    with_learner_at(stage, root, Precision::Fp32, || LR.into())
}

/// [`with_learner`] at `precision`, with the learning-rate schedule `lr` makes.
fn with_learner_at(
    stage: u8,
    root: &Path,
    precision: Precision,
    lr: impl Fn() -> ModuleLrScheduler + Sync,
) -> Vec<Ran> {
    let all = points(STEPS * N * B);
    let valid = points(2 * B);
    Launch::new(Topology::new(N, N).unwrap())
        .timeout(Duration::from_secs(60))
        .run_with(&whole(), |comm, model| {
            let rank = zero_comm::Communicator::rank(&comm);
            let engine = ZeroEngine::builder(comm, model)
                .config(ZeroConfig {
                    precision,
                    ..cfg(stage)
                })
                .optimizer(optimizer())
                .build()?;
            let learner = Sharded::new(engine)?.learner(lr());
            let out = root.join(format!("rank{rank}"));
            let trained =
                SupervisedTraining::new(&out, loader(&rank_points(&all, rank)), loader(&valid))
                    .metrics((LossMetric::new(),))
                    .num_epochs(EPOCHS)
                    .with_default_checkpointers()
                    .with_application_logger(None)
                    .launch(learner);
            assert!(trained.error.is_none(), "rank {rank}: {:?}", trained.error);
            let model = trained.model;
            let steps = model.engine().steps();
            let mut logger = FileMetricLogger::new(&out);
            let mut losses = Vec::new();
            for epoch in 1..=EPOCHS {
                let read = logger.read_numeric("Loss", epoch, &Split::Train);
                // One entry per step, then the epoch's `Final` mean.
                losses.extend(
                    read.expect("the loss log")
                        .iter()
                        .filter(|e| !matches!(e, NumericEntry::Final(_)))
                        .map(NumericEntry::current),
                );
            }
            Ok(Ran {
                params: values(model.model()),
                losses,
                steps,
            })
        })
        .unwrap()
}

/// The oracle: the engine's own loop over the same batches, in the same order.
fn with_engine(stage: u8) -> Vec<Ran> {
    with_engine_at(stage, Precision::Fp32, || LR.into())
}

/// [`with_engine`] at `precision`, each step at the rate the schedule `lr` makes gives it.
fn with_engine_at(
    stage: u8,
    precision: Precision,
    lr: impl Fn() -> ModuleLrScheduler + Sync,
) -> Vec<Ran> {
    let all = points(STEPS * N * B);
    Launch::new(Topology::new(N, N).unwrap())
        .timeout(Duration::from_secs(60))
        .run_with(&whole(), |comm, model| {
            let rank = zero_comm::Communicator::rank(&comm);
            let mut engine = ZeroEngine::builder(comm, model)
                .config(ZeroConfig {
                    precision,
                    ..cfg(stage)
                })
                .optimizer(optimizer())
                .build()?;
            let data = loader(&rank_points(&all, rank));
            let mut schedule = lr();
            let mut losses = Vec::new();
            for _ in 0..EPOCHS {
                for b in data.iter() {
                    let b = b.expect("in-memory data");
                    let rate = schedule.step().base() as f32;
                    losses.push(f64::from(engine.step(rate, &[b])?.loss));
                }
            }
            Ok(Ran {
                params: values(&engine.consolidated_model()?.module),
                losses,
                steps: engine.steps(),
            })
        })
        .unwrap()
}

#[test]
fn learner_at_stages_0_to_2_equals_the_engine_loop_bit_for_bit() {
    let tmp = dir("stages");
    let root = tmp.path().to_path_buf();
    let mut first: Option<Vec<Vec<u32>>> = None;
    for stage in 0..=2u8 {
        let learned = with_learner(stage, &root.join(format!("s{stage}")));
        let oracle = with_engine(stage);
        for (rank, (l, o)) in learned.iter().zip(&oracle).enumerate() {
            assert_eq!(
                l.steps,
                (EPOCHS * STEPS) as u64,
                "stage {stage} rank {rank}"
            );
            assert_eq!(
                bits(&l.params),
                bits(&o.params),
                "stage {stage} rank {rank}: burn-train's weights differ from the engine loop's"
            );
            // burn-train's loss metric, read back from its log: one entry per step, the rank's
            // own batch loss (f32 widened, as the engine's).
            assert_eq!(l.losses.len(), o.losses.len(), "stage {stage} rank {rank}");
            for (s, (a, b)) in l.losses.iter().zip(&o.losses).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs(),
                    "stage {stage} rank {rank} step {s}: logged loss {a}, engine {b}"
                );
            }
        }
        assert!(
            learned[0].losses.last() < learned[0].losses.first(),
            "the loss fell: {:?}",
            learned[0].losses
        );
        // Bit-identical across stages too (the engine's invariant, through burn-train).
        let b = bits(&learned[0].params);
        match &first {
            None => first = Some(b),
            Some(f) => assert_eq!(f, &b, "stage {stage} differs from stage 0"),
        }
        // burn's model checkpointer wrote each epoch's full model.
        for epoch in 1..=EPOCHS {
            let file = root.join(format!("s{stage}/rank0/checkpoint/model-{epoch}.bpk"));
            assert!(file.is_file(), "no {}", file.display());
        }
    }
}

/// Stage 3, fp16 and accumulation in the plan are refused when the adapter is built, naming
/// the option, before any step.
#[test]
fn stage_3_fp16_and_accumulation_are_refused_up_front() {
    let cases = [
        (ZeroConfig { stage: 3, ..cfg(0) }, "stage"),
        (
            ZeroConfig {
                precision: Precision::Fp16,
                ..cfg(1)
            },
            "precision",
        ),
        (
            ZeroConfig {
                gradient_accumulation_steps: 2,
                ..cfg(2)
            },
            "gradient_accumulation_steps",
        ),
    ];
    for (cfg, want) in cases {
        let got = Launch::new(Topology::new(1, 1).unwrap())
            .run_with(&whole(), |comm, model| {
                let engine = ZeroEngine::builder(comm, model)
                    .config(cfg.clone())
                    .build()?;
                Ok(Sharded::new(engine).err())
            })
            .unwrap();
        match &got[0] {
            Some(Error::Invalid { field, .. }) => assert_eq!(*field, want),
            other => panic!("{want}: {other:?}"),
        }
    }
}

/// A record loaded into burn-train's model (what a `SupervisedTraining::checkpoint` resume does,
/// through `Module::map`) never reaches the engine, which holds the weights: the next optimizer
/// step refuses with a message naming the cause, instead of silently overwriting the load.
#[test]
fn a_record_loaded_behind_the_engine_s_back_is_refused_at_the_next_step() {
    let all = points(N * B);
    let got = Launch::new(Topology::new(1, 1).unwrap())
        .run_with(&whole(), |comm, model| {
            let engine = ZeroEngine::builder(comm, model).config(cfg(1)).build()?;
            let sharded = Sharded::new(engine)?;
            let batch = loader(&all).iter().next().unwrap().unwrap();
            let grads = TrainStep::step(&sharded, batch.clone()).grads;
            let record = sharded.clone().into_record();
            let loaded = sharded.clone().load_record(record);
            let mut unused: burn::optim::ModuleOptimizer = burn::optim::SgdConfig::new().init();
            let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                TrainStep::optimize(loaded, &mut unused, LR.into(), grads)
            }));
            let why = match refused {
                Ok(_) => String::from("no refusal"),
                Err(p) => p
                    .downcast_ref::<String>()
                    .cloned()
                    .unwrap_or_else(|| "a panic without a message".into()),
            };
            // The unmapped model still steps.
            let grads = TrainStep::step(&sharded, batch).grads;
            let stepped = TrainStep::optimize(sharded, &mut unused, LR.into(), grads);
            Ok((why, stepped.last_step().is_some()))
        })
        .unwrap();
    let (why, stepped) = &got[0];
    assert!(why.contains("Module::map"), "{why}");
    assert!(*stepped, "the unmapped model stepped");
}

/// A real schedule (a linear warm-up over the first 5 steps, then constant), in fp32 at stage 2
/// and in bf16 at stage 1: burn-train's weights equal the engine loop's stepped at the same
/// per-step rates, bit for bit.
#[test]
fn a_warm_up_schedule_and_bf16_under_the_learner_equal_the_engine_loop() {
    let tmp = dir("schedule");
    let root = tmp.path().to_path_buf();
    let warm_up = || {
        LinearLrSchedulerConfig::new(LR / 10.0, LR, 5)
            .init()
            .expect("a valid schedule")
    };
    for (stage, precision) in [(2u8, Precision::Fp32), (1, Precision::Bf16)] {
        let learned = with_learner_at(stage, &root.join(format!("s{stage}")), precision, warm_up);
        let oracle = with_engine_at(stage, precision, warm_up);
        for (rank, (l, o)) in learned.iter().zip(&oracle).enumerate() {
            assert_eq!(
                bits(&l.params),
                bits(&o.params),
                "stage {stage} {precision:?} rank {rank}: the learner's weights differ"
            );
        }
        let constant = with_engine_at(stage, precision, || LR.into());
        assert_ne!(
            bits(&oracle[0].params),
            bits(&constant[0].params),
            "the warm-up changed the steps"
        );
    }
}

/// burn's per-group learning rates would step some parameters at another rate than the engine's
/// one: refused, naming the parameter; one rate for all (a plain schedule) passes.
#[test]
fn per_group_learning_rates_are_refused_naming_a_parameter() {
    let model = whole().module;
    let path = zero_burn::parameters(&model)[0].path.clone();
    let one: ModuleLearningRate = ModuleLrScheduler::new(ConstantLr::new(1e-3)).step();
    assert_eq!(single_learning_rate(&model, &one).unwrap(), 1e-3);
    let grouped = ModuleLrScheduler::new(ConstantLr::new(1e-3))
        .with_group(ParamGroup::from_path(path.clone()), ConstantLr::new(1e-2))
        .step();
    let e = single_learning_rate(&model, &grouped)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("`{path}`")) && e.contains("one learning rate"),
        "{e}"
    );
}
