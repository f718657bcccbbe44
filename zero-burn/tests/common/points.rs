//! A deterministic synthetic classification task (points, labels, a burn `DataLoader`) and a
//! residual MLP with nothing zero-rs-specific about it: shared by the model-family tests and the
//! burn-train adapter's tests.

use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use zero_burn::demo::gpt::deterministic_init;

pub(crate) const FEATURES: usize = 6;
pub(crate) const CLASSES: usize = 3;
/// Points per micro-batch.
pub(crate) const B: usize = 4;

/// One labelled point of a deterministic synthetic task: the label is the largest of three
/// fixed linear scores.
#[derive(Clone, Debug)]
pub(crate) struct Point {
    pub(crate) x: [f32; FEATURES],
    pub(crate) label: i64,
}

pub(crate) fn points(n: usize) -> Vec<Point> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let w: Vec<[f32; FEATURES]> = (0..CLASSES)
        .map(|_| std::array::from_fn(|_| uniform()))
        .collect();
    (0..n)
        .map(|_| {
            let x: [f32; FEATURES] = std::array::from_fn(|_| uniform());
            let score = |c: usize| w[c].iter().zip(&x).map(|(a, b)| a * b).sum::<f32>();
            let label = (0..CLASSES)
                .max_by(|&a, &b| score(a).total_cmp(&score(b)))
                .expect("classes") as i64;
            Point { x, label }
        })
        .collect()
}

/// A micro-batch: features `[B, FEATURES]` and labels `[B]`, without autodiff.
#[derive(Clone, Debug)]
pub(crate) struct PointBatch {
    pub(crate) x: Tensor<2>,
    pub(crate) y: Tensor<1, Int>,
}

#[derive(Clone, Debug)]
pub(crate) struct PointBatcher;

impl Batcher<Point, PointBatch> for PointBatcher {
    fn batch(&self, items: Vec<Point>, device: &Device) -> PointBatch {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|p| p.x).collect();
        let y: Vec<i64> = items.iter().map(|p| p.label).collect();
        PointBatch {
            x: Tensor::from_data(TensorData::new(x, [n, FEATURES]), device),
            y: Tensor::from_data(TensorData::new(y, [n]), device),
        }
    }
}

/// The loader every rank reads: `B` points a batch, in order. Global micro-batch `k` (numbered
/// step-major, then micro-step, then rank) is the loader's batch `k`.
pub(crate) fn loader(items: &[Point]) -> Arc<dyn DataLoader<PointBatch>> {
    DataLoaderBuilder::new(PointBatcher)
        .batch_size(B)
        .set_device(Device::flex())
        .build(InMemDataset::new(items.to_vec()))
}

pub(crate) fn cross_entropy(logits: Tensor<2>, y: Tensor<1, Int>) -> Tensor<1> {
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits, y)
}

/// Family (b): a residual MLP with nothing zero-rs-specific about it.
#[derive(Module, Debug)]
pub(crate) struct ResMlp {
    pub(crate) input: Linear,
    pub(crate) blocks: Vec<ResBlock>,
    pub(crate) out: Linear,
}

#[derive(Module, Debug)]
pub(crate) struct ResBlock {
    norm: LayerNorm,
    fc: Linear,
}

impl ResMlp {
    pub(crate) fn new(device: &Device) -> Self {
        deterministic_init(
            ResMlp {
                input: LinearConfig::new(FEATURES, 16).init(device),
                blocks: (0..2)
                    .map(|_| ResBlock {
                        norm: LayerNormConfig::new(16).init(device),
                        fc: LinearConfig::new(16, 16).init(device),
                    })
                    .collect(),
                out: LinearConfig::new(16, CLASSES).init(device),
            },
            11,
        )
    }

    pub(crate) fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let mut h = self.input.forward(x);
        for b in &self.blocks {
            h = h.clone() + relu(b.fc.forward(b.norm.forward(h)));
        }
        self.out.forward(h)
    }
}

/// Every float parameter's values, in visit order (plain burn: a visitor).
pub(crate) fn values<M: Module>(model: &M) -> Vec<Vec<f32>> {
    struct Values(Vec<Vec<f32>>);
    impl ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let v = p
                .val()
                .into_data()
                .try_into_vec_as::<f32>()
                .expect("f32 parameters");
            self.0.push(v);
        }
    }
    let mut v = Values(Vec::new());
    model.visit(&mut v);
    v.0
}

pub(crate) fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|p| p.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// Below this, a tensor's largest |b| counts as this (a zero-initialised bias is judged by
/// absolute gaps of `tol · FLOOR`, not divided by zero).
const FLOOR: f32 = 1e-3;

/// The largest gap of any tensor, relative to that tensor's own scale: max over tensors `t` of
/// `max |a_t − b_t| / max(max |b_t|, FLOOR)`. A small tensor (a bias, a layer norm's shift) is
/// held to its own size, not to the model's largest weight; a NaN is an infinite gap.
pub(crate) fn rel_gap(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "tensor counts differ");
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            assert_eq!(x.len(), y.len(), "tensor lengths differ");
            let scale = y.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(FLOOR);
            // A NaN on either side is an infinite gap (`f32::max` would drop it).
            let gap = x.iter().zip(y).fold(0.0f32, |m, (p, q)| {
                let d = (p - q).abs();
                m.max(if d.is_nan() { f32::INFINITY } else { d })
            });
            gap / scale
        })
        .fold(0.0f32, f32::max)
}

/// Checks a zero-rs run against plain burn's: the largest relative gap of the losses and of the
/// parameters within `tol` (printed either way).
pub(crate) fn assert_near_burn(
    what: &str,
    (losses, params): (&[f32], &[Vec<f32>]),
    (want_losses, want_params): (&[f32], &[Vec<f32>]),
    tol: f32,
) {
    let loss_gap = rel_gap(&[losses.to_vec()], &[want_losses.to_vec()]);
    let param_gap = rel_gap(params, want_params);
    eprintln!("{what}: loss gap {loss_gap:e}, parameter gap {param_gap:e}");
    assert!(
        loss_gap <= tol,
        "{what}: losses {losses:?} vs burn {want_losses:?}"
    );
    assert!(param_gap <= tol, "{what}: parameter gap {param_gap:e}");
}

/// zero-rs's AdamW and burn's with the same betas (0.9, 0.999), ε 1e-8 and weight decay `wd`.
/// burn decays the weights first, `p·(1 − lr·wd) − lr·u`; zero-rs computes `p − lr·(u + wd·p)`:
/// the same update, rounded differently.
pub(crate) fn adamw_pair(wd: f32) -> (zero_burn::Optimizer, burn::optim::ModuleOptimizer) {
    let ours = zero_burn::Optimizer::AdamW {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: wd,
    };
    let burns = burn::optim::AdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.999)
        .with_epsilon(1e-8)
        .with_weight_decay(wd)
        .init();
    (ours, burns)
}
