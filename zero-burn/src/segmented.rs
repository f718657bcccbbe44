//! The model contract: a burn module the engine runs segment by segment, any batch type, any
//! activation between segments, and [`Whole`], which makes any module plus a loss closure one.
//!
//! The engine runs the forward pass segment by segment. With activation checkpointing
//! (`ZeroConfig::checkpoint_activations`, by default at stage 3 only) it keeps only the
//! activation between segments and runs the backward in reverse, recomputing each segment under
//! autodiff from its saved input; without, one autodiff graph spans the segments and one backward
//! runs. Either way every training forward runs in training mode (BatchNorm on batch statistics,
//! Dropout on) with the device's generator seeded per segment ([`crate::rng`]), so the recompute
//! reproduces the forward bit for bit and checkpointing changes only memory and time; the
//! recompute's updates of the model's buffers are dropped. Segment boundaries are where stage 3 gathers (and, with checkpointing, releases)
//! weights and where a unit's gradients are complete and can be reduced: burn 0.22.1 has no
//! forward pre-hook and no public gradient-ready hook, so a model names its segments itself.

use std::convert::Infallible;
use std::fmt;
use std::marker::PhantomData;

use burn::module::{Devices, Module, ModuleMapper, ModuleVisitor};
use burn::tensor::{Device, Gradients, Tensor};

/// What flows from one segment to the next: a float tensor of any rank, a tuple of activations,
/// or a `Vec` of them. Values carry no gradient: in training the first forward runs on the
/// autodiff device with no parameter requiring one, in evaluation on `model.valid()`.
pub trait Activation: Clone + Send + 'static {
    /// The same values as a fresh autodiff leaf that keeps its gradient: the input of a
    /// recomputed segment.
    fn leaf(&self) -> Self;
    /// This leaf's gradient after a backward, without autodiff; `None` if nothing reached it.
    /// A part of a composite that no gradient reached is zeros.
    fn grad(&self, grads: &Gradients) -> Option<Self>;
    /// `Σ sum(self ⊙ g)`: the scalar whose backward pushes the output gradient `g` (without
    /// autodiff) into the segment that produced `self`.
    fn dot(self, g: &Self) -> Tensor<1>;
    /// Zeros of the same shape, without autodiff (the gradient of a part nothing reached).
    fn zeros(&self) -> Self;
    /// A crc32c of the values' bytes, appended to `crc`: the recompute guard compares the
    /// recompute's output with the forward's by it.
    fn checksum(&self, crc: u32) -> u32;
}

impl<const D: usize> Activation for Tensor<D> {
    fn leaf(&self) -> Self {
        Tensor::from_inner(self.clone()).require_grad()
    }
    fn grad(&self, grads: &Gradients) -> Option<Self> {
        Tensor::grad(self, grads)
    }
    fn dot(self, g: &Self) -> Tensor<1> {
        (self * Tensor::from_inner(g.clone())).sum()
    }
    fn zeros(&self) -> Self {
        self.zeros_like()
    }
    fn checksum(&self, crc: u32) -> u32 {
        crc32c::crc32c_append(crc, self.clone().into_data().as_bytes())
    }
}

impl<A: Activation, B: Activation> Activation for (A, B) {
    fn leaf(&self) -> Self {
        (self.0.leaf(), self.1.leaf())
    }
    fn grad(&self, grads: &Gradients) -> Option<Self> {
        match (self.0.grad(grads), self.1.grad(grads)) {
            (None, None) => None,
            (a, b) => Some((
                a.unwrap_or_else(|| self.0.zeros()),
                b.unwrap_or_else(|| self.1.zeros()),
            )),
        }
    }
    fn dot(self, g: &Self) -> Tensor<1> {
        self.0.dot(&g.0) + self.1.dot(&g.1)
    }
    fn zeros(&self) -> Self {
        (self.0.zeros(), self.1.zeros())
    }
    fn checksum(&self, crc: u32) -> u32 {
        self.1.checksum(self.0.checksum(crc))
    }
}

impl<A: Activation> Activation for Vec<A> {
    fn leaf(&self) -> Self {
        self.iter().map(Activation::leaf).collect()
    }
    fn grad(&self, grads: &Gradients) -> Option<Self> {
        let parts: Vec<Option<A>> = self.iter().map(|a| a.grad(grads)).collect();
        if parts.iter().all(Option::is_none) {
            return None;
        }
        Some(
            parts
                .into_iter()
                .zip(self)
                .map(|(g, a)| g.unwrap_or_else(|| a.zeros()))
                .collect(),
        )
    }
    fn dot(self, g: &Self) -> Tensor<1> {
        self.into_iter()
            .zip(g)
            .map(|(a, g)| a.dot(g))
            .reduce(|x, y| x + y)
            .expect("a Vec activation is never empty")
    }
    fn zeros(&self) -> Self {
        self.iter().map(Activation::zeros).collect()
    }
    fn checksum(&self, crc: u32) -> u32 {
        self.iter().fold(crc, |c, a| a.checksum(c))
    }
}

/// The activation of a model with a single segment: there is none.
impl Activation for Infallible {
    fn leaf(&self) -> Self {
        match *self {}
    }
    fn grad(&self, _: &Gradients) -> Option<Self> {
        match *self {}
    }
    fn dot(self, _: &Self) -> Tensor<1> {
        match self {}
    }
    fn zeros(&self) -> Self {
        match *self {}
    }
    fn checksum(&self, _: u32) -> u32 {
        match *self {}
    }
}

/// The output of one segment: the next activation, or (last segment) the mean loss, shape `[1]`,
/// with or without an output of the model's own (`O`, [`Segmented::Output`]: logits, predictions;
/// returned by [`ZeroEngine::eval_output`](crate::ZeroEngine::eval_output), dropped in training).
// Both variants hold tensors in practice (a burn tensor is 640 bytes); only a model without an
// activation (`Infallible`) makes `Next` small, and that enum is never stored.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum SegmentOut<A, O = ()> {
    /// The activation for the next segment.
    Next(A),
    /// The last segment's mean loss over its micro-batch, shape `[1]`.
    Loss(Tensor<1>),
    /// The last segment's mean loss, shape `[1]`, and the model's output for the micro-batch.
    LossAnd(Tensor<1>, O),
}

/// A burn module the engine can run segment by segment.
///
/// Segments follow the module's parameter visit order: the engine groups parameters by the
/// segment whose [`visit_segment`](Segmented::visit_segment) visits them, and every float
/// parameter must be visited by at least one segment. A segment visits every parameter its
/// forward reads: a parameter that several segments read (tied weights, e.g. a GPT head that
/// reads the token embedding) is visited by each of them. It is still one parameter, owned by the
/// first segment that visits it: the engine gathers it for every reader, sums their gradients
/// and reduces it once. A segment that reads a parameter it does not visit fails the step with
/// [`Error::UndeclaredRead`](crate::Error::UndeclaredRead). At stage 3 each segment's parameters
/// form its gather group: gathered before the segment runs, released after (a shared one when the
/// backward is done with it).
pub trait Segmented: Module + 'static {
    /// One rank's micro-batch: any type (burn-train's `TrainStep::Input`, a `Batcher`'s output).
    type Batch;
    /// What flows between segments ([`Infallible`] for a single segment).
    type Act: Activation;
    /// What the last segment may return besides the loss ([`SegmentOut::LossAnd`]): logits for
    /// an accuracy, predictions, anything a caller's evaluation needs; `()` for none.
    type Output: Send + 'static;

    /// Number of segments (at least 1).
    fn num_segments(&self) -> usize;

    /// Visits the parameters of segment `i` (e.g. `self.blocks[i - 1].visit(visitor)`).
    fn visit_segment<V: ModuleVisitor>(&self, i: usize, visitor: &mut V);

    /// Runs segment `i`. Segment 0 receives `None` and reads the batch; the others receive the
    /// previous segment's activation; the last returns [`SegmentOut::Loss`] (or
    /// [`SegmentOut::LossAnd`] with its output).
    fn forward_segment(
        &self,
        i: usize,
        batch: &Self::Batch,
        x: Option<Self::Act>,
    ) -> SegmentOut<Self::Act, Self::Output>;
}

/// Any burn module plus a loss closure, as a model of one segment: nothing to implement.
///
/// At stages 0–2 this costs nothing over a segmented model except overlap (reductions start
/// after the backward). At stage 3 the whole model is one gather group: every parameter is
/// gathered for the forward and again for the backward, so the peak holds a full copy of the
/// weights (ZeRO-3 still shards gradients, optimizer states and the weights at rest). Implement
/// [`Segmented`] to gather one segment at a time.
///
/// The closure gets the module and a micro-batch and returns the mean loss, shape `[1]`.
pub struct Whole<M, B, F> {
    /// The module.
    pub module: M,
    loss: F,
    batch: PhantomData<fn(&B)>,
}

impl<M, B, F> Whole<M, B, F>
where
    M: Module + 'static,
    F: Fn(&M, &B) -> Tensor<1> + Clone + Send + 'static,
{
    /// `module` trained on `loss(module, batch)`.
    pub fn new(module: M, loss: F) -> Self {
        Whole {
            module,
            loss,
            batch: PhantomData,
        }
    }

    /// The module, without the loss.
    pub fn into_inner(self) -> M {
        self.module
    }
}

impl<M: Clone, B, F: Clone> Clone for Whole<M, B, F> {
    fn clone(&self) -> Self {
        Whole {
            module: self.module.clone(),
            loss: self.loss.clone(),
            batch: PhantomData,
        }
    }
}

impl<M: fmt::Debug, B, F> fmt::Debug for Whole<M, B, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Whole")
            .field("module", &self.module)
            .finish_non_exhaustive()
    }
}

/// The [`Module`] methods of a wrapper that hands every call to the module in its field
/// `$field`, rebuilding itself with its own `with(self, f: impl FnOnce(M) -> M) -> Self`. The
/// wrapper writes `valid` and `map` itself.
macro_rules! delegate_module {
    ($field:ident) => {
        fn collect_devices(&self, devices: Devices) -> Devices {
            self.$field.collect_devices(devices)
        }
        fn fork(self, device: &Device) -> Self {
            self.with(|m| m.fork(device))
        }
        fn to_device(self, device: &Device) -> Self {
            self.with(|m| m.to_device(device))
        }
        fn train(self) -> Self {
            self.with(Module::train)
        }
        fn materialize(self) -> Self {
            self.with(Module::materialize)
        }
        fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
            self.$field.visit(visitor)
        }
    };
}
#[cfg_attr(not(feature = "burn-train"), allow(unused_imports))]
pub(crate) use delegate_module;

/// Every call delegates to the wrapped module: `Whole` holds no parameter of its own.
impl<M: Module, B, F: Clone + Send> Module for Whole<M, B, F> {
    delegate_module!(module);
    fn valid(&self) -> Self {
        Whole {
            module: self.module.valid(),
            loss: self.loss.clone(),
            batch: PhantomData,
        }
    }
    fn map<Mm: ModuleMapper>(self, mapper: &mut Mm) -> Self {
        self.with(|m| m.map(mapper))
    }
}

impl<M, B, F> Whole<M, B, F> {
    fn with(self, f: impl FnOnce(M) -> M) -> Self {
        Whole {
            module: f(self.module),
            loss: self.loss,
            batch: PhantomData,
        }
    }
}

impl<M, B, F> Segmented for Whole<M, B, F>
where
    M: Module + 'static,
    B: 'static,
    F: Fn(&M, &B) -> Tensor<1> + Clone + Send + 'static,
{
    type Batch = B;
    type Act = Infallible;
    type Output = ();

    fn num_segments(&self) -> usize {
        1
    }

    fn visit_segment<V: ModuleVisitor>(&self, _i: usize, visitor: &mut V) {
        self.module.visit(visitor)
    }

    fn forward_segment(
        &self,
        _i: usize,
        batch: &B,
        _x: Option<Infallible>,
    ) -> SegmentOut<Infallible> {
        SegmentOut::Loss((self.loss)(&self.module, batch))
    }
}

/// The segments that visit every parameter in `params` (visit order), ascending: the first is
/// its owner, the others read it too (tied weights). Every parameter must be visited by at
/// least one segment.
pub(crate) fn param_readers<M: Segmented>(
    model: &M,
    params: &[crate::params::ParamInfo],
) -> crate::Result<Vec<Vec<usize>>> {
    use std::collections::HashMap;
    let mut readers: HashMap<burn::module::ParamId, Vec<usize>> = HashMap::new();
    for i in 0..model.num_segments() {
        let mut ids = crate::params::Ids::default();
        model.visit_segment(i, &mut ids);
        for id in ids.0 {
            readers.entry(id).or_default().push(i);
        }
    }
    params
        .iter()
        .map(|p| {
            readers
                .remove(&p.id)
                .ok_or_else(|| crate::Error::Segmentation {
                    path: p.path.clone(),
                    detail: format!(
                        "is visited by none of the {} segments",
                        model.num_segments()
                    ),
                })
        })
        .collect()
}

/// The value of a segment's loss, which must have one element.
pub(crate) fn loss_value(loss: Tensor<1>) -> crate::Result<f32> {
    let n = loss.shape().num_elements();
    if n != 1 {
        return Err(crate::Error::Tensor(format!(
            "the loss has {n} elements, expected 1 (shape [1])"
        )));
    }
    let v = loss
        .into_data()
        .try_into_vec_as::<f32>()
        .map_err(|e| crate::Error::Tensor(format!("loss: {e:?}")))?;
    Ok(v[0])
}

/// The error for segment `i` of `segments` returning the wrong kind of output.
pub(crate) fn wrong_output(i: usize, segments: usize, expected_loss: bool) -> crate::Error {
    let (got, expected) = if expected_loss {
        ("an activation", "the loss (it is the last segment)")
    } else {
        (
            "the loss",
            "an activation (only the last segment returns the loss)",
        )
    };
    crate::Error::SegmentOutput {
        segment: i,
        segments,
        got,
        expected,
    }
}
