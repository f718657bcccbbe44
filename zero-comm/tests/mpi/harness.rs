//! Launching a test of this binary as an MPI job, and knowing inside one that it is.

use std::fs::File;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use zero_comm::mpi::{ENV_RANKS_PER_NODE, ENV_TIMEOUT, MpiComm, MpiOptions, mpirun};
use zero_testkit::gate::Device;

/// Set in the ranks of a job [`launch`] starts.
const ROLE: &str = "ZERO_MPI_TEST_RANK";

/// What a finished job printed, and how it ended.
pub(crate) struct Job {
    pub(crate) success: bool,
    pub(crate) output: String,
    pub(crate) elapsed: Duration,
}

impl Job {
    /// Panics unless every one of the `n` ranks printed its `ok` line and the job succeeded.
    #[track_caller]
    pub(crate) fn assert_ranks_ok(&self, n: usize) {
        let ok = (0..n)
            .filter(|r| self.output.contains(&format!("mpi-rank-ok {r}/{n}\n")))
            .count();
        assert!(
            self.success && ok == n,
            "{ok} of {n} ranks finished; the job {}:\n{}",
            if self.success { "succeeded" } else { "failed" },
            self.output
        );
    }
}

/// Whether this process is a rank of a job started by [`launch`].
pub(crate) fn is_rank() -> bool {
    std::env::var_os(ROLE).is_some()
}

/// The world communicator of a rank (the topology and timeout come from the job's environment).
pub(crate) fn world() -> MpiComm {
    MpiComm::world(MpiOptions::from_env().unwrap()).unwrap()
}

/// Prints the line [`Job::assert_ranks_ok`] looks for.
pub(crate) fn rank_ok(rank: usize, n: usize) {
    println!("mpi-rank-ok {rank}/{n}");
}

/// Runs test `name` (its full path in this binary, e.g. `collectives::world_sizes`) as a job of
/// `n` ranks, `per_node` ranks per node, collective timeout `timeout`, extra `env`; kills it if it
/// runs past `limit`. `None` (a recorded skip) without `mpirun`.
pub(crate) fn launch(
    name: &str,
    n: usize,
    per_node: usize,
    timeout: Duration,
    env: &[(&str, String)],
    limit: Duration,
) -> Option<Job> {
    let simulated = Device::Mpi.simulated();
    let Some(mut cmd) = mpirun(n).filter(|_| simulated.is_none()) else {
        let why = simulated.unwrap_or_else(|| "not on PATH".to_string());
        Device::Mpi.missing(zero_testkit::binary!(), name, &why);
        return None;
    };
    let mut vars: Vec<(&str, String)> = vec![
        (ROLE, "1".into()),
        (ENV_RANKS_PER_NODE, per_node.to_string()),
        (ENV_TIMEOUT, timeout.as_secs_f64().to_string()),
    ];
    vars.extend(env.iter().cloned());
    for (k, v) in &vars {
        cmd.arg("-x").arg(format!("{k}={v}"));
    }
    let exe = std::env::current_exe().unwrap();
    cmd.arg(exe)
        .args(["--exact", name, "--nocapture", "--test-threads=1"]);
    Some(run(cmd, limit))
}

/// Runs `cmd` with stdout and stderr in one temporary file, killing it past `limit`.
/// One `mpirun` job at a time per test binary: the tests of a binary run on parallel threads,
/// and two jobs of 4 ranks each on a 2-core machine would stretch every timing.
static ONE_JOB: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn run(mut cmd: Command, limit: Duration) -> Job {
    // A test that failed while holding the lock poisons it; the next job may still run.
    let _one = ONE_JOB.lock().unwrap_or_else(|e| e.into_inner());
    // One directory per job, removed when `dir` drops (also when this panics).
    let dir = tempfile::Builder::new()
        .prefix("zero-mpi-test-")
        .tempdir()
        .expect("a temp dir");
    let path = dir.path().join("mpirun.log");
    let log = File::create(&path).unwrap();
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("spawn mpirun");
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = start.elapsed();
    let output = std::fs::read_to_string(&path).unwrap_or_default();
    let status = status.unwrap_or_else(|| {
        panic!("the MPI job hung: killed after {limit:?}; its output:\n{output}")
    });
    Job {
        success: status.success(),
        output,
        elapsed,
    }
}
