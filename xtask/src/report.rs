//! The run report of `cargo xtask train`: printed (loss, throughput, memory booked and bytes
//! counted against planned, what the process and the device measured, checkpoints saved),
//! written as `report.json`, and drawn as `report.svg` and `report.png`.
//!
//! Words keep their meaning: **counted** bytes are summed where the communicator hands them to
//! its transport (peer reads on the loopbacks, the counts given to MPI and NCCL); **booked**
//! memory is the engine's own accounting of its buffers (in `report.json` under
//! `memory.measured`); **measured** memory comes from outside the engine: the process's peak
//! RSS, the device's memory pools.

use std::path::Path;

use anyhow::{Context, bail};
use zero_burn::demo::job::RunReport;
use zero_core::report::human_bytes;
use zero_core::{Collective, LinkClass, Precision};

/// Rank 0's NVMe traffic so far in a few words, appended to a progress line (empty without a
/// store).
pub(crate) fn io_progress(io: Option<zero_burn::IoReport>) -> String {
    io.map_or_else(String::new, |io| {
        format!(
            "  NVMe {} read, {} written, {:.1} s IO wait",
            human_bytes(io.read_bytes),
            human_bytes(io.written_bytes),
            io.wait_secs
        )
    })
}

/// Prints the report, writes `report.json` (with the process's peak RSS when known),
/// `report.svg` and `report.png` into `out`, and fails when the counted traffic or the booked
/// memory differs from the plan.
pub(crate) fn finish(report: &RunReport, out: &Path, peak_rss: Option<u64>) -> anyhow::Result<()> {
    print_report(report);
    if let Some(rss) = peak_rss {
        println!(
            "process peak RSS, measured by the OS (every rank of this process): {}",
            human_bytes(rss)
        );
    }
    let json = out.join("report.json");
    let mut value = serde_json::to_value(report)?;
    if let (Some(obj), Some(rss)) = (value.as_object_mut(), peak_rss) {
        // The whole process (every rank): what `cargo xtask bench` compares across stages.
        obj.insert("peak_rss_bytes".into(), rss.into());
    }
    std::fs::write(&json, serde_json::to_string_pretty(&value)?)
        .with_context(|| format!("cannot write {}", json.display()))?;
    for figure in ["report.svg", "report.png"] {
        report_figure(report, &out.join(figure))?;
    }
    println!(
        "\nrun directory: {}  (report.json, report.svg, report.png)",
        out.display()
    );
    if !report.comm_matches_plan || !report.memory_matches_plan {
        bail!(
            "counted traffic or booked memory differs from the plan (see the tables above and \
             report.json)"
        );
    }
    Ok(())
}

/// Rank 0's memory per plan category: (the plan's name, a short label, booked, planned).
fn memory_rows(r: &RunReport) -> [(&'static str, &'static str, u64, u64); 7] {
    let (m, p) = (&r.memory.measured[0], &r.memory.planned[0]);
    [
        ("parameters", "parameters", m.parameters, p.parameters),
        ("gradients", "gradients", m.gradients, p.gradients),
        (
            "optimizer_states",
            "optimizer",
            m.optimizer_states,
            p.optimizer_states,
        ),
        (
            "master_weights",
            "master",
            m.master_weights,
            p.master_weights,
        ),
        (
            "hpz_secondary",
            "hpZ secondary",
            m.hpz_secondary,
            p.hpz_secondary,
        ),
        (
            "gathered_working_set",
            "gathered",
            m.gathered_working_set,
            p.gathered_working_set,
        ),
        (
            "communication_buffers",
            "comm buffers",
            m.communication_buffers,
            p.communication_buffers,
        ),
    ]
}

/// The report's figure: the loss per step (rank mean) with the entropy floor, the tokens/s of
/// each step, and booked against planned memory per category on rank 0, in MiB; SVG, or PNG
/// for a `.png` path.
fn report_figure(r: &RunReport, path: &Path) -> anyhow::Result<()> {
    use crate::plot::{Bars, Panel, Series};
    let x0 = r.first_step as f64 + 1.0;
    let mut series = vec![Series {
        name: "loss (mean over ranks)".into(),
        points: r
            .loss
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (x0 + i as f64, f64::from(l)))
            .collect(),
    }];
    if let Some(f) = r.loss_floor {
        let last = x0 + r.loss.len().saturating_sub(1) as f64;
        series.push(Series {
            name: format!("entropy floor {f:.3}"),
            points: vec![(x0, f), (last, f)],
        });
    }
    let lines = Panel {
        title: format!(
            "ZeRO-{}: loss per step ({:.0} tokens/s)",
            r.job.zero.stage, r.tokens_per_sec
        ),
        x_label: "optimizer step".into(),
        y_label: "nats/token".into(),
        x_names: None,
        series,
    };
    let speed = Panel {
        title: "throughput per step".into(),
        x_label: "optimizer step".into(),
        y_label: "tokens/s".into(),
        x_names: None,
        series: vec![Series {
            name: "tokens/s (slowest rank)".into(),
            points: r
                .step_tokens_per_sec
                .iter()
                .enumerate()
                .map(|(i, &t)| (x0 + i as f64, t))
                .collect(),
        }],
    };
    let rows = memory_rows(r);
    let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
    let bars = Bars {
        title: "memory per rank, rank 0 (MiB)".into(),
        y_label: "MiB".into(),
        categories: rows.iter().map(|r| r.1.to_string()).collect(),
        series: vec![
            ("booked".into(), rows.iter().map(|r| mib(r.2)).collect()),
            ("planned".into(), rows.iter().map(|r| mib(r.3)).collect()),
        ],
    };
    crate::plot::lines_and_bars(path, &[lines, speed], &bars, 1500, 420)
}

fn print_report(r: &RunReport) {
    let first = r.loss.first().copied().unwrap_or(f32::NAN);
    let last10 = &r.loss[r.loss.len().saturating_sub(10)..];
    let last = last10.iter().sum::<f32>() / last10.len().max(1) as f32;
    println!(
        "\nloss: {first:.4} -> {last:.4} (mean of the last {} steps)",
        last10.len()
    );
    if let Some(f) = r.loss_floor {
        println!(
            "loss floor (entropy rate of the synthetic language): {f:.4} nats/token; gap {:.4}",
            f64::from(last) - f
        );
    }
    println!(
        "throughput: {:.0} tokens/s over {:.1} s",
        r.tokens_per_sec, r.wall_secs
    );
    for p in &r.shared {
        println!(
            "shared: `{}` ({} elements) owned by {}, read by {} too: one parameter, its gradients \
             summed",
            p.name,
            p.numel,
            p.owner,
            p.readers.join(", ")
        );
    }
    if r.job.zero.precision == Precision::Fp16 {
        println!(
            "fp16 loss scale: {} -> {}; skipped steps (overflow, every rank together): {}",
            r.loss_scale.first().copied().unwrap_or(f32::NAN),
            r.loss_scale.last().copied().unwrap_or(f32::NAN),
            if r.skipped_steps.is_empty() {
                "none".to_string()
            } else {
                format!("{} {:?}", r.skipped_steps.len(), r.skipped_steps)
            }
        );
    }

    println!("\nmemory per rank (peak bytes on rank 0: booked by the engine vs planned)");
    let (m, p) = (&r.memory.measured[0], &r.memory.planned[0]);
    let mut rows: Vec<(&str, u64, u64)> = memory_rows(r)
        .into_iter()
        .map(|(name, _, meas, plan)| (name, meas, plan))
        .collect();
    rows.push(("model states", m.model_states_bytes, p.model_states_bytes));
    println!("  {:<24} {:>12} {:>12}", "category", "booked", "planned");
    for (name, meas, plan) in rows {
        // `<`: under the plan's bound (e.g. overlapped reductions that never coincide).
        let mark = match meas.cmp(&plan) {
            std::cmp::Ordering::Equal => "=",
            std::cmp::Ordering::Less => "<",
            std::cmp::Ordering::Greater => ">",
        };
        println!(
            "  {name:<24} {:>12} {:>12}  {mark}",
            human_bytes(meas),
            human_bytes(plan)
        );
    }
    if m.f32_compute_copies > 0 {
        println!(
            "  {:<24} {:>12} {:>12}  (burn's f32 copies of the 16-bit weights on the CPU backend)",
            "f32 compute copies",
            human_bytes(m.f32_compute_copies),
            "-"
        );
    }
    println!(
        "  booked model states equal the plan on every rank: {}",
        if r.memory_matches_plan { "yes" } else { "NO" }
    );
    if p.host_bytes + p.disk_bytes > 0 {
        println!(
            "  planned where: {} on the device, {} in host memory, {} on NVMe",
            human_bytes(p.device_bytes),
            human_bytes(p.host_bytes),
            human_bytes(p.disk_bytes)
        );
    }
    if let Some(io) = r.nvme_io_per_rank.first() {
        println!(
            "  NVMe store (rank 0, counted by the store, {} IO): {} read, {} written, {:.2} s \
             waiting on IO, at most {} ring buffers in use (each store's ring holds {})",
            if io.direct_io { "direct" } else { "buffered" },
            human_bytes(io.read_bytes),
            human_bytes(io.written_bytes),
            io.wait_secs,
            io.peak_buffers,
            r.job.zero.offload_buffer_count
        );
    }
    if let Some(dev) = r.device_peak_per_rank.first() {
        println!(
            "  device memory in use at its peak, as the device's pools count it (every rank on \
             rank 0's device): {}",
            human_bytes(*dev)
        );
    }

    println!("\nbytes sent per rank over the whole run (rank 0; counted vs planned)");
    println!(
        "  {:<15} {:>8} {:>12} {:>12} {:>12} {:>12}",
        "collective", "calls", "intra count", "intra plan", "inter count", "inter plan"
    );
    let (meas, plan) = (&r.comm.measured[0], &r.comm.planned[0]);
    for op in Collective::ALL {
        let (a, b) = (
            meas.by_collective.get(&op).copied().unwrap_or_default(),
            plan.by_collective.get(&op).copied().unwrap_or_default(),
        );
        if a.calls == 0 && b.calls == 0 {
            continue;
        }
        println!(
            "  {:<15} {:>8} {:>12} {:>12} {:>12} {:>12}",
            op.name(),
            a.calls,
            human_bytes(a.sent.get(LinkClass::IntraNode)),
            human_bytes(b.sent.get(LinkClass::IntraNode)),
            human_bytes(a.sent.get(LinkClass::InterNode)),
            human_bytes(b.sent.get(LinkClass::InterNode)),
        );
    }
    println!(
        "  counted traffic equals the plan on every rank: {}",
        if r.comm_matches_plan { "yes" } else { "NO" }
    );
    if r.first_step > 0 {
        println!(
            "\nresumed at step {}: these figures cover steps {}..{}",
            r.first_step,
            r.first_step,
            r.first_step + r.loss.len() as u64
        );
    }
    if !r.saves.is_empty() {
        println!("\ncheckpoints saved (rank 0: bytes written, wall time of the collective save)");
        for c in &r.saves {
            println!(
                "  {}  step {:>6}  {:>12}  {:.3} s",
                c.tag,
                c.step,
                human_bytes(c.bytes),
                c.seconds
            );
        }
    }
}
