//! The MPI communicator's rows of the bandwidth table (feature `mpi`): the bench runs itself under
//! `mpirun -n 2` and `-n 4`; in the job every rank times the same ops with the same code as the
//! host loopback's ([`time_op`]), and rank 0 prints the rows.

use std::time::Duration;

use zero_comm::Communicator;
use zero_comm::mpi::{MpiComm, MpiOptions, mpirun};

use crate::{HEADER, OPS, row, time_op};

const RANK: &str = "ZERO_COMM_BENCH_MPI_RANK";
/// The launcher's single-thread memcpy bandwidth, for the last column.
const COPY: &str = "ZERO_COMM_BENCH_MEMCPY_GIBS";

/// Whether this process is a rank of the bench's MPI job.
pub(crate) fn is_rank() -> bool {
    std::env::var_os(RANK).is_some()
}

/// The rank side: time every op, print the rows on rank 0.
pub(crate) fn rank(bytes: usize, iters: usize) {
    let copy_bw: f64 = std::env::var(COPY)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN);
    let opts = MpiOptions {
        timeout: Duration::from_secs(600),
        ..MpiOptions::default()
    };
    let mut comm = MpiComm::world(opts).expect("MPI world");
    let n = comm.world_size();
    for op in OPS {
        let t = time_op(&mut comm, op, bytes, iters);
        if comm.rank() == 0 {
            println!("{}", row(op, n, bytes, t, copy_bw));
        }
    }
}

/// The launcher side: the MPI rows at n = 2 and 4, after the host loopback's.
pub(crate) fn run(mib: usize, iters: usize, copy_bw: f64) {
    println!();
    println!(
        "MPI (OpenMPI, one process per rank, `mpirun --oversubscribe`), {mib} MiB f32, best of \
         {iters}, same code (call-descriptor checks on):"
    );
    println!("{HEADER}");
    for n in [2usize, 4] {
        let Some(mut cmd) = mpirun(n) else {
            println!("(no mpirun on PATH: install openmpi-bin)");
            return;
        };
        let exe = std::env::current_exe().expect("the bench's executable");
        let status = cmd
            .args(["-x", &format!("{RANK}=1")])
            .args(["-x", &format!("{COPY}={copy_bw}")])
            .args(["-x", &format!("ZERO_COMM_BENCH_MIB={mib}")])
            .args(["-x", &format!("ZERO_COMM_BENCH_ITERS={iters}")])
            .arg(exe)
            .status()
            .expect("start mpirun");
        assert!(status.success(), "the MPI bench job failed ({status})");
    }
}
