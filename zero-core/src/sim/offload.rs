//! Offloaded state's moves (ZeRO-Offload, ZeRO-Infinity), timed from the cluster's [`Host`]:
//! PCIe between one GPU and host memory, the host-memory bandwidth of one GPU's share of the
//! CPUs, and the node's NVMe, shared by its GPUs. Like the GPU's, the CPU's optimizer step is
//! bound by memory bandwidth; nothing else about the CPU is modelled.
//!
//! - **Optimizer in host memory:** per step the gradients cross PCIe down and the new working
//!   weights up (`G + W` bytes per element of the rank's trainable shard; no `W` when stage 3's
//!   parameters live in host memory too), and the step streams `2·(K + M) + G + W` bytes per
//!   element at host-memory bandwidth. The two are not overlapped.
//! - **Optimizer on NVMe:** the moments and master are also read and written (`2·(K + M)` bytes
//!   per element) at the node's NVMe bandwidth over its GPUs; the ring overlaps that with the
//!   CPU's step, so the step takes the larger of the two.
//! - **Parameters off the GPU (stage 3):** every world gather of a unit first copies the rank's
//!   chunk (`W` bytes per element) up over PCIe, after reading it from NVMe when it lives there.
//!   The copy sits in the forward or backward window with its gather, so overlap hides it as it
//!   hides the collective. hpZ's backward gathers read the secondary shard, which stays on the
//!   GPU. After the step the updated shard goes back once: down over PCIe when the optimizer
//!   stepped it on the GPU, and to NVMe when it lives there.
//!
//! [`Host`]: super::cluster::Host

use super::cluster::Host;
use crate::comm_model::{GroupKind, Phase};
use crate::config::Placement;
use crate::plan::Plan;
use crate::traffic::Collective;

/// The parameter shard's moves, s: (per micro-step in the forward window, per micro-step in the
/// backward window, once per step). Zeros unless stage 3's shard is off the GPU.
pub(super) fn param_moves(plan: &Plan, h: &Host, gpus_per_node: usize) -> (f64, f64, f64) {
    let c = plan.config();
    if c.stage != 3 || !c.param_placement.is_offloaded() {
        return (0.0, 0.0, 0.0);
    }
    let nvme = c.param_placement == Placement::Nvme;
    let pcie = h.pcie_gbytes_per_s * 1e9;
    let disk = h.nvme_gbytes_per_s * 1e9 / gpus_per_node as f64;
    let per_byte = 1.0 / pcie + if nvme { 1.0 / disk } else { 0.0 };
    let w = plan.working_bytes() as f64;
    let (mut fwd, mut bwd) = (0.0, 0.0);
    for op in plan.schedule() {
        let gather = op.collective == Collective::AllGather && op.group == GroupKind::World;
        let (true, true, Some(u)) = (gather, op.per_micro_step, op.unit) else {
            continue;
        };
        let seconds = plan.chunk_len(u) as f64 * w * per_byte;
        match op.phase {
            Phase::Forward => fwd += seconds,
            Phase::Backward => bwd += seconds,
            _ => {}
        }
    }
    let shard = plan.shard_len() as f64 * w;
    let mut step = if nvme { shard / disk } else { 0.0 };
    if !c.optimizer_placement.is_offloaded() {
        step += shard / pcie;
    }
    (fwd, bwd, step)
}

/// The optimizer step of `elems` trainable elements whose state is off the GPU, streaming
/// `per` bytes per element (`2·(K + M) + G + W`), of which `state` are the moments and master
/// (`K + M`), `grad` the gradient's and `working` the working weight's.
pub(super) fn optimizer_seconds(
    plan: &Plan,
    h: &Host,
    gpus_per_node: usize,
    elems: f64,
    (per, state, grad, working): (f64, f64, f64, f64),
) -> f64 {
    let c = plan.config();
    let params_off = c.stage == 3 && c.param_placement.is_offloaded();
    let up = if params_off { 0.0 } else { working };
    let pcie = elems * (grad + up) / (h.pcie_gbytes_per_s * 1e9);
    let cpu = elems * per / (h.memory_gbytes_per_s * 1e9);
    let disk = match c.optimizer_placement {
        Placement::Nvme => elems * 2.0 * state / (h.nvme_gbytes_per_s * 1e9 / gpus_per_node as f64),
        _ => 0.0,
    };
    pcie + cpu.max(disk)
}

#[cfg(test)]
mod tests {
    use crate::sim::cluster::Host;
    use crate::sim::{Cluster, Overlap, SimOptions, simulate};
    use crate::{ModelDesc, Placement, Plan, ZeroConfig};

    #[test]
    fn offload_by_hand() {
        // 1e8 fp32 parameters on 2 nodes of 2 GPUs: stage 1 with the optimizer off the GPU, and
        // stage 3 with the parameters off it. Host: PCIe 10 GB/s, host memory 20 GB/s, NVMe 8 GB/s per node of 2 GPUs (4 GB/s
        // each). The rank's shard: 2.5e7 elements; fp32 Adam: K = 8, M = 0, G = W = 4 B.
        let mut c = Cluster::preset("dgx-a100").unwrap();
        c.gpus_per_node = 2;
        c.host = Some(Host {
            pcie_gbytes_per_s: 10.0,
            memory_gbytes_per_s: 20.0,
            nvme_gbytes_per_s: 8.0,
        });
        let m = ModelDesc::synthetic(100_000_000, 1).unwrap();
        let o = SimOptions {
            tokens_per_gpu: 1000,
            shape: None,
            recompute: false,
            overlap: Some(Overlap::None),
        };
        let close = |a: f64, b: f64| assert!((a - b).abs() < 1e-9 * b.max(1.0), "{a} vs {b}");
        let run = |cfg: ZeroConfig| {
            let cfg = ZeroConfig {
                nvme_path: Some("/nvme".into()),
                ..cfg
            };
            simulate(
                &Plan::new(&m, c.topology(2).unwrap(), &cfg).unwrap(),
                &c,
                &o,
            )
            .unwrap()
        };
        let on_gpu = run(ZeroConfig::stage(1));
        assert_eq!(on_gpu.offload, None);
        // Host: gradients down and weights up, 2.5e7 · 8 B at 10 GB/s = 20 ms, then the step's
        // 2.5e7 · 24 B at 20 GB/s = 30 ms.
        let host = run(ZeroConfig {
            optimizer_placement: Placement::Host,
            ..ZeroConfig::stage(1)
        });
        close(host.compute.optimizer_seconds, 0.02 + 0.03);
        close(
            host.step_seconds - on_gpu.step_seconds,
            0.05 - on_gpu.compute.optimizer_seconds,
        );
        // NVMe: the moments read and written, 2.5e7 · 16 B at 4 GB/s = 100 ms, overlapped with the
        // 30 ms step.
        let nvme = run(ZeroConfig {
            optimizer_placement: Placement::Nvme,
            ..ZeroConfig::stage(1)
        });
        close(nvme.compute.optimizer_seconds, 0.02 + 0.1);
        // Stage 3, parameters in host memory: the forward and the backward gather each copy the
        // 1e8-byte chunk up (10 ms); after the step the shard goes back down (10 ms). On NVMe each
        // copy and the write-back add 1e8 B at 4 GB/s (25 ms).
        for (place, copy) in [(Placement::Host, 0.01), (Placement::Nvme, 0.035)] {
            let base = ZeroConfig::stage(3);
            let plain = run(base.clone());
            let off = run(ZeroConfig {
                param_placement: place,
                ..base
            });
            let t = off.offload.unwrap();
            close(t.gather_copies_seconds, 2.0 * copy);
            close(t.shard_back_seconds, copy);
            close(off.step_seconds - plain.step_seconds, 3.0 * copy);
            assert!(
                off.memory.total_bytes < plain.memory.total_bytes,
                "{place:?}"
            );
        }
    }
}
