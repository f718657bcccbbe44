//! The checks a [`ZeroConfig`] passes before it is planned.

use super::{Placement, Precision, ZeroConfig};
use crate::error::{Error, Result};
use crate::topology::{Topology, divisors};

/// Checks a configuration against the topology it is planned on: every field in range, and the
/// fields that depend on the world (hpZ partition size, ranks per node) consistent with it.
pub(crate) fn validate(c: &ZeroConfig, t: &Topology) -> Result<()> {
    if c.stage > 3 {
        return Err(Error::invalid("stage", c.stage.to_string(), "0, 1, 2 or 3"));
    }
    if c.reduce_bucket_size == 0 {
        return Err(Error::invalid(
            "reduce_bucket_size",
            "0",
            "at least 1 element",
        ));
    }
    if c.allgather_bucket_size == 0 {
        return Err(Error::invalid(
            "allgather_bucket_size",
            "0",
            "at least 1 element",
        ));
    }
    if c.gradient_accumulation_steps == 0 {
        return Err(Error::invalid(
            "gradient_accumulation_steps",
            "0",
            "at least 1",
        ));
    }
    if !(c.gradient_clipping >= 0.0 && c.gradient_clipping.is_finite()) {
        return Err(Error::invalid(
            "gradient_clipping",
            c.gradient_clipping.to_string(),
            "a finite number ≥ 0 (0 disables clipping)",
        ));
    }
    if c.hpz_partition_size == 0 {
        return Err(Error::invalid(
            "hpz_partition_size",
            "0",
            "1 (off) or a divisor of ranks_per_node",
        ));
    }
    let zpp = [
        ("quantized_weights (qwZ)", c.quantized_weights),
        ("hpz_partition_size > 1 (hpZ)", c.hpz()),
        ("quantized_gradients (qgZ)", c.quantized_gradients),
    ];
    for (name, on) in zpp {
        if on && c.stage != 3 {
            return Err(Error::invalid(
                name,
                format!("enabled at stage {}", c.stage),
                "stage 3: ZeRO++ switches act on stage 3's weight gathers and gradient reduce-scatter",
            ));
        }
    }
    if c.hpz() && !t.ranks_per_node().is_multiple_of(c.hpz_partition_size) {
        return Err(Error::invalid(
            "hpz_partition_size",
            c.hpz_partition_size.to_string(),
            format!(
                "a divisor of ranks_per_node {} (the secondary group must stay inside a node): one of {:?}",
                t.ranks_per_node(),
                divisors(t.ranks_per_node())
            ),
        ));
    }
    if c.hpz() && !c.recompute() {
        return Err(Error::invalid(
            "checkpoint_activations",
            "false with hpz_partition_size > 1",
            "true (or unset) with hpZ: its secondary shard serves the backward's re-gather, which \
             stage 3 without activation checkpointing does not do",
        ));
    }
    if c.qwz_block_size == 0 {
        return Err(Error::invalid("qwz_block_size", "0", "at least 1 element"));
    }
    if c.qgz_block_size == 0 || !c.qgz_block_size.is_multiple_of(2) {
        return Err(Error::invalid(
            "qgz_block_size",
            c.qgz_block_size.to_string(),
            "an even number ≥ 2 (int4 packs two elements per byte)",
        ));
    }
    if c.accumulate_before_reduce && c.stage >= 2 {
        return Err(Error::invalid(
            "accumulate_before_reduce",
            format!("true at stage {}", c.stage),
            "false: stages 2 and 3 keep only their gradient shard, so they reduce every micro-step",
        ));
    }
    if let Some(g) = c.grad_accum_dtype
        && g != Precision::Fp32
        && g != c.precision
    {
        return Err(Error::invalid(
            "grad_accum_dtype",
            format!("{g:?} with {:?} weights", c.precision),
            "fp32, or the working precision",
        ));
    }
    offload(c)?;
    let s = &c.loss_scaler;
    if !(s.loss_scale >= 0.0 && s.loss_scale.is_finite()) {
        return Err(Error::invalid(
            "loss_scaler.loss_scale",
            s.loss_scale.to_string(),
            "0 (dynamic) or a positive finite scale",
        ));
    }
    if s.initial_scale_power > 126 {
        return Err(Error::invalid(
            "loss_scaler.initial_scale_power",
            s.initial_scale_power.to_string(),
            "at most 126 (the scale must be a finite f32)",
        ));
    }
    if s.loss_scale_window == 0 || s.hysteresis == 0 {
        return Err(Error::invalid(
            "loss_scaler",
            format!(
                "loss_scale_window {} hysteresis {}",
                s.loss_scale_window, s.hysteresis
            ),
            "both at least 1",
        ));
    }
    if !(s.min_loss_scale > 0.0 && s.min_loss_scale.is_finite()) {
        return Err(Error::invalid(
            "loss_scaler.min_loss_scale",
            s.min_loss_scale.to_string(),
            "a positive finite scale",
        ));
    }
    Ok(())
}

/// The placements: parameters leave the device only at stage 3, where they are partitioned, and
/// NVMe needs a folder and a ring of at least three buffers (read ahead, step, write back).
fn offload(c: &ZeroConfig) -> Result<()> {
    if c.param_placement.is_offloaded() && c.stage != 3 {
        return Err(Error::invalid(
            "param_placement",
            format!("{} at stage {}", c.param_placement.name(), c.stage),
            "device below stage 3: only stage 3 partitions the parameters, so only its shard can \
             leave the device",
        ));
    }
    let nvme = [c.optimizer_placement, c.param_placement].contains(&Placement::Nvme);
    if !nvme {
        return Ok(());
    }
    if c.nvme_path.as_deref().is_none_or(str::is_empty) {
        return Err(Error::invalid(
            "nvme_path",
            "none",
            "a folder for the NVMe store when a placement is nvme",
        ));
    }
    if c.offload_buffer_count < 3 {
        return Err(Error::invalid(
            "offload_buffer_count",
            c.offload_buffer_count.to_string(),
            "at least 3 with NVMe placement: one unit read ahead, one stepped, one written back",
        ));
    }
    Ok(())
}
