//! What a simulation reports, and its readable form.

use std::fmt;

use serde::Serialize;

use crate::comm_model::{GroupKind, Payload, Phase};
use crate::config::ZeroConfig;
use crate::memory::MemoryModel;
use crate::report::human_bytes;
use crate::sim::{Algorithm, StepFlops};
use crate::traffic::{Collective, LinkBytes, TrafficTable};

/// Compute times per optimizer step, s.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ComputeTimes {
    /// Forward, all micro-steps.
    pub forward_seconds: f64,
    /// Backward, all micro-steps.
    pub backward_seconds: f64,
    /// Recomputed forward, all micro-steps.
    pub recompute_seconds: f64,
    /// The optimizer step.
    pub optimizer_seconds: f64,
    /// FLOPs per GPU per micro-step.
    pub flops: StepFlops,
}

/// Offloaded state's moves per optimizer step, beside the optimizer's own (in
/// [`ComputeTimes::optimizer_seconds`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct OffloadTimes {
    /// Stage 3's parameter chunks copied to the GPU (from NVMe too) for the world gathers, all
    /// micro-steps; in the gathers' windows, hidden as far as overlap hides them, s.
    pub gather_copies_seconds: f64,
    /// The updated parameter shard moved back after the step (PCIe, NVMe), s.
    pub shard_back_seconds: f64,
}

/// Communication of one (phase, collective, group, payload) row, per optimizer step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PhaseTime {
    /// Phase.
    pub phase: Phase,
    /// Collective.
    pub collective: Collective,
    /// Group.
    pub group: GroupKind,
    /// Payload.
    pub payload: Payload,
    /// The algorithm of the row's costliest call.
    pub algorithm: Algorithm,
    /// Calls per step.
    pub calls: u64,
    /// Wall time, codecs included, s.
    pub seconds: f64,
    /// Latency part, s.
    pub latency_seconds: f64,
    /// NVLink busy time, s.
    pub intra_node_seconds: f64,
    /// NIC busy time, s.
    pub inter_node_seconds: f64,
    /// qwZ/qgZ kernel time, s.
    pub codec_seconds: f64,
    /// The plan's bytes sent by rank 0 ([`crate::traffic`]'s accounting).
    pub plan_sent: LinkBytes,
    /// Bytes one GPU sends over NVLink under the algorithm.
    pub intra_wire_bytes_per_gpu: f64,
    /// Bytes one node sends over its NICs under the algorithm.
    pub inter_wire_bytes_per_node: f64,
}

/// Communication per optimizer step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CommTimes {
    /// Every collective's wall time, codecs included, s.
    pub seconds: f64,
    /// What the overlap model leaves on the critical path, s.
    pub exposed_seconds: f64,
    /// Latency part, s.
    pub latency_seconds: f64,
    /// Codec part, s.
    pub codec_seconds: f64,
    /// NVLink busy time, s.
    pub intra_node_seconds: f64,
    /// NIC busy time, s.
    pub inter_node_seconds: f64,
    /// Bytes one GPU sends over NVLink.
    pub intra_wire_bytes_per_gpu: f64,
    /// Bytes one node sends over its NICs.
    pub inter_wire_bytes_per_node: f64,
    /// By phase, collective, group and payload.
    pub by_phase: Vec<PhaseTime>,
}

/// Memory per GPU and whether it fits.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct MemoryFit {
    /// The plan's memory model.
    pub model: MemoryModel,
    /// Activations, if the shape is known.
    pub activation_bytes: Option<u64>,
    /// The model's device bytes plus activations.
    pub total_bytes: u64,
    /// The GPU's memory.
    pub gpu_bytes: u64,
    /// `total_bytes ≤ gpu_bytes`.
    pub fits: bool,
}

/// One simulated configuration.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimReport {
    /// Cluster name.
    pub cluster: String,
    /// Nodes.
    pub nodes: usize,
    /// GPUs per node.
    pub gpus_per_node: usize,
    /// GPUs.
    pub world_size: usize,
    /// NIC line rate per node, Gbit/s.
    pub nic_gbps_per_node: f64,
    /// e.g. `ZeRO-3 Fp16 + qwZ + hpZ=16 + qgZ`.
    pub config: String,
    /// Tokens per GPU per micro-step.
    pub tokens_per_gpu: u64,
    /// Micro-steps per optimizer step.
    pub grad_accum: u32,
    /// Overlap fraction used.
    pub overlap: f64,
    /// Seconds per optimizer step.
    pub step_seconds: f64,
    /// Tokens per second, whole cluster.
    pub tokens_per_sec: f64,
    /// Hardware TFLOPs per GPU (recompute counted).
    pub tflops_per_gpu: f64,
    /// Model TFLOPs per GPU (`6Ψ + attention`, no recompute).
    pub model_tflops_per_gpu: f64,
    /// Compute.
    pub compute: ComputeTimes,
    /// Stage 3's offloaded parameters' moves; `None` when they stay on the GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offload: Option<OffloadTimes>,
    /// Communication.
    pub comm: CommTimes,
    /// The bytes the prediction used, by collective, for rank 0: equal to `Plan::comm(0)`.
    pub plan_traffic: TrafficTable,
    /// Memory.
    pub memory: MemoryFit,
}

/// `ZeRO-3 Fp16 + qwZ + hpZ=16 + qgZ`.
pub fn config_label(c: &ZeroConfig) -> String {
    let mut s = format!("ZeRO-{} {:?}", c.stage, c.precision);
    if c.quantized_weights {
        s.push_str(" + qwZ");
    }
    if c.hpz() {
        s.push_str(&format!(" + hpZ={}", c.hpz_partition_size));
    }
    if c.quantized_gradients {
        s.push_str(" + qgZ");
    }
    s
}

/// Seconds in a readable unit.
pub(crate) fn human_seconds(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.1} µs", s * 1e6)
    }
}

impl fmt::Display for SimReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} on {}: {} node(s) x {} GPUs = {}, NICs {} Gbps per node; {} tokens per GPU x {} micro-step(s), overlap {}",
            self.config,
            self.cluster,
            self.nodes,
            self.gpus_per_node,
            self.world_size,
            self.nic_gbps_per_node,
            self.tokens_per_gpu,
            self.grad_accum,
            self.overlap
        )?;
        writeln!(
            f,
            "step {}   {:.0} tokens/s   {:.1} TFLOPs/GPU (model {:.1})",
            human_seconds(self.step_seconds),
            self.tokens_per_sec,
            self.tflops_per_gpu,
            self.model_tflops_per_gpu
        )?;
        let c = &self.compute;
        writeln!(
            f,
            "compute: forward {}, backward {}, recompute {}, optimizer {}",
            human_seconds(c.forward_seconds),
            human_seconds(c.backward_seconds),
            human_seconds(c.recompute_seconds),
            human_seconds(c.optimizer_seconds)
        )?;
        if let Some(o) = &self.offload {
            writeln!(
                f,
                "offload: parameter copies for the gathers {} (in their windows), shard back {}; \
                 the offloaded optimizer's PCIe and disk moves are in its time",
                human_seconds(o.gather_copies_seconds),
                human_seconds(o.shard_back_seconds)
            )?;
        }
        let m = &self.comm;
        writeln!(
            f,
            "communication: {} in all, {} exposed; NVLink busy {}, NICs busy {}, latency {}, codecs {}",
            human_seconds(m.seconds),
            human_seconds(m.exposed_seconds),
            human_seconds(m.intra_node_seconds),
            human_seconds(m.inter_node_seconds),
            human_seconds(m.latency_seconds),
            human_seconds(m.codec_seconds)
        )?;
        writeln!(
            f,
            "  {:<12} {:<15} {:<11} {:<8} {:<7} {:>7} {:>10} {:>10} {:>10} {:>11} {:>11}",
            "phase",
            "collective",
            "group",
            "payload",
            "algo",
            "calls",
            "time",
            "NVLink",
            "NICs",
            "plan intra",
            "plan inter"
        )?;
        for r in &m.by_phase {
            writeln!(
                f,
                "  {:<12} {:<15} {:<11} {:<8} {:<7} {:>7} {:>10} {:>10} {:>10} {:>11} {:>11}",
                r.phase.name(),
                r.collective.name(),
                format!("{:?}", r.group).to_lowercase(),
                format!("{:?}", r.payload).to_lowercase(),
                format!("{:?}", r.algorithm).to_lowercase(),
                r.calls,
                human_seconds(r.seconds),
                human_seconds(r.intra_node_seconds),
                human_seconds(r.inter_node_seconds),
                human_bytes(r.plan_sent.intra_node),
                human_bytes(r.plan_sent.inter_node),
            )?;
        }
        let mem = &self.memory;
        writeln!(
            f,
            "memory per GPU: model states and buffers {}{}, activations {}, total {} of {}: {}",
            human_bytes(mem.model.device_bytes),
            match mem.model.total_bytes - mem.model.device_bytes {
                0 => String::new(),
                off => format!(" (and {} offloaded)", human_bytes(off)),
            },
            mem.activation_bytes
                .map_or("not modelled (shape unknown)".into(), human_bytes),
            human_bytes(mem.total_bytes),
            human_bytes(mem.gpu_bytes),
            if mem.fits { "fits" } else { "DOES NOT FIT" }
        )
    }
}
