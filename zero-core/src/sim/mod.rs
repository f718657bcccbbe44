//! The simulator: a [`Plan`] and a [`Cluster`] in, step time, throughput and memory out.
//!
//! Pure like the rest of zero-core. The collectives are the plan's own ([`Plan::schedule`]),
//! their bytes [`Plan::op_traffic`]'s, so the bytes a prediction rests on equal [`Plan::comm`]
//! exactly ([`SimReport::plan_traffic`]). Only time is added:
//!
//! 1. **Each collective** costs what [`collective::cost`] says for its group (world, hpZ group,
//!    node, cross-node peers), its buffer and the cluster: α-β per protocol, ring or tree, with
//!    NVLink and NIC bytes of the algorithm (which differ from the logical per-peer accounting:
//!    a ring forwards, so a node's NICs carry each chunk once). qgZ's two all-to-alls are the
//!    plan's two ops, one per link class.
//! 2. **Codecs** around qwZ and qgZ run at `fraction · HBM bandwidth` of tensor bytes (memory
//!    bound, so `fraction · HBM / W` elements/s with `W` working bytes per element): a qwZ all-gather of `c` elements per rank over `n`
//!    encodes `c` and decodes `n·c`; qgZ encodes and decode-accumulates the unit's `len`
//!    elements around the intra-node all-to-all and `len/L` around the cross-node one (`len` if
//!    there is no intra-node phase). Codec time adds to its collective's time.
//! 3. **Compute** ([`compute`]): FLOPs over `peak(precision) · compute_efficiency`; the optimizer
//!    step streams `2·(K + M) + G + W` bytes per element of the rank's trainable shard (the whole
//!    model at stage 0) at HBM bandwidth (`K` optimizer state, `M` master, `G` gradient, `W`
//!    working weight bytes).
//! 4. **Overlap**, a fraction `φ` (0 none, 1 full; by default 1 if the config's `overlap_comm`,
//!    else 0). Per micro-step two windows: forward (stage-3 forward gathers against forward
//!    compute) and backward (backward gathers and every per-micro-step reduction against backward
//!    plus recompute). In each, `exposed = C − φ·min(C, compute)`. Collectives once per optimizer
//!    step (clip, post-step gathers, reductions deferred by `accumulate_before_reduce`) are fully
//!    exposed. Not modelled: the first gather and last reduction that no prefetch can hide, and
//!    the SMs NCCL takes from compute while overlapping.
//! 5. **Step** `= A·(F + B + R + exposed_f + exposed_b) + per-step comm + optimizer`, with `A`
//!    accumulation micro-steps of `tokens_per_gpu` tokens each. `tokens/s = N·A·T / step`;
//!    `TFLOPs/GPU` = hardware FLOPs (recompute counted, Megatron's convention) per step time.
//! 6. **Offload** (`sim/offload.rs`, from the cluster's `host`: PCIe, host memory, NVMe): an
//!    offloaded optimizer steps at host-memory bandwidth with its PCIe and disk moves; stage 3's
//!    parameter chunks cross PCIe (and come off NVMe) for each world gather, in its window.
//! 7. **Memory** per GPU: [`Plan::memory`]'s device bytes plus activations ([`compute::activation_bytes`])
//!    when the model's shape is known; it fits if that is at most the GPU's memory (CUDA context,
//!    allocator fragmentation and logits not counted).

pub mod cluster;
pub mod collective;
pub mod compute;
mod offload;
mod report;
pub use report::{
    CommTimes, ComputeTimes, MemoryFit, OffloadTimes, PhaseTime, SimReport, config_label,
};
pub mod sweep;

use std::collections::HashMap;

use serde::Serialize;

pub use cluster::{CLUSTER_PRESETS, Cluster};
pub use collective::{Algorithm, GroupShape, OpCost};
pub use compute::{ModelShape, StepFlops};
pub use sweep::{SweepAxis, SweepRow, SweepTable, Variant};

use crate::comm_model::{GroupKind, Payload, Phase, PlannedOp};
use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::topology::Topology;
use crate::traffic::{Collective, TrafficTable};

/// How much communication may hide under compute.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// Everything is exposed.
    None,
    /// As much as the compute of its window allows.
    Full,
    /// A fraction in `[0, 1]` of what full overlap would hide.
    Fraction(f64),
}

impl Overlap {
    /// The fraction `φ`.
    pub fn fraction(self) -> f64 {
        match self {
            Overlap::None => 0.0,
            Overlap::Full => 1.0,
            Overlap::Fraction(f) => f,
        }
    }

    /// Parses `none`, `full` or a number in `[0, 1]`.
    pub fn parse(s: &str) -> Result<Overlap> {
        match s {
            "none" => Ok(Overlap::None),
            "full" => Ok(Overlap::Full),
            _ => match s.parse::<f64>() {
                Ok(f) if (0.0..=1.0).contains(&f) => Ok(Overlap::Fraction(f)),
                _ => Err(Error::invalid(
                    "overlap",
                    s,
                    "none, full or a fraction in [0, 1]",
                )),
            },
        }
    }
}

/// What the simulator needs beyond the plan and the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SimOptions {
    /// Tokens per GPU per micro-step.
    pub tokens_per_gpu: u64,
    /// The transformer's shape, for attention FLOPs and activations (`None`: both omitted).
    pub shape: Option<ModelShape>,
    /// Activation checkpointing: one more forward in the backward (the trainer always does it).
    pub recompute: bool,
    /// Overlap; `None` takes it from the config's `overlap_comm`.
    pub overlap: Option<Overlap>,
}

impl Cluster {
    /// The topology of `nodes` nodes of this cluster.
    pub fn topology(&self, nodes: usize) -> Result<Topology> {
        if nodes == 0 {
            return Err(Error::invalid("nodes", "0", "at least 1 node"));
        }
        Topology::new(nodes * self.gpus_per_node, self.gpus_per_node)
    }
}

/// What makes two planned ops cost the same: phase, collective, group, payload, count, element
/// bytes, per micro-step, and the unit length (codec work; 0 for unquantized payloads).
type OpKey = (Phase, Collective, GroupKind, Payload, u64, u64, bool, u64);

/// Simulates one optimizer step of `plan` on `cluster`.
pub fn simulate(plan: &Plan, cluster: &Cluster, opts: &SimOptions) -> Result<SimReport> {
    let t = *plan.topology();
    let c = plan.config();
    if t.ranks_per_node() != cluster.gpus_per_node {
        return Err(Error::invalid(
            "topology.ranks_per_node",
            t.ranks_per_node().to_string(),
            format!("the cluster's gpus_per_node ({})", cluster.gpus_per_node),
        ));
    }
    if opts.tokens_per_gpu == 0 {
        return Err(Error::invalid("tokens_per_gpu", "0", "at least 1 token"));
    }
    for (field, p) in [
        ("optimizer_placement", c.optimizer_placement),
        ("param_placement", c.param_placement),
    ] {
        if p.is_offloaded() && cluster.host.is_none() {
            // The step's time would be the CPU's, PCIe's and the disk's.
            return Err(Error::invalid(
                field,
                p.name(),
                "device, or a cluster with a `host` table (pcie_gbytes_per_s, \
                 memory_gbytes_per_s, nvme_gbytes_per_s; every preset has one)",
            ));
        }
    }
    if let Some(s) = opts.shape
        && (s.layers > compute::MAX_LAYERS as u64 || s.hidden > 1 << 20 || s.seq_len > 1 << 24)
    {
        return Err(Error::invalid(
            "shape",
            format!(
                "{} layers, hidden {}, sequence length {}",
                s.layers, s.hidden, s.seq_len
            ),
            format!(
                "at most {} layers, hidden 2^20 and sequence length 2^24",
                compute::MAX_LAYERS
            ),
        ));
    }
    if let Some(s) = opts.shape
        && (s.layers == 0 || s.hidden == 0 || s.seq_len == 0)
    {
        return Err(Error::invalid(
            "shape",
            format!(
                "{} layers, hidden {}, sequence length {}",
                s.layers, s.hidden, s.seq_len
            ),
            "layers, hidden size and sequence length of at least 1",
        ));
    }
    if let Some(s) = opts.shape
        && !opts.tokens_per_gpu.is_multiple_of(s.seq_len)
    {
        return Err(Error::invalid(
            "tokens_per_gpu",
            opts.tokens_per_gpu.to_string(),
            format!(
                "a multiple of the sequence length {} (whole sequences per GPU)",
                s.seq_len
            ),
        ));
    }
    let rate = cluster.sustained_flops(c.precision)?;
    let phi = opts
        .overlap
        .unwrap_or(if c.overlap_comm {
            Overlap::Full
        } else {
            Overlap::None
        })
        .fraction();
    let a = u64::from(c.gradient_accumulation_steps);
    let (l, m) = (t.ranks_per_node(), t.num_nodes());
    let shape_of = |g: GroupKind| match g {
        GroupKind::World => GroupShape {
            n: t.world_size(),
            nodes: m,
            per_node: l,
        },
        GroupKind::Hpz => {
            let h = plan.hpz().map_or(1, |h| h.size);
            GroupShape {
                n: h,
                nodes: 1,
                per_node: h,
            }
        }
        GroupKind::IntraNode => GroupShape {
            n: l,
            nodes: 1,
            per_node: l,
        },
        GroupKind::CrossNode => GroupShape {
            n: m,
            nodes: m,
            per_node: 1,
        },
    };
    // Distinct ops with their multiplicity: a model's units come in few sizes.
    let mut distinct: Vec<(PlannedOp, u64, u64)> = Vec::new();
    let mut index: HashMap<OpKey, usize> = HashMap::new();
    for op in plan.schedule() {
        let unit_len = match op.payload {
            Payload::Int8 | Payload::Int4 => op.unit.map_or(0, |u| plan.units()[u].len),
            _ => 0,
        };
        let key = (
            op.phase,
            op.collective,
            op.group,
            op.payload,
            op.count,
            op.elem_bytes,
            op.per_micro_step,
            unit_len,
        );
        match index.get(&key) {
            Some(&i) => distinct[i].1 += 1,
            None => {
                index.insert(key, distinct.len());
                distinct.push((op, 1, unit_len));
            }
        }
    }
    let hbm = cluster.gpu.hbm_gbytes_per_s * 1e9;
    let w = plan.working_bytes() as f64;
    let elems_per_s = |fraction: f64| fraction * hbm / w;
    let mut plan_traffic = TrafficTable::new();
    let mut rows: Vec<(PhaseTime, f64)> = Vec::new();
    let (mut win_f, mut win_b, mut per_step) = (0.0, 0.0, 0.0);
    for (op, k, unit_len) in &distinct {
        let calls = k * if op.per_micro_step { a } else { 1 };
        let traffic = plan.op_traffic(op, 0).scaled(calls);
        plan_traffic.record(op.collective, traffic);
        let g = shape_of(op.group);
        let n = g.n as f64;
        let one = (op.count * op.elem_bytes) as f64;
        let s = match op.collective {
            Collective::AllGather | Collective::ReduceScatter => n * one,
            _ => one,
        };
        let (alg, cost) = collective::cost(cluster, g, op.collective, s);
        let len = *unit_len as f64;
        let codec = match (op.payload, op.group) {
            (Payload::Int8, _) if g.n > 1 => {
                let chunk = len / n;
                chunk / elems_per_s(cluster.codec.int8_encode)
                    + n * chunk / elems_per_s(cluster.codec.int8_decode)
            }
            (Payload::Int4, GroupKind::CrossNode) if g.n > 1 => {
                let e = if l > 1 { len / l as f64 } else { len };
                e / elems_per_s(cluster.codec.int4_encode)
                    + e / elems_per_s(cluster.codec.int4_decode)
            }
            (Payload::Int4, _) if g.n > 1 => {
                len / elems_per_s(cluster.codec.int4_encode)
                    + len / elems_per_s(cluster.codec.int4_decode)
            }
            _ => 0.0,
        };
        let call = cost.seconds + codec;
        let x = calls as f64;
        if !op.per_micro_step {
            per_step += x * call;
        } else if op.phase == Phase::Forward {
            win_f += *k as f64 * call;
        } else {
            win_b += *k as f64 * call;
        }
        let row = PhaseTime {
            phase: op.phase,
            collective: op.collective,
            group: op.group,
            payload: op.payload,
            algorithm: alg,
            calls,
            seconds: x * call,
            latency_seconds: x * cost.latency_seconds,
            intra_node_seconds: x * cost.intra_seconds,
            inter_node_seconds: x * cost.inter_seconds,
            codec_seconds: x * codec,
            plan_sent: traffic.sent,
            intra_wire_bytes_per_gpu: x * cost.intra_bytes_per_gpu,
            inter_wire_bytes_per_node: x * cost.inter_bytes_per_node,
        };
        match rows.iter_mut().find(|(r, _)| {
            (r.phase, r.collective, r.group, r.payload)
                == (op.phase, op.collective, op.group, op.payload)
        }) {
            Some((r, worst)) => {
                if call > *worst {
                    *worst = call;
                    r.algorithm = alg;
                }
                r.calls += row.calls;
                r.seconds += row.seconds;
                r.latency_seconds += row.latency_seconds;
                r.intra_node_seconds += row.intra_node_seconds;
                r.inter_node_seconds += row.inter_node_seconds;
                r.codec_seconds += row.codec_seconds;
                r.plan_sent += row.plan_sent;
                r.intra_wire_bytes_per_gpu += row.intra_wire_bytes_per_gpu;
                r.inter_wire_bytes_per_node += row.inter_wire_bytes_per_node;
            }
            None => rows.push((row, call)),
        }
    }
    let (mut offload_f, mut offload_b, mut shard_back) = (0.0, 0.0, 0.0);
    if let Some(h) = &cluster.host {
        (offload_f, offload_b, shard_back) = offload::param_moves(plan, h, l);
    }
    let (win_f, win_b, per_step) = (win_f + offload_f, win_b + offload_b, per_step + shard_back);
    let mut by_phase: Vec<PhaseTime> = rows.into_iter().map(|(r, _)| r).collect();
    by_phase.sort_by_key(|r| (r.phase, r.collective, r.group));

    let flops = compute::flops(
        plan.model(),
        opts.shape,
        opts.tokens_per_gpu,
        opts.recompute,
    );
    let (f, b, r) = (
        flops.forward / rate,
        flops.backward / rate,
        flops.recompute / rate,
    );
    let exposed = |comm: f64, compute: f64| comm - phi * comm.min(compute);
    let (ef, eb) = (exposed(win_f, f), exposed(win_b, b + r));
    let optimizer = optimizer_seconds(plan, cluster);
    let af = a as f64;
    let step = af * (f + b + r + ef + eb) + per_step + optimizer;
    let total = |g: fn(&PhaseTime) -> f64| by_phase.iter().map(g).sum::<f64>();
    let comm = CommTimes {
        seconds: total(|r| r.seconds),
        exposed_seconds: af * (ef + eb) + per_step,
        latency_seconds: total(|r| r.latency_seconds),
        codec_seconds: total(|r| r.codec_seconds),
        intra_node_seconds: total(|r| r.intra_node_seconds),
        inter_node_seconds: total(|r| r.inter_node_seconds),
        intra_wire_bytes_per_gpu: total(|r| r.intra_wire_bytes_per_gpu),
        inter_wire_bytes_per_node: total(|r| r.inter_wire_bytes_per_node),
        by_phase,
    };
    let mm = plan.memory();
    let act = opts.shape.map(|s| {
        compute::activation_bytes(s, opts.tokens_per_gpu, plan.working_bytes(), opts.recompute)
    });
    // Offloaded optimizer state is in host memory, not the GPU's.
    let total_bytes = mm.device_bytes + act.unwrap_or(0);
    let n = t.world_size() as f64;
    Ok(SimReport {
        cluster: cluster.name.clone(),
        nodes: m,
        gpus_per_node: l,
        world_size: t.world_size(),
        nic_gbps_per_node: cluster.nic_gbps_per_node(),
        config: report::config_label(c),
        tokens_per_gpu: opts.tokens_per_gpu,
        grad_accum: c.gradient_accumulation_steps,
        overlap: phi,
        step_seconds: step,
        tokens_per_sec: n * af * opts.tokens_per_gpu as f64 / step,
        tflops_per_gpu: af * flops.hardware() / step / 1e12,
        model_tflops_per_gpu: af * flops.model / step / 1e12,
        offload: (offload_f + offload_b + shard_back > 0.0).then_some(OffloadTimes {
            gather_copies_seconds: af * (offload_f + offload_b),
            shard_back_seconds: shard_back,
        }),
        compute: ComputeTimes {
            forward_seconds: af * f,
            backward_seconds: af * b,
            recompute_seconds: af * r,
            optimizer_seconds: optimizer,
            flops,
        },
        comm,
        plan_traffic,
        memory: MemoryFit {
            model: mm,
            activation_bytes: act,
            total_bytes,
            gpu_bytes: cluster.gpu_memory_bytes(),
            fits: total_bytes <= cluster.gpu_memory_bytes(),
        },
    })
}

/// The optimizer step: `2·(K + M) + G + W` bytes per trainable element the rank steps, at HBM
/// bandwidth; off the GPU, at the host's ([`offload::optimizer_seconds`]).
fn optimizer_seconds(plan: &Plan, cluster: &Cluster) -> f64 {
    let c = plan.config();
    let n = plan.world_size() as u64;
    let elems: u64 = plan
        .units()
        .iter()
        .filter(|u| u.trainable)
        .map(|u| if c.stage == 0 { u.len } else { u.len / n })
        .sum();
    let master = if plan.mixed_precision() { 4 } else { 0 };
    let state = c.optimizer.state_bytes() + master;
    let per = 2 * state + plan.grad_accum_bytes() + plan.working_bytes();
    match &cluster.host {
        Some(h) if c.optimizer_placement.is_offloaded() => {
            let bytes = (plan.grad_accum_bytes(), plan.working_bytes());
            let parts = (per as f64, state as f64, bytes.0 as f64, bytes.1 as f64);
            offload::optimizer_seconds(plan, h, cluster.gpus_per_node, elems as f64, parts)
        }
        _ => (elems * per) as f64 / (cluster.gpu.hbm_gbytes_per_s * 1e9),
    }
}
