//! Who reads what: a small language model whose segments share or freeze parameters, against
//! plain burn in one process (the oracle: the whole global batch of each step through the
//! segments chained, burn's backward, burn's own SGD or AdamW).
//!
//! - **Tied head**: the output layer reuses the token embedding (`logits = norm(h)·Eᵀ`), which
//!   segment 0 owns and segment 2 reads too; as segments and as one `Whole`.
//! - **Middle read**: segment 1 adds the token embedding again (a value embedding).
//! - **Frozen**: the first segment, the middle one, or everything but the head.
//!
//! Each runs at stages 0–3 (stage 3 with `param_persistence_threshold` 0 and at its default), with
//! activation checkpointing on and off, on 2 and 4 ranks, with SGD and AdamW: every run of one
//! world size and optimizer gives the same bits (so checkpointing on gives the bits of
//! checkpointing off), within float rounding of plain burn, with traffic, model-state bytes and
//! the stage-3 gathered working set as the plan books them.

use std::time::Duration;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use zero_burn::checkpoint::{MemStorage, read_manifest};
use zero_burn::demo::gpt::deterministic_init;
use zero_burn::{Launch, Optimizer, RankReport, SegmentOut, Segmented, Whole, ZeroEngine};
use zero_core::{Topology, ZeroConfig};

use crate::common::points::{adamw_pair, assert_near_burn, bits, cross_entropy, values};

/// Vocabulary, width, sequence length, sequences per micro-batch, micro-steps, steps.
const V: usize = 11;
const D: usize = 6;
const T: usize = 4;
const B: usize = 3;
const A: usize = 2;
const STEPS: usize = 8;

/// Which parameters each segment reads, and which are frozen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Layout {
    /// The head reads the token embedding (no head of its own).
    #[default]
    TiedHead,
    /// The middle segment adds the token embedding again; the head is its own.
    MiddleRead,
    /// Nothing shared; `frozen` segments take no gradient.
    Untied { frozen: [bool; 3] },
    /// The head reads the token embedding without its segment visiting it: a mistake.
    Undeclared,
}

/// Token and position embeddings (segment 0), a residual block (segment 1), a norm and the head
/// with the loss (segment 2).
#[derive(Module, Debug)]
pub(crate) struct Lm {
    emb: Embedding,
    pos: Param<Tensor<2>>,
    block: Linear,
    norm: LayerNorm,
    head: Option<Linear>,
    #[module(skip)]
    layout: Layout,
}

/// A micro-batch: `[B, T]` tokens and their `[B·T]` targets.
#[derive(Clone, Debug)]
pub(crate) struct Toks {
    x: Tensor<2, Int>,
    y: Tensor<1, Int>,
}

/// Global micro-batches `ks` in one batch: each token a hash of its place, its target a fixed
/// function of it (learnable).
pub(crate) fn toks(ks: std::ops::Range<usize>) -> Toks {
    let n = ks.len() * B;
    let x: Vec<i64> = ks
        .flat_map(|k| (0..B * T).map(move |j| (k * B * T + j) as u64))
        .map(|h| (h.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 33) as i64 % V as i64)
        .collect();
    let y: Vec<i64> = x.iter().map(|t| (3 * t + 1) % V as i64).collect();
    let device = Device::flex();
    Toks {
        x: Tensor::from_data(TensorData::new(x, [n, T]), &device),
        y: Tensor::from_data(TensorData::new(y, [n * T]), &device),
    }
}

impl Lm {
    pub(crate) fn new(layout: Layout) -> Self {
        let device = Device::flex().autodiff();
        let pos = Tensor::<2>::zeros([T, D], &device).require_grad();
        let lm = Lm {
            emb: EmbeddingConfig::new(V, D).init(&device),
            pos: Param::from_tensor(pos),
            block: LinearConfig::new(D, D).init(&device),
            norm: LayerNormConfig::new(D).init(&device),
            head: (!matches!(layout, Layout::TiedHead | Layout::Undeclared))
                .then(|| LinearConfig::new(D, V).init(&device)),
            layout,
        };
        let mut lm = deterministic_init(lm, 5);
        if let Layout::Untied { frozen } = layout {
            if frozen[0] {
                lm.emb = lm.emb.no_grad();
                lm.pos = lm.pos.set_require_grad(false);
            }
            if frozen[1] {
                lm.block = lm.block.no_grad();
            }
            if frozen[2] {
                lm.norm = lm.norm.no_grad();
            }
        }
        lm
    }

    /// The mean loss of `b` through the segments chained.
    pub(crate) fn loss(&self, b: &Toks) -> Tensor<1> {
        let mut x = None;
        for i in 0..self.num_segments() {
            match self.forward_segment(i, b, x.take()) {
                SegmentOut::Next(y) => x = Some(y),
                SegmentOut::Loss(l) | SegmentOut::LossAnd(l, ()) => return l,
            }
        }
        unreachable!("the last segment returns the loss")
    }
}

impl Segmented for Lm {
    type Batch = Toks;
    type Act = Tensor<3>;
    type Output = ();

    fn num_segments(&self) -> usize {
        3
    }

    fn visit_segment<V2: ModuleVisitor>(&self, i: usize, v: &mut V2) {
        match i {
            0 => {
                self.emb.visit(v);
                self.pos.visit(v);
            }
            1 => {
                self.block.visit(v);
                if self.layout == Layout::MiddleRead {
                    self.emb.visit(v);
                }
            }
            _ => {
                self.norm.visit(v);
                self.head.visit(v);
                if self.layout == Layout::TiedHead {
                    self.emb.visit(v);
                }
            }
        }
    }

    fn forward_segment(&self, i: usize, b: &Toks, x: Option<Tensor<3>>) -> SegmentOut<Tensor<3>> {
        let device = self.pos.val().device();
        let tokens = b.x.clone().to_device(&device);
        match (i, x) {
            (0, None) => {
                SegmentOut::Next(self.emb.forward(tokens) + self.pos.val().unsqueeze_dim(0))
            }
            (1, Some(h)) => {
                let mut h = h.clone() + self.block.forward(h).tanh();
                if self.layout == Layout::MiddleRead {
                    h = h + self.emb.forward(tokens);
                }
                SegmentOut::Next(h)
            }
            (_, Some(h)) => {
                let [n, t, d] = h.dims();
                let h = self.norm.forward(h).reshape([n * t, d]);
                let logits = match &self.head {
                    Some(head) => head.forward(h),
                    None => h.matmul(self.emb.weight.val().transpose()),
                };
                SegmentOut::Loss(cross_entropy(logits, b.y.clone().to_device(&device)))
            }
            (i, x) => panic!("segment {i} with input {}", x.is_some()),
        }
    }
}

/// What a run saw: each step's loss (the mean over ranks), rank 0's consolidated parameters, and
/// every rank's report.
pub(crate) struct Run {
    losses: Vec<f32>,
    params: Vec<Vec<f32>>,
    reports: Vec<RankReport>,
}

/// `model` trained by the engine on `n` ranks with `cfg`: rank `r`'s micro-batch `m` of step
/// `s` is global micro-batch `(s·A + m)·n + r`.
pub(crate) fn engine<M: Segmented<Batch = Toks>>(
    model: &M,
    n: usize,
    cfg: &ZeroConfig,
    optimizer: Optimizer,
    lr: f32,
) -> zero_burn::Result<Run> {
    let cfg = ZeroConfig {
        gradient_accumulation_steps: A as u32,
        ..cfg.clone()
    };
    let ranks = Launch::new(Topology::single_node(n).unwrap())
        .timeout(Duration::from_secs(60))
        .run_with(model, |comm, model| {
            let (rank, mut engine) =
                crate::common::rank_engine(comm, model, &cfg, Some(optimizer))?;
            let mut losses = Vec::new();
            for s in 0..STEPS {
                let batches: Vec<Toks> = (0..A)
                    .map(|m| {
                        let k = (s * A + m) * n + rank;
                        toks(k..k + 1)
                    })
                    .collect();
                losses.push(engine.step(lr, &batches)?.loss);
            }
            Ok((
                losses,
                values(&engine.consolidated_model()?),
                engine.report(),
            ))
        })?;
    let losses = (0..STEPS)
        .map(|s| ranks.iter().map(|r| r.0[s]).sum::<f32>() / n as f32)
        .collect();
    Ok(Run {
        losses,
        params: ranks[0].1.clone(),
        reports: ranks.into_iter().map(|r| r.2).collect(),
    })
}

/// Plain burn: step `s` trains on global micro-batches `s·A·n ..` in one batch.
fn plain_burn(
    model: &Lm,
    n: usize,
    optim: &mut ModuleOptimizer,
    lr: f32,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let mut model = zero_burn::deep_copy(model);
    let mut losses = Vec::new();
    for s in 0..STEPS {
        let loss = model.loss(&toks(s * A * n..(s + 1) * A * n));
        losses.push(loss.clone().into_data().try_to_vec::<f32>().unwrap()[0]);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(f64::from(lr), model, grads);
    }
    (losses, values(&model))
}

/// The optimizers, each with its plain-burn twin, learning rate and tolerance against plain burn
/// (relative, per tensor: see `rel_gap`). The engine and plain burn sum the same gradients in a
/// different order (a backward per micro-batch and a mean over ranks, against one backward of the
/// global batch), and AdamW's weight decay is rounded differently (see `adamw_pair`): 6.4e-6 is
/// the largest gap measured over every configuration, where a reader's dropped gradient moves
/// the losses by 0.3.
fn optimizers() -> Vec<(Optimizer, ModuleOptimizer, f32, f32)> {
    let (ours, burns) = adamw_pair(0.01);
    vec![
        (
            Optimizer::Sgd { momentum: 0.0 },
            SgdConfig::new().init(),
            0.2,
            5e-5,
        ),
        (ours, burns, 2e-2, 1e-4),
    ]
}

/// Stages 0–2, stage 3 with persistence 0 and at its default, each with checkpointing on and
/// off.
fn configs() -> Vec<ZeroConfig> {
    let mut out = Vec::new();
    for (stage, threshold) in [(0u8, None), (1, None), (2, None), (3, Some(0)), (3, None)] {
        for ckpt in [true, false] {
            let mut c = ZeroConfig {
                stage,
                checkpoint_activations: Some(ckpt),
                ..Default::default()
            };
            if let Some(t) = threshold {
                c.param_persistence_threshold = t;
            }
            out.push(c);
        }
    }
    out
}

/// The whole matrix for `model`, whose oracle is `oracle` (the same model as plain burn sees it).
pub(crate) fn against_plain_burn<M: Segmented<Batch = Toks>>(what: &str, model: &M, oracle: &Lm) {
    let initial = bits(&values(model));
    for n in [2, 4] {
        for (optimizer, mut burns, lr, tol) in optimizers() {
            let (want_losses, want_params) = plain_burn(oracle, n, &mut burns, lr);
            assert!(
                want_losses[STEPS - 1] < want_losses[0],
                "{what}: plain burn learns: {want_losses:?}"
            );
            let mut reference: Option<(Vec<u32>, Vec<Vec<u32>>, String)> = None;
            for cfg in configs() {
                let label = format!(
                    "{what} N={n} {optimizer:?} stage {} threshold {} checkpointing {:?}",
                    cfg.stage, cfg.param_persistence_threshold, cfg.checkpoint_activations
                );
                let run = engine(model, n, &cfg, optimizer, lr)
                    .unwrap_or_else(|e| panic!("{label}: {e}"));
                for r in &run.reports {
                    assert!(r.traffic_matches_plan(), "{label} rank {}: traffic", r.rank);
                    assert!(
                        r.model_states_match_plan(),
                        "{label} rank {}: states",
                        r.rank
                    );
                    assert_eq!(
                        r.memory.gathered_working_set, r.planned_memory.gathered_working_set,
                        "{label} rank {}: gathered working set",
                        r.rank
                    );
                }
                assert_near_burn(
                    &label,
                    (&run.losses, &run.params),
                    (&want_losses, &want_params),
                    tol,
                );
                let got = (
                    run.losses.iter().map(|l| l.to_bits()).collect(),
                    bits(&run.params),
                    label,
                );
                match &reference {
                    None => reference = Some(got),
                    Some((l, p, first)) => {
                        assert_eq!(&got.0, l, "{}: losses differ from {first}", got.2);
                        assert_eq!(&got.1, p, "{}: parameters differ from {first}", got.2);
                    }
                }
            }
            let (_, params, _) = reference.expect("ran");
            assert_ne!(params, initial, "{what}: the weights moved");
        }
    }
}

/// The parameters' paths, in visit order, each once.
fn paths<M: Module>(model: &M) -> Vec<String> {
    zero_burn::parameters(model)
        .into_iter()
        .map(|p| p.path)
        .collect()
}

#[test]
fn a_head_tied_to_the_embedding_trains_as_plain_burn_in_every_configuration() {
    let lm = Lm::new(Layout::TiedHead);
    assert_eq!(
        paths(&lm),
        [
            "emb.weight",
            "pos",
            "block.weight",
            "block.bias",
            "norm.gamma",
            "norm.beta"
        ]
    );
    // The plan lists the shared parameter, owned by segment 0 and read by segment 2.
    let plan = zero_burn::plan_for(
        &lm,
        Topology::single_node(2).unwrap(),
        &ZeroConfig::default(),
    )
    .unwrap();
    let report = plan.report(0);
    assert_eq!(report.shared.len(), 1);
    assert_eq!(report.shared[0].name, "emb.weight");
    assert_eq!(report.shared[0].owner, "segment.0");
    assert_eq!(report.shared[0].readers, ["segment.2"]);
    assert!(
        report.to_string().contains("shared: `emb.weight`"),
        "{report}"
    );
    against_plain_burn("tied head", &lm, &lm);
}

#[test]
fn a_tied_head_as_one_whole_trains_as_plain_burn_in_every_configuration() {
    let lm = Lm::new(Layout::TiedHead);
    let whole = Whole::new(lm.clone(), |m: &Lm, b: &Toks| m.loss(b));
    against_plain_burn("tied head, whole", &whole, &lm);
}

#[test]
fn an_embedding_read_by_the_first_and_a_middle_segment_trains_as_plain_burn() {
    let lm = Lm::new(Layout::MiddleRead);
    against_plain_burn("middle read", &lm, &lm);
}

#[test]
fn a_frozen_first_segment_trains_as_plain_burn() {
    let lm = Lm::new(Layout::Untied {
        frozen: [true, false, false],
    });
    against_plain_burn("frozen first", &lm, &lm);
}

#[test]
fn a_frozen_middle_segment_trains_as_plain_burn() {
    let lm = Lm::new(Layout::Untied {
        frozen: [false, true, false],
    });
    against_plain_burn("frozen middle", &lm, &lm);
}

#[test]
fn a_model_frozen_but_its_head_trains_as_plain_burn() {
    let lm = Lm::new(Layout::Untied {
        frozen: [true, true, true],
    });
    against_plain_burn("frozen but the head", &lm, &lm);
}

/// Per rank: its micro-batch losses, and the parameters after the load and at the end, in bits.
type Leg = (Vec<u32>, Vec<Vec<u32>>, Vec<Vec<u32>>);

/// Trains `lm` on `n` ranks with `cfg` (`8 / n` micro-steps a step, the canonical tree: bits that
/// do not depend on `n`) over steps `from..to`, loading `load` first (resharding) and saving into
/// `save` after. Per rank: the losses, the consolidated parameters after the load and at the end.
fn leg(
    lm: &Lm,
    n: usize,
    stage: u8,
    (from, to): (usize, usize),
    load: Option<&MemStorage>,
    save: Option<&MemStorage>,
) -> Vec<Leg> {
    let a = 8 / n;
    let cfg = ZeroConfig {
        stage,
        param_persistence_threshold: 0,
        gradient_accumulation_steps: a as u32,
        accumulate_before_reduce: false,
        ..Default::default()
    };
    Launch::new(Topology::single_node(n).unwrap())
        .timeout(Duration::from_secs(60))
        .reduction(zero_burn::Reduction::CanonicalTree)
        .run_with(lm, |comm, model| {
            let rank = zero_comm::Communicator::rank(&comm);
            let mut e = ZeroEngine::builder(comm, model)
                .config(cfg.clone())
                .reduction(zero_burn::Reduction::CanonicalTree)
                .build()?;
            if let Some(s) = load {
                e.load_resharded(s)?;
            }
            let loaded = bits(&e.gather_all_params()?);
            let mut losses = Vec::new();
            for s in from..to {
                // Global micro-batch `m·n + rank` of step `s`, the tree's numbering.
                let batches: Vec<Toks> = (0..a)
                    .map(|m| {
                        let k = s * 8 + m * n + rank;
                        toks(k..k + 1)
                    })
                    .collect();
                let out = e.step(0.5, &batches)?;
                losses.extend(out.micro_losses.iter().map(|l| l.to_bits()));
            }
            if let Some(s) = save {
                e.save(s, serde_json::json!({}))?;
            }
            Ok((losses, loaded, bits(&e.gather_all_params()?)))
        })
        .unwrap()
}

/// A tied model saved at stage 3 on 2 ranks and resumed at stage 2 on 4: the shared parameter is
/// saved once, restored bit for bit, and the resumed run continues with the bits of a run that
/// never stopped.
#[test]
fn a_tied_model_saves_its_shared_parameter_once_and_resumes_bit_for_bit() {
    let lm = Lm::new(Layout::TiedHead);
    let straight = leg(&lm, 2, 3, (0, 4), None, None);
    let saved = MemStorage::new();
    let first = leg(&lm, 2, 3, (0, 2), None, Some(&saved));
    let (_, manifest) = read_manifest(&saved, None).unwrap();
    let names: Vec<&str> = manifest
        .layout
        .params
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(names, paths(&lm), "every parameter saved once");
    assert_eq!(manifest.layout.params[0].readers, ["segment.2"]);
    let resumed = leg(&lm, 4, 2, (2, 4), Some(&saved), None);
    for r in &resumed {
        assert_eq!(r.1, first[0].2, "restored bit for bit");
        assert_eq!(
            r.2, straight[0].2,
            "continued with the bits of the straight run"
        );
    }
    // The micro-batch losses of steps 2 and 3, in the tree's numbering, as the straight run had
    // them.
    let global = |ranks: &[Leg], n: usize, skip: usize| {
        let a = 8 / n;
        let mut out = Vec::new();
        for s in skip..ranks[0].0.len() / a {
            for m in 0..a {
                for r in ranks {
                    out.push(r.0[s * a + m]);
                }
            }
        }
        out
    };
    assert_eq!(global(&resumed, 4, 0), global(&straight, 2, 2));
    assert_ne!(straight[0].2, bits(&values(&lm)), "the weights moved");
}

/// A head that reads the token embedding without its segment visiting it: with checkpointing the
/// recompute's gradient for it, or at stage 3 its read of the released embedding, fails the step
/// naming the parameter, the segment that owns it and the one that read it.
#[test]
fn a_segment_that_reads_a_parameter_it_does_not_visit_fails_naming_both_segments() {
    let lm = Lm::new(Layout::Undeclared);
    for (stage, threshold, found) in [(1u8, 100_000u64, "gradient"), (3, 0, "released")] {
        let cfg = ZeroConfig {
            stage,
            param_persistence_threshold: threshold,
            checkpoint_activations: Some(true),
            ..Default::default()
        };
        let err = match engine(&lm, 2, &cfg, Optimizer::default(), 0.1) {
            Ok(_) => panic!("stage {stage}: the undeclared read trained"),
            Err(e) => e,
        };
        match err.root_cause() {
            zero_burn::Error::UndeclaredRead {
                path,
                owner,
                reader,
                found: how,
            } => {
                assert_eq!(
                    (path.as_str(), *owner, *reader),
                    ("emb.weight", 0, 2),
                    "{err}"
                );
                assert!(how.contains(found), "stage {stage}: {how}");
            }
            e => panic!("stage {stage}: expected an undeclared read, got {e}"),
        }
        assert!(err.to_string().contains("visit_segment(2)"), "{err}");
    }
}
