//! What gpu-check measured, as a cluster file for `cargo xtask simulate --cluster FILE`: the
//! preset of the GPU's class with the codec speeds this GPU ran at (the simulator models them as
//! fractions of HBM bandwidth, so each is the measured GB/s over the preset's HBM GB/s).
//!
//! The NCCL figures go in as comments only: gpu-check runs NCCL at world size 1, where a
//! collective is a device copy and says nothing of NVLink or the NICs. Link bandwidths need two
//! or more GPUs in one communicator.

use std::fmt::Write;
use std::path::Path;

use anyhow::Context;

use zero_core::sim::Cluster;

use super::bench::NcclFigure;
use super::{Step, Verdict};

/// One `ZERO_GPU_QUANT codec=… n=… encode_gbps=… decode_gbps=…` line.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CodecFigure {
    /// `int8` or `int4`.
    pub(crate) codec: String,
    /// Encode, GB/s of f32 tensor bytes.
    pub(crate) encode_gbps: f64,
    /// Decode, GB/s of f32 tensor bytes.
    pub(crate) decode_gbps: f64,
}

/// Parses the part of a quant line after its prefix.
pub(crate) fn parse_codec(rest: &str) -> Option<CodecFigure> {
    let (mut codec, mut enc, mut dec) = (None, None, None);
    for kv in rest.split_whitespace() {
        let (k, v) = kv.split_once('=')?;
        match k {
            "codec" => codec = Some(v.to_string()),
            "encode_gbps" => enc = v.parse().ok(),
            "decode_gbps" => dec = v.parse().ok(),
            _ => {}
        }
    }
    Some(CodecFigure {
        codec: codec?,
        encode_gbps: enc?,
        decode_gbps: dec?,
    })
}

/// The simulator preset of a GPU's class, by its `nvidia-smi` name.
pub(crate) fn preset_for(gpu_name: &str) -> &'static str {
    let n = gpu_name.to_ascii_uppercase();
    if n.contains("V100") {
        "dgx2-v100"
    } else if n.contains("A100") {
        "dgx-a100"
    } else {
        // H100, H200, and any other GPU: the codec figures are this GPU's either way, the links
        // and compute stay the preset's (the file's comments name the GPU).
        "dgx-h100"
    }
}

/// The cluster file: `preset` with `[codec]` from `codecs` (both int8 and int4 needed), and the
/// NCCL figures `(op, bytes, seconds)` as comments. Checked by loading it as `simulate` does.
pub(crate) fn cluster_toml(
    gpu_name: &str,
    codecs: &[CodecFigure],
    nccl: &[NcclFigure],
) -> anyhow::Result<String> {
    let preset = preset_for(gpu_name);
    let base = Cluster::preset(preset)?;
    let hbm = base.gpu.hbm_gbytes_per_s;
    let find = |c: &str| {
        codecs.iter().find(|f| f.codec == c).ok_or_else(|| {
            anyhow::anyhow!("no {c} codec figures (the CUDA kernel test prints them)")
        })
    };
    let (i8, i4) = (find("int8")?, find("int4")?);
    let mut t = String::new();
    writeln!(
        t,
        "# Measured by `cargo xtask gpu-check` on one {gpu_name}."
    )?;
    writeln!(
        t,
        "# Codecs: zero-quant's CUDA kernels on a 256 MiB f32 tensor, as fractions of the \
         preset's {hbm} GB/s of HBM:"
    )?;
    for f in [i8, i4] {
        writeln!(
            t,
            "#   {} encode {:.1} GB/s, decode {:.1} GB/s",
            f.codec, f.encode_gbps, f.decode_gbps
        )?;
    }
    writeln!(
        t,
        "# NCCL at world size 1 (a device copy: not a link; the links keep the preset's figures):"
    )?;
    for (op, bytes, secs) in nccl {
        writeln!(t, "#   {op} {} MiB in {:.1} µs", bytes >> 20, secs * 1e6)?;
    }
    writeln!(t, "preset = \"{preset}\"")?;
    // A JSON string is a valid TOML basic string: the GPU's name quoted and escaped.
    let name = serde_json::to_string(&format!("{preset}, codecs of gpu-check on {gpu_name}"))?;
    writeln!(t, "name = {name}")?;
    writeln!(t, "\n[codec]")?;
    writeln!(t, "int8_encode = {}", i8.encode_gbps / hbm)?;
    writeln!(t, "int8_decode = {}", i8.decode_gbps / hbm)?;
    writeln!(t, "int4_encode = {}", i4.encode_gbps / hbm)?;
    writeln!(t, "int4_decode = {}", i4.decode_gbps / hbm)?;
    Cluster::from_toml(&t)
        .map_err(|e| anyhow::anyhow!("the calibration file does not load: {e}"))?;
    Ok(t)
}

/// Writes what the codecs and NCCL measured as `<work>/gpu-calibration.toml`, a cluster file for
/// `cargo xtask simulate --cluster FILE` (see the module docs).
pub(super) fn step(gpus: &[String], quant: &[String], nccl: &[NcclFigure], work: &Path) -> Step {
    // `index, name, driver, memory` (nvidia-smi's CSV; anything else is another message).
    let name = gpus
        .first()
        .map(|g| g.split(',').collect::<Vec<_>>())
        .filter(|f| f.len() == 4)
        .map_or("unknown GPU", |f| f[1].trim());
    let codecs: Vec<_> = quant.iter().filter_map(|l| parse_codec(l)).collect();
    let path = work.join("gpu-calibration.toml");
    let r = cluster_toml(name, &codecs, nccl).and_then(|text| {
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))
    });
    Step {
        name: "calibration",
        verdict: if r.is_ok() {
            Verdict::Pass
        } else {
            Verdict::Fail
        },
        secs: None,
        detail: match r {
            Ok(()) => format!(
                "{} (codec speeds for `cargo xtask simulate --cluster` that file)",
                path.display()
            ),
            Err(e) => format!("not written: {e:#}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures() -> Vec<CodecFigure> {
        [
            "codec=int8 n=67108864 encode_gbps=1042.0 decode_gbps=1284.5",
            "codec=int4 n=67108864 encode_gbps=812.0 decode_gbps=1032.0",
        ]
        .iter()
        .map(|l| parse_codec(l).unwrap())
        .collect()
    }

    /// The file loads as `simulate --cluster FILE` loads it, on the GPU class's preset, and
    /// gives back the measured codec speeds; the links stay the preset's.
    #[test]
    fn the_calibration_loads_with_the_measured_codec_speeds() {
        let nccl = vec![("all_gather".to_string(), 64 << 20, 1.5e-4)];
        let text = cluster_toml("NVIDIA H200", &figures(), &nccl).unwrap();
        let c = Cluster::from_toml(&text).unwrap();
        let base = Cluster::preset("dgx-h100").unwrap();
        let hbm = c.gpu.hbm_gbytes_per_s;
        assert!((c.codec.int8_encode * hbm - 1042.0).abs() < 1e-6, "{text}");
        assert!((c.codec.int8_decode * hbm - 1284.5).abs() < 1e-6);
        assert!((c.codec.int4_encode * hbm - 812.0).abs() < 1e-6);
        assert!((c.codec.int4_decode * hbm - 1032.0).abs() < 1e-6);
        assert_eq!((c.intra, c.inter), (base.intra, base.inter));
        assert!(text.contains("all_gather 64 MiB in 150.0 µs"), "{text}");
        assert_eq!(preset_for("Tesla V100-SXM3-32GB"), "dgx2-v100");
        assert_eq!(preset_for("NVIDIA A100-SXM4-80GB"), "dgx-a100");
        // A name TOML would choke on unescaped.
        let odd = cluster_toml("GPU \"x\" \\ y", &figures(), &[]).unwrap();
        assert!(
            Cluster::from_toml(&odd)
                .unwrap()
                .name
                .ends_with("GPU \"x\" \\ y")
        );
    }

    #[test]
    fn a_missing_codec_is_an_error_naming_it() {
        let e = cluster_toml("NVIDIA H200", &figures()[..1], &[]).unwrap_err();
        assert!(e.to_string().contains("no int4 codec figures"), "{e}");
        assert!(parse_codec("codec=int8 encode_gbps=x decode_gbps=1").is_none());
    }

    /// The calibration step writes a cluster file `simulate` loads, on the GPU's preset, from
    /// the quant lines of step 4; without them it fails, saying why.
    #[test]
    fn the_calibration_step_writes_a_cluster_file() {
        let tmp = crate::temp_dir("zero-gpu-cal-");
        let work = tmp.path().to_path_buf();
        let gpus = vec!["0, NVIDIA A100-SXM4-80GB, 580.65, 81920 MiB".to_string()];
        let quant = [
            "codec=int8 n=1 encode_gbps=900.0 decode_gbps=1000.0",
            "codec=int4 n=1 encode_gbps=700.0 decode_gbps=800.0",
        ]
        .map(String::from);
        let s = step(&gpus, &quant, &[], &work);
        assert_eq!(s.verdict, Verdict::Pass, "{}", s.detail);
        let text = std::fs::read_to_string(work.join("gpu-calibration.toml")).unwrap();
        let c = zero_core::sim::Cluster::from_toml(&text).unwrap();
        assert!(
            c.name.contains("dgx-a100") && c.name.contains("A100-SXM4-80GB"),
            "{}",
            c.name
        );
        assert!((c.codec.int4_decode * c.gpu.hbm_gbytes_per_s - 800.0).abs() < 1e-6);
        let s = step(&gpus, &[], &[], &work);
        assert_eq!(s.verdict, Verdict::Fail);
        assert!(s.detail.contains("no int8 codec figures"), "{}", s.detail);
    }
}
