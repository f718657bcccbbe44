//! Sweeps: one model over node counts, NIC bandwidths or ZeRO variants, as a table.

use std::fmt;

use serde::Serialize;

use crate::config::ZeroConfig;
use crate::error::{Error, Result};
use crate::model::ModelDesc;
use crate::plan::Plan;
use crate::sim::report::human_seconds;
use crate::sim::{Cluster, SimOptions, SimReport, simulate};

/// Names accepted by [`Variant::named`].
pub const VARIANTS: [&str; 9] = [
    "config",
    "zero-0",
    "zero-1",
    "zero-2",
    "zero-3",
    "zero-3+qwz",
    "zero-3+hpz",
    "zero-3+qgz",
    "zero++",
];

/// A named ZeRO configuration.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Variant {
    /// Name.
    pub name: String,
    /// Configuration.
    pub config: ZeroConfig,
}

impl Variant {
    /// `config` (`base` as given), `zero-0` … `zero-3`, `zero-3+qwz`, `zero-3+hpz`,
    /// `zero-3+qgz`, or `zero++` (qwZ + hpZ over the whole node + qgZ): `base` with the ZeRO
    /// switches replaced.
    pub fn named(name: &str, base: &ZeroConfig, gpus_per_node: usize) -> Result<Variant> {
        let mut c = base.clone();
        if name != "config" {
            c.quantized_weights = false;
            c.hpz_partition_size = 1;
            c.quantized_gradients = false;
        }
        match name {
            "config" => {}
            "zero-0" | "zero-1" | "zero-2" | "zero-3" => {
                c.stage = name.as_bytes()[5] - b'0';
            }
            "zero-3+qwz" | "zero-3+hpz" | "zero-3+qgz" | "zero++" => {
                c.stage = 3;
                c.quantized_weights = name.ends_with("qwz") || name == "zero++";
                c.quantized_gradients = name.ends_with("qgz") || name == "zero++";
                if name.ends_with("hpz") || name == "zero++" {
                    c.hpz_partition_size = gpus_per_node;
                }
            }
            other => {
                return Err(Error::invalid(
                    "variant",
                    other,
                    format!("one of {VARIANTS:?}"),
                ));
            }
        }
        if c.stage < 3 {
            c.accumulate_before_reduce &= c.stage < 2;
        }
        Ok(Variant {
            name: name.into(),
            config: c,
        })
    }
}

/// What a sweep varies.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SweepAxis {
    /// Node counts.
    Nodes(Vec<usize>),
    /// NIC line rate per node, Gbit/s.
    NicGbpsPerNode(Vec<f64>),
    /// Nothing but the variants.
    Variants,
}

impl SweepAxis {
    /// The column header of the swept value.
    pub fn name(&self) -> &'static str {
        match self {
            SweepAxis::Nodes(_) => "nodes",
            SweepAxis::NicGbpsPerNode(_) => "NIC Gbps/node",
            SweepAxis::Variants => "point",
        }
    }
}

/// One configuration of a sweep.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SweepRow {
    /// The swept value (nodes, or Gbit/s per node; 0 for a variants-only sweep).
    pub x: f64,
    /// The variant's name.
    pub variant: String,
    /// Throughput over the first variant's at the same point.
    pub speedup: f64,
    /// The simulation.
    pub report: SimReport,
}

/// A sweep's rows, points in order, variants in order within a point.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SweepTable {
    /// What varies.
    pub axis: SweepAxis,
    /// The rows.
    pub rows: Vec<SweepRow>,
}

/// Simulates every point of `axis` for every variant (a plan is built once per node count and
/// variant and reused across bandwidths).
pub fn sweep(
    model: &ModelDesc,
    cluster: &Cluster,
    nodes: usize,
    axis: &SweepAxis,
    variants: &[Variant],
    opts: &SimOptions,
) -> Result<SweepTable> {
    if variants.is_empty() {
        return Err(Error::invalid(
            "variants",
            "none",
            format!("at least one of {VARIANTS:?}"),
        ));
    }
    let points: Vec<(f64, usize, Cluster)> = match axis {
        SweepAxis::Nodes(ns) if !ns.is_empty() => {
            ns.iter().map(|&k| (k as f64, k, cluster.clone())).collect()
        }
        SweepAxis::NicGbpsPerNode(gs) if !gs.is_empty() => gs
            .iter()
            .map(|&g| Ok((g, nodes, cluster.with_nic_gbps_per_node(g)?)))
            .collect::<Result<_>>()?,
        SweepAxis::Variants => vec![(0.0, nodes, cluster.clone())],
        _ => {
            return Err(Error::invalid(
                "sweep",
                "an empty list",
                "at least one value",
            ));
        }
    };
    let mut plans: Vec<(usize, usize, Plan)> = Vec::new();
    let mut rows: Vec<SweepRow> = Vec::with_capacity(points.len() * variants.len());
    for (x, k, c) in &points {
        let first = rows.len();
        for (vi, v) in variants.iter().enumerate() {
            if !plans.iter().any(|(pk, pv, _)| (*pk, *pv) == (*k, vi)) {
                plans.push((*k, vi, Plan::new(model, c.topology(*k)?, &v.config)?));
            }
            let plan = &plans
                .iter()
                .find(|(pk, pv, _)| (*pk, *pv) == (*k, vi))
                .expect("built")
                .2;
            let report = simulate(plan, c, opts)?;
            let base = match rows.get(first) {
                Some(r) if vi > 0 => r.report.tokens_per_sec,
                _ => report.tokens_per_sec,
            };
            let speedup = report.tokens_per_sec / base;
            rows.push(SweepRow {
                x: *x,
                variant: v.name.clone(),
                speedup,
                report,
            });
        }
    }
    Ok(SweepTable {
        axis: axis.clone(),
        rows,
    })
}

impl fmt::Display for SweepTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "| {} | variant | GPUs | step | tokens/s | TFLOPs/GPU | comm | exposed | NICs busy | NVLink busy | GiB/GPU | fits | speed-up |",
            self.axis.name()
        )?;
        writeln!(
            f,
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"
        )?;
        for r in &self.rows {
            let s = &r.report;
            let x = match self.axis {
                SweepAxis::Variants => "-".to_string(),
                _ => format!("{}", r.x),
            };
            writeln!(
                f,
                "| {x} | {} | {} | {} | {:.0} | {:.1} | {} | {} | {} | {} | {:.1} | {} | {:.2}x |",
                r.variant,
                s.world_size,
                human_seconds(s.step_seconds),
                s.tokens_per_sec,
                s.tflops_per_gpu,
                human_seconds(s.comm.seconds),
                human_seconds(s.comm.exposed_seconds),
                human_seconds(s.comm.inter_node_seconds),
                human_seconds(s.comm.intra_node_seconds),
                s.memory.total_bytes as f64 / (1u64 << 30) as f64,
                if s.memory.fits { "yes" } else { "no" },
                r.speedup
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_set_the_switches() {
        let base = ZeroConfig::stage(1);
        let z = Variant::named("zero++", &base, 8).unwrap().config;
        assert_eq!(
            (
                z.stage,
                z.quantized_weights,
                z.hpz_partition_size,
                z.quantized_gradients
            ),
            (3, true, 8, true)
        );
        let z = Variant::named("zero-3+hpz", &base, 16).unwrap().config;
        assert_eq!(
            (
                z.quantized_weights,
                z.hpz_partition_size,
                z.quantized_gradients
            ),
            (false, 16, false)
        );
        let z = Variant::named("zero-2", &z, 16).unwrap().config;
        assert_eq!((z.stage, z.hpz_partition_size), (2, 1));
        assert!(
            Variant::named("zero-4", &base, 8)
                .unwrap_err()
                .to_string()
                .contains("zero++")
        );
    }
}
