//! Cluster descriptions: GPUs, links, NCCL-like protocols and codec speeds, with presets taken
//! from hardware specifications only.
//!
//! A cluster is plain data (serde, TOML). [`Cluster::preset`] gives `dgx2-v100`, `dgx-a100` and
//! `dgx-h100`; [`Cluster::from_toml`] reads a full description or `preset = "NAME"` plus the
//! fields to change; [`Cluster::set`] changes one field by its dotted path (`inter.nic_gbps`).

use serde::{Deserialize, Serialize};

use crate::config::Precision;
use crate::error::{Error, Result};

/// Names accepted by [`Cluster::preset`].
pub const CLUSTER_PRESETS: [&str; 3] = ["dgx2-v100", "dgx-a100", "dgx-h100"];

/// One GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    /// Model name (informational).
    pub name: String,
    /// Device memory in GiB.
    pub memory_gib: f64,
    /// HBM bandwidth in GB/s (10⁹ B/s): the optimizer step and the codecs are bound by it.
    pub hbm_gbytes_per_s: f64,
    /// Dense peak TFLOPs (10¹² FLOP/s) per training precision; 0 means unsupported.
    pub peak_tflops: PeakTflops,
    /// Sustained fraction of peak for a transformer's training step (an assumption, not a fit).
    pub compute_efficiency: f64,
}

/// Dense peak TFLOPs per precision.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeakTflops {
    /// fp32 without TF32.
    pub fp32: f64,
    /// bf16 tensor cores (0 where the GPU has none).
    pub bf16: f64,
    /// fp16 tensor cores.
    pub fp16: f64,
}

/// The intra-node interconnect, per GPU and per direction.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IntraLink {
    /// Line rate per GPU per direction, GB/s (half of the bidirectional figure vendors quote).
    pub gbytes_per_s: f64,
    /// Fraction of the line rate a collective reaches (NCCL's NVLink busbw is about 0.8).
    pub efficiency: f64,
}

/// The inter-node network of one node.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterLink {
    /// NICs per node.
    pub nics_per_node: usize,
    /// Line rate of one NIC, Gbit/s.
    pub nic_gbps: f64,
    /// Fraction of the line rate delivered (a 100 Gbps NIC gives 12.2 GB/s of 12.5).
    pub efficiency: f64,
}

/// One NCCL-like protocol: a bandwidth efficiency and latencies, in µs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Protocol {
    /// Name (`ll`, `ll128`, `simple`).
    pub name: String,
    /// Fraction of link bandwidth carrying payload (LL: 4 B of data per 8 B line).
    pub bw_efficiency: f64,
    /// Fixed cost of one collective call.
    pub base_us: f64,
    /// Latency of one intra-node hop.
    pub intra_hop_us: f64,
    /// Latency of one inter-node hop.
    pub inter_hop_us: f64,
}

/// Throughput of the qwZ/qgZ codecs as fractions of HBM bandwidth, counted in tensor bytes (the
/// uncompressed side), as zero-quant's CUDA kernels were measured on an H200 with f32 tensors.
/// A 16-bit tensor is assumed to stream at the same bytes per second (twice the elements).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Codec {
    /// int8 encode.
    pub int8_encode: f64,
    /// int8 decode.
    pub int8_decode: f64,
    /// int4 encode.
    pub int4_encode: f64,
    /// int4 decode (and decode-accumulate).
    pub int4_decode: f64,
}

/// Where offloaded state moves (the simulator module docs, step 6); needed only to simulate
/// offload.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Host {
    /// PCIe between one GPU and host memory, GB/s per direction (the line rate).
    pub pcie_gbytes_per_s: f64,
    /// Host-memory bandwidth of one GPU's share of the CPUs, GB/s (the sockets' DDR channels
    /// over the node's GPUs): an offloaded optimizer step is bound by it.
    pub memory_gbytes_per_s: f64,
    /// NVMe bandwidth of a node, GB/s, reads and writes alike (the drives' sequential read),
    /// shared by its GPUs.
    pub nvme_gbytes_per_s: f64,
}

/// A cluster of identical nodes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// Name (a preset's, or a file's).
    pub name: String,
    /// GPUs per node (`L`).
    pub gpus_per_node: usize,
    /// The GPU.
    pub gpu: Gpu,
    /// NVLink / NVSwitch.
    pub intra: IntraLink,
    /// InfiniBand.
    pub inter: InterLink,
    /// Protocols a collective may pick from (the fastest wins, as NCCL's tuner does).
    pub protocols: Vec<Protocol>,
    /// Codec speeds.
    pub codec: Codec,
    /// PCIe, host memory and NVMe, for offloaded state; `None`: offload is not simulated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<Host>,
}

/// Latencies of the magnitude NCCL's own tuning model uses for rings (µs, rounded): LL,
/// LL128 and Simple. The same on every preset: they are NCCL's, not the GPU's.
fn nccl_protocols() -> Vec<Protocol> {
    let p = |name: &str, bw_efficiency, base_us, intra_hop_us, inter_hop_us| Protocol {
        name: name.into(),
        bw_efficiency,
        base_us,
        intra_hop_us,
        inter_hop_us,
    };
    vec![
        p("ll", 0.5, 6.6, 0.6, 2.7),
        p("ll128", 120.0 / 128.0, 14.0, 1.9, 4.0),
        p("simple", 1.0, 8.4, 3.4, 14.0),
    ]
}

/// zero-quant's CUDA codecs on an H200 (the first H200 run, docs/benchmarks-history.md: int8
/// 1042/1284, int4 812/1032 GB/s of f32 tensor bytes) over its 4,800 GB/s of HBM.
const CODEC: Codec = Codec {
    int8_encode: 1042.0 / 4800.0,
    int8_decode: 1284.0 / 4800.0,
    int4_encode: 812.0 / 4800.0,
    int4_decode: 1032.0 / 4800.0,
};

/// The compute efficiency every preset assumes (dense GEMMs near 0.75 of peak, diluted by
/// memory-bound layer norms, softmax and elementwise work). Not fitted to any throughput.
pub const DEFAULT_COMPUTE_EFFICIENCY: f64 = 0.5;

impl Cluster {
    /// A preset from hardware specifications: `dgx2-v100`, `dgx-a100`, `dgx-h100`.
    pub fn preset(name: &str) -> Result<Cluster> {
        let gpu = |name: &str, memory_gib, hbm, fp32, bf16, fp16| Gpu {
            name: name.into(),
            memory_gib,
            hbm_gbytes_per_s: hbm,
            peak_tflops: PeakTflops { fp32, bf16, fp16 },
            compute_efficiency: DEFAULT_COMPUTE_EFFICIENCY,
        };
        let host = |pcie_gbytes_per_s, memory_gbytes_per_s, nvme_gbytes_per_s| Host {
            pcie_gbytes_per_s,
            memory_gbytes_per_s,
            nvme_gbytes_per_s,
        };
        let (gpus_per_node, g, intra_bidir, nics, gbps, nic_eff, h) = match name {
            // DGX-2: 16 × V100-SXM3 32 GB on NVSwitch (300 GB/s per GPU, both directions),
            // 8 × 100 Gbps EDR InfiniBand (12.2 GB/s delivered of 12.5). PCIe 3 x16; 2 × Xeon
            // 8168, 6 DDR4-2666 channels each (256 GB/s over 16 GPUs); 8 NVMe drives of about
            // 3 GB/s.
            "dgx2-v100" => (
                16,
                gpu("V100-SXM3-32GB", 32.0, 900.0, 15.7, 0.0, 125.0),
                300.0,
                8,
                100.0,
                12.2 / 12.5,
                host(16.0, 16.0, 24.0),
            ),
            // DGX A100: 8 × A100 80 GB, NVLink 3 (600 GB/s), 8 × 200 Gbps HDR. PCIe 4 x16;
            // 2 × EPYC 7742, 8 DDR4-3200 channels each (409.6 GB/s over 8 GPUs); 4 NVMe drives
            // of about 6.5 GB/s.
            "dgx-a100" => (
                8,
                gpu("A100-SXM4-80GB", 80.0, 2039.0, 19.5, 312.0, 312.0),
                600.0,
                8,
                200.0,
                0.96,
                host(32.0, 51.2, 26.0),
            ),
            // DGX H100: 8 × H100 80 GB, NVLink 4 (900 GB/s), 8 × 400 Gbps NDR (46–48 GB/s).
            // PCIe 5 x16; 2 × Xeon 8480C, 8 DDR5-4800 channels each (614.4 GB/s over 8 GPUs);
            // 8 NVMe drives of about 6.5 GB/s.
            "dgx-h100" => (
                8,
                gpu("H100-SXM5-80GB", 80.0, 3350.0, 67.0, 989.0, 989.0),
                900.0,
                8,
                400.0,
                47.0 / 50.0,
                host(64.0, 76.8, 52.0),
            ),
            other => {
                return Err(Error::invalid(
                    "cluster",
                    other,
                    format!("one of {CLUSTER_PRESETS:?} or a TOML file"),
                ));
            }
        };
        Ok(Cluster {
            name: name.into(),
            gpus_per_node,
            gpu: g,
            intra: IntraLink {
                gbytes_per_s: intra_bidir / 2.0,
                efficiency: 0.8,
            },
            inter: InterLink {
                nics_per_node: nics,
                nic_gbps: gbps,
                efficiency: nic_eff,
            },
            protocols: nccl_protocols(),
            codec: CODEC,
            host: Some(h),
        })
    }

    /// Parses a cluster from TOML: a full description, or `preset = "NAME"` and the fields to
    /// change (tables merge key by key). Unknown keys are errors.
    pub fn from_toml(text: &str) -> Result<Cluster> {
        let parse = |m: String| Error::Parse {
            what: "cluster description (TOML)".into(),
            message: m,
        };
        let mut file: toml::Table = toml::from_str(text).map_err(|e| parse(e.to_string()))?;
        let c: Cluster = match file.remove("preset") {
            Some(toml::Value::String(p)) => {
                let mut base = Cluster::preset(&p)?.to_table();
                merge(&mut base, file);
                base.try_into()
                    .map_err(|e: toml::de::Error| parse(e.to_string()))?
            }
            Some(v) => return Err(parse(format!("`preset` must be a string, got {v}"))),
            None => toml::Value::Table(file)
                .try_into()
                .map_err(|e: toml::de::Error| parse(e.to_string()))?,
        };
        c.validated()
    }

    /// The cluster as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a cluster serializes")
    }

    fn to_table(&self) -> toml::Table {
        toml::Table::try_from(self).expect("a cluster serializes")
    }

    /// Sets one field by dotted path (`gpus_per_node`, `inter.nic_gbps`, `gpu.peak_tflops.bf16`)
    /// from its TOML text (`8`, `0.9`, `"name"`), then validates.
    pub fn set(&self, path: &str, value: &str) -> Result<Cluster> {
        if path.is_empty() {
            return Err(Error::invalid(
                "cluster field",
                "an empty name",
                format!("one of {}", field_paths(&self.to_table(), "").join(", ")),
            ));
        }
        let v: toml::Value = toml::from_str::<toml::Table>(&format!("v = {value}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .ok_or_else(|| {
                Error::invalid(path, value, "a TOML value (a number, or a \"string\")")
            })?;
        let mut t = self.to_table();
        let mut cur = &mut t;
        let keys: Vec<&str> = path.split('.').collect();
        for (i, k) in keys.iter().enumerate() {
            let known = cur.contains_key(*k);
            if !known || (i + 1 < keys.len() && !cur[*k].is_table()) {
                return Err(Error::invalid(
                    "cluster field",
                    path,
                    format!("one of {}", field_paths(&self.to_table(), "").join(", ")),
                ));
            }
            if i + 1 == keys.len() {
                cur.insert((*k).into(), v.clone());
                break;
            }
            cur = cur[*k].as_table_mut().expect("checked above");
        }
        let c: Cluster = toml::Value::Table(t)
            .try_into()
            .map_err(|e: toml::de::Error| Error::invalid(path, value, e.message().to_string()))?;
        c.validated()
    }

    /// Sets the total NIC bandwidth of a node, keeping the NIC count.
    pub fn with_nic_gbps_per_node(&self, gbps: f64) -> Result<Cluster> {
        if !(gbps > 0.0 && gbps.is_finite()) {
            return Err(Error::invalid(
                "nic_gbps_per_node",
                gbps.to_string(),
                "a finite number > 0",
            ));
        }
        let mut c = self.clone();
        c.inter.nic_gbps = gbps / c.inter.nics_per_node.max(1) as f64;
        c.validated()
    }

    /// Checks every field's range. Rates, sizes and latencies lie within `[1e-6, 1e9]` in their
    /// units (a subnormal speed or a 1e308 one would only give an infinite or zero step time).
    pub fn validated(self) -> Result<Cluster> {
        const RANGE: std::ops::RangeInclusive<f64> = 1e-6..=1e9;
        let pos = |field: &str, v: f64| {
            if RANGE.contains(&v) {
                Ok(())
            } else {
                Err(Error::invalid(
                    field,
                    v.to_string(),
                    "a finite number > 0, from 1e-6 to 1e9",
                ))
            }
        };
        let frac = |field: &str, v: f64| {
            if v > 0.0 && v <= 1.0 {
                Ok(())
            } else {
                Err(Error::invalid(field, v.to_string(), "a fraction in (0, 1]"))
            }
        };
        if self.gpus_per_node == 0 {
            return Err(Error::invalid("gpus_per_node", "0", "at least 1"));
        }
        if self.inter.nics_per_node == 0 {
            return Err(Error::invalid("inter.nics_per_node", "0", "at least 1"));
        }
        pos("gpu.memory_gib", self.gpu.memory_gib)?;
        pos("gpu.hbm_gbytes_per_s", self.gpu.hbm_gbytes_per_s)?;
        frac("gpu.compute_efficiency", self.gpu.compute_efficiency)?;
        let p = self.gpu.peak_tflops;
        for (f, v) in [("fp32", p.fp32), ("bf16", p.bf16), ("fp16", p.fp16)] {
            if !(v == 0.0 || RANGE.contains(&v)) {
                return Err(Error::invalid(
                    format!("gpu.peak_tflops.{f}"),
                    v.to_string(),
                    "0 (unsupported) or a number from 1e-6 to 1e9",
                ));
            }
        }
        pos("intra.gbytes_per_s", self.intra.gbytes_per_s)?;
        frac("intra.efficiency", self.intra.efficiency)?;
        pos("inter.nic_gbps", self.inter.nic_gbps)?;
        frac("inter.efficiency", self.inter.efficiency)?;
        if self.protocols.is_empty() {
            return Err(Error::invalid("protocols", "[]", "at least one protocol"));
        }
        for pr in &self.protocols {
            frac(
                &format!("protocols.{}.bw_efficiency", pr.name),
                pr.bw_efficiency,
            )?;
            for (f, v) in [
                ("base_us", pr.base_us),
                ("intra_hop_us", pr.intra_hop_us),
                ("inter_hop_us", pr.inter_hop_us),
            ] {
                if !(v == 0.0 || RANGE.contains(&v)) {
                    return Err(Error::invalid(
                        format!("protocols.{}.{f}", pr.name),
                        v.to_string(),
                        "0 or a number from 1e-6 to 1e9 (µs)",
                    ));
                }
            }
        }
        let c = self.codec;
        for (f, v) in [
            ("int8_encode", c.int8_encode),
            ("int8_decode", c.int8_decode),
            ("int4_encode", c.int4_encode),
            ("int4_decode", c.int4_decode),
        ] {
            pos(&format!("codec.{f}"), v)?;
        }
        if let Some(h) = self.host {
            pos("host.pcie_gbytes_per_s", h.pcie_gbytes_per_s)?;
            pos("host.memory_gbytes_per_s", h.memory_gbytes_per_s)?;
            pos("host.nvme_gbytes_per_s", h.nvme_gbytes_per_s)?;
        }
        Ok(self)
    }

    /// Sustained FLOP/s of one GPU at `precision`, or an error naming the missing peak.
    pub fn sustained_flops(&self, precision: Precision) -> Result<f64> {
        let (name, peak) = match precision {
            Precision::Fp32 => ("fp32", self.gpu.peak_tflops.fp32),
            Precision::Bf16 => ("bf16", self.gpu.peak_tflops.bf16),
            Precision::Fp16 => ("fp16", self.gpu.peak_tflops.fp16),
        };
        if peak <= 0.0 {
            return Err(Error::invalid(
                format!("gpu.peak_tflops.{name}"),
                format!("0 ({} has no {name} peak)", self.gpu.name),
                "another --precision, or a peak set with --set gpu.peak_tflops.NAME=TFLOPS",
            ));
        }
        Ok(peak * 1e12 * self.gpu.compute_efficiency)
    }

    /// Delivered intra-node bandwidth per GPU per direction, B/s.
    pub fn intra_bytes_per_s(&self) -> f64 {
        self.intra.gbytes_per_s * 1e9 * self.intra.efficiency
    }

    /// Delivered NIC bandwidth of a whole node, B/s.
    pub fn node_nic_bytes_per_s(&self) -> f64 {
        self.inter.nics_per_node as f64 * self.inter.nic_gbps * 1e9 / 8.0 * self.inter.efficiency
    }

    /// Total NIC line rate of a node, Gbit/s.
    pub fn nic_gbps_per_node(&self) -> f64 {
        self.inter.nics_per_node as f64 * self.inter.nic_gbps
    }

    /// GPU memory in bytes.
    pub fn gpu_memory_bytes(&self) -> u64 {
        (self.gpu.memory_gib * (1u64 << 30) as f64) as u64
    }
}

fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

fn field_paths(t: &toml::Table, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (k, v) in t {
        let p = format!("{prefix}{k}");
        match v {
            toml::Value::Table(s) => out.extend(field_paths(s, &format!("{p}."))),
            toml::Value::Array(_) => {}
            _ => out.push(p),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_follow_the_specs() {
        let v = Cluster::preset("dgx2-v100").unwrap();
        assert_eq!(v.gpus_per_node, 16);
        // 8 × 100 Gbps at 12.2 GB/s each.
        assert!((v.node_nic_bytes_per_s() - 8.0 * 12.2e9).abs() < 1.0);
        // 150 GB/s per direction at 80 %.
        assert!((v.intra_bytes_per_s() - 120e9).abs() < 1.0);
        let h = Cluster::preset("dgx-h100").unwrap();
        assert!((h.intra_bytes_per_s() - 360e9).abs() < 1.0);
        assert!((h.node_nic_bytes_per_s() / 8.0 - 47e9).abs() < 1.0);
        assert!(Cluster::preset("dgx-b200").is_err());
        let e = v.sustained_flops(Precision::Bf16).unwrap_err().to_string();
        assert!(e.contains("no bf16 peak"), "{e}");
        assert_eq!(
            v.sustained_flops(Precision::Fp16).unwrap(),
            125e12 * DEFAULT_COMPUTE_EFFICIENCY
        );
    }

    #[test]
    fn toml_round_trips_and_merges_onto_a_preset() {
        let a = Cluster::preset("dgx-a100").unwrap();
        assert_eq!(Cluster::from_toml(&a.to_toml()).unwrap(), a);
        let c = Cluster::from_toml("preset = \"dgx-a100\"\n[inter]\nnics_per_node = 4\n").unwrap();
        assert_eq!(c.inter.nics_per_node, 4);
        assert_eq!(c.inter.nic_gbps, 200.0);
        let e = Cluster::from_toml("preset = \"dgx-a100\"\n[inter]\nnic_gbs = 4\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("nic_gbs"), "{e}");
        let e = Cluster::from_toml("preset = \"dgx-a100\"\ngpus_per_node = 0\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("gpus_per_node"), "{e}");
    }

    #[test]
    fn set_changes_one_field_and_names_the_valid_ones() {
        let a = Cluster::preset("dgx-a100").unwrap();
        let b = a.set("inter.nic_gbps", "100").unwrap();
        assert_eq!(b.inter.nic_gbps, 100.0);
        assert_eq!(a.set("gpus_per_node", "4").unwrap().gpus_per_node, 4);
        let e = a.set("inter.nic_gbs", "1").unwrap_err().to_string();
        assert!(e.contains("inter.nic_gbps"), "{e}");
        assert!(a.set("intra.efficiency", "1.5").is_err());
        assert!(a.set("gpus_per_node", "many").is_err());
        let c = a.with_nic_gbps_per_node(800.0).unwrap();
        assert_eq!(c.nic_gbps_per_node(), 800.0);
        assert!(a.with_nic_gbps_per_node(0.0).is_err());
    }
}
