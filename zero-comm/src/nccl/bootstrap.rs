//! The torchrun-style bootstrap: launch variables, and a tiny TCP rendezvous that hands rank 0's
//! NCCL unique id to every other rank.
//!
//! Pure Rust (`std::net`), built with or without the `nccl` feature, so it is tested everywhere.
//!
//! # Launch variables
//!
//! [`LaunchEnv::from_env`] reads what `torchrun` (and most launchers) set:
//!
//! | variable | meaning | when absent |
//! |---|---|---|
//! | `RANK` | global rank, `0..WORLD_SIZE` | error |
//! | `WORLD_SIZE` | number of ranks | error |
//! | `LOCAL_WORLD_SIZE` or `ZERO_RANKS_PER_NODE` | ranks per node (both set: they must agree) | `WORLD_SIZE` if it is 1, else error |
//! | `LOCAL_RANK` | rank on this node, picks the GPU; must equal `RANK % LOCAL_WORLD_SIZE` | `RANK % LOCAL_WORLD_SIZE` |
//! | `MASTER_ADDR`, `MASTER_PORT` | where rank 0 serves the rendezvous | error if `WORLD_SIZE > 1` |
//!
//! Ranks are numbered node-major (`RANK = node · LOCAL_WORLD_SIZE + LOCAL_RANK`), as torchrun does
//! and as [`zero_core::Topology`] assumes; a launch that numbers ranks otherwise is rejected, since
//! its traffic would be classified on the wrong links. Every error names the variable.
//!
//! # Rendezvous protocol
//!
//! Rank 0 listens on `MASTER_ADDR:MASTER_PORT` ([`RendezvousServer`]); every other rank connects
//! ([`fetch`]), retrying until its deadline, and sends a 12-byte hello (`b"ZRO1"`, rank and world
//! size as little-endian `u32`). Rank 0 waits until **every** rank has said hello, then sends each
//! the payload (status byte, `u32` length, bytes). The rendezvous is therefore also a barrier: when
//! it returns, every rank was alive a moment ago, which is what makes a following
//! `ncclCommInitRank` unlikely to wait for a dead peer.
//!
//! Failures are reported, never waited out forever:
//!
//! - a rank that cannot reach rank 0 before its deadline fails with the address and the last
//!   connection error ("rank 0 never came");
//! - rank 0 fails, listing the missing ranks, when some never say hello; it tells the ranks that
//!   did come, so they fail at once instead of at their own deadline;
//! - a hello with another world size, a rank out of range or a duplicate rank fails the whole
//!   rendezvous, on every rank that connected;
//! - a connection that does not speak the protocol (a port scanner) is dropped and ignored.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::thread;
use std::time::{Duration, Instant};

use zero_core::Topology;

use crate::error::{Error, Result};

/// Global rank.
pub const ENV_RANK: &str = "RANK";
/// Number of ranks.
pub const ENV_WORLD_SIZE: &str = "WORLD_SIZE";
/// Rank on this node.
pub const ENV_LOCAL_RANK: &str = "LOCAL_RANK";
/// Ranks per node (torchrun's name).
pub const ENV_LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// Ranks per node (this project's name, for launchers that do not set `LOCAL_WORLD_SIZE`).
pub const ENV_RANKS_PER_NODE: &str = "ZERO_RANKS_PER_NODE";
/// Host of rank 0's rendezvous.
pub const ENV_MASTER_ADDR: &str = "MASTER_ADDR";
/// Port of rank 0's rendezvous.
pub const ENV_MASTER_PORT: &str = "MASTER_PORT";

/// The timeout of a rendezvous when the caller has no better idea.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

const MAGIC: &[u8; 4] = b"ZRO1";
const HELLO_LEN: usize = 12;
const STATUS_OK: u8 = 0;
const STATUS_ERR: u8 = 1;
/// Largest payload (or error message) a rendezvous carries.
const MAX_PAYLOAD: usize = 1 << 20;
/// How long a connected peer may take to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a waiting rank retries, at most.
const RETRY_INTERVAL: Duration = Duration::from_millis(100);

fn boot_err(msg: impl std::fmt::Display) -> Error {
    Error::Backend(format!("nccl bootstrap: {msg}"))
}

/// NCCL's unique id (`ncclUniqueId`): 128 opaque bytes made by rank 0 and shipped to every rank.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId(pub [u8; UniqueId::LEN]);

impl UniqueId {
    /// Size of the id in bytes.
    pub const LEN: usize = 128;

    /// The id from the bytes of a rendezvous payload.
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        let arr: [u8; UniqueId::LEN] = bytes.try_into().map_err(|_| {
            boot_err(format!(
                "a unique id has {} bytes, got {}",
                UniqueId::LEN,
                bytes.len()
            ))
        })?;
        Ok(UniqueId(arr))
    }
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The id embeds rank 0's bootstrap address; a short hash is enough to compare ids in logs.
        let h = self.0.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        write!(f, "UniqueId({h:016x})")
    }
}

/// The launch description of one rank, from torchrun-style variables. See the
/// [module docs](self) for the variables and their rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank on this node (`rank % local_world_size`); picks the GPU.
    pub local_rank: usize,
    /// Ranks per node.
    pub local_world_size: usize,
    /// Host of rank 0's rendezvous.
    pub master_addr: String,
    /// Port of rank 0's rendezvous.
    pub master_port: u16,
}

fn parse_usize(name: &str, value: &str) -> Result<usize> {
    value.trim().parse::<usize>().map_err(|_| {
        boot_err(format!(
            "environment variable {name}={value:?} is not a non-negative integer"
        ))
    })
}

impl LaunchEnv {
    /// Reads the launch variables of this process.
    pub fn from_env() -> Result<LaunchEnv> {
        LaunchEnv::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the launch variables through `get` (a variable that `get` maps to `None` or to an empty
    /// string is unset). Every error names the variable at fault.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let var = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        let required = |name: &str| {
            var(name).ok_or_else(|| {
                boot_err(format!(
                    "environment variable {name} is not set (launch with torchrun, or set RANK, \
                     WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
                ))
            })
        };
        let world_size = parse_usize(ENV_WORLD_SIZE, &required(ENV_WORLD_SIZE)?)?;
        if world_size == 0 {
            return Err(boot_err(format!(
                "environment variable {ENV_WORLD_SIZE}=0: a world needs at least one rank"
            )));
        }
        let rank = parse_usize(ENV_RANK, &required(ENV_RANK)?)?;
        if rank >= world_size {
            return Err(boot_err(format!(
                "environment variable {ENV_RANK}={rank} is not below {ENV_WORLD_SIZE}={world_size}"
            )));
        }

        let lws = var(ENV_LOCAL_WORLD_SIZE)
            .map(|v| parse_usize(ENV_LOCAL_WORLD_SIZE, &v))
            .transpose()?;
        let rpn = var(ENV_RANKS_PER_NODE)
            .map(|v| parse_usize(ENV_RANKS_PER_NODE, &v))
            .transpose()?;
        let (local_world_size, lws_name) = match (lws, rpn) {
            (Some(a), Some(b)) if a != b => {
                return Err(boot_err(format!(
                    "environment variables {ENV_LOCAL_WORLD_SIZE}={a} and {ENV_RANKS_PER_NODE}={b} disagree"
                )));
            }
            (Some(a), _) => (a, ENV_LOCAL_WORLD_SIZE),
            (None, Some(b)) => (b, ENV_RANKS_PER_NODE),
            (None, None) if world_size == 1 => (1, ENV_LOCAL_WORLD_SIZE),
            (None, None) => {
                return Err(boot_err(format!(
                    "environment variable {ENV_LOCAL_WORLD_SIZE} is not set (nor {ENV_RANKS_PER_NODE}): \
                     the ranks per node decide which links are intra-node"
                )));
            }
        };
        if local_world_size == 0 || !world_size.is_multiple_of(local_world_size) {
            return Err(boot_err(format!(
                "environment variable {lws_name}={local_world_size} does not divide \
                 {ENV_WORLD_SIZE}={world_size} (nodes must be full)"
            )));
        }
        let expected_local = rank % local_world_size;
        let local_rank = match var(ENV_LOCAL_RANK) {
            None => expected_local,
            Some(v) => {
                let lr = parse_usize(ENV_LOCAL_RANK, &v)?;
                if lr != expected_local {
                    return Err(boot_err(format!(
                        "environment variable {ENV_LOCAL_RANK}={lr} does not match \
                         {ENV_RANK}={rank} % {lws_name}={local_world_size} = {expected_local} \
                         (ranks must be numbered node-major)"
                    )));
                }
                lr
            }
        };

        let (master_addr, master_port) = if world_size == 1 {
            (
                var(ENV_MASTER_ADDR).unwrap_or_else(|| "127.0.0.1".to_string()),
                match var(ENV_MASTER_PORT) {
                    Some(p) => parse_port(&p)?,
                    None => 29500,
                },
            )
        } else {
            (
                required(ENV_MASTER_ADDR)?,
                parse_port(&required(ENV_MASTER_PORT)?)?,
            )
        };

        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
        })
    }

    /// A single-process world of one rank on GPU 0.
    pub fn single() -> LaunchEnv {
        LaunchEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".to_string(),
            master_port: 29500,
        }
    }

    /// The world's topology (`world_size` ranks, `local_world_size` per node).
    pub fn topology(&self) -> Result<Topology> {
        Ok(Topology::new(self.world_size, self.local_world_size)?)
    }

    /// The addresses `MASTER_ADDR:MASTER_PORT` resolves to.
    pub fn master_addrs(&self) -> Result<Vec<SocketAddr>> {
        resolve(&self.master_addr, self.master_port)
    }
}

fn parse_port(v: &str) -> Result<u16> {
    match v.trim().parse::<u16>() {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(boot_err(format!(
            "environment variable {ENV_MASTER_PORT}={v:?} is not a port in 1..=65535"
        ))),
    }
}

fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| {
            boot_err(format!(
                "cannot resolve {ENV_MASTER_ADDR}={host:?} (port {port}): {e}"
            ))
        })?
        .collect();
    if addrs.is_empty() {
        return Err(boot_err(format!(
            "{ENV_MASTER_ADDR}={host:?} resolves to no address"
        )));
    }
    Ok(addrs)
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

fn write_reply(stream: &mut TcpStream, status: u8, body: &[u8]) -> io::Result<()> {
    let len = u32::try_from(body.len()).map_err(|_| io::Error::other("payload too large"))?;
    let mut msg = Vec::with_capacity(5 + body.len());
    msg.push(status);
    msg.extend_from_slice(&len.to_le_bytes());
    msg.extend_from_slice(body);
    stream.write_all(&msg)?;
    stream.flush()
}

/// Rank 0's side of the rendezvous: a bound listener waiting for the other ranks.
#[derive(Debug)]
pub struct RendezvousServer {
    listener: TcpListener,
    world_size: usize,
}

impl RendezvousServer {
    /// Listens on `addr` (port 0 picks a free port; see [`local_addr`](Self::local_addr)) for the
    /// `world_size - 1` other ranks of a world.
    pub fn bind(addr: impl ToSocketAddrs, world_size: usize) -> Result<RendezvousServer> {
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| boot_err(format!("cannot resolve the rendezvous address: {e}")))?
            .collect();
        let listener = TcpListener::bind(&addrs[..]).map_err(|e| {
            boot_err(format!(
                "rank 0 cannot listen on {addrs:?}: {e} (is {ENV_MASTER_PORT} in use, or \
                 {ENV_MASTER_ADDR} not an address of this host?)"
            ))
        })?;
        RendezvousServer::from_listener(listener, world_size)
    }

    /// Serves on a listener the caller bound, for example to port 0 before handing the port it
    /// got to the other ranks: no other process can take the port in between.
    pub fn from_listener(listener: TcpListener, world_size: usize) -> Result<RendezvousServer> {
        if world_size == 0 {
            return Err(boot_err("a rendezvous needs a world of at least one rank"));
        }
        listener
            .set_nonblocking(true)
            .map_err(|e| boot_err(format!("cannot make the listener non-blocking: {e}")))?;
        Ok(RendezvousServer {
            listener,
            world_size,
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|e| boot_err(format!("listener has no address: {e}")))
    }

    /// Waits (at most `timeout`) until every other rank has said hello, then sends each of them
    /// `payload`. Fails, telling every rank that came, if a rank never comes or a hello is invalid.
    pub fn serve(self, payload: &[u8], timeout: Duration) -> Result<()> {
        if payload.len() > MAX_PAYLOAD {
            return Err(boot_err(format!(
                "payload of {} bytes exceeds {MAX_PAYLOAD}",
                payload.len()
            )));
        }
        let n = self.world_size;
        let deadline = Instant::now() + timeout;
        let mut peers: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
        let mut arrived = 1; // rank 0
        let mut failure: Option<String> = None;

        while arrived < n && failure.is_none() {
            match self.listener.accept() {
                Ok((mut stream, from)) => match read_hello(&mut stream, deadline) {
                    Ok(None) => {} // not our protocol: ignore
                    Ok(Some((rank, world))) => {
                        if world != n {
                            failure = Some(format!(
                                "rank {rank} (from {from}) has {ENV_WORLD_SIZE}={world}, rank 0 has {n}"
                            ));
                            let _ = write_reply(
                                &mut stream,
                                STATUS_ERR,
                                failure.as_deref().unwrap_or_default().as_bytes(),
                            );
                        } else if rank == 0 || rank >= n {
                            failure = Some(format!(
                                "a peer from {from} claims rank {rank}, expected 1..{n}"
                            ));
                            let _ = write_reply(
                                &mut stream,
                                STATUS_ERR,
                                failure.as_deref().unwrap_or_default().as_bytes(),
                            );
                        } else if peers[rank].is_some() {
                            failure = Some(format!("rank {rank} said hello twice (from {from})"));
                            let _ = write_reply(
                                &mut stream,
                                STATUS_ERR,
                                failure.as_deref().unwrap_or_default().as_bytes(),
                            );
                        } else {
                            peers[rank] = Some(stream);
                            arrived += 1;
                        }
                    }
                    Err(_) => {} // a peer that connected but never spoke: it will retry or time out
                },
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let left = remaining(deadline);
                    if left.is_zero() {
                        let missing: Vec<usize> = (1..n).filter(|&r| peers[r].is_none()).collect();
                        failure = Some(format!(
                            "rank 0 timed out after {timeout:?} waiting for ranks {missing:?} to connect"
                        ));
                        break;
                    }
                    thread::sleep(left.min(Duration::from_millis(5)));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => failure = Some(format!("rank 0 failed to accept a connection: {e}")),
            }
        }

        if let Some(msg) = failure {
            for s in peers.iter_mut().flatten() {
                let _ = write_reply(s, STATUS_ERR, msg.as_bytes());
            }
            return Err(boot_err(msg));
        }
        let mut lost = Vec::new();
        for (rank, s) in peers.iter_mut().enumerate() {
            if let Some(s) = s {
                let _ = s.set_write_timeout(Some(remaining(deadline).max(HELLO_TIMEOUT)));
                if write_reply(s, STATUS_OK, payload).is_err() {
                    lost.push(rank);
                }
            }
        }
        if !lost.is_empty() {
            return Err(boot_err(format!(
                "ranks {lost:?} disconnected before rank 0 could send them the payload"
            )));
        }
        Ok(())
    }
}

/// Reads a hello. `Ok(None)`: the peer does not speak the protocol.
fn read_hello(stream: &mut TcpStream, deadline: Instant) -> io::Result<Option<(usize, usize)>> {
    stream.set_nonblocking(false)?;
    let t = remaining(deadline).clamp(Duration::from_millis(50), HELLO_TIMEOUT);
    stream.set_read_timeout(Some(t))?;
    let mut hello = [0u8; HELLO_LEN];
    stream.read_exact(&mut hello)?;
    if &hello[..4] != MAGIC {
        return Ok(None);
    }
    let rank = u32::from_le_bytes([hello[4], hello[5], hello[6], hello[7]]) as usize;
    let world = u32::from_le_bytes([hello[8], hello[9], hello[10], hello[11]]) as usize;
    Ok(Some((rank, world)))
}

/// A non-zero rank's side of the rendezvous: connects to `addrs` (retrying until `timeout`), says
/// hello as `rank` of `world_size`, and returns rank 0's payload.
pub fn fetch(
    addrs: &[SocketAddr],
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let to_u32 = |v: usize, what: &str| {
        u32::try_from(v).map_err(|_| boot_err(format!("{what} {v} does not fit the protocol")))
    };
    let mut hello = [0u8; HELLO_LEN];
    hello[..4].copy_from_slice(MAGIC);
    hello[4..8].copy_from_slice(&to_u32(rank, "rank")?.to_le_bytes());
    hello[8..].copy_from_slice(&to_u32(world_size, "world size")?.to_le_bytes());

    let mut last_err = String::from("no address to try");
    loop {
        for addr in addrs {
            let left = remaining(deadline);
            if left.is_zero() {
                break;
            }
            match TcpStream::connect_timeout(addr, left.min(Duration::from_secs(1))) {
                Ok(stream) => {
                    return exchange_hello(stream, &hello, rank, *addr, deadline, timeout);
                }
                Err(e) => last_err = format!("{addr}: {e}"),
            }
        }
        let left = remaining(deadline);
        if left.is_zero() {
            return Err(boot_err(format!(
                "rank {rank} timed out after {timeout:?}: could not reach rank 0 at {addrs:?} \
                 (rank 0 never came? last error: {last_err})"
            )));
        }
        thread::sleep(left.min(RETRY_INTERVAL));
    }
}

fn exchange_hello(
    mut stream: TcpStream,
    hello: &[u8],
    rank: usize,
    addr: SocketAddr,
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let io_err = |what: &str, e: io::Error| {
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            boot_err(format!(
                "rank {rank} timed out after {timeout:?} waiting for rank 0 at {addr} to {what} \
                 (other ranks may be missing)"
            ))
        } else {
            boot_err(format!(
                "rank {rank}: connection to rank 0 at {addr} failed while waiting to {what}: {e}"
            ))
        }
    };
    let _ = stream.set_nodelay(true);
    stream
        .set_write_timeout(Some(remaining(deadline).max(Duration::from_millis(1))))
        .and_then(|()| stream.write_all(hello))
        .map_err(|e| io_err("accept the hello", e))?;
    let read_timeout = remaining(deadline).max(Duration::from_millis(1));
    stream
        .set_read_timeout(Some(read_timeout))
        .map_err(|e| io_err("reply", e))?;
    let mut head = [0u8; 5];
    stream
        .read_exact(&mut head)
        .map_err(|e| io_err("reply", e))?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(boot_err(format!(
            "rank {rank}: rank 0 at {addr} announced {len} bytes, more than {MAX_PAYLOAD}"
        )));
    }
    let mut body = vec![0u8; len];
    stream
        .read_exact(&mut body)
        .map_err(|e| io_err("send the payload", e))?;
    match head[0] {
        STATUS_OK => Ok(body),
        _ => Err(boot_err(format!(
            "rank {rank}: rank 0 at {addr} reported: {}",
            String::from_utf8_lossy(&body)
        ))),
    }
}

/// Runs the rendezvous of `env`: rank 0 calls `make` and serves its bytes (binding
/// `MASTER_ADDR:MASTER_PORT`), every other rank fetches them. A world of one rank only calls `make`.
/// Each side gives up after `timeout`.
pub fn exchange(
    env: &LaunchEnv,
    timeout: Duration,
    make: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    exchange_via(env, None, timeout, make)
}

/// [`exchange`], where rank 0 may bring its server already listening (`server`; see
/// [`RendezvousServer::from_listener`]) instead of binding `MASTER_ADDR:MASTER_PORT`. Other ranks
/// and a world of one pass `None`.
pub fn exchange_via(
    env: &LaunchEnv,
    server: Option<RendezvousServer>,
    timeout: Duration,
    make: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    if let Some(s) = &server
        && (env.rank != 0 || s.world_size != env.world_size)
    {
        return Err(boot_err(format!(
            "rank {} of {} was handed a rendezvous server for a world of {}: only rank 0 serves, \
             for its own world",
            env.rank, env.world_size, s.world_size
        )));
    }
    if env.world_size == 1 {
        return make();
    }
    let addrs = env.master_addrs()?;
    if env.rank == 0 {
        // Bind before making the payload, so early peers find the port open sooner.
        let server = match server {
            Some(s) => s,
            None => RendezvousServer::bind(&addrs[..], env.world_size)?,
        };
        let payload = make()?;
        server.serve(&payload, timeout)?;
        Ok(payload)
    } else {
        fetch(&addrs, env.rank, env.world_size, timeout)
    }
}

/// [`exchange`] of an NCCL [`UniqueId`]: rank 0 makes it with `make`, everyone returns it.
pub fn exchange_unique_id(
    env: &LaunchEnv,
    timeout: Duration,
    make: impl FnOnce() -> Result<UniqueId>,
) -> Result<UniqueId> {
    let bytes = exchange(env, timeout, || make().map(|id| id.0.to_vec()))?;
    UniqueId::from_bytes(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_debug_is_short_and_stable() {
        let a = UniqueId([7; 128]);
        assert_eq!(format!("{a:?}"), format!("{:?}", UniqueId([7; 128])));
        assert_ne!(format!("{a:?}"), format!("{:?}", UniqueId([8; 128])));
        assert!(format!("{a:?}").len() < 40);
        assert!(UniqueId::from_bytes(&[0; 127]).is_err());
    }
}
