//! Two more model families through the public API alone: (a) a segmented MLP classifier whose
//! batches come from a burn `DataLoader`, (b) a plain residual MLP through the single-segment
//! adapter [`Whole`]. Each runs at stages 0–3 with hpZ on and off: bit-identical across all of
//! them, traffic and model-state bytes equal to the plan. Family (a) is also checked against plain
//! burn (burn's own SGD and AdamW on the same global batch, one process, no zero-rs code), and so
//! is the gradient norm that clipping reports. A parameter that no gradient reaches in a step is
//! checked against plain burn in `families/unused.rs`.

use crate::common;
mod reads;
mod unused;

use std::time::Duration;

use burn::data::dataloader::DataLoader;
use burn::data::dataloader::batcher::Batcher;
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use zero_burn::demo::gpt::deterministic_init;
use zero_burn::{
    Launch, Optimizer, RankReport, SegmentOut, Segmented, StepOutput, Whole, ZeroEngine,
};
use zero_core::{Topology, ZeroConfig};

use common::assert_traffic_as_planned;
use common::points::{
    B, CLASSES, FEATURES, PointBatch, PointBatcher, ResMlp, adamw_pair, assert_near_burn, bits,
    cross_entropy, loader, points, values,
};

/// Rank `rank`'s micro-batches of every step: loader batch `(s·A + m)·N + rank`.
fn rank_batches(
    loader: &dyn DataLoader<PointBatch>,
    rank: usize,
    n: usize,
    a: usize,
) -> Vec<Vec<PointBatch>> {
    let mine: Vec<PointBatch> = loader
        .iter()
        .enumerate()
        .filter(|(k, _)| k % n == rank)
        .map(|(_, b)| b.expect("the in-memory dataset never fails"))
        .collect();
    mine.chunks_exact(a).map(<[PointBatch]>::to_vec).collect()
}

/// Family (a): three segments (two hidden layers, then the head with the loss).
#[derive(Module, Debug)]
struct Mlp {
    l1: Linear,
    l2: Linear,
    head: Linear,
}

impl Mlp {
    /// Deterministic weights (burn's initialisers draw from a global RNG), so every run of the
    /// suite trains the same model.
    fn new(device: &Device) -> Self {
        deterministic_init(
            Mlp {
                l1: LinearConfig::new(FEATURES, 16).init(device),
                l2: LinearConfig::new(16, 16).init(device),
                head: LinearConfig::new(16, CLASSES).init(device),
            },
            7,
        )
    }

    /// The plain forward: what the oracle trains with burn alone.
    fn loss(&self, batch: &PointBatch) -> Tensor<1> {
        let h = relu(self.l2.forward(relu(self.l1.forward(batch.x.clone()))));
        cross_entropy(self.head.forward(h), batch.y.clone())
    }
}

impl Segmented for Mlp {
    type Batch = PointBatch;
    type Act = Tensor<2>;
    /// The logits, for an accuracy.
    type Output = Tensor<2>;

    fn num_segments(&self) -> usize {
        3
    }

    fn visit_segment<V: ModuleVisitor>(&self, i: usize, visitor: &mut V) {
        match i {
            0 => self.l1.visit(visitor),
            1 => self.l2.visit(visitor),
            _ => self.head.visit(visitor),
        }
    }

    fn forward_segment(
        &self,
        i: usize,
        batch: &PointBatch,
        x: Option<Tensor<2>>,
    ) -> SegmentOut<Tensor<2>, Tensor<2>> {
        match (i, x) {
            (0, _) => SegmentOut::Next(relu(self.l1.forward(batch.x.clone()))),
            (1, Some(x)) => SegmentOut::Next(relu(self.l2.forward(x))),
            (_, Some(x)) => {
                let logits = self.head.forward(x);
                SegmentOut::LossAnd(cross_entropy(logits.clone(), batch.y.clone()), logits)
            }
            (_, None) => unreachable!("the engine hands segments after the first their input"),
        }
    }
}

/// What one rank saw: its losses per step, the consolidated model's values, its report.
struct Seen {
    losses: Vec<f32>,
    params: Vec<Vec<f32>>,
    report: RankReport,
}

const STEPS: usize = 8;

/// Trains `model` with `cfg` on `topo` for `steps`, every rank reading the shared loader.
fn train<M: Segmented<Batch = PointBatch>>(
    model: &M,
    topo: Topology,
    cfg: &ZeroConfig,
    optimizer: Optimizer,
    lr: f32,
    steps: usize,
) -> Vec<Seen> {
    let n = topo.world_size();
    let a = cfg.gradient_accumulation_steps as usize;
    let items = points(steps * n * a * B);
    let loader = loader(&items);
    Launch::new(topo)
        .timeout(Duration::from_secs(60))
        .run_with(model, |comm, model| {
            let (rank, mut engine) = common::rank_engine(comm, model, cfg, Some(optimizer))?;
            let mut losses = Vec::new();
            for batches in rank_batches(loader.as_ref(), rank, n, a) {
                let out: StepOutput = engine.step(lr, &batches)?;
                losses.push(out.loss);
            }
            let report = engine.report();
            let params = values(&engine.consolidated_model()?);
            Ok(Seen {
                losses,
                params,
                report,
            })
        })
        .unwrap()
}

fn topo() -> Topology {
    Topology::new(4, 2).unwrap()
}

/// Stages 0–3 (stage 3 with hpZ off and on, and with persistence of small tensors),
/// accumulation 2, with and without activation checkpointing: identical bits on every rank and
/// every stage for each choice, traffic and model-state bytes as planned.
fn stages_are_bit_identical<M: Segmented<Batch = PointBatch>>(model: &M, family: &str) {
    for ckpt in [true, false] {
        stages_agree(model, family, ckpt);
    }
}

/// [`stages_are_bit_identical`] with one activation-checkpointing choice for every stage (hpZ
/// needs it).
fn stages_agree<M: Segmented<Batch = PointBatch>>(model: &M, family: &str, ckpt: bool) {
    let mut reference: Option<(Vec<u32>, Vec<Vec<u32>>)> = None;
    let hpz = if ckpt { 2 } else { 1 };
    for (stage, hpz) in [(0u8, 1usize), (1, 1), (2, 1), (3, 1), (3, hpz)] {
        let cfg = ZeroConfig {
            stage,
            hpz_partition_size: hpz,
            gradient_accumulation_steps: 2,
            param_persistence_threshold: 20,
            checkpoint_activations: Some(ckpt),
            ..Default::default()
        };
        let seen = train(model, topo(), &cfg, Optimizer::default(), 3e-2, STEPS);
        for s in &seen {
            let r = &s.report;
            assert_eq!(r.steps, STEPS as u64);
            assert_traffic_as_planned(&format!("{family} stage {stage} hpz {hpz}"), r);
            assert!(
                r.model_states_match_plan(),
                "{family} stage {stage} hpz {hpz} rank {}: {:?} vs {:?}",
                r.rank,
                r.memory,
                r.planned_memory
            );
            if hpz > 1 {
                assert!(r.memory.hpz_secondary > 0, "{family}: hpZ held a secondary");
            }
        }
        let losses: Vec<u32> = seen[0].losses.iter().map(|l| l.to_bits()).collect();
        let params = bits(&seen[0].params);
        for s in &seen[1..] {
            assert_eq!(
                bits(&s.params),
                params,
                "{family}: ranks agree on the model"
            );
        }
        match &reference {
            None => reference = Some((losses, params)),
            Some((l, p)) => {
                assert_eq!(&losses, l, "{family} stage {stage} hpz {hpz}: losses");
                assert_eq!(&params, p, "{family} stage {stage} hpz {hpz}: parameters");
            }
        }
    }
    // The run trained: the loss fell and the weights moved.
    let (l, p) = reference.expect("ran");
    let first = f32::from_bits(l[0]);
    let last = f32::from_bits(*l.last().expect("steps"));
    assert!(last < first, "{family}: loss {first} -> {last}");
    assert_ne!(p, bits(&values(model)), "{family}: the weights moved");
}

#[test]
fn family_a_segmented_mlp_is_bit_identical_across_stages() {
    stages_are_bit_identical(&Mlp::new(&Device::flex().autodiff()), "mlp");
}

#[test]
fn family_b_any_module_through_whole_is_bit_identical_across_stages() {
    let model = Whole::new(
        ResMlp::new(&Device::flex().autodiff()),
        |m: &ResMlp, b: &PointBatch| cross_entropy(m.forward(b.x.clone()), b.y.clone()),
    );
    stages_are_bit_identical(&model, "resmlp");
}

/// Plain burn on one process: the global batch of each step (all `N·A·B` points, in loader
/// order) through `Mlp::loss`, burn's backward and burn's optimizer.
fn plain_burn(
    model: Mlp,
    optim: &mut burn::optim::ModuleOptimizer,
    lr: f64,
    steps: usize,
    per_step: usize,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let items = points(steps * per_step);
    let mut model = model;
    let mut losses = Vec::new();
    for s in 0..steps {
        let batch = PointBatcher.batch(
            items[s * per_step..(s + 1) * per_step].to_vec(),
            &Device::flex(),
        );
        let loss = model.loss(&batch);
        losses.push(
            loss.clone()
                .into_data()
                .try_into_vec_as::<f32>()
                .expect("f32")[0],
        );
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(lr, model, grads);
    }
    (losses, values(&model))
}

const ORACLE_STEPS: usize = 20;

fn against_plain_burn(
    optimizer: Optimizer,
    burn_optim: &mut dyn FnMut() -> burn::optim::ModuleOptimizer,
    tol: f32,
) {
    let model = Mlp::new(&Device::flex().autodiff());
    let topo = Topology::new(2, 1).unwrap();
    let a = 2usize;
    let (want_losses, want_params) = plain_burn(
        model.clone(),
        &mut burn_optim(),
        1e-2,
        ORACLE_STEPS,
        2 * a * B,
    );
    for stage in 0..=3u8 {
        let cfg = ZeroConfig {
            stage,
            gradient_accumulation_steps: a as u32,
            ..Default::default()
        };
        let seen = train(&model, topo, &cfg, optimizer, 1e-2, ORACLE_STEPS);
        // The global loss of a step: the mean of the two ranks' means (equal micro-batches).
        let losses: Vec<f32> = (0..ORACLE_STEPS)
            .map(|s| (seen[0].losses[s] + seen[1].losses[s]) / 2.0)
            .collect();
        assert_near_burn(
            &format!("{optimizer:?} stage {stage}"),
            (&losses, &seen[0].params),
            (&want_losses, &want_params),
            tol,
        );
    }
}

#[test]
fn family_a_sgd_matches_plain_burn() {
    against_plain_burn(
        Optimizer::Sgd { momentum: 0.0 },
        &mut || SgdConfig::new().init(),
        1e-6,
    );
}

#[test]
fn family_a_adamw_matches_plain_burn() {
    let (ours, burns) = adamw_pair(0.01);
    against_plain_burn(ours, &mut || burns.clone(), 1e-4);
}

/// `eval` is a forward pass with the current weights: at stage 3 with hpZ it gives the loss the
/// next step's forward computes, bit for bit, changes no weight, and its gathers are booked apart
/// from the plan's training traffic.
#[test]
fn eval_is_the_forward_of_the_next_step() {
    let model = Mlp::new(&Device::flex().autodiff());
    let topo = topo();
    let n = topo.world_size();
    let items = points(3 * n * B);
    let loader = loader(&items);
    let cfg = ZeroConfig {
        stage: 3,
        hpz_partition_size: 2,
        param_persistence_threshold: 20,
        ..Default::default()
    };
    Launch::new(topo)
        .run_with(&model, |comm, model| {
            let (rank, mut engine) = common::rank_engine(comm, model, &cfg, None)?;
            for batches in rank_batches(loader.as_ref(), rank, n, 1) {
                let before = values(&engine.consolidated_model()?);
                let eval = engine.eval(&batches[0])?;
                assert_eq!(
                    before,
                    values(&engine.consolidated_model()?),
                    "eval changed weights"
                );
                let out = engine.step(1e-2, &batches)?;
                assert_eq!(eval.to_bits(), out.loss.to_bits(), "rank {rank}");
            }
            let r = engine.report();
            assert_traffic_as_planned("eval then step", &r);
            assert!(
                r.other_traffic.sent().total() > 0,
                "eval and consolidation moved bytes"
            );
            Ok(())
        })
        .unwrap();
}

/// `eval_output` returns what the last segment returned besides the loss (the MLP's logits):
/// bit-identical at stages 0 and 3 (hpZ on), equal to the plain forward of the consolidated
/// model, with the loss `eval` gives.
#[test]
fn eval_output_returns_the_last_segment_s_output_at_every_stage() {
    let model = Mlp::new(&Device::flex().autodiff());
    let topo = topo();
    let n = topo.world_size();
    let items = points(2 * n * B);
    let loader = loader(&items);
    let mut per_stage = Vec::new();
    for (stage, hpz) in [(0u8, 1usize), (3, 2)] {
        let cfg = ZeroConfig {
            stage,
            hpz_partition_size: hpz,
            ..Default::default()
        };
        let out = Launch::new(topo)
            .run_with(&model, |comm, model| {
                let (rank, mut engine) = common::rank_engine(comm, model, &cfg, None)?;
                let batches = rank_batches(loader.as_ref(), rank, n, 1);
                engine.step(1e-2, &batches[0])?;
                let b = &batches[1][0];
                let (loss, logits) = engine.eval_output(b)?;
                let logits = logits.expect("the MLP returns its logits");
                assert_eq!(logits.dims(), [B, CLASSES]);
                assert_eq!(loss.to_bits(), engine.eval(b)?.to_bits());
                let m = engine.consolidated_model()?.valid();
                let plain = m
                    .head
                    .forward(relu(m.l2.forward(relu(m.l1.forward(b.x.clone())))));
                let got = logits.into_data().try_into_vec_as::<f32>().unwrap();
                let want = plain.into_data().try_into_vec_as::<f32>().unwrap();
                assert_eq!(
                    bits(std::slice::from_ref(&got)),
                    bits(&[want]),
                    "rank {rank}, stage {stage}"
                );
                Ok(got)
            })
            .unwrap();
        per_stage.push(out);
    }
    assert_eq!(
        bits(&per_stage[0]),
        bits(&per_stage[1]),
        "stage 0 and stage 3 logits differ"
    );
}

/// A model whose segments miss a parameter, or visit one twice, is refused at `build` with the
/// parameter named.
#[test]
fn segments_must_cover_every_parameter() {
    #[derive(Module, Debug)]
    struct Bad {
        a: Linear,
        b: Linear,
        #[module(skip)]
        twice: bool,
    }
    impl Segmented for Bad {
        type Batch = PointBatch;
        type Act = Tensor<2>;
        type Output = ();
        fn num_segments(&self) -> usize {
            2
        }
        fn visit_segment<V: ModuleVisitor>(&self, i: usize, visitor: &mut V) {
            match (i, self.twice) {
                (0, _) => self.a.visit(visitor),
                (_, true) => self.a.visit(visitor),
                (_, false) => {}
            }
        }
        fn forward_segment(
            &self,
            i: usize,
            b: &PointBatch,
            x: Option<Tensor<2>>,
        ) -> SegmentOut<Tensor<2>> {
            match x {
                None => SegmentOut::Next(self.a.forward(b.x.clone())),
                Some(x) if i == 1 => {
                    SegmentOut::Loss(cross_entropy(self.b.forward(x), b.y.clone()))
                }
                Some(x) => SegmentOut::Next(x),
            }
        }
    }
    let device = Device::flex().autodiff();
    // Segment 1 visits `a` (a parameter may be visited by several segments) or nothing: either
    // way no segment visits `b`.
    for twice in [false, true] {
        let model = Bad {
            a: LinearConfig::new(FEATURES, 4).init(&device),
            b: LinearConfig::new(4, CLASSES).init(&device),
            twice,
        };
        let err = Launch::new(Topology::single_node(1).unwrap())
            .run_with(&model, |comm, model| {
                ZeroEngine::builder(comm, model).build().map(|_| ())
            })
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err.root_cause(), zero_burn::Error::Segmentation { .. }),
            "{msg}"
        );
        assert!(msg.contains("visited by none"), "{msg}");
        assert!(msg.contains("`b.weight`"), "{msg}");
    }
}

/// The global gradient norm that clipping reports (`StepInfo::grad_norm`) against an oracle
/// outside the engine: plain burn's backward of the same first global batch through the same
/// initial model, the L2 norm of every parameter's gradient summed in f64. Every stage, clipping
/// at a threshold it exceeds.
#[test]
fn the_clipping_norm_equals_plain_burn_s_gradient_norm() {
    struct SumSq<'a> {
        grads: &'a GradientsParams,
        sum: f64,
    }
    impl ModuleVisitor for SumSq<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(p.id) {
                let v = g.into_data().try_into_vec_as::<f32>().expect("f32");
                self.sum += v.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>();
            }
        }
    }
    let model = Mlp::new(&Device::flex().autodiff());
    let topo = Topology::new(2, 1).unwrap();
    let a = 2usize;
    // Plain burn: the first global batch (all N·A·B points, loader order), one backward.
    let items = points(2 * a * B);
    let batch = PointBatcher.batch(items.clone(), &Device::flex());
    let grads = GradientsParams::from_grads(model.loss(&batch).backward(), &model);
    let mut sq = SumSq {
        grads: &grads,
        sum: 0.0,
    };
    model.visit(&mut sq);
    let want = sq.sum.sqrt();
    for stage in 0..=3u8 {
        let cfg = ZeroConfig {
            stage,
            gradient_accumulation_steps: a as u32,
            gradient_clipping: want / 4.0,
            ..Default::default()
        };
        let loader = loader(&items);
        let norms = Launch::new(topo)
            .timeout(Duration::from_secs(60))
            .run_with(&model, |comm, model| {
                let rank = zero_comm::Communicator::rank(&comm);
                let mut engine = ZeroEngine::builder(comm, model)
                    .config(cfg.clone())
                    .optimizer(Optimizer::Sgd { momentum: 0.0 })
                    .build()?;
                let batches = rank_batches(loader.as_ref(), rank, 2, a).remove(0);
                Ok(engine.step(1e-2, &batches)?.info.grad_norm)
            })
            .unwrap();
        for (rank, got) in norms.into_iter().enumerate() {
            let got = f64::from(got.expect("clipping reports the norm"));
            let gap = (got - want).abs() / want;
            eprintln!("stage {stage} rank {rank}: norm {got} vs plain burn {want} (gap {gap:e})");
            assert!(gap < 1e-6, "stage {stage} rank {rank}: {got} vs {want}");
        }
    }
}

/// `step_grads`, the optimizer step from gradients the caller computed (what burn-train's
/// `Learner` drives): the residual MLP's own backward handed in gives the bits `step` gives at
/// stages 0–2 on 2 ranks; non-finite gradients are `Diverged`, naming the rank.
#[test]
fn step_grads_equals_step_and_refuses_non_finite_gradients() {
    let model = Whole::new(
        ResMlp::new(&Device::flex().autodiff()),
        |m: &ResMlp, b: &PointBatch| cross_entropy(m.forward(b.x.clone()), b.y.clone()),
    );
    let items = points(4 * 2 * B);
    let data = loader(&items);
    for stage in 0..=2u8 {
        let cfg = ZeroConfig {
            stage,
            ..Default::default()
        };
        let run = |external: bool| {
            Launch::new(Topology::new(2, 2).unwrap())
                .timeout(Duration::from_secs(60))
                .run_with(&model, |comm, model| {
                    let (rank, mut e) = common::rank_engine(comm, model, &cfg, None)?;
                    for b in data.iter().skip(rank).step_by(2) {
                        let b = b.expect("in-memory data");
                        if external {
                            let m = &e.model().module;
                            let loss = cross_entropy(m.forward(b.x.clone()), b.y.clone());
                            let grads = GradientsParams::from_grads(loss.backward(), m);
                            e.step_grads(1e-2, &grads)?;
                        } else {
                            e.step(1e-2, &[b])?;
                        }
                    }
                    Ok(bits(&values(&e.consolidated_model()?)))
                })
                .unwrap()
        };
        assert_eq!(run(true), run(false), "stage {stage}");
    }
    let err = Launch::new(Topology::new(1, 1).unwrap())
        .run_with(&model, |comm, model| {
            let mut e = ZeroEngine::builder(comm, model).build()?;
            let b = data.iter().next().unwrap().unwrap();
            let m = &e.model().module;
            let loss = cross_entropy(m.forward(b.x.clone()), b.y.clone()).mul_scalar(f32::NAN);
            let grads = GradientsParams::from_grads(loss.backward(), m);
            Ok(e.step_grads(1e-2, &grads).err())
        })
        .unwrap();
    assert!(
        matches!(&err[0], Some(zero_burn::Error::Diverged { rank: 0, what, .. }) if what.contains("not finite")),
        "{:?}",
        err[0]
    );
}
