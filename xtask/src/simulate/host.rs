//! `cargo xtask simulate --validate-host`: the simulator against a measurement.
//!
//! The default job's plan (`cargo xtask train`'s model, 4 ranks as 2 nodes of 2, ZeRO-3 + qwZ +
//! hpZ + qgZ) is replayed on zero-comm's host loopback: every collective of `Plan::schedule()`,
//! through the same calls the trainer makes (plain collectives, `qwz_all_gather`,
//! `qgz_reduce_scatter`), each after a barrier and timed on rank 0, compute left out. The
//! prediction is `zero_core::sim` on the host loopback described as a cluster
//! (`host-loopback.toml`, calibrated from `cargo bench -p zero-comm`). Both are per optimizer step
//! and per phase; the replay's traffic is checked against the plan.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use burn::tensor::Device;
use zero_burn::demo::gpt::GptConfig;
use zero_burn::demo::job::JobConfig;
use zero_comm::host::{HostWorld, probe};
use zero_comm::quantized::{QuantGroups, QuantScratch, qgz_reduce_scatter, qwz_all_gather};
use zero_comm::{Communicator, ReduceOp};
use zero_core::comm_model::{GroupKind, Payload, Phase};
use zero_core::sim::{Cluster, ModelShape, Overlap, SimOptions, simulate};
use zero_core::{Collective, Plan, Topology, TrafficTable};
use zero_quant::{BlockCodec, Int4Block, Int8Block};

const PHASES: [Phase; 5] = [
    Phase::Forward,
    Phase::Backward,
    Phase::GradReduce,
    Phase::Clip,
    Phase::PostStep,
];

/// Communication per optimizer step and per phase ([`PHASES`]), in seconds: predicted on the
/// given cluster (A) and on the in-process calibration (B), and measured by the replay.
pub(crate) struct Validation {
    topo: Topology,
    label: String,
    calibrated: Cluster,
    pub(crate) bench: Vec<f64>,
    pub(crate) inproc: Vec<f64>,
    pub(crate) measured: Vec<f64>,
}

pub(crate) fn validate(cluster: &Cluster, steps: usize, json: bool) -> anyhow::Result<()> {
    let v = measure(cluster, steps)?;
    print(cluster, steps, json, &v)
}

/// Calibrates, predicts and replays the default job's communication (see the module docs).
pub(crate) fn measure(cluster: &Cluster, steps: usize) -> anyhow::Result<Validation> {
    let job = JobConfig::default_job();
    let model_cfg = GptConfig {
        vocab: 64,
        ..job.model
    };
    let model = model_cfg.init(&Device::flex().autodiff(), job.seed);
    let topo = Topology::new(job.world_size, job.ranks_per_node)?;
    let plan = zero_burn::plan_for(&model, topo, &job.zero)?;
    let shape = ModelShape {
        layers: job.model.layers as u64,
        hidden: job.model.d_model as u64,
        seq_len: job.model.context as u64,
    };
    let opts = SimOptions {
        tokens_per_gpu: (job.micro_batch * job.model.context) as u64,
        shape: Some(shape),
        recompute: true,
        overlap: Some(Overlap::None),
    };
    let calibrated = calibrate(cluster, topo, 200)?;
    let per_phase = |c: &Cluster| -> anyhow::Result<Vec<f64>> {
        let r = simulate(&plan, c, &opts)?;
        Ok(PHASES
            .iter()
            .map(|p| {
                r.comm
                    .by_phase
                    .iter()
                    .filter(|x| x.phase == *p)
                    .map(|x| x.seconds)
                    .sum()
            })
            .collect())
    };
    let (bench, inproc) = (per_phase(cluster)?, per_phase(&calibrated)?);
    let measured = replay(&plan, steps)?;
    Ok(Validation {
        topo,
        label: zero_core::sim::config_label(plan.config()),
        calibrated,
        bench,
        inproc,
        measured,
    })
}

fn print(cluster: &Cluster, steps: usize, json: bool, v: &Validation) -> anyhow::Result<()> {
    let Validation {
        topo,
        label,
        calibrated,
        bench,
        inproc,
        measured,
    } = v;
    let sum = |v: &[f64]| v.iter().sum::<f64>();
    let (tb, ti, tm) = (sum(bench), sum(inproc), sum(measured));
    if json {
        let rows: Vec<serde_json::Value> = PHASES
            .iter()
            .enumerate()
            .map(|(i, p)| {
                serde_json::json!({"phase": p.name(), "predicted_seconds": bench[i],
                    "predicted_in_process_seconds": inproc[i], "measured_seconds": measured[i]})
            })
            .collect();
        let out = serde_json::json!({
            "cluster": cluster.name, "calibrated_cluster": calibrated, "steps": steps,
            "phases": rows, "predicted_seconds": tb, "predicted_in_process_seconds": ti,
            "measured_seconds": tm,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "default job ({} ranks as {} nodes of {}, {}): communication per optimizer step; measured: \
         median of {steps} replayed steps (each op after a barrier, rank 0) on the host loopback",
        topo.world_size(),
        topo.num_nodes(),
        topo.ranks_per_node(),
        label,
    );
    println!(
        "predicted A: zero_core::sim on `{}`; predicted B: on the in-process calibration \
         (alpha {:.1} µs + {:.1} µs per hop, world {:.2} GB/s, pair {:.2} GB/s, int8 {:.2}/{:.2}, int4 {:.2}/{:.2} GB/s)",
        cluster.name,
        calibrated.protocols[0].base_us,
        calibrated.protocols[0].intra_hop_us,
        calibrated.node_nic_bytes_per_s() / 1e9,
        calibrated.intra_bytes_per_s() / 1e9,
        calibrated.codec.int8_encode,
        calibrated.codec.int8_decode,
        calibrated.codec.int4_encode,
        calibrated.codec.int4_decode,
    );
    println!(
        "| phase | predicted A ms | predicted B ms | measured ms | A / measured | B / measured |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    let row = |name: &str, a: f64, b: f64, m: f64| {
        println!(
            "| {name} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} |",
            a * 1e3,
            b * 1e3,
            m * 1e3,
            a / m,
            b / m
        )
    };
    for (i, p) in PHASES.iter().enumerate() {
        if measured[i] > 0.0 || bench[i] > 0.0 {
            row(p.name(), bench[i], inproc[i], measured[i]);
        }
    }
    row("total", tb, ti, tm);
    Ok(())
}

/// Calibrates the host loopback in-process, on the job's topology: zero-comm's probe of the
/// trainer's path (`probe::all_gather_medians`: 0 B and 1 MiB over the world and over both node
/// pairs at once) fitted by [`fit`], and the codecs on every rank thread at once (1 MiB of f32)
/// as rates S / t (HBM set to 1 GB/s so the codec fractions read as GB/s).
fn calibrate(base: &Cluster, topo: Topology, reps: usize) -> anyhow::Result<Cluster> {
    const S: usize = 1 << 18;
    let ag = probe::all_gather_medians(topo, S * 4, reps, Duration::from_secs(120))
        .context("the calibration's collectives")?;
    let (q8, q4) = (Int8Block::default(), Int4Block::default());
    // The codecs on every rank thread at once, as in a step.
    let results = HostWorld::new(topo, Duration::from_secs(120)).launch(|mut world| {
        let data: Vec<f32> = (0..S).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut wire8 = vec![0u8; q8.encoded_len(S)];
        let mut wire4 = vec![0u8; q4.encoded_len(S)];
        let mut out = vec![0f32; S];
        let mut t: Vec<Vec<f64>> = (0..4).map(|_| Vec::with_capacity(reps)).collect();
        for _ in 0..reps {
            for (i, ti) in t.iter_mut().enumerate() {
                world.barrier()?;
                let s = Instant::now();
                let r = match i {
                    0 => q8.encode(&data, &mut wire8),
                    1 => q8.decode(&wire8, &mut out),
                    2 => q4.encode(&data, &mut wire4),
                    _ => q4.decode(&wire4, &mut out),
                };
                ti.push(s.elapsed().as_secs_f64());
                if let Err(e) = r {
                    return Ok(Err(e.to_string()));
                }
            }
        }
        Ok::<_, zero_comm::Error>(Ok(t))
    });
    let mut t = results
        .into_iter()
        .next()
        .expect("rank 0")
        .map_err(|_| anyhow::anyhow!("rank 0 panicked in the calibration"))?
        .context("the calibration's codecs")?
        .map_err(|e| anyhow::anyhow!("the calibration's codecs: {e}"))?;
    let med: Vec<f64> = t
        .iter_mut()
        .map(|v| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        })
        .collect();
    let bytes = (S * 4) as f64;
    let mut c = fit(base, topo, &ag);
    c.name = "host-loopback (in-process calibration)".into();
    c.gpu.hbm_gbytes_per_s = 1.0;
    c.codec.int8_encode = bytes / med[0] / 1e9;
    c.codec.int8_decode = bytes / med[1] / 1e9;
    c.codec.int4_encode = bytes / med[2] / 1e9;
    c.codec.int4_decode = bytes / med[3] / 1e9;
    Ok(c.validated()?)
}

/// `base` with the α-β values of the probe's medians ([`probe::AllGatherMedians::fit`]).
fn fit(base: &Cluster, topo: Topology, ag: &probe::AllGatherMedians) -> Cluster {
    let f = ag.fit(topo);
    let mut c = base.clone();
    c.protocols.truncate(1);
    c.protocols[0].base_us = f.base_us;
    c.protocols[0].intra_hop_us = f.hop_us;
    c.protocols[0].inter_hop_us = f.hop_us;
    c.inter.nics_per_node = 1;
    c.inter.efficiency = 1.0;
    c.inter.nic_gbps = f.world_bytes_per_s * 8.0 / 1e9;
    c.intra.efficiency = 1.0;
    c.intra.gbytes_per_s = f.node_bytes_per_s / 1e9;
    c
}

/// Replays `plan`'s schedule `steps + 1` times (the first is a warm-up) and returns rank 0's
/// median seconds per step, by phase. Fails if the replay's traffic differs from the plan's.
fn replay(plan: &Plan, steps: usize) -> anyhow::Result<Vec<f64>> {
    let c = plan.config();
    if plan.working_bytes() != 4 {
        bail!(
            "the host replay moves fp32 working elements; this plan's are {} B",
            plan.working_bytes()
        );
    }
    let ops = plan.schedule();
    let a = c.gradient_accumulation_steps as usize;
    let (n, l) = (plan.world_size(), plan.topology().ranks_per_node());
    let longest = plan
        .units()
        .iter()
        .map(|u| u.len as usize)
        .max()
        .unwrap_or(0);
    let data: Vec<f32> = (0..longest).map(|i| (i as f32 * 0.37).sin()).collect();
    let q8 = Int8Block::new(c.qwz_block_size)?;
    let q4 = Int4Block::new(c.qgz_block_size)?;
    let supported = |op: &zero_core::PlannedOp| {
        matches!(
            (op.collective, op.payload, op.group),
            (
                Collective::AllGather,
                Payload::Working | Payload::F64,
                GroupKind::World
            ) | (
                Collective::AllGather,
                Payload::Int8,
                GroupKind::World | GroupKind::Hpz
            ) | (
                Collective::ReduceScatter,
                Payload::Working,
                GroupKind::World
            ) | (
                Collective::AllToAll,
                Payload::Int4,
                GroupKind::IntraNode | GroupKind::CrossNode
            )
        )
    };
    if let Some(op) = ops.iter().find(|op| !supported(op)) {
        bail!("the host replay cannot run {op:?}");
    }
    if steps == 0 {
        bail!("--steps must be at least 1");
    }
    let results = HostWorld::new(*plan.topology(), Duration::from_secs(120)).launch(|mut world| {
        let rank = world.global_rank();
        let mut hpz = match plan.hpz() {
            Some(h) => Some(world.split(rank / h.size, rank)?),
            None => None,
        };
        let mut groups = if c.quantized_gradients {
            Some(QuantGroups::new(&mut world)?)
        } else {
            None
        };
        let mut scratch = QuantScratch::new();
        let mut out = vec![0f32; longest];
        let mut per_step: Vec<[f64; 5]> = Vec::new();
        for _ in 0..=steps {
            let mut t = [0.0f64; 5];
            for micro in 0..a {
                for op in &ops {
                    if !op.per_micro_step && micro + 1 < a {
                        continue;
                    }
                    let unit = op.unit.map_or(0, |u| plan.units()[u].len as usize);
                    let count = op.count as usize;
                    world.barrier()?;
                    let start = Instant::now();
                    match (op.collective, op.payload, op.group) {
                        (Collective::AllGather, Payload::Working, GroupKind::World) => {
                            world.all_gather_host(&data[..count])?;
                        }
                        (Collective::AllGather, Payload::F64, GroupKind::World) => {
                            world.all_gather_host(&[0u8; 8][..count])?;
                        }
                        (Collective::AllGather, Payload::Int8, g) => {
                            let comm = match (g, hpz.as_mut()) {
                                (GroupKind::Hpz, Some(h)) => h,
                                _ => &mut world,
                            };
                            let k = comm.world_size();
                            let chunk = unit / k;
                            qwz_all_gather(
                                comm,
                                &q8,
                                &data[..chunk],
                                &mut out[..chunk * k],
                                &mut scratch,
                            )?;
                        }
                        (Collective::ReduceScatter, Payload::Working, GroupKind::World) => {
                            world.reduce_scatter_host(&data[..count * n], ReduceOp::Mean)?;
                        }
                        // One qgZ call issues both all-to-alls: run it on the first.
                        (Collective::AllToAll, Payload::Int4, g)
                            if g == GroupKind::IntraNode || l == 1 =>
                        {
                            let gr = groups.as_mut().expect("qgZ groups exist with qgZ");
                            qgz_reduce_scatter(
                                gr,
                                &q4,
                                &data[..unit],
                                &mut out[..unit / n],
                                &mut scratch,
                            )?;
                        }
                        _ => {} // excluded above
                    }
                    let i = PHASES
                        .iter()
                        .position(|p| *p == op.phase)
                        .expect("every phase");
                    t[i] += start.elapsed().as_secs_f64();
                }
            }
            per_step.push(t);
        }
        let mut traffic = world.traffic().clone();
        if let Some(h) = &hpz {
            traffic.merge(h.traffic());
        }
        if let Some(g) = &groups {
            traffic.merge(&g.traffic());
        }
        traffic.by_collective.remove(&Collective::Barrier);
        Ok::<_, zero_comm::Error>((per_step, traffic))
    });
    let mut rank0 = None;
    for (rank, r) in results.into_iter().enumerate() {
        let (per_step, traffic) = r
            .map_err(|_| anyhow::anyhow!("rank {rank} panicked in the replay"))?
            .with_context(|| format!("rank {rank} of the replay"))?;
        let mut want = TrafficTable::new();
        for (op, t) in &plan.comm(rank).by_collective.by_collective {
            want.record(*op, t.scaled(steps as u64 + 1));
        }
        if traffic != want {
            bail!("rank {rank}: the replay moved {traffic:?}, the plan says {want:?}");
        }
        if rank == 0 {
            rank0 = Some(per_step);
        }
    }
    let per_step = rank0.expect("rank 0 ran");
    Ok((0..PHASES.len())
        .map(|i| {
            let mut v: Vec<f64> = per_step[1..].iter().map(|t| t[i]).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        })
        .collect())
}
