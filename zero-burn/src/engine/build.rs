//! Building an engine: every check, the layout, the initial shards.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use burn::module::ParamId;
use zero_comm::Communicator;
use zero_core::{Placement, Plan, UnitKind};

use super::grad_acc::GradAcc;
use super::layout::RankLayout;
use super::opt_state::OptState;
use super::sharded::Stage3Weights;
use super::slab::Place;
use super::{Clock, Core, EngineOptions, Meter, UnitStatus, ZeroEngine};
use crate::comms::Comms;
use crate::error::{Error, Result};
use crate::params;
use crate::precision::{Half, LossScaler};
use crate::reduction::Reduction;
use crate::segmented::Segmented;

/// The optimizer's state of rank `rank`: where the plan places it, zeroed, with `lens[u]`
/// elements for trainable unit `u`.
fn opt_state(
    plan: &Plan,
    rank: usize,
    options: EngineOptions,
    device: &burn::tensor::Device,
    lens: &[Option<usize>],
) -> Result<OptState> {
    let c = plan.config();
    let scaler =
        (c.precision == zero_core::Precision::Fp16).then(|| LossScaler::new(c.loss_scaler));
    match (c.optimizer_placement, c.nvme_path.as_deref()) {
        (Placement::Nvme, Some(root)) => {
            let ring = (Path::new(root), rank, c.offload_buffer_count as usize);
            OptState::on_disk(
                options.optimizer,
                ring,
                lens,
                scaler,
                plan.mixed_precision(),
            )
        }
        (p, _) => {
            let state = Place::of(p, device);
            Ok(OptState::new(options.optimizer, state, lens, scaler))
        }
    }
}

impl<C: Communicator, M: Segmented> ZeroEngine<C, M> {
    /// The engine of this rank. `model` must hold the same initial values on every rank; the
    /// plan must describe it (see [`crate::plan_for`]).
    pub(crate) fn new(
        plan: Arc<Plan>,
        mut world: C,
        model: M,
        options: EngineOptions,
    ) -> Result<Self> {
        let rank = world.rank();
        if world.world_size() != plan.world_size() {
            return Err(Error::PlanMismatch {
                what: format!(
                    "the communicator has {} ranks but the plan {}",
                    world.world_size(),
                    plan.world_size()
                ),
            });
        }
        let half = Half::of(plan.config().precision);
        if half.is_some() && options.reduction == Reduction::CanonicalTree {
            return Err(Error::Invalid {
                field: "reduction",
                got: format!("canonical_tree with {:?}", plan.config().precision),
                expected: "rank_ordered (the canonical tree is built for fp32 only), or fp32"
                    .into(),
            });
        }
        if plan.config().optimizer != options.optimizer.kind() {
            return Err(Error::Invalid {
                field: "optimizer",
                got: format!("{:?} in the plan", plan.config().optimizer),
                expected: format!("{:?}, the trainer's optimizer", options.optimizer.kind()),
            });
        }
        if options.reduction == Reduction::CanonicalTree {
            check_canonical_tree(&plan, &world)?;
        }
        let device = model
            .devices()
            .into_iter()
            .next()
            .ok_or_else(|| Error::Invalid {
                field: "model",
                got: "a module with no tensor".into(),
                expected: "at least one parameter".into(),
            })?;
        let params = params::describe(&model);
        let readers = crate::segmented::param_readers(&model, &params)?;
        check_plan_describes(&plan, &crate::model::describe_model(&model)?)?;
        let layout = RankLayout::new(&plan, model.num_segments(), readers)?;
        // Every local check is done: now every rank must agree before anything moves.
        check_ranks_agree(&mut world, &plan, &options, &model)?;
        let units = plan.units();
        let stage = plan.stage();
        let acc_len = layout.acc_len;
        // The optimizer's slot of each trainable unit: the whole unit at stage 0, else the
        // rank's chunk.
        let slot_lens: Vec<Option<usize>> = (0..units.len())
            .map(|u| {
                layout.opt_offset[u].map(|_| {
                    if stage == 0 {
                        units[u].len as usize
                    } else {
                        plan.chunk_len(u) as usize
                    }
                })
            })
            .collect();
        let draws = crate::rng::Draws::new(model.num_segments());
        let comms = Comms::new(world, &plan)?;
        let mut t = Core {
            plan: plan.clone(),
            rank,
            device_tensors: None,
            model,
            device: device.clone(),
            options,
            params,
            layout,
            sharded: Stage3Weights::empty(half, units.len()),
            acc: GradAcc::new(&plan, half, options.reduction, acc_len, &device),
            opt: opt_state(&plan, rank, options, &device, &slot_lens)?,
            status: vec![UnitStatus::Released; units.len()],
            meter: Meter::new(units.len()),
            clock: Clock::default(),
            draws,
        };
        t.init_master()?;
        t.init_shards()?;
        t.init_working_weights()?;
        let mut e = ZeroEngine { comms, core: t };
        e.core.meter.traffic_base = e.traffic();
        Ok(e)
    }
}

impl<C: Communicator, M: Segmented> Core<C, M> {
    /// bf16/fp16: the fp32 master of this rank's part of every trainable unit, from the initial
    /// values.
    fn init_master(&mut self) -> Result<()> {
        let plan = self.plan.clone();
        let (units, stage, rank) = (plan.units(), plan.stage(), self.rank);
        let half = self.half();
        if half.is_some() {
            // The fp32 master of this rank's part of every trainable unit, from the initial
            // values (stage 0: whole units; otherwise the rank's chunk).
            for u in 0..units.len() {
                if self.layout.opt_offset[u].is_none() {
                    continue;
                }
                let full = self.read_unit(u)?;
                let c = plan.chunk_len(u) as usize;
                let mine = if stage == 0 {
                    &full[..]
                } else {
                    &full[rank * c..(rank + 1) * c]
                };
                self.opt.set_master(u, mine)?;
            }
        }
        Ok(())
    }

    /// Stage 3: the rank's shard of every unit, where `param_placement` puts it; the gather units
    /// released.
    fn init_shards(&mut self) -> Result<()> {
        let plan = self.plan.clone();
        let (units, stage, rank) = (plan.units(), plan.stage(), self.rank);
        let device = self.device.clone();
        if stage == 3 {
            // The shard of every unit, from the initial full values; then release gather units.
            let mut chunks = Vec::new();
            for (u, unit) in units.iter().enumerate() {
                let full = self.read_unit(u)?;
                let c = plan.chunk_len(u) as usize;
                chunks.push(full[rank * c..(rank + 1) * c].to_vec());
                if unit.kind == UnitKind::Gather {
                    self.release(u);
                }
            }
            // The shard lives where `param_placement` puts it, whatever the optimizer's placement
            // (the plan books it there): on NVMe, filled in host memory and moved to the store.
            let c = plan.config();
            let on = Place::of(c.param_placement, &device);
            self.sharded.fill(chunks, on);
            if let (Placement::Nvme, Some(root)) = (c.param_placement, c.nvme_path.as_deref()) {
                let store = (Path::new(root), rank, c.offload_buffer_count as usize);
                self.sharded.move_to_disk(store)?;
            }
        }
        Ok(())
    }

    /// The working weights of the parameters this rank keeps resident, as fresh autodiff leaves
    /// (rounded to 16 bits in bf16/fp16).
    fn init_working_weights(&mut self) -> Result<()> {
        let plan = self.plan.clone();
        let stage = plan.stage();
        let half = self.half();
        // Fresh autodiff leaves for the parameters this rank keeps resident. Clones of one module
        // share their tensors (so the clones cost nothing until here, and stage 3 never holds a
        // full copy), and burn's autodiff graph must not be shared between threads: it
        // deadlocks on merge.
        let slots: Vec<usize> = (0..self.params.len())
            .filter(|&i| !(stage == 3 && self.is_gathered_param(i)))
            .collect();
        let want: HashMap<ParamId, usize> = slots
            .iter()
            .enumerate()
            .map(|(k, &i)| (self.params[i].id, k))
            .collect();
        let mut values = params::read_values(&self.model, &want)?;
        if let Some(h) = half {
            // The working weights: the initial values rounded to 16 bits (widened for burn).
            // Buffers keep their precision: they are not weights.
            for (v, &i) in values.iter_mut().zip(&slots) {
                if self.params[i].buffer {
                    continue;
                }
                for x in v.iter_mut() {
                    *x = h.quantize(*x);
                }
            }
        }
        let fresh = slots
            .iter()
            .zip(values)
            .map(|(&i, v)| {
                (
                    self.params[i].id,
                    (v, self.params[i].shape.clone(), self.params[i].trainable),
                )
            })
            .collect();
        self.set_params(fresh);
        Ok(())
    }

    /// Whether parameter `i` lives in a stage-3 gather unit (released between uses).
    pub(super) fn is_gathered_param(&self, i: usize) -> bool {
        self.plan
            .locate(i)
            .is_some_and(|(u, _)| self.plan.units()[u].kind == UnitKind::Gather)
    }
}

/// Refuses a plan made for another model: other names, shapes, trainable flags or buffers, or
/// other segments (the parameters' owners and readers, the segments' order).
fn check_plan_describes(plan: &Plan, model: &zero_core::ModelDesc) -> Result<()> {
    let desc = &plan.model().params;
    let mismatch = |what: String| Err(Error::PlanMismatch { what });
    if desc.len() != model.params.len()
        || desc.iter().zip(&model.params).any(|(d, p)| {
            d.name != p.name
                || d.shape != p.shape
                || d.trainable != p.trainable
                || d.buffer != p.buffer
        })
    {
        return mismatch(
            "the plan was made for a different model (names, shapes, trainable flags or buffers \
             differ)"
                .into(),
        );
    }
    if let Some((d, p)) = desc
        .iter()
        .zip(&model.params)
        .find(|(d, p)| d.module != p.module || (!d.buffer && d.readers != p.readers))
    {
        return mismatch(format!(
            "the plan puts `{}` in module `{}` read by {:?}, the model's segments in `{}` read by \
             {:?} (make the plan with `plan_for`)",
            d.name, d.module, d.readers, p.module, p.readers
        ));
    }
    if plan.model().module_order() != model.module_order() {
        return mismatch(format!(
            "the plan runs the modules {:?}, the model the segments {:?}",
            plan.model().module_order(),
            model.module_order()
        ));
    }
    Ok(())
}

/// What [`Reduction::CanonicalTree`] needs: a communicator that sums in the pairwise-tree order,
/// and no reduction path with an order of its own.
fn check_canonical_tree<C: Communicator>(plan: &Plan, world: &C) -> Result<()> {
    let c = plan.config();
    let order = world.reduce_order();
    if order != Some(zero_comm::ReduceOrder::PairwiseTree) {
        return Err(Error::Invalid {
            field: "reduction",
            got: format!("canonical_tree on a communicator whose reduce order is {order:?}"),
            expected: "a communicator that sums over the pairwise tree (the host loopback built \
                       with ReduceOrder::PairwiseTree), or rank_ordered"
                .into(),
        });
    }
    if c.quantized_gradients {
        return Err(Error::Invalid {
            field: "reduction",
            got: "canonical_tree with qgZ".into(),
            expected: "rank_ordered (qgZ's all-to-all sums in its own order)".into(),
        });
    }
    if c.accumulate_before_reduce && c.gradient_accumulation_steps > 1 {
        return Err(Error::Invalid {
            field: "reduction",
            got: "canonical_tree with accumulate_before_reduce and gradient accumulation".into(),
            expected: "rank_ordered, or a reduction every micro-step (the tree numbers \
                       micro-batches micro-step-major)"
                .into(),
        });
    }
    Ok(())
}

/// Fails every rank alike, before any data moves, unless every rank runs the same plan and options
/// and starts from the same parameter values: one all-gather of two 64-bit fingerprints (FNV-1a of
/// the plan's fingerprint and the options; crc32c of every parameter's bytes, read once). The
/// engine calls it after its local checks, before its first collective. A rank whose local checks
/// fail returns at once without reaching it; its peers then learn of the failure from the backend
/// (the host loopback fails them fast; under MPI the failing process aborts the job).
fn check_ranks_agree<C: Communicator, M: Segmented>(
    comm: &mut C,
    plan: &Plan,
    options: &EngineOptions,
    model: &M,
) -> Result<()> {
    // The fingerprint leaves the optimizer's placement out (it moves no checkpoint byte), but
    // replicas stepped on different devices could drift apart: it must agree too.
    let setup = format!(
        "{}|{:?}|{:?}|{:?}|{}|{:?}",
        zero_core::checkpoint::fingerprint(plan),
        plan.config().optimizer_placement,
        options.optimizer,
        options.reduction,
        options.seed,
        options.buffers
    );
    let setup = setup.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let values = crate::params::values_crc(model);
    let mine: Vec<u8> = [setup, values]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    let all = comm.all_gather_host(&mine)?;
    let word = |r: usize, k: usize| {
        let o = 16 * r + 8 * k;
        u64::from_le_bytes(all[o..o + 8].try_into().unwrap_or([0; 8]))
    };
    for (k, what) in [(0, "plan or options"), (1, "model (parameter values)")] {
        if let Some(rank) = (1..comm.world_size()).find(|&r| word(r, k) != word(0, k)) {
            return Err(Error::RanksDisagree {
                rank: comm.members()[rank],
                what,
                ours: word(0, k),
                theirs: word(rank, k),
            });
        }
    }
    Ok(())
}
