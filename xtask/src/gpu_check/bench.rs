//! gpu-check's **bench** step: NCCL all-gather, reduce-scatter and all-reduce at world size 1,
//! their `ZERO_GPU_BW` lines parsed into figures (which the calibration step also records).

use std::process::Command;
use std::time::Duration;

use super::{Step, Verdict, run_limited};

/// One collective's figure: `(op, bytes, seconds)`.
pub(super) type NcclFigure = (String, u64, f64);

const BW_PREFIX: &str = "ZERO_GPU_BW ";

/// One `ZERO_GPU_BW op=… bytes=… seconds=… algbw_gbps=…` line as `(op, bytes, seconds, GB/s)`.
fn parse_bw_line(line: &str) -> Option<(String, u64, f64, f64)> {
    let rest = line.trim().strip_prefix(BW_PREFIX)?;
    let mut op = None;
    let (mut bytes, mut secs, mut gbps) = (None, None, None);
    for kv in rest.split_whitespace() {
        let (k, v) = kv.split_once('=')?;
        match k {
            "op" => op = Some(v.to_string()),
            "bytes" => bytes = v.parse().ok(),
            "seconds" => secs = v.parse().ok(),
            "algbw_gbps" => gbps = v.parse().ok(),
            _ => {}
        }
    }
    Some((op?, bytes?, secs?, gbps?))
}

/// Runs the NCCL test program's bandwidth report (`cmd`: the program with gpu-check's
/// environment; `None` when it was not built) on `mib` MiB: the step, and `(op, bytes, seconds)`
/// per collective.
pub(super) fn step(
    cmd: Option<Command>,
    mib: usize,
    limit: Duration,
) -> anyhow::Result<(Step, Vec<NcclFigure>)> {
    let Some(mut bench) = cmd else {
        let step = Step {
            name: "bench",
            verdict: Verdict::Fail,
            secs: None,
            detail: "did not run: no NCCL test program".into(),
        };
        return Ok((step, Vec::new()));
    };
    bench
        .args(["gpu_bandwidth_report", "--exact", "--nocapture"])
        .env("ZERO_GPU_BENCH", "1")
        .env("ZERO_GPU_BENCH_MIB", mib.to_string());
    let r = run_limited("bench", bench, limit, true)?;
    let parsed: Vec<_> = r.stdout.iter().filter_map(|l| parse_bw_line(l)).collect();
    let raw = parsed
        .iter()
        .map(|(op, b, s, _)| (op.clone(), *b, *s))
        .collect();
    let figures: Vec<String> = parsed
        .into_iter()
        .map(|(op, bytes, secs, gbps)| {
            format!(
                "{op} {} MiB: {gbps:.1} GB/s ({:.1} µs)",
                bytes >> 20,
                secs * 1e6
            )
        })
        .collect();
    let ok = r.ok && figures.len() == 3;
    let step = Step {
        name: "bench",
        verdict: if ok { Verdict::Pass } else { Verdict::Fail },
        secs: Some(r.secs),
        detail: if figures.is_empty() {
            format!("{}; no figures (skipped? see above)", r.status)
        } else {
            figures.join("; ")
        },
    };
    Ok((step, raw))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidth_lines_parse() {
        let l =
            "ZERO_GPU_BW op=all_gather bytes=67108864 iters=20 seconds=2.5e-5 algbw_gbps=2684.4";
        assert_eq!(
            parse_bw_line(l),
            Some(("all_gather".into(), 67108864, 2.5e-5, 2684.4))
        );
        assert_eq!(parse_bw_line("test foo ... ok"), None);
        assert_eq!(parse_bw_line("ZERO_GPU_BW op=x"), None);
    }
}
