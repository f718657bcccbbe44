//! Where one rank's state lives and which collectives serve each unit, derived once from the
//! plan (its units and its schedule) and the model's segments: pure (no burn, no communicator)
//! and immutable after the engine is built.

use zero_core::{Collective, GatherOrder, GroupKind, Phase, Plan, UnitKind};

use crate::error::{Error, Result};

/// One rank's layout of the plan's units over the model's segments and its flat buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RankLayout {
    /// The segment that owns every parameter (indexed like the plan's model): the first that
    /// visits it.
    pub(crate) param_segment: Vec<usize>,
    /// The segments that visit every parameter, ascending (the owner first; more than one for a
    /// tied weight).
    pub(crate) param_readers: Vec<Vec<usize>>,
    /// Units completed by each segment's backward (the lowest segment of their parameters), in
    /// plan order: their reductions are submitted once that segment's backward is done.
    pub(crate) completes_at: Vec<Vec<usize>>,
    /// The plan's order of the segments: the stage-3 gather units each needs
    /// (`order.needs`), which run a backward, how long shared units stay.
    pub(crate) order: GatherOrder,
    /// Offset of each trainable unit in the gradient accumulator (whole units at stage 0 and at
    /// stage 1 with `accumulate_before_reduce`, the rank's chunk otherwise).
    pub(crate) acc_offset: Vec<Option<usize>>,
    /// Offset of each trainable unit in the optimizer state and the master weights (whole units
    /// at stage 0, the rank's chunk otherwise).
    pub(crate) opt_offset: Vec<Option<usize>>,
    /// Elements of the gradient accumulator.
    pub(crate) acc_len: usize,
    /// Elements of the optimizer state (per moment) and of the master weights.
    pub(crate) opt_len: usize,
    /// How each trainable unit's gradients are reduced, read from `Plan::schedule()`.
    pub(crate) reduce: Vec<Option<ReduceBy>>,
    /// The group each stage-3 gather unit is gathered over for the backward (with activation
    /// checkpointing), read from `Plan::schedule()`: the world, or the hpZ group.
    pub(crate) backward_gather: Vec<Option<GroupKind>>,
}

/// How a trainable unit's gradients are reduced: the collective the plan's schedule lists for
/// it, so the micro-step runs what the plan counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReduceBy {
    /// Stage 0: an all-reduce of the whole unit.
    AllReduce,
    /// A reduce-scatter to the ranks' chunks.
    ReduceScatter,
    /// qgZ: int4 all-to-alls within the node, then across nodes.
    Qgz,
}

impl RankLayout {
    /// Unit `u`'s offset in the gradient accumulator and its reduction: both for a trainable
    /// unit (the build checks that the schedule reduces every trainable unit and nothing else),
    /// neither for a frozen one.
    pub(crate) fn reduction(&self, u: usize) -> Option<(usize, ReduceBy)> {
        self.acc_offset[u].zip(self.reduce[u])
    }

    /// The layout of `plan` for a model of `segments` segments whose parameter `i` is visited
    /// by segments `param_readers[i]` (ascending). A stage-3 gather unit must lie within one
    /// segment, and the plan's modules must be the segments.
    pub(crate) fn new(
        plan: &Plan,
        segments: usize,
        param_readers: Vec<Vec<usize>>,
    ) -> Result<Self> {
        let units = plan.units();
        let stage = plan.stage();
        let n = plan.world_size();
        let full_acc = stage == 0 || (stage == 1 && plan.config().accumulate_before_reduce);
        let order = plan.gather_order();
        if order.modules.len() != segments {
            return Err(Error::PlanMismatch {
                what: format!(
                    "the plan runs {} modules, the model has {segments} segments",
                    order.modules.len()
                ),
            });
        }
        let param_segment = param_readers
            .iter()
            .map(|r| r.first().copied().unwrap_or(usize::MAX))
            .collect();
        let mut l = RankLayout {
            completes_at: vec![Vec::new(); segments],
            param_readers,
            order,
            acc_offset: vec![None; units.len()],
            opt_offset: vec![None; units.len()],
            acc_len: 0,
            opt_len: 0,
            param_segment,
            reduce: vec![None; units.len()],
            backward_gather: vec![None; units.len()],
        };
        for (u, unit) in units.iter().enumerate() {
            let segs = plan
                .unit_entries(u)
                .iter()
                .map(|e| l.param_segment[e.param]);
            let (lo, hi) = segs.fold((usize::MAX, 0), |(lo, hi), s| (lo.min(s), hi.max(s)));
            if lo >= segments || hi >= segments {
                return Err(Error::PlanMismatch {
                    what: format!("unit {u} has no parameter in the model's {segments} segments"),
                });
            }
            let len = unit.len as usize;
            if unit.trainable {
                l.completes_at[lo].push(u);
                l.acc_offset[u] = Some(l.acc_len);
                l.acc_len += if full_acc { len } else { len / n };
                l.opt_offset[u] = Some(l.opt_len);
                l.opt_len += if stage == 0 { len } else { len / n };
            }
            if unit.kind == UnitKind::Gather && lo != hi {
                return Err(Error::PlanMismatch {
                    what: format!(
                        "gather unit {u} spans segments {lo}..={hi}; group parameters by segment"
                    ),
                });
            }
        }
        // A unit is reduced after the backward of its lowest segment, which must run one.
        if let Some(s) =
            (0..l.order.backward_from.min(segments)).find(|&s| !l.completes_at[s].is_empty())
        {
            return Err(Error::PlanMismatch {
                what: format!(
                    "segment {s} owns trainable units but runs no backward (the plan's backward \
                     starts at segment {})",
                    l.order.backward_from
                ),
            });
        }
        l.read_schedule(plan)?;
        Ok(l)
    }

    /// Each unit's reduction and backward gather from the plan's schedule. Every trainable unit
    /// is reduced by exactly one kind of collective, and nothing else is.
    fn read_schedule(&mut self, plan: &Plan) -> Result<()> {
        let mismatch = |what: String| Err(Error::PlanMismatch { what });
        for op in plan.schedule() {
            let Some(u) = op.unit else { continue };
            let kind = match (op.phase, op.collective) {
                (Phase::GradReduce, Collective::AllReduce) => ReduceBy::AllReduce,
                (Phase::GradReduce, Collective::ReduceScatter) => ReduceBy::ReduceScatter,
                (Phase::GradReduce, Collective::AllToAll) => ReduceBy::Qgz,
                (Phase::Backward, Collective::AllGather) => {
                    if !self.order.backward_gather(u) {
                        return mismatch(format!(
                            "the schedule gathers unit {u} for the backward, which keeps it from \
                             the forward or runs no backward for its segment"
                        ));
                    }
                    self.backward_gather[u] = Some(op.group);
                    continue;
                }
                _ => continue,
            };
            match self.reduce[u].replace(kind) {
                Some(k) if k != kind => {
                    return mismatch(format!(
                        "the schedule reduces unit {u} by {k:?} and {kind:?}"
                    ));
                }
                _ => {}
            }
        }
        for (u, unit) in plan.units().iter().enumerate() {
            // qgZ's all-to-alls move nothing in a group of one rank, so the schedule lists none
            // at world size 1; the unit still goes through qgZ's codec path.
            let qgz_alone = plan.world_size() == 1
                && plan.config().quantized_gradients
                && plan.stage() == 3
                && unit.kind == UnitKind::Gather;
            if unit.trainable && self.reduce[u].is_none() && qgz_alone {
                self.reduce[u] = Some(ReduceBy::Qgz);
            }
            if unit.trainable != self.reduce[u].is_some() {
                return mismatch(format!(
                    "the schedule's reductions of unit {u} ({:?}) do not match its being {}",
                    self.reduce[u],
                    if unit.trainable {
                        "trainable"
                    } else {
                        "frozen"
                    }
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use zero_core::{ModelDesc, ParamDesc, Topology, ZeroConfig};

    use super::*;

    /// Two segments: `a.*` in segment 0, `b.*` in segment 1; `b.f` frozen.
    fn model() -> ModelDesc {
        ModelDesc::new(vec![
            ParamDesc::new("a.w", &[4, 4], "a"),
            ParamDesc::new("a.b", &[4], "a"),
            ParamDesc::new("b.w", &[6], "b"),
            ParamDesc::new("b.f", &[2], "b").frozen(),
        ])
    }

    /// Every parameter visited by one segment, `segment[i]`.
    fn owners(segment: &[usize]) -> Vec<Vec<usize>> {
        segment.iter().map(|&s| vec![s]).collect()
    }

    fn plan(cfg: ZeroConfig) -> Plan {
        Plan::new(&model(), Topology::single_node(2).unwrap(), &cfg).unwrap()
    }

    #[test]
    fn offsets_are_dense_and_sized_by_stage() {
        for (stage, abr, whole_acc, whole_opt) in [
            (0, false, true, true),
            (1, false, false, false),
            (1, true, true, false),
            (2, false, false, false),
            (3, false, false, false),
        ] {
            let p = plan(ZeroConfig {
                stage,
                accumulate_before_reduce: abr,
                reduce_bucket_size: 8,
                ..Default::default()
            });
            let l = RankLayout::new(&p, 2, owners(&[0, 0, 1, 1])).unwrap();
            let (mut acc, mut opt) = (0, 0);
            for (u, unit) in p.units().iter().enumerate() {
                let len = unit.len as usize;
                if !unit.trainable {
                    assert_eq!((l.acc_offset[u], l.opt_offset[u]), (None, None));
                    continue;
                }
                assert_eq!(l.acc_offset[u], Some(acc), "stage {stage} unit {u}");
                assert_eq!(l.opt_offset[u], Some(opt), "stage {stage} unit {u}");
                acc += if whole_acc { len } else { len / 2 };
                opt += if whole_opt { len } else { len / 2 };
            }
            assert_eq!((l.acc_len, l.opt_len), (acc, opt), "stage {stage}");
            // Every trainable unit completes at exactly one segment.
            let completes: usize = l.completes_at.iter().map(Vec::len).sum();
            assert_eq!(completes, p.units().iter().filter(|u| u.trainable).count());
        }
    }

    #[test]
    fn stage3_gather_units_belong_to_their_segment() {
        let p = plan(ZeroConfig {
            stage: 3,
            param_persistence_threshold: 0,
            ..Default::default()
        });
        let l = RankLayout::new(&p, 2, owners(&[0, 0, 1, 1])).unwrap();
        for (s, units) in l.order.needs.iter().enumerate() {
            assert!(!units.is_empty(), "segment {s} has gather units");
            for &u in units {
                assert_eq!(p.units()[u].kind, UnitKind::Gather);
                for e in p.unit_entries(u) {
                    assert_eq!(l.param_segment[e.param], s);
                }
            }
        }
    }

    /// The reductions and backward gathers the micro-step runs are the schedule's: stage 0
    /// all-reduces, 1–2 reduce-scatter, 3 reduce-scatters or (qgZ) all-to-alls gather units,
    /// frozen units are never reduced, backward gathers run over the hpZ group when it is on.
    #[test]
    fn collectives_are_read_from_the_schedule() {
        for (stage, qgz, hpz, want) in [
            (0, false, 1, ReduceBy::AllReduce),
            (1, false, 1, ReduceBy::ReduceScatter),
            (2, false, 1, ReduceBy::ReduceScatter),
            (3, false, 1, ReduceBy::ReduceScatter),
            (3, true, 2, ReduceBy::Qgz),
        ] {
            let p = plan(ZeroConfig {
                stage,
                quantized_gradients: qgz,
                hpz_partition_size: hpz,
                param_persistence_threshold: 0,
                ..Default::default()
            });
            let l = RankLayout::new(&p, 2, owners(&[0, 0, 1, 1])).unwrap();
            for (u, unit) in p.units().iter().enumerate() {
                let reduce = unit.trainable.then_some(want);
                assert_eq!(l.reduce[u], reduce, "stage {stage} unit {u}");
                let back = (stage == 3 && p.config().recompute()).then_some(if hpz > 1 {
                    GroupKind::Hpz
                } else {
                    GroupKind::World
                });
                assert_eq!(l.backward_gather[u], back, "stage {stage} unit {u}");
            }
        }
    }

    #[test]
    fn a_gather_unit_across_segments_is_refused() {
        let p = plan(ZeroConfig {
            stage: 3,
            param_persistence_threshold: 0,
            ..Default::default()
        });
        // `a.b` in segment 1: the gather unit of module `a` holds parameters of two segments.
        let err = RankLayout::new(&p, 2, owners(&[0, 1, 1, 1])).unwrap_err();
        assert!(
            matches!(&err, Error::PlanMismatch { what } if what.contains("spans segments")),
            "{err}"
        );
    }
}
