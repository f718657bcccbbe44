//! burn-train's `Learner` over a sharded optimizer step (feature `burn-train`, stages 0–2).
//!
//! [`Sharded`] wraps the user's model (any burn `Module` that implements burn-train's
//! `TrainStep` and `InferenceStep`) and its rank's [`ZeroEngine`]. burn-train drives everything
//! it drives for a plain model: the data loader, metrics and their renderers, the learning-rate
//! schedule, gradient accumulation, validation, early stopping, the model checkpointer. Only the
//! optimizer step changes: `Sharded` overrides `TrainStep::optimize`, the one place where burn
//! hands back both the model and the step's gradients (`Learner::optimizer_step`), and runs
//! [`ZeroEngine::step_grads`] there (the reductions, the global-norm clipping, the update of this
//! rank's shard of the fp32 master and optimizer state, the new weights gathered), so the
//! optimizer state lives only in the shards, and `Learner`'s model is current after every step.
//!
//! One `SupervisedTraining` runs per rank (threads under [`crate::Launch`], or processes under
//! MPI), each with its own shard of the training data and the same number of batches (every
//! optimizer step is collective), and the same validation data (the weights are identical on
//! every rank at stages 0–2, so are the metrics and early-stopping decisions).
//!
//! What does not carry over, and why:
//! - **Stage 3** is refused: `TrainStep::step` is one forward and backward over the whole model
//!   that burn runs itself, so nothing can gather a segment's weights before it and release them
//!   after; `Learner`'s model, validation and checkpointer want full weights too. Stage 3 runs
//!   in the engine's own loop ([`ZeroEngine::step`] over a [`crate::Segmented`] model).
//! - **fp16** is refused: the loss scale must multiply the loss before the backward, which is
//!   the user's `TrainStep::step`. fp32 and bf16 work.
//! - The plan's `gradient_accumulation_steps` must be 1: burn's `GradientsAccumulator` sums the
//!   micro-batches' gradients before `optimize` (use mean losses divided by the accumulation
//!   count if a mean is wanted; burn's own optimizers see the same sum).
//! - The `ModuleOptimizer` inside `Learner` is never used ([`Sharded::learner`] gives it plain
//!   SGD, which keeps no state); burn's per-parameter gradient clipping does not apply, the
//!   engine's global-norm clipping does. One learning rate for every parameter, whatever its
//!   schedule (a warm-up, a decay): per-group rates (`ModuleLrScheduler::with_group`) are
//!   refused at the step, naming a parameter whose rate differs ([`single_learning_rate`]).
//! - burn's checkpointer saves `Learner`'s model (full weights) and the unused optimizer's empty
//!   record, not the shards. A resume through burn-train (`SupervisedTraining::checkpoint`)
//!   loads the record into `Learner`'s model, not into the engine, so the next step refuses
//!   (as it does after any `Module::map` of the model, a freeze for instance): resume from the
//!   engine's own checkpoint ([`Sharded::engine`], `ZeroEngine::save` and `load`).
//! - burn-train's multi-device strategy is refused (`optimize_multi`); run one single-device
//!   `SupervisedTraining` per rank.
//! - The feature also turns on burn-flex's rayon for the whole build (burn-train asks for flex's
//!   default features); each build is deterministic on its own.
//! - `optimize` cannot return an error: a failed step panics with the engine's error, which ends
//!   that rank's training (and, through its dropped communicator, every other rank's).

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use burn::module::{Devices, Module, ModuleMapper, ModuleVisitor};
use burn::optim::lr_scheduler::module_lr_scheduler::{ModuleLearningRate, ModuleLrScheduler};
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::Device;
use burn_train::{InferenceStep, Learner, LearnerModel, TrainOutput, TrainStep};
use zero_comm::Communicator;

use crate::engine::ZeroEngine;
use crate::error::Result;
use crate::precision::StepInfo;
use crate::segmented::{Whole, delegate_module};

/// The one learning rate of `lr` for every trainable parameter of `model`: its base rate, or
/// [`Error::Invalid`](crate::Error::Invalid) naming the first parameter a group gives another
/// rate (burn's per-group rates, `ModuleLrScheduler::with_group`): the engine steps flat shards
/// that mix parameters, at one rate.
pub fn single_learning_rate<M: Module>(model: &M, lr: &ModuleLearningRate) -> Result<f64> {
    let base = lr.base();
    for p in crate::params::describe(model)
        .iter()
        .filter(|p| p.trainable)
    {
        let mine = lr.lr_from_param(p.id, Some(&p.path));
        if mine != base {
            return Err(crate::Error::Invalid {
                field: "lr",
                got: format!(
                    "a ModuleLearningRate whose groups give `{}` the rate {mine} and the base \
                     {base}",
                    p.path
                ),
                expected: "one learning rate for every parameter (no ModuleLrScheduler groups): \
                           the engine steps flat shards at one rate"
                    .into(),
            });
        }
    }
    Ok(base)
}

/// What [`Sharded`] needs from its engine: an optimizer step from burn's gradients, returning
/// the model with the new weights, and what the last step did.
pub trait ShardedStep<M>: Send {
    /// One optimizer step at `lr` from `grads`; the updated model.
    fn step_grads(&mut self, lr: f32, grads: &GradientsParams) -> Result<M>;
    /// What the last optimizer step did; `None` before the first.
    fn last_step(&self) -> Option<StepInfo>;
}

impl<C, M, B, F> ShardedStep<M> for ZeroEngine<C, Whole<M, B, F>>
where
    C: Communicator,
    M: Module + 'static,
    B: 'static,
    F: Fn(&M, &B) -> burn::tensor::Tensor<1> + Clone + Send + 'static,
{
    fn step_grads(&mut self, lr: f32, grads: &GradientsParams) -> Result<M> {
        ZeroEngine::step_grads(self, lr, grads)?;
        Ok(self.model().module.clone())
    }

    fn last_step(&self) -> Option<StepInfo> {
        (self.steps() > 0).then(|| ZeroEngine::last_step(self))
    }
}

/// A burn-train `LearnerModel`: the user's model `M`, whose optimizer step is the engine `E`'s
/// (see the [module docs](self)). Built from a rank's engine with [`Sharded::new`].
pub struct Sharded<M, E> {
    model: M,
    engine: Arc<Mutex<E>>,
    /// Set by [`Module::map`] (a record loaded into burn-train's model, a freeze): values the
    /// engine does not have, which its next step would silently replace.
    mapped: bool,
}

impl<C, M, B, F> Sharded<M, ZeroEngine<C, Whole<M, B, F>>>
where
    C: Communicator,
    M: Module + 'static,
    B: 'static,
    F: Fn(&M, &B) -> burn::tensor::Tensor<1> + Clone + Send + 'static,
{
    /// Wraps a rank's engine over [`Whole`]`(model, loss)`: the model burn-train trains is the
    /// engine's (`loss` serves the engine's own `eval`; burn's `TrainStep::step` computes the
    /// gradients). Refuses stage 3, fp16 and gradient accumulation in the plan
    /// ([`crate::Error::Invalid`], naming the option).
    pub fn new(engine: ZeroEngine<C, Whole<M, B, F>>) -> Result<Self> {
        engine.core.check_external_grads()?;
        Ok(Self {
            model: engine.model().module.clone(),
            engine: Arc::new(Mutex::new(engine)),
            mapped: false,
        })
    }
}

impl<M, E> Sharded<M, E> {
    /// The user's model, with the weights of the last step.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The engine, for its report, checkpoints or consolidated model (after training, or between
    /// `SupervisedTraining` runs). After a step that panicked its state is undefined (the next
    /// `optimize` refuses it).
    pub fn engine(&self) -> MutexGuard<'_, E> {
        self.engine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What the last optimizer step did (skipped, gradient norm); `None` before the first.
    pub fn last_step(&self) -> Option<StepInfo>
    where
        E: ShardedStep<M>,
    {
        self.engine().last_step()
    }
}

impl<M, E> Sharded<M, E>
where
    Self: LearnerModel,
{
    /// A `Learner` over this model with the learning-rate schedule `lr`; its `ModuleOptimizer`
    /// is plain SGD, which keeps no state and never runs (the engine steps).
    pub fn learner(self, lr: impl Into<ModuleLrScheduler>) -> Learner<Self> {
        let unused: ModuleOptimizer = SgdConfig::new().init();
        Learner::new(self, unused, lr)
    }
}

impl<M: Clone, E> Clone for Sharded<M, E> {
    fn clone(&self) -> Self {
        Self {
            model: self.model.clone(),
            engine: self.engine.clone(),
            mapped: self.mapped,
        }
    }
}

impl<M: fmt::Debug, E> fmt::Debug for Sharded<M, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sharded")
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

impl<M: fmt::Display, E> fmt::Display for Sharded<M, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Sharded({})", self.model)
    }
}

impl<M, E> Sharded<M, E> {
    fn with(self, f: impl FnOnce(M) -> M) -> Self {
        Self {
            model: f(self.model),
            engine: self.engine,
            mapped: self.mapped,
        }
    }
}

/// Every call delegates to the user's model: the engine holds no parameter burn should see.
impl<M: Module, E: Send + 'static> Module for Sharded<M, E> {
    delegate_module!(model);
    fn valid(&self) -> Self {
        Self {
            model: self.model.valid(),
            engine: self.engine.clone(),
            mapped: self.mapped,
        }
    }
    /// Marks the model as changed behind the engine's back: the next optimizer step refuses
    /// (see the module docs).
    fn map<Mm: ModuleMapper>(self, mapper: &mut Mm) -> Self {
        let mut s = self.with(|m| m.map(mapper));
        s.mapped = true;
        s
    }
}

impl<M, E> TrainStep for Sharded<M, E>
where
    M: TrainStep + Module,
    E: ShardedStep<M> + 'static,
{
    type Input = M::Input;
    type Output = M::Output;

    fn step(&self, item: Self::Input) -> TrainOutput<Self::Output> {
        self.model.step(item)
    }

    /// The engine's step in place of burn's optimizer (which is never used). The updated model
    /// comes back on the device the Learner's model was on.
    fn optimize(
        self,
        _unused: &mut ModuleOptimizer,
        lr: ModuleLearningRate,
        grads: GradientsParams,
    ) -> Self {
        // burn's `optimize` returns no error: a failure ends this rank's training (module docs).
        let fail =
            |why: String| -> ! { panic!("zero-burn: the sharded optimizer step failed: {why}") };
        if self.mapped {
            fail(
                "the model was changed through Module::map (a record loaded into burn-train's \
                 model, e.g. a SupervisedTraining::checkpoint resume, or a freeze); the engine \
                 holds the weights and would overwrite it: resume from the engine's checkpoint"
                    .into(),
            );
        }
        let rate = single_learning_rate(&self.model, &lr).unwrap_or_else(|e| fail(e.to_string()));
        let device = self.model.devices().into_iter().next();
        let stepped = match self.engine.lock() {
            Ok(mut engine) => engine.step_grads(rate as f32, &grads),
            Err(_) => fail("the engine panicked in an earlier step".into()),
        };
        match stepped {
            Ok(model) => {
                let model = match device {
                    Some(d) => model.fork(&d),
                    None => model,
                };
                Self {
                    model,
                    engine: self.engine,
                    mapped: false,
                }
            }
            Err(e) => fail(e.to_string()),
        }
    }

    /// burn-train's multi-device strategy (`MultiDeviceOptim::OptimSharded`) would step burn's
    /// unused optimizer instead of the engine: refused. Run one single-device training per rank.
    fn optimize_multi(
        self,
        _unused: &mut ModuleOptimizer,
        _lr: ModuleLearningRate,
        _grads: burn::optim::MultiGradientsParams,
    ) -> Self {
        panic!(
            "zero-burn: Sharded does not run under burn-train's multi-device strategy (its \
             optimizer step would bypass the engine); run one single-device SupervisedTraining \
             per rank"
        )
    }
}

impl<M: InferenceStep, E> InferenceStep for Sharded<M, E> {
    type Input = M::Input;
    type Output = M::Output;

    fn step(&self, item: Self::Input) -> Self::Output {
        self.model.step(item)
    }
}
