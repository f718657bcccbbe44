//! Offload past the device: `optimizer_placement = nvme` keeps the optimizer's state in each
//! rank's NVMe store, and `param_placement = cpu | nvme` stage 3's parameter shard in host memory
//! or in the store; each gives the bits of in-memory training, and a checkpoint moves between the
//! placements. Faults in the store (a full disk, a flipped byte) are errors naming the rank, the
//! unit and the file.

use crate::common;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use zero_burn::checkpoint::{MemStorage, Storage};
use zero_burn::demo::gpt::Gpt;
use zero_burn::demo::run::{Checkpointing, HostRun, RankResult, Tick, Work};
use zero_burn::demo::train::{self as launcher, On};
use zero_burn::{Error, IoReport, plan_for};
use zero_core::{Placement, Precision, Topology, ZeroConfig};

fn config(stage: u8, precision: Precision, placement: Placement, nvme: &Path) -> ZeroConfig {
    ZeroConfig {
        nvme_path: Some(nvme.display().to_string()),
        offload_buffer_count: 3,
        ..common::placed(stage, precision, placement)
    }
}

fn train(
    cfg: &ZeroConfig,
    steps: u64,
    checkpoint: Option<Checkpointing>,
) -> Result<Vec<RankResult<Gpt>>, Error> {
    let (model, corpus) = common::tiny();
    let plan = Arc::new(plan_for(&model, Topology::new(2, 2).unwrap(), cfg).unwrap());
    let run = HostRun {
        steps,
        timeout: Duration::from_secs(60),
        keep_final_params: true,
        checkpoint,
    };
    let saves = run.checkpoint.as_ref().is_some_and(|c| c.save.is_some());
    let ticks = Mutex::new(Vec::new());
    let out = launcher::train(
        On::Host,
        plan,
        model,
        Work::new(&corpus, common::options(), &run).on_step(&|t| ticks.lock().unwrap().push(t)),
    )?;
    // Rank 0's progress: one tick a step, with its stores' traffic so far where it has a store.
    let ticks = ticks.into_inner().unwrap();
    let numbers: Vec<u64> = ticks.iter().map(|t| t.step).collect();
    assert_eq!(numbers, (out[0].first_step..steps).collect::<Vec<_>>());
    assert!(
        ticks
            .iter()
            .all(|t| t.nvme_io.is_some() == out[0].nvme_io.is_some())
    );
    if !saves {
        assert_eq!(ticks.last().and_then(|t| t.nvme_io), out[0].nvme_io);
    }
    Ok(out)
}

/// The bytes of a rank's stage-3 parameter shard under `cfg`, as the plan books them.
fn shard_bytes(cfg: &ZeroConfig) -> u64 {
    let (model, _) = common::tiny();
    let plan = plan_for(&model, Topology::new(2, 2).unwrap(), cfg).unwrap();
    let word = if cfg.precision == Precision::Fp32 {
        4
    } else {
        2
    };
    plan.shard_len() * word
}

/// Two steps under `first`, saved, then resumed under `then` to step 4: the bits of `mem`, four
/// uninterrupted steps.
fn resumes_across(mem: &[RankResult<Gpt>], first: &ZeroConfig, then: &ZeroConfig, what: &str) {
    let store: Arc<dyn Storage> = Arc::new(MemStorage::new());
    let a = train(first, 2, Some(common::checkpointing(&store, true))).unwrap();
    let b = train(then, 4, Some(common::checkpointing(&store, false))).unwrap();
    common::assert_resumes(mem, &a, &b, what);
}

/// The store read at least `min_read` bytes and held at most `max_buffers` units at once.
fn assert_io(what: &str, io: &IoReport, (min_read, max_buffers): (u64, usize)) {
    assert!(
        io.read_bytes >= min_read,
        "{what}: {io:?}, read at least {min_read} B"
    );
    assert!(io.peak_buffers <= max_buffers, "{what}: {io:?}");
}

/// The store's folder holds nothing once the run is over.
fn assert_empty(nvme: &Path, what: &str) {
    let left = std::fs::read_dir(nvme).unwrap().count();
    assert_eq!(left, 0, "{what}: the store's files are removed");
}

/// At every stage, in fp32 and bf16, with accumulation: the state on NVMe gives the bits of the
/// state in memory, books the same state bytes, reads and writes each unit's state once per step
/// through a ring of at most its buffers, and leaves no file behind. A checkpoint saved under
/// one placement resumes under the other, bit-identically.
#[test]
fn nvme_gives_the_bits_of_memory_and_shares_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let nvme = tmp.path();
    for stage in 0..=3u8 {
        for precision in [Precision::Fp32, Precision::Bf16] {
            let what = format!("stage {stage} {precision:?}");
            let cfg = |p| config(stage, precision, p, nvme);
            let mem = train(&cfg(Placement::Device), 4, None).unwrap();
            let disk = train(&cfg(Placement::Nvme), 4, None).unwrap();
            common::assert_same(&mem, &disk, &what);
            for (m, d) in mem.iter().zip(&disk) {
                assert_eq!(m.memory, d.memory, "{what}: the same state, wherever it is");
                assert_eq!(m.nvme_io, None, "{what}: no store in memory");
                let io = d.nvme_io.expect("an NVMe run reports its store");
                // Per step each unit is read once and written once; the build writes it once.
                let state = d.memory.optimizer_states + d.memory.master_weights;
                assert_io(&what, &io, (4 * state, 3));
                let written = 5 * state..5 * state + 5 * 4096 * 64;
                assert!(
                    written.contains(&io.written_bytes),
                    "{what}: {io:?}, state {state} B"
                );
            }
            assert_empty(nvme, &what);

            for (first, then) in [
                (Placement::Device, Placement::Nvme),
                (Placement::Nvme, Placement::Device),
            ] {
                let what = format!("{what} {first:?} → {then:?}");
                resumes_across(&mem, &cfg(first), &cfg(then), &what);
            }
        }
    }
}

/// A full disk (the unit's file is the kernel's `/dev/full`) fails the build with an error
/// naming the rank, the unit and the file; nothing panics.
#[test]
fn a_full_disk_is_an_error_naming_the_unit() {
    if !Path::new("/dev/full").exists() {
        zero_testkit::record_skip!("", "no /dev/full on this machine");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let rank1 = tmp.path().join("rank1");
    std::fs::create_dir_all(&rank1).unwrap();
    std::os::unix::fs::symlink("/dev/full", rank1.join("unit0.bin")).unwrap();
    let cfg = config(2, Precision::Fp32, Placement::Nvme, tmp.path());
    let Err(e) = train(&cfg, 2, None) else {
        panic!("training on a full disk succeeded");
    };
    let text = e.to_string();
    assert!(
        text.contains("rank 1 failed")
            && text.contains("NVMe store of rank 1, unit 0")
            && text.contains("No space left on device"),
        "{text}"
    );
}

/// A byte changed in the store between two steps (every block of rank 0's first unit, both
/// slots: the optimizer's state, then stage 3's parameter shard) fails the next step with an
/// error naming the rank, the unit, the file and the block, never with wrong values.
#[test]
fn a_changed_byte_in_the_store_fails_the_next_step() {
    for (name, stage, placement) in [
        ("unit0.bin", 1, Placement::Nvme),
        ("param0.bin", 3, Placement::Device),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("rank0").join(name);
        let cfg = ZeroConfig {
            param_placement: if stage == 3 {
                Placement::Nvme
            } else {
                Placement::Device
            },
            ..config(stage, Precision::Bf16, placement, tmp.path())
        };
        let (model, corpus) = common::tiny();
        let plan = Arc::new(plan_for(&model, Topology::new(2, 2).unwrap(), &cfg).unwrap());
        let flip = |t: Tick| {
            if t.step == 1 {
                let mut bytes = std::fs::read(&file).unwrap();
                bytes.iter_mut().step_by(4096).for_each(|b| *b ^= 0x40);
                std::fs::write(&file, bytes).unwrap();
            }
        };
        let run = HostRun::new(3, Duration::from_secs(60));
        let Err(e) = launcher::train(
            On::Host,
            plan,
            model,
            Work::new(&corpus, common::options(), &run).on_step(&flip),
        ) else {
            panic!("training over a changed {name} succeeded");
        };
        let text = e.to_string();
        assert!(
            text.contains("rank 0 failed")
                && text.contains("NVMe store of rank 0, unit 0")
                && text.contains(name)
                && text.contains("fails its CRC-32C check"),
            "{name}: {text}"
        );
    }
}

/// Stage 3's parameter shard in host memory or on NVMe, beside each optimizer placement, in
/// fp32, bf16 and fp16, with accumulation: the bits of the shard on the device. On NVMe the
/// store reads every unit's chunk for each gather, holds at most the ring's buffers, and leaves
/// no file behind; a checkpoint resumes across parameter placements bit-identically.
#[test]
fn the_parameter_shard_off_the_device_gives_the_bits_of_the_device() {
    let tmp = tempfile::tempdir().unwrap();
    let nvme = tmp.path();
    for precision in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
        let base = config(3, precision, Placement::Device, nvme);
        let mem = train(&base, 4, None).unwrap();
        for (opt, param) in [
            (Placement::Device, Placement::Host),
            (Placement::Host, Placement::Host),
            (Placement::Device, Placement::Nvme),
            (Placement::Nvme, Placement::Nvme),
        ] {
            let what = format!("{precision:?} optimizer {opt:?} parameters {param:?}");
            let cfg = ZeroConfig {
                optimizer_placement: opt,
                param_placement: param,
                ..base.clone()
            };
            let off = train(&cfg, 4, None).unwrap();
            common::assert_same(&mem, &off, &what);
            for r in &off {
                let io = r.nvme_io;
                let on_nvme = opt == Placement::Nvme || param == Placement::Nvme;
                assert_eq!(io.is_some(), on_nvme, "{what}: {io:?}");
                if param == Placement::Nvme {
                    let io = io.unwrap();
                    // Each micro-step gathers every chunk from the store, twice with recompute
                    // (the default at stage 3): 4 steps of 2 micro-steps.
                    let shard = shard_bytes(&cfg);
                    println!("{what}: rank {} {io:?}, shard {shard} B", r.rank);
                    assert_io(&what, &io, (16 * shard, 6));
                }
            }
            assert_empty(nvme, &what);
        }
        for (first, then) in [
            (Placement::Device, Placement::Nvme),
            (Placement::Nvme, Placement::Host),
        ] {
            let at = |p| ZeroConfig {
                param_placement: p,
                ..base.clone()
            };
            let what = format!("{precision:?} parameters {first:?} → {then:?}");
            resumes_across(&mem, &at(first), &at(then), &what);
        }
    }
}
