//! A serializable summary of a plan for one rank: what `cargo xtask plan` prints.

use std::fmt;

use serde::Serialize;

use crate::comm_model::CommModel;
use crate::config::ZeroConfig;
use crate::memory::MemoryModel;
use crate::plan::Plan;

/// Layout summary.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LayoutSummary {
    /// Number of units (buckets or gather groups).
    pub units: usize,
    /// Flat buffer length in elements, padding included.
    pub flat_elems: u64,
    /// Padding elements.
    pub padding_elems: u64,
    /// Elements of each rank's shard buffer.
    pub shard_elems: u64,
    /// Peak gathered elements (stage 3).
    pub peak_gathered_elems: u64,
    /// Stage 3: elements of the persistent units, which every rank holds whole (parameters of at
    /// most `param_persistence_threshold` elements); 0 at stages 0–2.
    pub persistent_elems: u64,
    /// Elements of the buffers (module state that is not a parameter), which every rank holds
    /// whole at every stage.
    pub buffer_elems: u64,
}

/// Everything a person or a script needs to know about a plan, for one rank. Bytes are per rank;
/// communication bytes are per optimizer step.
#[derive(Clone, Debug, Serialize)]
pub struct PlanReport {
    /// Model parameters.
    pub params: u64,
    /// Trainable parameters.
    pub trainable_params: u64,
    /// World size.
    pub world_size: usize,
    /// Ranks per node.
    pub ranks_per_node: usize,
    /// The configuration.
    pub config: ZeroConfig,
    /// Layout summary.
    pub layout: LayoutSummary,
    /// Memory model.
    pub memory: MemoryModel,
    /// Communication model.
    pub comm: CommModel,
    /// Parameters read by modules other than their own (tied weights), with their readers.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shared: Vec<SharedParam>,
}

/// A parameter that several modules read (a tied weight): one parameter, one unit, one gradient.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SharedParam {
    /// Its name.
    pub name: String,
    /// Its elements.
    pub numel: u64,
    /// The module that owns it.
    pub owner: String,
    /// The other modules whose forward reads it.
    pub readers: Vec<String>,
}

impl Plan {
    /// The report for `rank`.
    pub fn report(&self, rank: usize) -> PlanReport {
        PlanReport {
            params: self.model().numel(),
            trainable_params: self.model().trainable_numel(),
            world_size: self.world_size(),
            ranks_per_node: self.topology().ranks_per_node(),
            config: self.config().clone(),
            layout: LayoutSummary {
                units: self.units().len(),
                flat_elems: self.flat_len(),
                padding_elems: self.padding(),
                shard_elems: self.shard_len(),
                peak_gathered_elems: self.peak_gathered(),
                persistent_elems: self
                    .units()
                    .iter()
                    .filter(|u| u.kind == crate::plan::UnitKind::Persistent)
                    .map(|u| u.numel)
                    .sum(),
                buffer_elems: self.model().buffer_numel(),
            },
            memory: self.memory(),
            comm: self.comm(rank),
            shared: self.shared_params(),
        }
    }

    /// The parameters that several modules read (tied weights), with their owners and readers.
    pub fn shared_params(&self) -> Vec<SharedParam> {
        self.model()
            .shared()
            .map(|p| SharedParam {
                name: p.name.clone(),
                numel: p.numel(),
                owner: p.module.clone(),
                readers: p.readers.clone(),
            })
            .collect()
    }
}

/// Bytes in a readable unit (powers of 1000, as the ZeRO paper's GB).
pub fn human_bytes(b: u64) -> String {
    let x = b as f64;
    if x >= 1e12 {
        format!("{:.2} TB", x / 1e12)
    } else if x >= 1e9 {
        format!("{:.2} GB", x / 1e9)
    } else if x >= 1e6 {
        format!("{:.2} MB", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.2} kB", x / 1e3)
    } else {
        format!("{b} B")
    }
}

impl fmt::Display for PlanReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        let mut zpp = Vec::new();
        if c.quantized_weights {
            zpp.push("qwZ".to_string());
        }
        if c.hpz_partition_size > 1 {
            zpp.push(format!("hpZ={}", c.hpz_partition_size));
        }
        if c.quantized_gradients {
            zpp.push("qgZ".to_string());
        }
        writeln!(
            f,
            "ZeRO-{} {:?}{}  params {} ({} trainable)  world {} = {} node(s) x {}  grad accumulation {}",
            c.stage,
            c.precision,
            if zpp.is_empty() {
                String::new()
            } else {
                format!(" + {}", zpp.join(" + "))
            },
            self.params,
            self.trainable_params,
            self.world_size,
            self.world_size / self.ranks_per_node,
            self.ranks_per_node,
            c.gradient_accumulation_steps,
        )?;
        writeln!(
            f,
            "layout: {} units, flat {} elements ({} padding), shard {} elements per rank",
            self.layout.units,
            self.layout.flat_elems,
            self.layout.padding_elems,
            self.layout.shard_elems
        )?;
        let l = &self.layout;
        if c.stage == 3 && l.persistent_elems > 0 {
            writeln!(
                f,
                "replicated: {} of {} elements stay whole on every rank: parameters of at most {} \
                 elements (param_persistence_threshold){}",
                l.persistent_elems + l.buffer_elems,
                self.params,
                c.param_persistence_threshold,
                if l.buffer_elems > 0 {
                    format!(" and {} buffer elements", l.buffer_elems)
                } else {
                    String::new()
                },
            )?;
        } else if l.buffer_elems > 0 {
            writeln!(
                f,
                "buffers: {} elements stay whole on every rank, kept equal by the engine",
                l.buffer_elems
            )?;
        }
        for p in &self.shared {
            writeln!(
                f,
                "shared: `{}` ({} elements) owned by {}, read by {} too: one parameter, its \
                 gradients summed{}",
                p.name,
                p.numel,
                p.owner,
                p.readers.join(", "),
                if c.stage == 3 {
                    "; gathered once and kept until the backward is done with it"
                } else {
                    ""
                },
            )?;
        }
        writeln!(f, "\nmemory per rank")?;
        for (name, b) in self.memory.rows() {
            if name == "offload_buffers" && b == 0 {
                continue;
            }
            writeln!(f, "  {name:<24} {:>12}  {b:>16} B", human_bytes(b))?;
        }
        writeln!(
            f,
            "  {:<24} {:>12}  {:>16} B",
            "model states",
            human_bytes(self.memory.model_states_bytes),
            self.memory.model_states_bytes
        )?;
        writeln!(
            f,
            "  {:<24} {:>12}  {:>16} B",
            "total",
            human_bytes(self.memory.total_bytes),
            self.memory.total_bytes
        )?;
        let m = &self.memory;
        if m.host_bytes + m.disk_bytes > 0 {
            let c = &self.config;
            let placed = format!(
                "(optimizer_placement = {}, param_placement = {})",
                c.optimizer_placement.name(),
                c.param_placement.name()
            );
            let split = [
                ("of which on the device", m.device_bytes),
                ("of which in host memory", m.host_bytes),
                ("of which on NVMe", m.disk_bytes),
            ];
            for (i, (name, b)) in split.into_iter().enumerate() {
                let why = if i == 0 { placed.as_str() } else { "" };
                let line = format!("  {name:<24} {:>12}  {b:>16} B  {why}", human_bytes(b));
                writeln!(f, "{}", line.trim_end())?;
            }
        }
        writeln!(
            f,
            "\ncommunication per rank per optimizer step (bytes sent; received is the same)"
        )?;
        writeln!(
            f,
            "  {:<12} {:<15} {:<11} {:<8} {:>8} {:>12} {:>12}",
            "phase", "collective", "group", "payload", "calls", "intra-node", "inter-node"
        )?;
        for r in &self.comm.by_phase {
            writeln!(
                f,
                "  {:<12} {:<15} {:<11} {:<8} {:>8} {:>12} {:>12}",
                r.phase.name(),
                r.collective.name(),
                format!("{:?}", r.group).to_lowercase(),
                format!("{:?}", r.payload).to_lowercase(),
                r.traffic.calls,
                human_bytes(r.traffic.sent.intra_node),
                human_bytes(r.traffic.sent.inter_node),
            )?;
        }
        writeln!(
            f,
            "  {:<12} {:<15} {:<11} {:<8} {:>8} {:>12} {:>12}",
            "total",
            "",
            "",
            "",
            self.comm.calls,
            human_bytes(self.comm.intra_node_bytes),
            human_bytes(self.comm.inter_node_bytes),
        )
    }
}
