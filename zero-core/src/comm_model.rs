//! The communication model: every collective one optimizer step issues, and the bytes per rank
//! per link class that follow from it (accounting: [`crate::traffic`]).
//!
//! The schedule ([`Plan::schedule`]) is the single source of truth: the trainer issues exactly
//! these collectives, in this order, so measured traffic equals the prediction exactly.
//!
//! Per optimizer step with `A` accumulation micro-steps:
//! - Stage 0: per micro-step, one all-reduce (mean) per bucket.
//! - Stages 1–2: per micro-step, one reduce-scatter (mean) per bucket; after the optimizer step,
//!   one all-gather per bucket. (With `accumulate_before_reduce`, stages 0–1 reduce once per step.)
//! - Stage 3: per micro-step, per gather unit: a forward all-gather over the world; with
//!   activation checkpointing (the default at stage 3) a backward all-gather (over the hpZ group
//!   with hpZ); for trainable units a reduce-scatter (with qgZ: an
//!   intra-node all-to-all then a cross-node all-to-all of int4 wire bytes). Persistent trainable
//!   units: a reduce-scatter per micro-step and an all-gather after the step. With qwZ, weight
//!   all-gathers of gather units move int8 wire bytes (codes plus fp32 scales).
//! - Stages 1–3 with clipping or fp16: one all-gather of each rank's f64 sum of squares (8 bytes)
//!   per step; every rank sums them in rank order, which also detects overflow (a non-finite sum).
//!   Stage 0 computes the same sums locally, chunk by chunk in rank order (gradients are replicated),
//!   so the clip coefficient is bit-identical across stages.
//!
//! Published totals (ring, Ψ elements, N large): 2Ψ for stages 0–2, 3Ψ for stage 3. With this
//! accounting they come out as exactly `(N−1)/N` of those, plus padding.

use serde::Serialize;

use crate::plan::{Plan, UnitKind};
use crate::quant_wire::{int4_wire_len, int8_wire_len};
use crate::topology::Topology;
use crate::traffic::{Collective, CollectiveTraffic, GroupView, LinkBytes, TrafficTable};

/// When in the step an operation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Stage 3 weight gathers before each unit's forward.
    Forward,
    /// Stage 3 weight gathers before each unit's backward.
    Backward,
    /// Gradient reductions.
    GradReduce,
    /// The global-norm / overflow all-reduce.
    Clip,
    /// Weight all-gathers after the optimizer step.
    PostStep,
}

impl Phase {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::GradReduce => "grad_reduce",
            Phase::Clip => "clip",
            Phase::PostStep => "post_step",
        }
    }
}

/// Which ranks a collective runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupKind {
    /// Every rank.
    World,
    /// The rank's hpZ group (consecutive ranks inside a node).
    Hpz,
    /// The ranks of the rank's node.
    IntraNode,
    /// The ranks with the same local index on every node.
    CrossNode,
}

/// What the bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Payload {
    /// Working-precision elements (fp32, bf16 or fp16).
    Working,
    /// f64 scalars, sent as bytes (the global-norm partial sums).
    F64,
    /// qwZ int8 wire bytes.
    Int8,
    /// qgZ int4 wire bytes.
    Int4,
}

/// One collective of the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PlannedOp {
    /// When it runs.
    pub phase: Phase,
    /// Which collective.
    pub collective: Collective,
    /// Over which ranks.
    pub group: GroupKind,
    /// The unit it serves, if any.
    pub unit: Option<usize>,
    /// Element count in [`crate::traffic`]'s sense: per-rank chunk for all-gather and
    /// reduce-scatter, buffer length for all-reduce and all-to-all.
    pub count: u64,
    /// Bytes per element (1 for wire bytes).
    pub elem_bytes: u64,
    /// Payload type.
    pub payload: Payload,
    /// Runs every micro-step (else once per optimizer step).
    pub per_micro_step: bool,
}

/// One row of the per-phase summary.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PhaseRow {
    /// Phase.
    pub phase: Phase,
    /// Collective.
    pub collective: Collective,
    /// Group.
    pub group: GroupKind,
    /// Payload.
    pub payload: Payload,
    /// Traffic of rank `rank` per optimizer step.
    pub traffic: CollectiveTraffic,
}

/// The communication model of one rank for one optimizer step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CommModel {
    /// The rank this is for.
    pub rank: usize,
    /// Bytes this rank sends over intra-node links per optimizer step.
    pub intra_node_bytes: u64,
    /// Bytes this rank sends over inter-node links per optimizer step.
    pub inter_node_bytes: u64,
    /// Collective calls per optimizer step.
    pub calls: u64,
    /// By collective (the table measured traffic is compared with).
    pub by_collective: TrafficTable,
    /// By phase, collective, group and payload.
    pub by_phase: Vec<PhaseRow>,
}

impl Plan {
    /// Every collective of one optimizer step, in issue order within each phase.
    pub fn schedule(&self) -> Vec<PlannedOp> {
        let c = self.config();
        let t = self.topology();
        let n = self.world_size() as u64;
        let w = self.working_bytes();
        let (l, m) = (t.ranks_per_node() as u64, t.num_nodes() as u64);
        let mut ops = Vec::new();
        let op = |phase, collective, group, unit, count, elem_bytes, payload, per_micro_step| {
            PlannedOp {
                phase,
                collective,
                group,
                unit: Some(unit),
                count,
                elem_bytes,
                payload,
                per_micro_step,
            }
        };
        // A unit's shard of working-precision values over the whole world.
        let world = |phase, collective, unit: usize, per_micro_step| {
            let count = self.units()[unit].len / n;
            op(
                phase,
                collective,
                GroupKind::World,
                unit,
                count,
                w,
                Payload::Working,
                per_micro_step,
            )
        };
        let per_micro = !c.accumulate_before_reduce;
        match c.stage {
            0 => {
                for (i, u) in self.units().iter().enumerate() {
                    ops.push(op(
                        Phase::GradReduce,
                        Collective::AllReduce,
                        GroupKind::World,
                        i,
                        u.len,
                        w,
                        Payload::Working,
                        per_micro,
                    ));
                }
            }
            1 | 2 => {
                let units = 0..self.units().len();
                for i in units.clone() {
                    ops.push(world(
                        Phase::GradReduce,
                        Collective::ReduceScatter,
                        i,
                        per_micro,
                    ));
                }
                for i in units {
                    ops.push(world(Phase::PostStep, Collective::AllGather, i, false));
                }
            }
            _ => {
                let gather = |count: u64| {
                    if c.quantized_weights {
                        (
                            int8_wire_len(count, c.qwz_block_size as u64),
                            1,
                            Payload::Int8,
                        )
                    } else {
                        (count, w, Payload::Working)
                    }
                };
                for (i, u) in self.units().iter().enumerate() {
                    if u.kind != UnitKind::Gather {
                        continue;
                    }
                    let (cnt, eb, pl) = gather(u.len / n);
                    ops.push(op(
                        Phase::Forward,
                        Collective::AllGather,
                        GroupKind::World,
                        i,
                        cnt,
                        eb,
                        pl,
                        true,
                    ));
                }
                let order = self.gather_order();
                for (i, u) in self.units().iter().enumerate().rev() {
                    match u.kind {
                        UnitKind::Gather => {
                            // Without activation checkpointing the forward's gathers stay for
                            // the backward; with it, shared units stay too, and the modules
                            // before the first that takes a gradient run no backward.
                            if c.recompute() && order.backward_gather(i) {
                                let (group, count) = match self.hpz() {
                                    Some(h) => (GroupKind::Hpz, u.len / h.size as u64),
                                    None => (GroupKind::World, u.len / n),
                                };
                                let (cnt, eb, pl) = gather(count);
                                ops.push(op(
                                    Phase::Backward,
                                    Collective::AllGather,
                                    group,
                                    i,
                                    cnt,
                                    eb,
                                    pl,
                                    true,
                                ));
                            }
                            if u.trainable {
                                if c.quantized_gradients {
                                    let e = int4_wire_len(u.len / n, c.qgz_block_size as u64);
                                    if l > 1 {
                                        ops.push(op(
                                            Phase::GradReduce,
                                            Collective::AllToAll,
                                            GroupKind::IntraNode,
                                            i,
                                            l * m * e,
                                            1,
                                            Payload::Int4,
                                            true,
                                        ));
                                    }
                                    if m > 1 {
                                        ops.push(op(
                                            Phase::GradReduce,
                                            Collective::AllToAll,
                                            GroupKind::CrossNode,
                                            i,
                                            m * e,
                                            1,
                                            Payload::Int4,
                                            true,
                                        ));
                                    }
                                } else {
                                    ops.push(world(
                                        Phase::GradReduce,
                                        Collective::ReduceScatter,
                                        i,
                                        true,
                                    ));
                                }
                            }
                        }
                        UnitKind::Persistent if u.trainable => {
                            ops.push(world(Phase::GradReduce, Collective::ReduceScatter, i, true));
                        }
                        _ => {}
                    }
                }
                for (i, u) in self.units().iter().enumerate() {
                    if u.kind == UnitKind::Persistent && u.trainable {
                        ops.push(world(Phase::PostStep, Collective::AllGather, i, false));
                    }
                }
            }
        }
        if c.stage >= 1
            && (c.gradient_clipping > 0.0 || c.precision == crate::config::Precision::Fp16)
        {
            // Each rank's f64 sum of squares over its shard, gathered as 8 bytes and summed in
            // rank order on every rank: the same arithmetic as stage 0's local norm.
            ops.push(PlannedOp {
                phase: Phase::Clip,
                collective: Collective::AllGather,
                group: GroupKind::World,
                unit: None,
                count: 8,
                elem_bytes: 1,
                payload: Payload::F64,
                per_micro_step: false,
            });
        }
        ops
    }

    /// The global ranks of `rank`'s group of kind `g`, in group-rank order.
    pub fn group_members(&self, g: GroupKind, rank: usize) -> Vec<usize> {
        let t = self.topology();
        match g {
            GroupKind::World => (0..t.world_size()).collect(),
            GroupKind::Hpz => self.hpz_group(rank).collect(),
            GroupKind::IntraNode => t.node_ranks(t.node_of(rank)).collect(),
            GroupKind::CrossNode => t.cross_node_ranks(t.local_rank(rank)),
        }
    }

    /// The communication model of `rank` for one optimizer step.
    pub fn comm(&self, rank: usize) -> CommModel {
        self.comm_of(rank, false)
    }

    /// The communication model of `rank` for an fp16 step skipped on overflow: everything up to
    /// and including the overflow check, and no [`Phase::PostStep`] all-gathers (the weights did
    /// not change, as in DeepSpeed).
    pub fn comm_skipped_step(&self, rank: usize) -> CommModel {
        self.comm_of(rank, true)
    }

    fn comm_of(&self, rank: usize, skipped: bool) -> CommModel {
        let a = u64::from(self.config().gradient_accumulation_steps);
        let mut cache = BaseCache::new(self.topology());
        let mut by_collective = TrafficTable::new();
        let mut by_phase: Vec<PhaseRow> = Vec::new();
        for op in self.schedule() {
            if skipped && op.phase == Phase::PostStep {
                continue;
            }
            let mut tr = cache.traffic(self, &op, rank);
            if op.per_micro_step {
                tr = tr.scaled(a);
            }
            by_collective.record(op.collective, tr);
            match by_phase.iter_mut().find(|r| {
                (r.phase, r.collective, r.group, r.payload)
                    == (op.phase, op.collective, op.group, op.payload)
            }) {
                Some(row) => row.traffic += tr,
                None => by_phase.push(PhaseRow {
                    phase: op.phase,
                    collective: op.collective,
                    group: op.group,
                    payload: op.payload,
                    traffic: tr,
                }),
            }
        }
        by_phase.sort_by_key(|r| (r.phase, r.collective, r.group));
        let sent = by_collective.sent();
        CommModel {
            rank,
            intra_node_bytes: sent.intra_node,
            inter_node_bytes: sent.inter_node,
            calls: by_collective.calls(),
            by_collective,
            by_phase,
        }
    }

    /// The traffic of one planned op on `rank` (one call).
    pub fn op_traffic(&self, op: &PlannedOp, rank: usize) -> CollectiveTraffic {
        BaseCache::new(self.topology()).traffic(self, op, rank)
    }
}

/// Per-group unit traffic, so the model costs `O(ops)` rather than `O(ops × N)`.
struct BaseCache<'a> {
    topology: &'a Topology,
    members: Vec<(GroupKind, Vec<usize>, usize)>,
    unit: Vec<(GroupKind, Collective, LinkBytes, LinkBytes)>,
}

impl<'a> BaseCache<'a> {
    fn new(topology: &'a Topology) -> Self {
        BaseCache {
            topology,
            members: Vec::new(),
            unit: Vec::new(),
        }
    }

    fn traffic(&mut self, plan: &Plan, op: &PlannedOp, rank: usize) -> CollectiveTraffic {
        if !self.members.iter().any(|m| m.0 == op.group) {
            let members = plan.group_members(op.group, rank);
            let me = members
                .iter()
                .position(|&g| g == rank)
                .expect("rank is in its own group");
            self.members.push((op.group, members, me));
        }
        let (_, members, me) = self
            .members
            .iter()
            .find(|m| m.0 == op.group)
            .expect("cached above");
        let view = GroupView {
            topology: self.topology,
            members,
            me: *me,
        };
        let n = members.len() as u64;
        let linear = match op.collective {
            Collective::AllGather | Collective::ReduceScatter => true,
            Collective::AllReduce | Collective::AllToAll => op.count.is_multiple_of(n),
            Collective::Broadcast | Collective::Barrier => false,
        };
        if !linear {
            return match op.collective {
                Collective::AllReduce => view.all_reduce(op.count, op.elem_bytes),
                Collective::AllToAll => view.all_to_all(op.count, op.elem_bytes),
                Collective::Broadcast => view.broadcast(op.count, op.elem_bytes, 0),
                _ => view.barrier(),
            };
        }
        let (sent, recv) = match self
            .unit
            .iter()
            .find(|e| e.0 == op.group && e.1 == op.collective)
        {
            Some(e) => (e.2, e.3),
            None => {
                // Traffic per unit of `count` (per n elements for all-reduce and all-to-all).
                let t = match op.collective {
                    Collective::AllGather => view.all_gather(1, 1),
                    Collective::ReduceScatter => view.reduce_scatter(1, 1),
                    Collective::AllReduce => view.all_reduce(n, 1),
                    _ => view.all_to_all(n, 1),
                };
                self.unit
                    .push((op.group, op.collective, t.sent, t.received));
                (t.sent, t.received)
            }
        };
        let k = match op.collective {
            Collective::AllReduce | Collective::AllToAll => op.count / n,
            _ => op.count,
        } * op.elem_bytes;
        CollectiveTraffic {
            calls: 1,
            sent: sent.scaled(k),
            received: recv.scaled(k),
        }
    }
}
