//! The NCCL backend.
//!
//! - The torchrun-style bootstrap (launch variables, TCP rendezvous on 127.0.0.1 with threads):
//!   pure Rust, runs everywhere.
//! - Without a GPU, libcuda or libnccl (or without the `nccl` feature): construction fails with a
//!   readable error, never a panic.
//! - On a GPU: the shared collective bodies of `tests/comm/common.rs` (world size 1, which is what
//!   one GPU allows: NCCL refuses two ranks on one device), split, groups, validation, an init
//!   timeout, and a bandwidth report. They are compiled only with the `gpu-tests` feature (so
//!   they never pass vacuously in CI) and run with `ZERO_GPU_TESTS=1`, where a missing library
//!   or device fails them; without it they record that they did not run (`$ZERO_SKIP_LOG`). Each
//!   one that passes appends `<name> ok` to `<target dir>/.gpu_tests_ran`, one that the library
//!   cannot run `<name> skipped: <reason>`: the proof `cargo xtask gpu-check` reads.

#[cfg(feature = "gpu-tests")]
#[path = "comm/bits.rs"]
mod bits;
#[allow(dead_code, unused_imports)]
#[path = "comm/common.rs"]
mod common;
#[cfg(feature = "gpu-tests")]
#[path = "cuda/loopback.rs"]
mod cuda_loopback;
#[cfg(feature = "gpu-tests")]
#[path = "comm/quant_common.rs"]
mod quant_common;

use std::collections::HashMap;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Mutex;
#[cfg(feature = "gpu-tests")]
use std::sync::MutexGuard;
use std::thread;
use std::time::{Duration, Instant};

#[cfg(feature = "gpu-tests")]
use zero_comm::Communicator;
use zero_comm::Error;
#[cfg(feature = "gpu-tests")]
use zero_comm::nccl::WaitMode;
use zero_comm::nccl::bootstrap::{self, LaunchEnv, RendezvousServer, UniqueId};
use zero_comm::nccl::{NcclComm, NcclOptions};

// ---------------------------------------------------------------------------------------------
// Launch variables

fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

const TORCHRUN: &[(&str, &str)] = &[
    ("RANK", "5"),
    ("WORLD_SIZE", "8"),
    ("LOCAL_RANK", "1"),
    ("LOCAL_WORLD_SIZE", "4"),
    ("MASTER_ADDR", "127.0.0.1"),
    ("MASTER_PORT", "29500"),
];

fn with(overrides: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
    let mut v: Vec<(&str, &str)> = TORCHRUN
        .iter()
        .filter(|(k, _)| !overrides.iter().any(|(o, _)| o == k))
        .copied()
        .collect();
    v.extend(overrides.iter().filter(|(_, val)| !val.is_empty()));
    v
}

#[test]
fn launch_env_reads_torchrun_variables() {
    let env = LaunchEnv::from_lookup(lookup(TORCHRUN)).unwrap();
    assert_eq!(
        env,
        LaunchEnv {
            rank: 5,
            world_size: 8,
            local_rank: 1,
            local_world_size: 4,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
        }
    );
    let t = env.topology().unwrap();
    assert_eq!(
        (t.world_size(), t.ranks_per_node(), t.node_of(5)),
        (8, 4, 1)
    );

    // ZERO_RANKS_PER_NODE stands in for LOCAL_WORLD_SIZE; LOCAL_RANK defaults to RANK % it.
    let alt = with(&[
        ("LOCAL_WORLD_SIZE", ""),
        ("LOCAL_RANK", ""),
        ("ZERO_RANKS_PER_NODE", "2"),
    ]);
    let env = LaunchEnv::from_lookup(lookup(&alt)).unwrap();
    assert_eq!((env.local_world_size, env.local_rank), (2, 1));

    // A world of one needs nothing but RANK and WORLD_SIZE.
    let env = LaunchEnv::from_lookup(lookup(&[("RANK", "0"), ("WORLD_SIZE", "1")])).unwrap();
    assert_eq!(env, LaunchEnv::single());
}

#[test]
fn bad_launch_variables_fail_naming_the_variable() {
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[("RANK", "")], "RANK"),
        (&[("RANK", "five")], "RANK"),
        (&[("RANK", "8")], "RANK"),
        (&[("WORLD_SIZE", "")], "WORLD_SIZE"),
        (&[("WORLD_SIZE", "0")], "WORLD_SIZE"),
        (&[("WORLD_SIZE", "-2")], "WORLD_SIZE"),
        (&[("LOCAL_RANK", "2")], "LOCAL_RANK"),
        (&[("LOCAL_RANK", "x")], "LOCAL_RANK"),
        (&[("LOCAL_WORLD_SIZE", "3")], "LOCAL_WORLD_SIZE"),
        (&[("LOCAL_WORLD_SIZE", "")], "LOCAL_WORLD_SIZE"),
        (&[("ZERO_RANKS_PER_NODE", "2")], "ZERO_RANKS_PER_NODE"),
        (&[("MASTER_ADDR", "")], "MASTER_ADDR"),
        (&[("MASTER_PORT", "")], "MASTER_PORT"),
        (&[("MASTER_PORT", "70000")], "MASTER_PORT"),
        (&[("MASTER_PORT", "0")], "MASTER_PORT"),
    ];
    for (overrides, var) in cases {
        let vars = with(overrides);
        let err = LaunchEnv::from_lookup(lookup(&vars))
            .map(|e| format!("unexpectedly parsed {e:?}"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(var),
            "{overrides:?}: error does not name {var}: {err}"
        );
    }
}

#[test]
fn unresolvable_master_addr_is_named() {
    let vars = with(&[("MASTER_ADDR", "no-such-host.invalid")]);
    let env = LaunchEnv::from_lookup(lookup(&vars)).unwrap();
    let err = env.master_addrs().unwrap_err().to_string();
    assert!(err.contains("MASTER_ADDR"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Rendezvous (127.0.0.1 only)

const LOOPBACK: &str = "127.0.0.1:0";
const SAFE: Duration = Duration::from_secs(20);
/// Upper bound on a wait that must end by a short timeout: it only has to catch a wait that never
/// ends, so it is wide enough that a loaded machine cannot reach it.
const ENDS: Duration = Duration::from_secs(30);

fn id_of(seed: u8) -> UniqueId {
    let mut b = [0u8; UniqueId::LEN];
    for (i, x) in b.iter_mut().enumerate() {
        *x = seed.wrapping_mul(31).wrapping_add(i as u8);
    }
    UniqueId(b)
}

/// A loopback port held by a socket that is bound but not listening: a connection to it is
/// refused, as to a port nobody uses, yet no other process can take it while the socket lives
/// (binding to port 0 and releasing the port would leave that window open).
struct HeldPort(OwnedFd);

impl HeldPort {
    fn new() -> HeldPort {
        // SAFETY: plain socket calls on a descriptor this value owns from creation on.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
            let fd = OwnedFd::from_raw_fd(fd);
            let mut sa: libc::sockaddr_in = std::mem::zeroed();
            sa.sin_family = libc::AF_INET as libc::sa_family_t;
            sa.sin_addr.s_addr = u32::from(Ipv4Addr::LOCALHOST).to_be();
            let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            let rc = libc::bind(fd.as_raw_fd(), (&raw const sa).cast(), len);
            assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
            HeldPort(fd)
        }
    }

    fn addr(&self) -> SocketAddr {
        // SAFETY: getsockname writes at most `len` bytes into `sa`, which this frame owns.
        unsafe {
            let mut sa: libc::sockaddr_in = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            let rc = libc::getsockname(self.0.as_raw_fd(), (&raw mut sa).cast(), &mut len);
            assert_eq!(rc, 0, "getsockname: {}", std::io::Error::last_os_error());
            SocketAddr::from((Ipv4Addr::LOCALHOST, u16::from_be(sa.sin_port)))
        }
    }

    /// Starts listening on the held port.
    fn listen(self) -> TcpListener {
        // SAFETY: listen on the descriptor this value owns.
        let rc = unsafe { libc::listen(self.0.as_raw_fd(), 128) };
        assert_eq!(rc, 0, "listen: {}", std::io::Error::last_os_error());
        TcpListener::from(self.0)
    }
}

#[test]
fn rendezvous_hands_rank_0_s_id_to_every_rank_for_worlds_1_to_4() {
    for world in 1..=4usize {
        let id = id_of(world as u8);
        let got: Vec<UniqueId> = if world == 1 {
            vec![bootstrap::exchange_unique_id(&LaunchEnv::single(), SAFE, || Ok(id)).unwrap()]
        } else {
            let server = RendezvousServer::bind(LOOPBACK, world).unwrap();
            let addr = server.local_addr().unwrap();
            thread::scope(|s| {
                let peers: Vec<_> = (1..world)
                    .map(|rank| {
                        s.spawn(move || {
                            let bytes = bootstrap::fetch(&[addr], rank, world, SAFE).unwrap();
                            UniqueId::from_bytes(&bytes).unwrap()
                        })
                    })
                    .collect();
                server.serve(&id.0, SAFE).unwrap();
                let mut all = vec![id];
                all.extend(peers.into_iter().map(|h| h.join().unwrap()));
                all
            })
        };
        assert_eq!(got.len(), world);
        assert!(got.iter().all(|g| *g == id), "world {world}");
    }
}

#[test]
fn exchange_over_launch_variables_agrees_on_one_id() {
    let world = 3;
    // Rank 0 listens on a port of its own choosing before the others learn its number.
    let server = RendezvousServer::bind(LOOPBACK, world).unwrap();
    let port = server.local_addr().unwrap().port().to_string();
    let envs: Vec<LaunchEnv> = (0..world)
        .map(|r| {
            let rank = r.to_string();
            LaunchEnv::from_lookup(lookup(&[
                ("RANK", &rank),
                ("WORLD_SIZE", "3"),
                ("LOCAL_WORLD_SIZE", "3"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", &port),
            ]))
            .unwrap()
        })
        .collect();
    let mut servers = vec![Some(server)];
    servers.resize_with(world, || None);
    let made = Mutex::new(0);
    let ids: Vec<UniqueId> = thread::scope(|s| {
        let hs: Vec<_> = envs
            .iter()
            .zip(servers)
            .map(|(env, server)| {
                let made = &made;
                s.spawn(move || {
                    let bytes = bootstrap::exchange_via(env, server, SAFE, || {
                        *made.lock().unwrap() += 1;
                        Ok(id_of(42).0.to_vec())
                    })
                    .unwrap();
                    UniqueId::from_bytes(&bytes).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(*made.lock().unwrap(), 1, "only rank 0 makes the id");
    assert!(ids.iter().all(|i| *i == id_of(42)));
}

#[test]
fn only_rank_0_of_the_same_world_may_bring_a_server() {
    let env = |rank: &str| {
        LaunchEnv::from_lookup(lookup(&[
            ("RANK", rank),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
    };
    for (rank, world) in [("1", 2), ("0", 3)] {
        let server = RendezvousServer::bind(LOOPBACK, world).unwrap();
        let err = bootstrap::exchange_via(&env(rank), Some(server), SAFE, || Ok(vec![1]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("rank {rank} of 2")) && err.contains("only rank 0"),
            "{err}"
        );
    }
}

#[test]
fn ranks_that_start_first_retry_until_rank_0_listens() {
    let world = 3;
    // Connections are refused until rank 0 listens on the held port.
    let held = HeldPort::new();
    let addr = held.addr();
    thread::scope(|s| {
        let peers: Vec<_> = (1..world)
            .map(|rank| s.spawn(move || bootstrap::fetch(&[addr], rank, world, SAFE)))
            .collect();
        thread::sleep(Duration::from_millis(300));
        let server = RendezvousServer::from_listener(held.listen(), world).unwrap();
        server.serve(b"late but fine", SAFE).unwrap();
        for p in peers {
            assert_eq!(p.join().unwrap().unwrap(), b"late but fine");
        }
    });
}

#[test]
fn a_rank_times_out_when_rank_0_never_comes() {
    let held = HeldPort::new();
    let addr = held.addr();
    let start = Instant::now();
    let err = bootstrap::fetch(&[addr], 2, 4, Duration::from_millis(400))
        .unwrap_err()
        .to_string();
    let took = start.elapsed();
    assert!(
        err.contains("rank 2") && err.contains("rank 0") && err.contains("timed out"),
        "{err}"
    );
    assert!(took < ENDS, "took {took:?}");
    drop(held);
}

#[test]
fn rank_0_times_out_listing_missing_ranks_and_tells_those_that_came() {
    let server = RendezvousServer::bind(LOOPBACK, 4).unwrap();
    let addr = server.local_addr().unwrap();
    thread::scope(|s| {
        let early = s.spawn(move || {
            let start = Instant::now();
            (bootstrap::fetch(&[addr], 1, 4, SAFE), start.elapsed())
        });
        let start = Instant::now();
        let err = server
            .serve(b"id", Duration::from_millis(500))
            .unwrap_err()
            .to_string();
        assert!(err.contains("[2, 3]") && err.contains("timed out"), "{err}");
        assert!(start.elapsed() < ENDS);
        let (res, took) = early.join().unwrap();
        let err = res.unwrap_err().to_string();
        assert!(err.contains("rank 1") && err.contains("[2, 3]"), "{err}");
        assert!(took < ENDS, "the early rank waited {took:?}");
    });
}

#[test]
fn a_mismatched_world_size_fails_every_rank() {
    let server = RendezvousServer::bind(LOOPBACK, 3).unwrap();
    let addr = server.local_addr().unwrap();
    thread::scope(|s| {
        // Short client timeouts: should the bad rank win the race, the good one finds no
        // server and fails by itself.
        let t = Duration::from_secs(3);
        let good = s.spawn(move || bootstrap::fetch(&[addr], 1, 3, t));
        thread::sleep(Duration::from_millis(100));
        let bad = s.spawn(move || bootstrap::fetch(&[addr], 2, 5, t));
        let err = server.serve(b"id", SAFE).unwrap_err().to_string();
        assert!(err.contains("WORLD_SIZE=5"), "{err}");
        let e = bad.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("WORLD_SIZE=5"), "{e}");
        assert!(good.join().unwrap().is_err());
    });
}

#[test]
fn a_duplicate_rank_fails_the_rendezvous() {
    let server = RendezvousServer::bind(LOOPBACK, 3).unwrap();
    let addr = server.local_addr().unwrap();
    thread::scope(|s| {
        let a = s.spawn(move || bootstrap::fetch(&[addr], 1, 3, SAFE));
        thread::sleep(Duration::from_millis(100));
        let b = s.spawn(move || bootstrap::fetch(&[addr], 1, 3, SAFE));
        let err = server.serve(b"id", SAFE).unwrap_err().to_string();
        assert!(err.contains("rank 1 said hello twice"), "{err}");
        for h in [a, b] {
            assert!(h.join().unwrap().is_err());
        }
    });
}

#[test]
fn a_stray_connection_is_ignored() {
    let server = RendezvousServer::bind(LOOPBACK, 2).unwrap();
    let addr = server.local_addr().unwrap();
    thread::scope(|s| {
        let stray = s.spawn(move || {
            let mut c = TcpStream::connect(addr).unwrap();
            c.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        });
        stray.join().unwrap();
        let rank1 = s.spawn(move || bootstrap::fetch(&[addr], 1, 2, SAFE));
        server.serve(b"the id", SAFE).unwrap();
        assert_eq!(rank1.join().unwrap().unwrap(), b"the id");
    });
}

// ---------------------------------------------------------------------------------------------
// Without a GPU (or libcuda, or libnccl, or the feature)

#[test]
fn without_a_gpu_construction_fails_with_a_readable_error() {
    let probe = zero_comm::nccl::probe();
    if let Ok(rt) = &probe
        && rt.devices > 0
    {
        eprintln!(
            "skip: this machine has {} CUDA device(s): {rt:?}",
            rt.devices
        );
        return;
    }
    let probe_err = probe.unwrap_err().to_string();
    let readable = |e: &str| {
        e.contains("libcuda")
            || e.contains("libnccl")
            || e.contains("CUDA device")
            || e.contains("not compiled in")
    };
    assert!(readable(&probe_err), "{probe_err}");
    if cfg!(feature = "nccl") {
        assert!(!probe_err.contains("not compiled"), "{probe_err}");
    } else {
        assert!(matches!(
            zero_comm::nccl::probe(),
            Err(Error::NotCompiled { backend: "nccl" })
        ));
    }

    let opts = NcclOptions {
        timeout: Duration::from_secs(2),
        ..NcclOptions::default()
    };
    let err = NcclComm::new(&LaunchEnv::single(), opts.clone()).unwrap_err();
    eprintln!("NcclComm::new: {err}");
    assert!(readable(&err.to_string()), "{err}");
    let err = NcclComm::single(0, opts.clone()).unwrap_err();
    assert!(readable(&err.to_string()), "{err}");
    let err = NcclComm::from_unique_id(
        &id_of(1),
        0,
        zero_core::Topology::single_node(1).unwrap(),
        0,
        opts,
    )
    .unwrap_err();
    assert!(readable(&err.to_string()), "{err}");
    assert!(NcclComm::unique_id().is_err());
    // Whatever this process's environment says, `from_env` returns an error (a missing launch
    // variable, or the missing library), never a panic.
    let err = NcclComm::from_env().unwrap_err();
    eprintln!("NcclComm::from_env: {err}");
    assert!(!err.to_string().is_empty());
    // The CUDA loopback needs no NCCL, but a driver: it says so, too.
    #[cfg(feature = "nccl")]
    {
        let err = zero_comm::nccl::CudaWorld::new(
            0,
            zero_core::Topology::single_node(2).unwrap(),
            Duration::from_secs(2),
        )
        .unwrap_err();
        eprintln!("CudaWorld::new: {err}");
        assert!(readable(&err.to_string()), "{err}");
        assert!(matches!(err, Error::Backend(_)), "{err:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// On a GPU

#[cfg(feature = "gpu-tests")]
static GPU: Mutex<()> = Mutex::new(());

/// `Some` (holding the GPU lock) when the GPU tests run: with `ZERO_GPU_TESTS=1` (as
/// `cargo xtask gpu-check` sets), where a missing library or device is a failure, not a skip.
/// Without it the test does not run, says why and records it in `$ZERO_SKIP_LOG` (the not-run
/// count of `cargo xtask test`).
#[cfg(feature = "gpu-tests")]
fn gpu(test: &str) -> Option<MutexGuard<'static, ()>> {
    if !zero_testkit::cookie::gpu_tests() {
        zero_testkit::record_skip!(
            test,
            "ZERO_GPU_TESTS=1 is not set (cargo xtask gpu-check sets it)",
        );
        return None;
    }
    match zero_comm::nccl::probe() {
        Err(e) => panic!("ZERO_GPU_TESTS=1 but NCCL cannot be used: {e}"),
        Ok(rt) if rt.devices == 0 => panic!("ZERO_GPU_TESTS=1 but there is no CUDA device"),
        Ok(rt) => {
            eprintln!("{test}: {rt:?}");
            Some(GPU.lock().unwrap_or_else(|p| p.into_inner()))
        }
    }
}

#[cfg(feature = "gpu-tests")]
use zero_testkit::cookie::passed;

/// A GPU test that cannot run on this machine's library (a missing capability): the cookie says
/// so, and `cargo xtask gpu-check` fails naming the reason.
#[cfg(feature = "gpu-tests")]
fn skipped(test: &str, reason: &str) {
    eprintln!("{test} did not run: {reason}");
    zero_testkit::cookie::write(&format!("{test} skipped: {reason}"));
}

#[cfg(feature = "gpu-tests")]
fn opts(wait: WaitMode, check_peers: bool, nonblocking: bool) -> NcclOptions {
    NcclOptions {
        timeout: Duration::from_secs(60),
        wait,
        check_peers,
        nonblocking,
        device: Some(0),
    }
}

/// The option sets every GPU test runs under.
#[cfg(feature = "gpu-tests")]
fn modes() -> Vec<NcclOptions> {
    vec![
        opts(WaitMode::Eager, true, true),
        opts(WaitMode::Lazy, false, true),
        opts(WaitMode::Eager, false, false),
    ]
}

#[cfg(feature = "gpu-tests")]
fn world(o: &NcclOptions) -> Vec<NcclComm> {
    vec![NcclComm::single(0, o.clone()).unwrap()]
}

#[cfg(feature = "gpu-tests")]
mod gpu_bodies {
    use half::{bf16, f16};
    use zero_comm::ReduceOp;

    use super::common::*;
    use super::*;

    const COUNTS: &[usize] = &[0, 1, 3, 7, 64, 2049];
    const LENS: &[usize] = &[0, 1, 2, 5, 13, 100, 4099];

    #[test]
    fn gpu_every_collective_at_world_1() {
        let Some(_g) = gpu("gpu_every_collective_at_world_1") else {
            return;
        };
        for o in modes() {
            check_all_gather::<_, f32>(world(&o), COUNTS);
            check_all_gather::<_, bf16>(world(&o), COUNTS);
            check_all_gather::<_, f16>(world(&o), COUNTS);
            check_all_gather::<_, u8>(world(&o), COUNTS);
            for op in [ReduceOp::Sum, ReduceOp::Mean] {
                check_reduce_scatter::<_, f32>(world(&o), COUNTS, op);
                check_reduce_scatter::<_, bf16>(world(&o), COUNTS, op);
                check_reduce_scatter::<_, f16>(world(&o), COUNTS, op);
                check_all_reduce::<_, f32>(world(&o), LENS, op);
                check_all_reduce::<_, bf16>(world(&o), LENS, op);
                check_all_reduce::<_, f16>(world(&o), LENS, op);
                check_all_reduce_is_rs_ag::<_, f32>(world(&o), COUNTS, op);
            }
            check_broadcast::<_, f32>(world(&o), LENS);
            check_broadcast::<_, u8>(world(&o), LENS);
            check_all_to_all::<_, f32>(world(&o), COUNTS);
            check_all_to_all::<_, bf16>(world(&o), COUNTS);
            check_barrier(world(&o));
            run_ranks(world(&o), |mut c| {
                upload_into_body::<_, f32>(&mut c);
                upload_into_body::<_, bf16>(&mut c);
                upload_into_body::<_, u8>(&mut c);
            });
        }
        passed("gpu_every_collective_at_world_1");
    }

    #[test]
    fn gpu_traffic_equals_the_formulas_at_world_1() {
        let Some(_g) = gpu("gpu_traffic_equals_the_formulas_at_world_1") else {
            return;
        };
        for o in modes() {
            run_ranks(world(&o), |mut comm| exercise_and_check_traffic(&mut comm));
        }
        passed("gpu_traffic_equals_the_formulas_at_world_1");
    }

    #[test]
    fn gpu_split_into_a_group_of_one() {
        let Some(_g) = gpu("gpu_split_into_a_group_of_one") else {
            return;
        };
        let rt = zero_comm::nccl::probe().unwrap();
        if !rt.comm_split {
            let why = format!("libnccl {:?} has no ncclCommSplit", rt.nccl_version);
            skipped("gpu_split_into_a_group_of_one", &why);
            return;
        }
        for o in modes() {
            run_ranks(world(&o), |mut comm| {
                let mut sub = comm.split(0, 7).unwrap();
                assert_eq!(
                    (sub.rank(), sub.world_size(), sub.members()),
                    (0, 1, &[0usize][..])
                );
                // The child starts with an empty table (checked first, before other calls).
                exercise_and_check_traffic(&mut sub);
                all_gather_body::<_, f32>(&mut sub, &[0, 5]);
                reduce_scatter_body::<_, bf16>(&mut sub, &[3], ReduceOp::Mean);
                all_reduce_body::<_, f16>(&mut sub, &[9], ReduceOp::Sum);
                broadcast_body::<_, u8>(&mut sub, &[4]);
                all_to_all_body::<_, f32>(&mut sub, &[2]);
                // The parent keeps its own table and still works.
                all_reduce_body::<_, f32>(&mut comm, &[17], ReduceOp::Mean);
                assert_eq!(comm.traffic().calls(), 1);
                let mut nested = sub.split(3, 0).unwrap();
                check_barrier_one(&mut nested);
            });
        }
        passed("gpu_split_into_a_group_of_one");
    }

    fn check_barrier_one(comm: &mut NcclComm) {
        comm.barrier().unwrap();
        assert_eq!(comm.traffic().calls(), 1);
    }

    #[test]
    fn gpu_groups_defer_the_mean_and_run_on_finish() {
        let Some(_g) = gpu("gpu_groups_defer_the_mean_and_run_on_finish") else {
            return;
        };
        for o in modes() {
            let mut comm = NcclComm::single(0, o).unwrap();
            let x = values::<f32>(0, 6, 1);
            let send = comm.upload(&x).unwrap();
            let mut gathered = comm.alloc::<f32>(6).unwrap();
            let mut shard = comm.alloc::<f32>(6).unwrap();
            let mut b = comm.upload(&[9u8; 5]).unwrap();
            let mut ar = comm.upload(&values::<bf16>(0, 7, 2)).unwrap();
            let mut g = comm.group();
            g.all_gather(&send, &mut gathered)
                .reduce_scatter(&send, &mut shard, ReduceOp::Mean)
                .broadcast(&mut b, 0)
                .all_reduce(&mut ar, ReduceOp::Mean);
            g.finish().unwrap();
            assert_bits(
                &comm.download_vec(&gathered).unwrap(),
                &x,
                "group all_gather",
            );
            assert_bits(
                &comm.download_vec(&shard).unwrap(),
                &x,
                "group reduce_scatter",
            );
            assert_eq!(comm.download_vec(&b).unwrap(), vec![9u8; 5]);
            assert_bits(
                &comm.download_vec(&ar).unwrap(),
                &values::<bf16>(0, 7, 2),
                "group all_reduce",
            );
            assert_eq!(comm.traffic().calls(), 4);
        }
        passed("gpu_groups_defer_the_mean_and_run_on_finish");
    }

    #[test]
    fn gpu_validation_errors_leave_the_communicator_usable() {
        let Some(_g) = gpu("gpu_validation_errors_leave_the_communicator_usable") else {
            return;
        };
        for o in modes() {
            let mut comm = NcclComm::single(0, o).unwrap();
            let s = comm.upload(&[1.0f32, 2.0]).unwrap();
            let mut r = comm.alloc::<f32>(3).unwrap();
            assert!(matches!(
                comm.all_gather(&s, &mut r),
                Err(Error::LengthMismatch {
                    expected: 2,
                    got: 3,
                    ..
                })
            ));
            let mut bytes = comm.upload(&[1u8, 2]).unwrap();
            assert!(matches!(
                comm.all_reduce(&mut bytes, ReduceOp::Sum),
                Err(Error::UnsupportedReduce { .. })
            ));
            assert!(matches!(
                comm.broadcast(&mut bytes, 1),
                Err(Error::InvalidRoot { root: 1, .. })
            ));
            let mut host = [0.0f32; 3];
            assert!(matches!(
                comm.download(&s, &mut host),
                Err(Error::BufferLength { .. })
            ));
            assert!(!comm.is_aborted());
            let mut ok = comm.upload(&[3.0f32]).unwrap();
            comm.all_reduce(&mut ok, ReduceOp::Mean).unwrap();
            assert_eq!(comm.download_vec(&ok).unwrap(), vec![3.0]);
            // An explicit abort fails later calls with `Aborted`.
            comm.abort("test abort".into());
            assert!(matches!(comm.barrier(), Err(Error::Aborted { .. })));
        }
        passed("gpu_validation_errors_leave_the_communicator_usable");
    }
}

/// A world of two where rank 1 never joins: non-blocking init must give up at the timeout, abort,
/// and return an error (run on a thread, so a hang fails this test instead of the whole run).
#[cfg(feature = "gpu-tests")]
#[test]
fn gpu_init_times_out_when_a_peer_never_joins() {
    let Some(_g) = gpu("gpu_init_times_out_when_a_peer_never_joins") else {
        return;
    };
    let rt = zero_comm::nccl::probe().unwrap();
    if !rt.nonblocking_init {
        let why = format!(
            "libnccl {:?} cannot create non-blocking communicators",
            rt.nccl_version
        );
        skipped("gpu_init_times_out_when_a_peer_never_joins", &why);
        return;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let start = Instant::now();
        let o = NcclOptions {
            timeout: Duration::from_secs(3),
            ..opts(WaitMode::Eager, true, true)
        };
        let topo = zero_core::Topology::single_node(2).unwrap();
        let r = NcclComm::unique_id()
            .and_then(|id| NcclComm::from_unique_id(&id, 0, topo, 0, o))
            .map(|_| ());
        let _ = tx.send((r, start.elapsed()));
    });
    let (r, took) = rx
        .recv_timeout(Duration::from_secs(90))
        .expect("init with a missing peer hung past 90 s despite a 3 s timeout");
    let err = r.unwrap_err().to_string();
    eprintln!("init without rank 1 after {took:?}: {err}");
    assert!(err.contains("did not complete"), "{err}");
    assert!(took < Duration::from_secs(60), "took {took:?}");
    passed("gpu_init_times_out_when_a_peer_never_joins");
}

/// `ZERO_GPU_BENCH=1`: all-gather, reduce-scatter and all-reduce of 64 MiB at world size 1 (a
/// device copy, or an in-place no-op plus the launch), one `ZERO_GPU_BW …` line each.
#[cfg(feature = "gpu-tests")]
#[test]
fn gpu_bandwidth_report() {
    if std::env::var("ZERO_GPU_BENCH").as_deref() != Ok("1") {
        zero_testkit::record_skip!(
            "gpu_bandwidth_report",
            "ZERO_GPU_BENCH=1 is not set (a benchmark: gpu-check's bench step sets it)",
        );
        return;
    }
    let Some(_g) = gpu("gpu_bandwidth_report") else {
        return;
    };
    let mib: usize = std::env::var("ZERO_GPU_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let bytes = mib << 20;
    let len = bytes / 4;
    let iters = 20;
    let mut comm = NcclComm::single(0, opts(WaitMode::Lazy, false, true)).unwrap();
    let src = comm.upload(&vec![1.0f32; len]).unwrap();
    let mut dst = comm.alloc::<f32>(len).unwrap();
    let mut buf = comm.upload(&vec![1.0f32; len]).unwrap();
    let mut time = |name: &str, f: &mut dyn FnMut(&mut NcclComm)| {
        for _ in 0..3 {
            f(&mut comm);
        }
        comm.synchronize().unwrap();
        let start = Instant::now();
        for _ in 0..iters {
            f(&mut comm);
        }
        comm.synchronize().unwrap();
        let secs = start.elapsed().as_secs_f64() / f64::from(iters);
        let gbps = bytes as f64 / secs / 1e9;
        println!(
            "ZERO_GPU_BW op={name} bytes={bytes} iters={iters} seconds={secs:.6e} algbw_gbps={gbps:.1}"
        );
    };
    time("all_gather", &mut |c| c.all_gather(&src, &mut dst).unwrap());
    time("reduce_scatter", &mut |c| {
        c.reduce_scatter(&src, &mut dst, zero_comm::ReduceOp::Sum)
            .unwrap()
    });
    time("all_reduce", &mut |c| {
        c.all_reduce(&mut buf, zero_comm::ReduceOp::Sum).unwrap()
    });
    passed("gpu_bandwidth_report");
}

/// qwZ on device memory (zero-quant's CUDA kernels, NCCL's all-gather) equals the host path on
/// the host loopback bit for bit, errors included.
#[cfg(feature = "gpu-tests")]
#[test]
fn gpu_qwz_on_device_matches_the_host_path() {
    use half::bf16;
    use zero_comm::quantized::qwz_all_gather_device;
    use zero_comm::quantized::{QuantScratch, qwz_all_gather};
    use zero_quant::{Codec, CudaQuantizer, Int4Block, Int8Block};

    let Some(_g) = gpu("gpu_qwz_on_device_matches_the_host_path") else {
        return;
    };
    fn case<E>(comm: &mut NcclComm, q: &CudaQuantizer, codec: Codec, x: &[E])
    where
        E: zero_comm::Element + zero_quant::cuda::CudaElement + common::Val,
    {
        let mut host = common::host_world(common::topo(1, 1)).pop().unwrap();
        let mut want = vec![E::default(); x.len()];
        let mut scratch = QuantScratch::new();
        let h = qwz_all_gather(&mut host, &codec, x, &mut want, &mut scratch);
        let chunk = comm.upload(x).unwrap();
        let mut out = comm.alloc::<E>(x.len()).unwrap();
        let d = qwz_all_gather_device(comm, q, codec, &chunk, &mut out);
        match (d, h) {
            (Ok(()), Ok(())) => {
                let got = comm.download_vec(&out).unwrap();
                common::assert_bits(&got, &want, &format!("{codec:?} n={}", x.len()));
            }
            (Err(d), Err(h)) => assert_eq!(d.to_string(), h.to_string()),
            (d, h) => panic!("{codec:?}: device {d:?}, host {h:?}"),
        }
    }
    let mut comm = NcclComm::single(0, NcclOptions::default()).unwrap();
    let q = CudaQuantizer::new(comm.stream().clone()).unwrap();
    let codecs: [Codec; 3] = [
        Int8Block::default().into(),
        Int8Block::new(7).unwrap().into(),
        Int4Block::default().into(),
    ];
    for codec in codecs {
        for n in [0usize, 1, 5, 1000, 4097] {
            let x: Vec<f32> = common::values::<f32>(0, n, n as u64);
            case(&mut comm, &q, codec, &x);
            let xb: Vec<bf16> = common::values::<bf16>(0, n, n as u64);
            case(&mut comm, &q, codec, &xb);
        }
        // A non-finite input fails on the device as on the host, naming this rank.
        let mut x = common::values::<f32>(0, 100, 9);
        x[37] = f32::NAN;
        case(&mut comm, &q, codec, &x);
    }
    // A quantizer on another stream is refused.
    let other = CudaQuantizer::new(comm.context().new_stream().unwrap()).unwrap();
    let chunk = comm.upload(&[1.0f32]).unwrap();
    let mut out = comm.alloc::<f32>(1).unwrap();
    assert!(matches!(
        qwz_all_gather_device(&mut comm, &other, Int8Block::default(), &chunk, &mut out),
        Err(Error::Backend(_))
    ));
    passed("gpu_qwz_on_device_matches_the_host_path");
}

/// qgZ on device memory (zero-quant's CUDA kernels) equals the host path on the host loopback
/// bit for bit, errors included, at the one world size a single GPU allows (N = 1: no group, no
/// exchange; the output is the input after the finiteness check). The stages of N > 1 need
/// several GPUs; their final division and rounding are checked on one GPU by
/// `gpu_qgz_finish_kernels_divide_and_round_like_the_host` (the library's tests).
#[cfg(feature = "gpu-tests")]
#[test]
fn gpu_qgz_on_device_matches_the_host_path() {
    use half::bf16;
    use zero_comm::quantized::qgz_reduce_scatter_device;
    use zero_comm::quantized::{QuantGroups, QuantScratch, qgz_reduce_scatter};
    use zero_quant::{Codec, CudaQuantizer, Identity, Int4Block, Int8Block};

    let Some(_g) = gpu("gpu_qgz_on_device_matches_the_host_path") else {
        return;
    };
    fn case<E>(
        comm: &mut NcclComm,
        groups: &mut QuantGroups<NcclComm>,
        q: &CudaQuantizer,
        codec: Codec,
        x: &[E],
    ) where
        E: zero_comm::quantized::QuantElement + zero_quant::cuda::CudaElement + common::Val,
    {
        let mut host = common::host_world(common::topo(1, 1)).pop().unwrap();
        let mut host_groups = QuantGroups::new(&mut host).unwrap();
        let mut want = vec![E::default(); x.len()];
        let mut scratch = QuantScratch::new();
        let h = qgz_reduce_scatter(&mut host_groups, &codec, x, &mut want, &mut scratch);
        let input = comm.upload(x).unwrap();
        let mut out = comm.alloc::<E>(x.len()).unwrap();
        let d = qgz_reduce_scatter_device(groups, q, codec, &input, &mut out);
        match (d, h) {
            (Ok(()), Ok(())) => {
                let got = comm.download_vec(&out).unwrap();
                common::assert_bits(&got, &want, &format!("{codec:?} n={}", x.len()));
            }
            (Err(d), Err(h)) => assert_eq!(format!("{d} {d:?}"), format!("{h} {h:?}")),
            (d, h) => panic!("{codec:?}: device {d:?}, host {h:?}"),
        }
        assert_eq!(groups.traffic(), host_groups.traffic());
    }
    let mut comm = NcclComm::single(0, NcclOptions::default()).unwrap();
    let mut groups = QuantGroups::new(&mut comm).unwrap();
    assert!(groups.intra().is_none() && groups.cross().is_none());
    let q = CudaQuantizer::new(comm.stream().clone()).unwrap();
    let codecs: [Codec; 3] = [
        Int4Block::default().into(),
        Int4Block::new(6).unwrap().into(),
        Int8Block::new(7).unwrap().into(),
    ];
    for codec in codecs {
        for n in [0usize, 1, 5, 1000, 4097] {
            let x: Vec<f32> = common::values::<f32>(0, n, n as u64);
            case(&mut comm, &mut groups, &q, codec, &x);
            let xb: Vec<bf16> = common::values::<bf16>(0, n, n as u64);
            case(&mut comm, &mut groups, &q, codec, &xb);
        }
        // A non-finite input fails on the device as on the host, naming this rank, with the
        // first such element and its value.
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = common::values::<f32>(0, 100, 9);
            x[37] = bad;
            x[80] = f32::NAN;
            case(&mut comm, &mut groups, &q, codec, &x);
        }
    }
    // The identity codec has no device kernel: refused before anything moves, as is a wrong
    // output length (the host's error).
    let input = comm.upload(&[1.0f32; 4]).unwrap();
    let mut out = comm.alloc::<f32>(4).unwrap();
    assert!(matches!(
        qgz_reduce_scatter_device(&mut groups, &q, Identity, &input, &mut out),
        Err(Error::Backend(_))
    ));
    let mut short = comm.alloc::<f32>(3).unwrap();
    assert!(matches!(
        qgz_reduce_scatter_device(&mut groups, &q, Int4Block::default(), &input, &mut short),
        Err(Error::LengthMismatch {
            expected: 4,
            got: 3,
            ..
        })
    ));
    assert_eq!(comm.traffic().calls(), 0, "nothing moved at N = 1");
    passed("gpu_qgz_on_device_matches_the_host_path");
}
