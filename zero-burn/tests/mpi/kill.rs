//! A rank killed (`kill -9`) at a step drawn from a seeded RNG, between saves or inside one,
//! under `mpirun`: the job ends without a hang, `LATEST` names the last whole checkpoint, and a
//! run that resumes from it into the same directory (saving there again, beside whatever the
//! dead save left) continues bit-identically to an uninterrupted run and commits its own saves.
//!
//! A draw: a seed picks the rank (0–3), the step (2–5) at whose batches it dies, and, at step 4,
//! whether it dies inside the save of step 4 instead. The test runs seeds 3 (rank 1 after step
//! 5) and 6 (rank 0 after step 2), or `ZERO_KILL_SEED` alone, and prints each seed and draw;
//! `a_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable` always kills rank 1 inside
//! the save of step 4.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use zero_burn::checkpoint::{DirStorage, Storage, read_manifest, verify};
use zero_burn::demo::data::{self, Corpus, TokenBatch};
use zero_burn::demo::run::{Checkpointing, HostRun, Work, train_rank};
use zero_burn::demo::train::{On, train};
use zero_burn::plan_for;
use zero_comm::Communicator;

use super::common::{options, tiny};
use super::harness::{self, is_rank, launch};
use super::{configs, topo};

/// The tests' paths in this binary, which the harness runs under `mpirun` with `--exact`.
const RANDOM: &str = "kill::a_rank_killed_at_a_random_step_resumes_bit_identically";
const MID_SAVE: &str = "kill::a_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable";
const OUT: &str = "ZERO_MPI_KILL_OUT";
const DRAW: &str = "ZERO_MPI_KILL_DRAW";

/// Who dies where.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Draw {
    rank: usize,
    /// Steps done when it dies.
    step: u64,
    /// Inside the save of `step` (only at step 4), not when fetching the next batches.
    inside_save: bool,
}

impl Draw {
    fn of(seed: u64) -> Draw {
        // SplitMix64.
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let step = 2 + (z >> 8) % 4;
        Draw {
            rank: (z % 4) as usize,
            step,
            inside_save: step == 4 && (z >> 16) & 1 == 1,
        }
    }

    fn to_env(self) -> String {
        format!("{},{},{}", self.rank, self.step, self.inside_save)
    }

    fn from_env(s: &str) -> Draw {
        let v: Vec<&str> = s.split(',').collect();
        Draw {
            rank: v[0].parse().unwrap(),
            step: v[1].parse().unwrap(),
            inside_save: v[2].parse().unwrap(),
        }
    }

    /// The step of the last whole checkpoint: saves follow steps 2, 4 and 6.
    fn latest(self) -> u64 {
        if self.inside_save {
            self.step - 2
        } else {
            self.step / 2 * 2
        }
    }
}

/// A corpus that SIGKILLs its own process when rank `rank` asks for the batches of the step
/// after `step` steps.
struct DiesAtStep<C> {
    inner: C,
    rank: usize,
    step: u64,
}

impl<C: Corpus> Corpus for DiesAtStep<C> {
    fn vocab(&self) -> usize {
        self.inner.vocab()
    }
    fn sequence(&self, index: u64, seq: usize) -> Vec<i64> {
        self.inner.sequence(index, seq)
    }
    fn entropy_floor(&self) -> Option<f64> {
        self.inner.entropy_floor()
    }
    fn rank_batches(&self, d: data::Draw) -> Vec<TokenBatch> {
        if (d.rank, d.step) == (self.rank, self.step) {
            let pid = std::process::id().to_string();
            let _ = std::process::Command::new("kill")
                .args(["-9", &pid])
                .status();
            std::thread::sleep(Duration::from_secs(30));
        }
        self.inner.rank_batches(d)
    }
}

/// A store that SIGKILLs its own process at the first append to a file of the save of step 4,
/// after that file's first bytes are written: a rank dying in the middle of its stream, inside a
/// collective save. Every other call, reads by range and appends included, is `DirStorage`'s own
/// (not the trait's rewrite-whole defaults), so the dead save leaves what a real one would.
#[derive(Debug)]
struct DiesMidSave(zero_burn::checkpoint::DirStorage);

impl zero_burn::checkpoint::Storage for DiesMidSave {
    fn write(&self, path: &str, bytes: &[u8]) -> zero_burn::Result<()> {
        self.0.write(path, bytes)
    }
    fn append(&self, path: &str, bytes: &[u8]) -> zero_burn::Result<()> {
        if path.contains("00000004") {
            let pid = std::process::id().to_string();
            let _ = std::process::Command::new("kill")
                .args(["-9", &pid])
                .status();
            std::thread::sleep(Duration::from_secs(30));
        }
        self.0.append(path, bytes)
    }
    fn read_range(&self, path: &str, offset: u64, len: u64) -> zero_burn::Result<Option<Vec<u8>>> {
        self.0.read_range(path, offset, len)
    }
    fn sync_file(&self, path: &str) -> zero_burn::Result<()> {
        self.0.sync_file(path)
    }
    fn rename(&self, from: &str, to: &str) -> zero_burn::Result<()> {
        self.0.rename(from, to)
    }
    fn sync_dir(&self, dir: &str) -> zero_burn::Result<()> {
        self.0.sync_dir(dir)
    }
    fn create_dir(&self, dir: &str) -> zero_burn::Result<()> {
        self.0.create_dir(dir)
    }
    fn read(&self, path: &str) -> zero_burn::Result<Option<Vec<u8>>> {
        self.0.read(path)
    }
    fn size(&self, path: &str) -> zero_burn::Result<Option<u64>> {
        self.0.size(path)
    }
    fn exists(&self, path: &str) -> zero_burn::Result<bool> {
        self.0.exists(path)
    }
    fn list(&self, dir: &str) -> zero_burn::Result<Vec<String>> {
        self.0.list(dir)
    }
}

/// A rank killed (`kill -9`) in the middle of a save ends the job without a hang, and the
/// checkpoint `LATEST` names is still the previous one, whole: it verifies and an in-process run
/// resumes from it bit-identically to an uninterrupted one.
fn checkpointing(store: Arc<dyn Storage>, resume: bool) -> Checkpointing {
    Checkpointing {
        save: Some(store.clone()),
        save_every: 2,
        resume: resume.then_some(store),
        resume_tag: None,
        reshard: false,
    }
}

fn rank_side() {
    let dir = std::env::var(OUT).unwrap();
    let draw = Draw::from_env(&std::env::var(DRAW).unwrap());
    let comm = harness::world();
    let me = comm.rank();
    let plain = DirStorage::new(&dir).unwrap();
    let store: Arc<dyn Storage> = if me == draw.rank && draw.inside_save {
        Arc::new(DiesMidSave(plain))
    } else {
        Arc::new(plain)
    };
    let (model, corpus) = tiny();
    let corpus = DiesAtStep {
        inner: corpus,
        rank: if draw.inside_save {
            usize::MAX
        } else {
            draw.rank
        },
        step: draw.step,
    };
    let plan = Arc::new(plan_for(&model, topo(), &configs().remove(3).1).unwrap());
    let run = HostRun {
        checkpoint: Some(checkpointing(store, false)),
        ..HostRun::new(6, Duration::from_secs(30))
    };
    let r = train_rank(comm, plan, model, Work::new(&corpus, options(), &run));
    unreachable!("rank {me} finished with a dead peer: {:?}", r.map(|_| ()));
}

#[test]
fn a_rank_killed_at_a_random_step_resumes_bit_identically() {
    if is_rank() {
        return rank_side();
    }
    let seeds: Vec<u64> = match std::env::var("ZERO_KILL_SEED") {
        Ok(s) => vec![s.parse().expect("ZERO_KILL_SEED is a number")],
        Err(_) => vec![3, 6],
    };
    for seed in seeds {
        let draw = Draw::of(seed);
        eprintln!("ZERO_KILL_SEED={seed}: {draw:?}");
        if !killed_and_resumed(RANDOM, draw) {
            return;
        }
    }
}

#[test]
fn a_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable() {
    if is_rank() {
        return rank_side();
    }
    let draw = Draw {
        rank: 1,
        step: 4,
        inside_save: true,
    };
    killed_and_resumed(MID_SAVE, draw);
}

/// The job of test `name` for one draw, its checks and the resume; false when the harness could
/// not launch it (recorded).
fn killed_and_resumed(name: &str, draw: Draw) -> bool {
    let (_tmp, dir) = super::scratch(&format!("zero-burn-mpi-kill-{}-", draw.to_env()));
    let env = [(OUT, dir.display().to_string()), (DRAW, draw.to_env())];
    let timeout = Duration::from_secs(30);
    let Some(job) = launch(name, 4, 2, timeout, &env, Duration::from_secs(120)) else {
        return false;
    };
    assert!(!job.success, "{draw:?}: the job succeeded:\n{}", job.output);
    assert!(
        job.elapsed < timeout / 2,
        "{draw:?}: took {:?} (the collective timeout is {timeout:?})",
        job.elapsed
    );
    assert!(
        job.output.contains(&format!("rank {}", draw.rank)),
        "{draw:?}: the dead rank is named:\n{}",
        job.output
    );
    let store = DirStorage::new(&dir).unwrap();
    let (_, m) = read_manifest(&store, None).unwrap();
    assert_eq!(m.scalars.step, draw.latest(), "{draw:?}: LATEST's step");
    verify(&store, None).unwrap();
    let stale = |dir: &PathBuf| {
        std::fs::read_dir(dir)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.file_name().to_string_lossy().starts_with(".staging-"))
            })
            .count()
    };
    let stale_before = stale(&dir);
    if draw.inside_save {
        assert!(
            stale_before > 0,
            "{draw:?}: the dead save left its staging directory"
        );
    }
    // Resume into the same directory, saving there again, up to step 6.
    let (model, corpus) = tiny();
    let plan = Arc::new(plan_for(&model, topo(), &configs().remove(3).1).unwrap());
    let store: Arc<dyn Storage> = Arc::new(store);
    let resumed = train(
        On::Host,
        plan.clone(),
        model.clone(),
        Work::new(
            &corpus,
            options(),
            &HostRun {
                checkpoint: Some(checkpointing(store.clone(), true)),
                ..HostRun::new(6, Duration::from_secs(30))
            },
        ),
    )
    .unwrap();
    let whole = train(
        On::Host,
        plan,
        model,
        Work::new(
            &corpus,
            options(),
            &HostRun::new(6, Duration::from_secs(30)),
        ),
    )
    .unwrap();
    let from = draw.latest() as usize;
    for (a, b) in resumed.iter().zip(&whole) {
        assert_eq!(a.first_step, draw.latest(), "{draw:?}");
        let want: Vec<u32> = b.losses[from..].iter().map(|l| l.to_bits()).collect();
        let got: Vec<u32> = a.losses.iter().map(|l| l.to_bits()).collect();
        assert_eq!(
            got, want,
            "{draw:?}: rank {}'s losses after the resume",
            a.rank
        );
    }
    let (tag, m) = read_manifest(store.as_ref(), None).unwrap();
    assert_eq!((tag.as_str(), m.scalars.step), ("step-00000006", 6));
    verify(store.as_ref(), None).unwrap();
    // What the dead save left is `ckpt gc`'s to remove (tested in xtask); nothing else is.
    assert_eq!(
        stale(&dir),
        stale_before,
        "{draw:?}: the resumed saves left no staging"
    );
    true
}
