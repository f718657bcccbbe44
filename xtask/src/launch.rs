//! `cargo xtask launch`: torchrun for this project. Starts `--nproc-per-node` processes on this
//! machine, each with torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `MASTER_ADDR`, `MASTER_PORT`), forwards their output line by
//! line behind a `[rank k]` prefix, and stops all of them as soon as one fails, or when it is
//! interrupted (Ctrl-C, SIGTERM).
//!
//! `-- train ARGS…` runs this xtask's `train` with `--launcher nccl` (one GPU per process, the
//! NCCL communicator from the TCP bootstrap) and the world filled in when the arguments leave it
//! out; any other command runs as given, with the same environment.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;

#[derive(Args, Debug)]
pub(crate) struct LaunchArgs {
    /// Processes on this machine (one per GPU).
    #[arg(long)]
    nproc_per_node: usize,
    /// Machines in the job; run this command once on each, with its `--node-rank`.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This machine's index, `0..nnodes`.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of the machine with rank 0 (NCCL's bootstrap listens there).
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the bootstrap on the machine with rank 0.
    #[arg(long, default_value_t = 29500)]
    master_port: u16,
    /// What each process runs: `train ARGS…` (this xtask's), or any program and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// The most processes `launch` starts on one machine (each with two output threads here).
const MAX_PROCS_PER_NODE: usize = 1024;

impl LaunchArgs {
    /// Whether the processes run this xtask's `train`.
    pub(crate) fn is_train(&self) -> bool {
        self.command.first().is_some_and(|c| c == "train")
    }

    /// The xtask features each process needs for `train`: `nccl`, and `cuda` with
    /// `--backend cuda`.
    pub(crate) fn train_features(&self) -> Vec<&'static str> {
        let cuda = self
            .command
            .windows(2)
            .any(|w| w[0] == "--backend" && w[1] == "cuda")
            || self.command.iter().any(|w| w == "--backend=cuda");
        if cuda {
            vec!["nccl", "cuda"]
        } else {
            vec!["nccl"]
        }
    }

    /// Checks the launch before anything is built or started: the world (at most
    /// [`zero_core::MAX_WORLD_SIZE`] ranks), this node's rank, the bootstrap's address and port,
    /// and, for `train`, that its arguments parse.
    pub(crate) fn check(&self) -> anyhow::Result<usize> {
        if self.nproc_per_node == 0 || self.nnodes == 0 {
            bail!("--nproc-per-node and --nnodes must be at least 1");
        }
        if self.nproc_per_node > MAX_PROCS_PER_NODE {
            bail!(
                "--nproc-per-node {}: at most {MAX_PROCS_PER_NODE} processes per machine (one per GPU)",
                self.nproc_per_node
            );
        }
        let world = self
            .nproc_per_node
            .checked_mul(self.nnodes)
            .filter(|&w| w <= zero_core::MAX_WORLD_SIZE)
            .with_context(|| {
                format!(
                    "--nproc-per-node {} x --nnodes {}: at most {} ranks in all",
                    self.nproc_per_node,
                    self.nnodes,
                    zero_core::MAX_WORLD_SIZE
                )
            })?;
        if self.node_rank >= self.nnodes {
            bail!(
                "--node-rank {} is not a node of --nnodes {}",
                self.node_rank,
                self.nnodes
            );
        }
        if self.master_port == 0 {
            bail!("--master-port 0: expected the port rank 0's bootstrap listens on (1-65535)");
        }
        let addr = self.master_addr.trim();
        if addr.is_empty() || addr.contains(char::is_whitespace) {
            bail!(
                "--master-addr {:?}: expected rank 0's host name or IP address",
                self.master_addr
            );
        }
        if self.is_train() {
            crate::train::TrainArgs::try_parse_words(process_args(self)).map_err(|e| {
                let text = e.render().to_string();
                anyhow::anyhow!(
                    "-- train: {}",
                    text.trim_start_matches("error: ").trim_end()
                )
            })?;
        }
        Ok(world)
    }
}

/// The arguments of each process: `train` gets the launcher and the world when they are missing.
fn process_args(a: &LaunchArgs) -> Vec<String> {
    let mut args = a.command.clone();
    if a.is_train() {
        let has = |flag: &str| {
            args.iter()
                .any(|x| x == flag || x.starts_with(&format!("{flag}=")))
        };
        let mut extra = Vec::new();
        if !has("--launcher") {
            extra.extend(["--launcher".to_string(), "nccl".to_string()]);
        }
        if !has("--world-size") {
            extra.extend([
                "--world-size".to_string(),
                a.nproc_per_node.saturating_mul(a.nnodes).to_string(),
            ]);
        }
        if !has("--ranks-per-node") {
            extra.extend(["--ranks-per-node".to_string(), a.nproc_per_node.to_string()]);
        }
        if !has("--out") {
            // One run directory for every rank (each would otherwise pick its own by the clock).
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            extra.extend(["--out".to_string(), format!("runs/{secs}-launch")]);
        }
        args.extend(extra);
    }
    args
}

/// Where the processes' lines go: `(rank, from stderr, line)`.
type Sink = Arc<dyn Fn(usize, bool, &str) + Send + Sync>;

pub(crate) fn run(a: LaunchArgs) -> anyhow::Result<()> {
    run_with(
        a,
        Arc::new(|rank, stderr, line| {
            if stderr {
                eprintln!("[rank {rank}] {line}");
            } else {
                println!("[rank {rank}] {line}");
            }
        }),
    )
}

fn run_with(a: LaunchArgs, sink: Sink) -> anyhow::Result<()> {
    let world = a.check()?;
    let args = process_args(&a);
    let (program, rest) = if a.is_train() {
        (
            std::env::current_exe().context("cannot find this xtask's executable")?,
            &args[..],
        )
    } else {
        (args[0].clone().into(), &args[1..])
    };
    // The ranks run in process groups of their own, so a Ctrl-C at the terminal reaches only this
    // launcher: it stops them.
    let interrupted = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, interrupted.clone())
            .context("cannot install the launcher's signal handler")?;
    }
    let mut children: Vec<(usize, Child)> = Vec::new();
    let mut pumps = Vec::new();
    for local in 0..a.nproc_per_node {
        let rank = a.node_rank * a.nproc_per_node + local;
        let mut cmd = Command::new(&program);
        cmd.args(rest)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", a.nproc_per_node.to_string())
            .env("GROUP_RANK", a.node_rank.to_string())
            .env("MASTER_ADDR", &a.master_addr)
            .env("MASTER_PORT", a.master_port.to_string())
            // A release build runs as it is: no process rebuilds or re-executes itself.
            .env("ZERO_XTASK_NO_RELEASE", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group, so that stopping it stops whatever it started too.
            .process_group(0);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop(&mut children);
                return Err(e).with_context(|| format!("cannot start rank {rank}: {program:?}"));
            }
        };
        let out = pump(rank, child.stdout.take(), false, sink.clone());
        let err = pump(rank, child.stderr.take(), true, sink.clone());
        children.push((rank, child));
        match out.and_then(|o| Ok((o, err?))) {
            Ok((o, e)) => pumps.extend([o, e]),
            Err(e) => {
                stop(&mut children);
                return Err(e).context(format!("cannot forward rank {rank}'s output"));
            }
        }
    }
    // Wait for all; the first failure stops the rest.
    let mut failed = None;
    while !children.is_empty() {
        if interrupted.load(Ordering::Relaxed) {
            stop(&mut children);
            bail!("interrupted: every rank of this machine was stopped");
        }
        let mut i = 0;
        while i < children.len() {
            match children[i].1.try_wait()? {
                Some(status) => {
                    let (rank, child) = children.remove(i);
                    if !status.success() && failed.is_none() {
                        failed = Some((rank, status));
                        // What it started may still hold its output pipes.
                        kill_group(&child);
                        stop(&mut children);
                    }
                }
                None => i += 1,
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for p in pumps {
        let _ = p.join();
    }
    match failed {
        Some((rank, status)) => {
            bail!("rank {rank} failed ({status}); the other ranks of this machine were stopped")
        }
        None => Ok(()),
    }
}

/// Kills `c`'s process group (it leads one: `process_group(0)`).
fn kill_group(c: &Child) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", c.id())])
        .stderr(Stdio::null())
        .status();
}

/// Kills every child still running, with its process group, and reaps it.
fn stop(children: &mut Vec<(usize, Child)>) {
    for (_, c) in children.iter_mut() {
        kill_group(c);
        let _ = c.kill();
    }
    for (_, c) in children.iter_mut() {
        let _ = c.wait();
    }
    children.clear();
}

/// Hands `from` line by line to `sink`.
fn pump(
    rank: usize,
    from: Option<impl Read + Send + 'static>,
    stderr: bool,
    sink: Sink,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().spawn(move || {
        let Some(from) = from else { return };
        // Bytes, not UTF-8 lines: a process that prints anything is still drained to the end
        // (a pipe left unread would block it).
        let mut r = BufReader::new(from);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match r.read_until(b'\n', &mut buf) {
                Ok(0) => break,
                Ok(_) => {
                    let line = String::from_utf8_lossy(&buf);
                    sink(rank, stderr, line.trim_end_matches(['\n', '\r']));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(cmd: &[&str]) -> LaunchArgs {
        LaunchArgs {
            nproc_per_node: 2,
            nnodes: 2,
            node_rank: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            command: cmd.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// A bad launch is refused before anything is built or started, saying what is wrong.
    #[test]
    fn a_bad_world_address_port_or_train_flag_is_refused_up_front() {
        assert_eq!(args(&["true"]).check().unwrap(), 4);
        let refused = |a: LaunchArgs, needle: &str| {
            let e = format!("{:#}", a.check().unwrap_err());
            assert!(e.contains(needle), "{needle}: {e}");
        };
        let mut a = args(&["true"]);
        a.nnodes = usize::MAX;
        refused(a, "at most 1048576 ranks");
        let mut a = args(&["true"]);
        a.nproc_per_node = 100_000;
        refused(a, "at most 1024 processes per machine");
        let mut a = args(&["true"]);
        a.node_rank = 2;
        refused(a, "not a node of --nnodes 2");
        let mut a = args(&["true"]);
        a.master_port = 0;
        refused(a, "--master-port 0");
        let mut a = args(&["true"]);
        a.master_addr = " ".into();
        refused(a, "--master-addr");
        refused(args(&["train", "--bogus"]), "--bogus");
        assert!(args(&["train", "--steps", "5"]).check().is_ok());
    }

    #[test]
    fn train_gets_the_launcher_and_the_world_unless_given() {
        let got = process_args(&args(&["train", "--steps", "5"]));
        assert_eq!(
            got[..9],
            [
                "train",
                "--steps",
                "5",
                "--launcher",
                "nccl",
                "--world-size",
                "4",
                "--ranks-per-node",
                "2",
            ]
        );
        // One run directory for every rank.
        assert_eq!(got[9], "--out");
        assert!(
            got[10].starts_with("runs/") && got[10].ends_with("-launch"),
            "{got:?}"
        );
        let given = [
            "train",
            "--launcher=nccl",
            "--world-size",
            "4",
            "--ranks-per-node",
            "2",
            "--out",
            "r",
        ];
        assert_eq!(process_args(&args(&given)), given);
        assert_eq!(
            process_args(&args(&["sh", "-c", "true"])),
            ["sh", "-c", "true"]
        );
    }

    #[test]
    fn every_process_gets_torchrun_s_environment_and_a_failure_stops_the_rest() {
        // Rank 3 (node 1, local 1) fails at once; rank 2 would sleep for a minute.
        let a = args(&[
            "sh",
            "-c",
            "echo \"env $RANK/$WORLD_SIZE local $LOCAL_RANK/$LOCAL_WORLD_SIZE node $GROUP_RANK \
             $MASTER_ADDR:$MASTER_PORT\"; [ \"$RANK\" = 3 ] && exit 7; sleep 60",
        ]);
        let lines = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = lines.clone();
        let sink: Sink = Arc::new(move |rank, stderr, line| {
            log.lock().unwrap().push(format!("{rank} {stderr} {line}"))
        });
        let start = std::time::Instant::now();
        let e = run_with(a, sink.clone()).unwrap_err().to_string();
        assert!(e.contains("rank 3 failed") && e.contains("7"), "{e}");
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the sleeping rank was not stopped: {:?}",
            start.elapsed()
        );
        let mut got = lines.lock().unwrap().clone();
        got.sort();
        assert_eq!(
            got,
            [
                "2 false env 2/4 local 0/2 node 1 127.0.0.1:29500",
                "3 false env 3/4 local 1/2 node 1 127.0.0.1:29500"
            ]
        );
        let ok = run_with(args(&["sh", "-c", "echo oops >&2"]), sink.clone());
        assert!(ok.is_ok(), "{ok:?}");
        assert!(lines.lock().unwrap().iter().any(|l| l == "2 true oops"));
        // Ctrl-C and SIGTERM are signals to the launcher's own process: `xtask/tests/cli.rs`
        // sends them to the `xtask` binary, not to this test process.
    }
}
