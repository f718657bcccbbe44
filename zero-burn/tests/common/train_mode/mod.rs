//! The training-mode harness the `train_mode*` tests share: a small CNN with BatchNorm (buffers)
//! and Dropout (random masks) and its data, reading and writing module state, the engine run
//! ([`train`]: every rank's losses, consolidated parameters, buffers and report) and the
//! plain-burn oracle ([`plain_burn`]) that replays the engine's seeded dropout masks.

use std::sync::Arc;
use std::time::Duration;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{
    BatchNorm, BatchNormConfig, Dropout, DropoutConfig, Linear, LinearConfig, PaddingConfig2d,
};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use zero_burn::demo::gpt::deterministic_init;
use zero_burn::params::buffers;
use zero_burn::rng::{segment_seed, with_seed};
use zero_burn::{
    BufferSync, Launch, Optimizer, RankReport, SegmentOut, Segmented, Whole, ZeroEngine,
};
use zero_core::{Plan, Topology, ZeroConfig};

use super::points::cross_entropy;

mod oracle;

// Not every test program uses the oracle.
#[allow(unused_imports)]
pub(crate) use oracle::*;

/// Image side, conv channels, classes, images per micro-batch.
pub(crate) const IMG: usize = 8;
pub(crate) const CH: usize = 4;
pub(crate) const CLASSES: usize = 3;
pub(crate) const B: usize = 4;
/// Micro-steps per optimizer step.
pub(crate) const A: usize = 2;
pub(crate) const STEPS: usize = 3;
pub(crate) const LR: f32 = 0.1;
/// The largest absolute gap allowed between the engine and plain burn, per element of any
/// tensor (parameters and buffers) and per micro-batch loss. The two sum the same gradients in a
/// different order (plain burn: one backward of the mean of every micro-batch loss; the engine: a
/// backward per micro-batch, scaled by 1/A, reduced with the mean over ranks), so they differ by
/// float rounding: at most 3e-8 (losses), 1.5e-8 (parameters) and 7.5e-9 (buffers) measured
/// over three SGD steps, so 1e-6 leaves a 30× margin. Different dropout masks, eval-mode batch
/// statistics or another rank's running statistics move them by 1e-3 or more.
pub(crate) const TOL: f32 = 1e-6;

/// `(path, values)` of every tensor, in visit order.
pub(crate) type Named = Vec<(String, Vec<f32>)>;

pub(crate) fn device() -> Device {
    Device::flex().autodiff()
}

// ------------------------------------------------------------------------------------------------
// Data
// ------------------------------------------------------------------------------------------------

/// A deterministic uniform generator on [-1, 1) for micro-batch `k`.
fn uniform(k: usize, salt: u64) -> impl FnMut() -> f32 {
    let mut s = (k as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt;
    s |= 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// A micro-batch of `D`-dimensional inputs (batch first) and their labels, without autodiff.
#[derive(Clone, Debug)]
pub(crate) struct Labelled<const D: usize> {
    pub(crate) x: Tensor<D>,
    pub(crate) y: Tensor<1, Int>,
}

/// A micro-batch of 1×8×8 images and labels.
pub(crate) type Images = Labelled<4>;

/// Global micro-batch `k` (numbered step-major, then micro-step, then rank) of shape `shape`:
/// sample `i`'s label is `(k·B + i·stride + k/div) % CLASSES`, its values noise from `uniform(k,
/// salt)` halved plus `signal(label, j)` at position `j` within the sample.
pub(crate) fn labelled<const D: usize>(
    (k, salt): (usize, u64),
    (stride, div): (usize, usize),
    shape: [usize; D],
    signal: impl Fn(usize, usize) -> f32,
) -> Labelled<D> {
    let mut u = uniform(k, salt);
    let per_sample: usize = shape[1..].iter().product();
    let mut x = Vec::with_capacity(shape[0] * per_sample);
    let mut y = Vec::with_capacity(shape[0]);
    for i in 0..shape[0] {
        let label = (k * B + i * stride + k / div) % CLASSES;
        y.push(label as i64);
        x.extend((0..per_sample).map(|j| 0.5 * u() + signal(label, j)));
    }
    let host = Device::flex();
    Labelled {
        x: Tensor::from_data(TensorData::new(x, shape), &host),
        y: Tensor::from_data(TensorData::new(y, [shape[0]]), &host),
    }
}

/// Global micro-batch `k` of images: noise plus a bright band of rows whose position is the
/// label.
pub(crate) fn images(k: usize) -> Images {
    let band = |label, j: usize| {
        if (j / IMG) * CLASSES / IMG == label {
            1.0
        } else {
            0.0
        }
    };
    labelled((k, 0x51), (7, 3), [B, 1, IMG, IMG], band)
}

// ------------------------------------------------------------------------------------------------
// Models
// ------------------------------------------------------------------------------------------------

/// Conv2d(1→4, 3×3, padding 1) → BatchNorm(4) → ReLU → Dropout(0.25) → flatten → Linear(256→3).
#[derive(Module, Debug)]
pub(crate) struct Cnn {
    conv: Conv2d,
    bn: BatchNorm,
    dropout: Dropout,
    head: Linear,
}

impl Cnn {
    /// Deterministic weights (burn's initialisers draw from the global generator, so they draw
    /// under the engine's lock); BatchNorm keeps burn's init (γ 1, β 0, running mean 0, var 1).
    pub(crate) fn new() -> Self {
        let device = device();
        with_seed(&device, 0, || Cnn {
            // Weights of std 0.5 rather than 0.02: micro-batches then differ visibly in their
            // batch statistics, so which running statistics a rank keeps shows in the buffers.
            conv: scaled(
                deterministic_init(
                    Conv2dConfig::new([1, CH], [3, 3])
                        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                        .init(&device),
                    5,
                ),
                25.0,
            ),
            bn: BatchNormConfig::new(CH).init(&device),
            dropout: DropoutConfig::new(0.25).init(),
            head: deterministic_init(LinearConfig::new(CH * IMG * IMG, CLASSES).init(&device), 6),
        })
    }

    /// Segment 0: the convolutional features, flattened.
    pub(crate) fn features(&self, x: &Tensor<4>) -> Tensor<2> {
        let h = self
            .dropout
            .forward(relu(self.bn.forward(self.conv.forward(x.clone()))));
        h.flatten::<2>(1, 3)
    }

    /// Segment 1: the head and the loss.
    pub(crate) fn head_loss(&self, h: Tensor<2>, y: &Tensor<1, Int>) -> Tensor<1> {
        cross_entropy(self.head.forward(h), y.clone())
    }
}

impl Segmented for Cnn {
    type Batch = Images;
    type Act = Tensor<2>;
    type Output = ();

    fn num_segments(&self) -> usize {
        2
    }

    fn visit_segment<V: ModuleVisitor>(&self, i: usize, visitor: &mut V) {
        match i {
            0 => {
                self.conv.visit(visitor);
                self.bn.visit(visitor);
                self.dropout.visit(visitor);
            }
            _ => self.head.visit(visitor),
        }
    }

    fn forward_segment(
        &self,
        i: usize,
        batch: &Images,
        x: Option<Tensor<2>>,
    ) -> SegmentOut<Tensor<2>> {
        match (i, x) {
            (0, _) => SegmentOut::Next(self.features(&batch.x)),
            (_, Some(h)) => SegmentOut::Loss(self.head_loss(h, &batch.y)),
            (_, None) => unreachable!("the engine hands segment 1 its input"),
        }
    }
}

/// The CNN as one segment: any module plus a loss closure.
pub(crate) fn whole_cnn(
    cnn: Cnn,
) -> Whole<Cnn, Images, impl Fn(&Cnn, &Images) -> Tensor<1> + Clone + Send + 'static> {
    Whole::new(cnn, |m: &Cnn, b: &Images| {
        m.head_loss(m.features(&b.x), &b.y)
    })
}

/// `module` with every float tensor multiplied by `factor` (through the host, keeping whether it
/// requires a gradient).
pub(crate) fn scaled<M: Module>(module: M, factor: f32) -> M {
    struct Scale(f32);
    impl ModuleMapper for Scale {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, t, mapper) = p.consume();
            let (dims, device, require_grad) = (t.dims(), t.device(), t.is_require_grad());
            let v: Vec<f32> = t
                .into_data()
                .try_into_vec_as::<f32>()
                .expect("f32")
                .into_iter()
                .map(|x| x * self.0)
                .collect();
            let mut nt = Tensor::<D>::from_data(TensorData::new(v, dims), &device);
            if require_grad {
                nt = nt.require_grad();
            }
            Param::from_mapped_value(id, nt, mapper)
        }
    }
    module.map(&mut Scale(factor))
}

// ------------------------------------------------------------------------------------------------
// Reading and writing module state (plain burn)
// ------------------------------------------------------------------------------------------------

/// Every float tensor of the module: `(dotted path, values)` in visit order.
pub(crate) fn floats<M: Module>(model: &M) -> Named {
    #[derive(Default)]
    struct Floats {
        path: Vec<String>,
        out: Named,
    }
    impl ModuleVisitor for Floats {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let v = p.val().into_data().try_into_vec_as::<f32>().expect("f32");
            self.out.push((self.path.join("."), v));
        }
    }
    let mut f = Floats::default();
    model.visit(&mut f);
    f.out
}

/// The trainable parameters: every float tensor that is not a buffer.
pub(crate) fn params_of<M: Module>(model: &M) -> Named {
    let bufs: Vec<String> = buffers(model).into_iter().map(|(p, _)| p).collect();
    floats(model)
        .into_iter()
        .filter(|(p, _)| !bufs.contains(p))
        .collect()
}

/// Writes `values` into the buffers of those paths. burn's `clone()` shares a `RunningState`,
/// and mapping one writes its shared value, so mapping a clone writes into `model` itself. The
/// caller has settled pending updates first ([`buffers`] does).
pub(crate) fn set_buffers<M: Module>(model: &M, values: &Named) {
    struct Set<'a> {
        path: Vec<String>,
        values: &'a Named,
        set: usize,
    }
    impl ModuleMapper for Set<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let path = self.path.join(".");
            let Some((_, v)) = self.values.iter().find(|(n, _)| *n == path) else {
                return p;
            };
            let (id, t, mapper) = p.consume();
            let nt = Tensor::<D>::from_data(TensorData::new(v.clone(), t.dims()), &t.device());
            self.set += 1;
            Param::from_mapped_value(id, nt, mapper)
        }
    }
    let mut s = Set {
        path: Vec::new(),
        values,
        set: 0,
    };
    drop(model.clone().map(&mut s));
    assert_eq!(s.set, values.len(), "every buffer written once");
}

/// A copy that shares nothing with `model` (burn's `clone()` shares running statistics).
pub(crate) fn fresh<M: Module>(model: &M) -> M {
    model.valid().train()
}

pub(crate) fn bits(v: &Named) -> Vec<(String, Vec<u32>)> {
    v.iter()
        .map(|(p, x)| (p.clone(), x.iter().map(|f| f.to_bits()).collect()))
        .collect()
}

pub(crate) fn loss_bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|x| x.iter().map(|f| f.to_bits()).collect())
        .collect()
}

/// Asserts every tensor of `got` within `tol` of `want` (same paths, same lengths), printing and
/// naming the worst per-tensor absolute gap. Returns it.
pub(crate) fn assert_close(what: &str, got: &Named, want: &Named, tol: f32) -> f32 {
    let names = |v: &Named| {
        v.iter()
            .map(|(p, x)| (p.clone(), x.len()))
            .collect::<Vec<_>>()
    };
    assert_eq!(names(got), names(want), "{what}: tensors and lengths");
    let gaps: Vec<(String, f32)> = got
        .iter()
        .zip(want)
        .map(|((p, a), (_, b))| {
            let gap = a.iter().zip(b).fold(0.0f32, |m, (x, y)| {
                let d = (x - y).abs();
                if d.is_nan() { f32::INFINITY } else { m.max(d) }
            });
            (p.clone(), gap)
        })
        .collect();
    let (worst_path, worst) = gaps
        .iter()
        .fold((String::new(), 0.0f32), |(wp, w), (p, g)| {
            if *g > w { (p.clone(), *g) } else { (wp, w) }
        });
    eprintln!("{what}: worst per-tensor absolute gap {worst:e} (`{worst_path}`)");
    assert!(
        worst <= tol,
        "{what}: worst per-tensor absolute gap {worst:e} in `{worst_path}` exceeds {tol:e}; \
         per tensor: {gaps:?}"
    );
    worst
}

/// The largest absolute gap between two tensor lists of the same layout.
pub(crate) fn max_gap(a: &Named, b: &Named) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|((_, x), (_, y))| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

// ------------------------------------------------------------------------------------------------
// The engine
// ------------------------------------------------------------------------------------------------

/// What one rank saw.
#[derive(Debug)]
pub(crate) struct Seen {
    /// Per step, the loss of each micro-batch.
    pub(crate) losses: Vec<Vec<f32>>,
    /// The consolidated model's parameters.
    pub(crate) params: Named,
    /// The consolidated model's buffers.
    pub(crate) buffers: Named,
    /// The buffers of the engine's own model.
    pub(crate) own_buffers: Named,
    /// The engine's report right after the last step (before `consolidated_model`, which books
    /// other traffic of its own).
    pub(crate) report: RankReport,
    /// The engine's plan.
    pub(crate) plan: Arc<Plan>,
}

/// One engine run.
#[derive(Clone, Debug)]
pub(crate) struct Run {
    pub(crate) topo: Topology,
    pub(crate) config: ZeroConfig,
    pub(crate) sync: BufferSync,
    pub(crate) seed: Option<u64>,
}

impl Run {
    /// fp32 at `stage`, [`A`] micro-steps per step, checkpointing `ckpt` (`None`: the stage's
    /// default), rank 0's buffers, base seed 0.
    pub(crate) fn new(topo: Topology, stage: u8, ckpt: Option<bool>) -> Self {
        Run {
            topo,
            config: ZeroConfig {
                stage,
                gradient_accumulation_steps: A as u32,
                // Stage 3 shards every tensor, however small.
                param_persistence_threshold: 0,
                checkpoint_activations: ckpt,
                ..Default::default()
            },
            sync: BufferSync::Broadcast,
            seed: None,
        }
    }
}

pub(crate) fn world2() -> Topology {
    Topology::single_node(2).unwrap()
}

/// Rank `rank`'s micro-batches of step `s`: global micro-batches `(s·A + m)·N + rank`.
pub(crate) fn rank_batches<T>(
    data: &impl Fn(usize) -> T,
    s: usize,
    n: usize,
    rank: usize,
) -> Vec<T> {
    (0..A).map(|m| data((s * A + m) * n + rank)).collect()
}

/// Trains `model` (a fresh copy, sharing nothing with the caller's) for [`STEPS`] with SGD (no
/// momentum) and returns what every rank saw.
pub(crate) fn train<M, T, F>(model: &M, run: &Run, data: F) -> Vec<Seen>
where
    M: Segmented<Batch = T> + Clone + Send,
    F: Fn(usize) -> T + Sync,
{
    let n = run.topo.world_size();
    let cfg = run.config.clone();
    Launch::new(run.topo)
        .timeout(Duration::from_secs(120))
        .run_with(&fresh(model), |comm, model| {
            let rank = zero_comm::Communicator::rank(&comm);
            let mut b = ZeroEngine::builder(comm, model)
                .config(cfg.clone())
                .optimizer(Optimizer::Sgd { momentum: 0.0 })
                .buffers(run.sync);
            if let Some(seed) = run.seed {
                b = b.seed(seed);
            }
            let mut e = b.build()?;
            let mut losses = Vec::new();
            for s in 0..STEPS {
                let out = e.step(LR, &rank_batches(&data, s, n, rank))?;
                assert_eq!(out.micro_losses.len(), A);
                losses.push(out.micro_losses);
            }
            let own_buffers = buffers(e.model());
            let report = e.report();
            let plan = e.plan().clone();
            let full = e.consolidated_model()?;
            Ok(Seen {
                losses,
                params: params_of(&full),
                buffers: buffers(&full),
                own_buffers,
                report,
                plan,
            })
        })
        .unwrap_or_else(|e| panic!("{run:?}: {e}"))
}

/// Every rank holds the same consolidated parameters and the same buffers, in its own model and
/// in the consolidated one.
pub(crate) fn assert_ranks_agree(what: &str, seen: &[Seen]) {
    let (p0, b0) = (&seen[0].params, &seen[0].buffers);
    for (r, s) in seen.iter().enumerate() {
        let got = [&s.params, &s.buffers, &s.own_buffers];
        assert_state_bits(&format!("{what}: rank {r}"), got, [p0, b0, b0]);
    }
}

/// A rank's consolidated parameters, consolidated buffers and own buffers (`got`) have the bits
/// of `want`, part by part.
pub(crate) fn assert_state_bits(what: &str, got: [&Named; 3], want: [&Named; 3]) {
    let parts = [
        "consolidated parameters",
        "consolidated buffers",
        "own buffers",
    ];
    for ((g, w), part) in got.into_iter().zip(want).zip(parts) {
        assert_eq!(bits(g), bits(w), "{what}: {part}");
    }
}
