//! Shared test bodies and helpers, generic over the backend.

use std::fmt::Debug;
use std::sync::{Condvar, Mutex, PoisonError};
use std::thread;
use std::time::Duration;

use half::{bf16, f16};
use zero_comm::host::{HostComm, HostWorld};
use zero_comm::{Communicator, Element, ReduceOp};
use zero_core::Topology;

/// Builds the communicators of one world, indexed by rank.
pub(crate) type Factory<C> = fn(Topology) -> Vec<C>;

/// Timeout for tests that must not time out.
pub(crate) const SAFE_TIMEOUT: Duration = Duration::from_secs(20);

/// Every `(world size, ranks per node)` with at most `max_world` ranks and `max_per_node` ranks
/// per node, the node size dividing the world size; by world size, then node size.
pub(crate) fn layouts(max_world: usize, max_per_node: usize) -> Vec<(usize, usize)> {
    (1..=max_world)
        .flat_map(|n| (1..=n.min(max_per_node)).map(move |l| (n, l)))
        .filter(|(n, l)| n % l == 0)
        .collect()
}

/// A one-shot event that orders ranks in failure tests instead of sleeps: one rank `set`s it when
/// something has happened (its timeout fired, say), the others `wait` for it. A wait gives up
/// after [`SAFE_TIMEOUT`] with a panic, so a broken test fails instead of hanging.
pub(crate) struct Signal {
    set: Mutex<bool>,
    cv: Condvar,
}

impl Signal {
    pub(crate) fn new() -> Self {
        Signal {
            set: Mutex::new(false),
            cv: Condvar::new(),
        }
    }

    pub(crate) fn set(&self) {
        *self.set.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.cv.notify_all();
    }

    /// Waits until [`Signal::set`]; `what` names the event for the panic message.
    #[track_caller]
    pub(crate) fn wait(&self, what: &str) {
        let set = self.set.lock().unwrap_or_else(PoisonError::into_inner);
        let (set, _) = self
            .cv
            .wait_timeout_while(set, SAFE_TIMEOUT, |s| !*s)
            .unwrap_or_else(PoisonError::into_inner);
        assert!(*set, "gave up after {SAFE_TIMEOUT:?} waiting for {what}");
    }
}

pub(crate) fn host_world(topology: Topology) -> Vec<HostComm> {
    HostWorld::new(topology, SAFE_TIMEOUT).into_comms()
}

pub(crate) fn topo(world: usize, per_node: usize) -> Topology {
    Topology::new(world, per_node).unwrap()
}

/// Runs `f` on every rank, one thread each; panics (naming every failed rank) if any rank panicked.
pub(crate) fn run_ranks<C, R, F>(comms: Vec<C>, f: F) -> Vec<R>
where
    C: Communicator,
    R: Send,
    F: Fn(C) -> R + Sync,
{
    let f = &f;
    let results: Vec<thread::Result<R>> = thread::scope(|s| {
        let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(move || f(c))).collect();
        hs.into_iter().map(|h| h.join()).collect()
    });
    let mut failures = Vec::new();
    let mut out = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(v) => out.push(v),
            Err(p) => failures.push(format!("rank {rank}: {}", panic_message(&p))),
        }
    }
    assert!(
        failures.is_empty(),
        "ranks failed:\n{}",
        failures.join("\n")
    );
    out
}

pub(crate) fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "<non-string panic>".into()
    }
}

/// Test-side view of the element types: deterministic values and the reference arithmetic.
pub(crate) trait Val: Element + Debug + PartialEq {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    fn bits(self) -> u32;
    const REDUCIBLE: bool = true;
}

impl Val for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
}

impl Val for bf16 {
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn bits(self) -> u32 {
        u32::from(self.to_bits())
    }
}

impl Val for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn bits(self) -> u32 {
        u32::from(self.to_bits())
    }
}

impl Val for u8 {
    fn from_f32(x: f32) -> Self {
        x as u8
    }
    fn to_f32(self) -> f32 {
        f32::from(self)
    }
    fn bits(self) -> u32 {
        u32::from(self)
    }
    const REDUCIBLE: bool = false;
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Deterministic values for `rank` (salted), of mixed sign and magnitude so that the summation
/// order changes the rounded result; bytes for `u8`.
pub(crate) fn values<E: Val>(rank: usize, len: usize, salt: u64) -> Vec<E> {
    (0..len)
        .map(|i| {
            let h = mix(salt ^ ((rank as u64) << 40) ^ i as u64);
            if !E::REDUCIBLE {
                return E::from_f32((h & 0xff) as f32);
            }
            let mant = 1.0 + (h & 0xffff) as f32 / 65536.0;
            let exp = ((h >> 16) % 9) as i32 - 4;
            let sign = if (h >> 24) & 1 == 1 { -1.0 } else { 1.0 };
            E::from_f32(sign * mant * 2f32.powi(exp))
        })
        .collect()
}

/// The canonical reduction: rank-ordered `f32` sum, divided by `n` for `Mean`, rounded once.
pub(crate) fn reference_reduce<E: Val>(inputs: &[Vec<E>], op: ReduceOp) -> Vec<E> {
    let len = inputs[0].len();
    (0..len)
        .map(|i| {
            let mut acc = inputs[0][i].to_f32();
            for x in &inputs[1..] {
                acc += x[i].to_f32();
            }
            match op {
                ReduceOp::Sum => E::from_f32(acc),
                ReduceOp::Mean => E::from_f32(acc / inputs.len() as f32),
            }
        })
        .collect()
}

#[track_caller]
pub(crate) fn assert_bits<E: Val>(got: &[E], want: &[E], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].bits() != want[i].bits()) {
        panic!(
            "{what}: element {i} is {:?} (bits {:#x}), expected {:?} (bits {:#x})",
            got[i],
            got[i].bits(),
            want[i],
            want[i].bits()
        );
    }
}

fn label<C: Communicator, E: Element>(comm: &C, what: &str) -> String {
    format!(
        "{what} {} rank {}/{}",
        E::DTYPE,
        comm.rank(),
        comm.world_size()
    )
}

// ---------------------------------------------------------------------------------------------
// Test bodies, one per collective. Each runs every length in one launch of the world.

/// All-gather, out of place and in place, for each chunk length in `counts`.
pub(crate) fn check_all_gather<C: Communicator, E: Val>(comms: Vec<C>, counts: &[usize]) {
    run_ranks(comms, |mut comm| all_gather_body::<C, E>(&mut comm, counts));
}

/// Per-rank body of [`check_all_gather`], for use inside sub-groups.
pub(crate) fn all_gather_body<C: Communicator, E: Val>(comm: &mut C, counts: &[usize]) {
    let (n, me) = (comm.world_size(), comm.rank());
    for (t, &c) in counts.iter().enumerate() {
        let salt = t as u64;
        let want: Vec<E> = (0..n).flat_map(|k| values::<E>(k, c, salt)).collect();
        let send = comm.upload(&values::<E>(me, c, salt)).unwrap();
        // Garbage in the output proves every element is written.
        let mut recv = comm.upload(&values::<E>(99, n * c, salt + 1000)).unwrap();
        comm.all_gather(&send, &mut recv).unwrap();
        let what = label::<C, E>(comm, &format!("all_gather c={c}"));
        assert_bits(&comm.download_vec(&recv).unwrap(), &want, &what);
        // The owned-vector form (host buffers: the vector itself is sent).
        let got = comm.all_gather_vec(values::<E>(me, c, salt)).unwrap();
        assert_bits(&got, &want, &format!("{what}, all_gather_vec"));

        let mut buf_host = values::<E>(77 + me, n * c, salt + 2000);
        buf_host[me * c..(me + 1) * c].copy_from_slice(&values::<E>(me, c, salt));
        let mut buf = comm.upload(&buf_host).unwrap();
        comm.all_gather_in_place(&mut buf).unwrap();
        let what = label::<C, E>(comm, &format!("all_gather_in_place c={c}"));
        assert_bits(&comm.download_vec(&buf).unwrap(), &want, &what);
    }
}

/// `upload_into` rewrites an existing buffer in place (lengths 0..=9 cover every tail of a 4-byte
/// word for 1- and 2-byte elements), is ordered after a collective already issued on it, and
/// refuses a length that differs from the buffer's.
pub(crate) fn upload_into_body<C: Communicator, E: Val>(comm: &mut C) {
    let me = comm.rank();
    for len in 0..=9usize {
        let mut buf = comm.upload(&values::<E>(me + 50, len, 1)).unwrap();
        let fresh = values::<E>(me, len, 2);
        comm.upload_into(&fresh, &mut buf).unwrap();
        let what = label::<C, E>(comm, &format!("upload_into len={len}"));
        assert_bits(&comm.download_vec(&buf).unwrap(), &fresh, &what);
        // Reuse after a collective: the write lands after the broadcast, not before it.
        comm.broadcast(&mut buf, 0).unwrap();
        let again = values::<E>(me, len, 3);
        comm.upload_into(&again, &mut buf).unwrap();
        assert_bits(&comm.download_vec(&buf).unwrap(), &again, &what);
    }
    let mut buf = comm.alloc::<E>(4).unwrap();
    assert!(matches!(
        comm.upload_into(&values::<E>(me, 3, 0), &mut buf),
        Err(zero_comm::Error::BufferLength { .. })
    ));
}

/// Reduce-scatter with `op` for each output length in `counts`, bit-exact against the reference.
pub(crate) fn check_reduce_scatter<C: Communicator, E: Val>(
    comms: Vec<C>,
    counts: &[usize],
    op: ReduceOp,
) {
    run_ranks(comms, |mut comm| {
        reduce_scatter_body::<C, E>(&mut comm, counts, op)
    });
}

/// Per-rank body of [`check_reduce_scatter`], for use inside sub-groups.
pub(crate) fn reduce_scatter_body<C: Communicator, E: Val>(
    comm: &mut C,
    counts: &[usize],
    op: ReduceOp,
) {
    let (n, me) = (comm.world_size(), comm.rank());
    for (t, &c) in counts.iter().enumerate() {
        let salt = 10 + t as u64;
        let inputs: Vec<Vec<E>> = (0..n).map(|k| values::<E>(k, n * c, salt)).collect();
        let mine: Vec<Vec<E>> = inputs
            .iter()
            .map(|x| x[me * c..(me + 1) * c].to_vec())
            .collect();
        let want = reference_reduce(&mine, op);
        let send = comm.upload(&inputs[me]).unwrap();
        let mut recv = comm.upload(&values::<E>(99, c, salt)).unwrap();
        comm.reduce_scatter(&send, &mut recv, op).unwrap();
        let what = label::<C, E>(comm, &format!("reduce_scatter {op} c={c}"));
        assert_bits(&comm.download_vec(&recv).unwrap(), &want, &what);
        // The owned-vector form (host buffers: the vector itself is sent).
        let got = comm.reduce_scatter_vec(inputs[me].clone(), op).unwrap();
        assert_bits(&got, &want, &format!("{what}, reduce_scatter_vec"));
    }
}

/// All-reduce with `op` for each length in `lens` (any length), bit-exact against the reference.
pub(crate) fn check_all_reduce<C: Communicator, E: Val>(
    comms: Vec<C>,
    lens: &[usize],
    op: ReduceOp,
) {
    run_ranks(comms, |mut comm| {
        all_reduce_body::<C, E>(&mut comm, lens, op)
    });
}

/// Per-rank body of [`check_all_reduce`], for use inside sub-groups.
pub(crate) fn all_reduce_body<C: Communicator, E: Val>(comm: &mut C, lens: &[usize], op: ReduceOp) {
    let (n, me) = (comm.world_size(), comm.rank());
    for (t, &len) in lens.iter().enumerate() {
        let salt = 20 + t as u64;
        let inputs: Vec<Vec<E>> = (0..n).map(|k| values::<E>(k, len, salt)).collect();
        let want = reference_reduce(&inputs, op);
        let mut buf = comm.upload(&inputs[me]).unwrap();
        comm.all_reduce(&mut buf, op).unwrap();
        let what = label::<C, E>(comm, &format!("all_reduce {op} len={len}"));
        assert_bits(&comm.download_vec(&buf).unwrap(), &want, &what);
        // The owned-vector form (host buffers: reduced in place, no copy).
        let got = comm.all_reduce_vec(inputs[me].clone(), op).unwrap();
        assert_bits(&got, &want, &format!("{what}, all_reduce_vec"));
    }
}

/// All-reduce equals reduce-scatter followed by all-gather, bit for bit, on `n · c` elements.
pub(crate) fn check_all_reduce_is_rs_ag<C: Communicator, E: Val>(
    comms: Vec<C>,
    counts: &[usize],
    op: ReduceOp,
) {
    run_ranks(comms, |mut comm| {
        all_reduce_is_rs_ag_body::<C, E>(&mut comm, counts, op)
    });
}

/// Per-rank body of [`check_all_reduce_is_rs_ag`], for use inside sub-groups.
pub(crate) fn all_reduce_is_rs_ag_body<C: Communicator, E: Val>(
    comm: &mut C,
    counts: &[usize],
    op: ReduceOp,
) {
    let (n, me) = (comm.world_size(), comm.rank());
    for (t, &c) in counts.iter().enumerate() {
        let x = values::<E>(me, n * c, 30 + t as u64);
        let mut ar = comm.upload(&x).unwrap();
        comm.all_reduce(&mut ar, op).unwrap();
        let send = comm.upload(&x).unwrap();
        let mut shard = comm.alloc::<E>(c).unwrap();
        comm.reduce_scatter(&send, &mut shard, op).unwrap();
        let mut full = comm.alloc::<E>(n * c).unwrap();
        comm.all_gather(&shard, &mut full).unwrap();
        let what = label::<C, E>(comm, &format!("all_reduce vs rs+ag {op} c={c}"));
        assert_bits(
            &comm.download_vec(&ar).unwrap(),
            &comm.download_vec(&full).unwrap(),
            &what,
        );
    }
}

/// Broadcast from every root, for each length in `lens`.
pub(crate) fn check_broadcast<C: Communicator, E: Val>(comms: Vec<C>, lens: &[usize]) {
    run_ranks(comms, |mut comm| broadcast_body::<C, E>(&mut comm, lens));
}

/// Per-rank body of [`check_broadcast`], for use inside sub-groups.
pub(crate) fn broadcast_body<C: Communicator, E: Val>(comm: &mut C, lens: &[usize]) {
    let (n, me) = (comm.world_size(), comm.rank());
    for (t, &len) in lens.iter().enumerate() {
        for root in 0..n {
            let salt = 40 + t as u64;
            let mut buf = comm.upload(&values::<E>(me, len, salt)).unwrap();
            comm.broadcast(&mut buf, root).unwrap();
            let what = label::<C, E>(comm, &format!("broadcast root={root} len={len}"));
            assert_bits(
                &comm.download_vec(&buf).unwrap(),
                &values::<E>(root, len, salt),
                &what,
            );
        }
    }
}

/// Equal-split all-to-all with `c` elements per pair, for each `c` in `counts`.
pub(crate) fn check_all_to_all<C: Communicator, E: Val>(comms: Vec<C>, counts: &[usize]) {
    run_ranks(comms, |mut comm| all_to_all_body::<C, E>(&mut comm, counts));
}

/// Per-rank body of [`check_all_to_all`], for use inside sub-groups.
pub(crate) fn all_to_all_body<C: Communicator, E: Val>(comm: &mut C, counts: &[usize]) {
    let (n, me) = (comm.world_size(), comm.rank());
    for (t, &c) in counts.iter().enumerate() {
        let salt = 50 + t as u64;
        let send = comm.upload(&values::<E>(me, n * c, salt)).unwrap();
        let mut recv = comm.upload(&values::<E>(99, n * c, salt)).unwrap();
        comm.all_to_all(&send, &mut recv).unwrap();
        let want: Vec<E> = (0..n)
            .flat_map(|k| values::<E>(k, n * c, salt)[me * c..(me + 1) * c].to_vec())
            .collect();
        let what = label::<C, E>(comm, &format!("all_to_all c={c}"));
        assert_bits(&comm.download_vec(&recv).unwrap(), &want, &what);
    }
}

/// No rank leaves a barrier before every rank entered it.
pub(crate) fn check_barrier<C: Communicator>(comms: Vec<C>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let entered = AtomicUsize::new(0);
    let n = comms.len();
    run_ranks(comms, |mut comm| {
        for round in 1..=5 {
            if comm.rank() == round % n {
                thread::sleep(Duration::from_millis(5));
            }
            entered.fetch_add(1, Ordering::SeqCst);
            comm.barrier().unwrap();
            assert!(
                entered.load(Ordering::SeqCst) >= round * n,
                "left barrier {round} early"
            );
            comm.barrier().unwrap();
        }
    });
}

/// Runs every collective (several lengths and dtypes) on `comm` and checks after each call that the
/// measured traffic equals zero-core's `GroupView` formula, accumulated.
pub(crate) fn exercise_and_check_traffic<C: Communicator>(comm: &mut C) {
    use zero_core::{Collective, TrafficTable};
    let mut expected = TrafficTable::new();
    let n = comm.world_size();
    let me = comm.rank();
    for c in [0usize, 1, 5, 33] {
        // all-gather, f32 and u8, out of place and in place
        let s = comm.upload(&values::<f32>(me, c, 1)).unwrap();
        let mut r = comm.alloc::<f32>(n * c).unwrap();
        comm.all_gather(&s, &mut r).unwrap();
        expected.record(
            Collective::AllGather,
            comm.group_view().all_gather(c as u64, 4),
        );
        assert_eq!(comm.traffic(), &expected, "all_gather c={c}");
        let mut b = comm.alloc::<u8>(n * c).unwrap();
        comm.all_gather_in_place(&mut b).unwrap();
        expected.record(
            Collective::AllGather,
            comm.group_view().all_gather(c as u64, 1),
        );
        assert_eq!(comm.traffic(), &expected, "all_gather_in_place c={c}");

        // reduce-scatter, bf16
        let s = comm.upload(&values::<bf16>(me, n * c, 2)).unwrap();
        let mut r = comm.alloc::<bf16>(c).unwrap();
        comm.reduce_scatter(&s, &mut r, ReduceOp::Mean).unwrap();
        expected.record(
            Collective::ReduceScatter,
            comm.group_view().reduce_scatter(c as u64, 2),
        );
        assert_eq!(comm.traffic(), &expected, "reduce_scatter c={c}");

        // all-to-all, f16
        let s = comm.upload(&values::<f16>(me, n * c, 3)).unwrap();
        let mut r = comm.alloc::<f16>(n * c).unwrap();
        comm.all_to_all(&s, &mut r).unwrap();
        expected.record(
            Collective::AllToAll,
            comm.group_view().all_to_all((n * c) as u64, 2),
        );
        assert_eq!(comm.traffic(), &expected, "all_to_all c={c}");
    }
    for len in [0usize, 1, 7, 19, 64] {
        let mut b = comm.upload(&values::<f32>(me, len, 4)).unwrap();
        comm.all_reduce(&mut b, ReduceOp::Sum).unwrap();
        expected.record(
            Collective::AllReduce,
            comm.group_view().all_reduce(len as u64, 4),
        );
        assert_eq!(comm.traffic(), &expected, "all_reduce len={len}");
        for root in 0..n {
            let mut b = comm.upload(&values::<bf16>(me, len, 5)).unwrap();
            comm.broadcast(&mut b, root).unwrap();
            expected.record(
                Collective::Broadcast,
                comm.group_view().broadcast(len as u64, 2, root),
            );
            assert_eq!(comm.traffic(), &expected, "broadcast len={len} root={root}");
        }
    }
    comm.barrier().unwrap();
    expected.record(Collective::Barrier, comm.group_view().barrier());
    assert_eq!(comm.traffic(), &expected, "barrier");
}
