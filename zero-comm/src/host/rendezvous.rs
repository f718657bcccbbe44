//! The rendezvous shared by every rank of a host world: one mutex, one condvar, a phase counter per
//! group.
//!
//! # Protocol
//!
//! A collective is a sequence of *barriers* on its group. At each barrier every member posts a
//! [`Payload`] into its slot; the last one to arrive moves the slots into a fresh, immutable
//! [`Published`] snapshot, advances the group's phase and wakes everyone. A waiter that sees the
//! phase advance takes the snapshot. The snapshot of phase `p` is only replaced when barrier `p+1`
//! completes, which needs every member to arrive again, so no member can miss it.
//!
//! There are two kinds of wait:
//!
//! - [`Wait::Arrival`], the first barrier of an op (its payload carries the call descriptor and
//!   pointers to the caller's memory). It gives up on a world failure, on a group member that left,
//!   or after the timeout, in which case it poisons the world. Giving up is safe because no peer
//!   can have seen this rank's pointers: they are published only when the barrier completes, and a
//!   barrier that one member gave up on can never complete (every later arrival sees the failure
//!   first).
//! - [`Wait::Drain`], every later barrier of an op. Between the arrival barrier and the last drain
//!   barrier, peers read this rank's memory, so a drain wait never gives up: it returns only when
//!   every member has arrived. That cannot hang, because between those barriers a member runs only
//!   this crate's copy loops, which neither block nor fail; if one panicked anyway, its
//!   `DrainGuard` still arrives at the remaining barriers while unwinding.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use zero_core::{CollectiveTraffic, Topology};

use crate::error::{Error, FailureReason, Op};
use crate::validate::{Desc, tally, validate};

/// A raw pointer to a rank's memory, posted for its peers to read.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawPtr(pub(crate) *const u8);

// SAFETY: a `RawPtr` is only an address while it sits in the shared state. It is dereferenced only
// by the copy code of a collective, between that collective's arrival barrier and its last drain
// barrier, a window during which its owner is blocked inside the same collective and keeps the
// memory alive and unmodified in the ranges peers read (see `host::HostComm::run`).
unsafe impl Send for RawPtr {}
// SAFETY: as above; sharing the address between threads is what the protocol is for.
unsafe impl Sync for RawPtr {}

impl RawPtr {
    pub(crate) const NULL: RawPtr = RawPtr(std::ptr::null());
}

/// What one rank posts at the arrival barrier of an op: its call descriptor and the base of the
/// memory peers read.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Call {
    pub(crate) desc: Desc,
    pub(crate) src: RawPtr,
}

impl Call {
    pub(crate) fn new(desc: Desc, src: RawPtr) -> Self {
        Call { desc, src }
    }
}

impl From<Desc> for Call {
    fn from(desc: Desc) -> Self {
        Call::new(desc, RawPtr::NULL)
    }
}

/// A slot's content at one barrier.
#[derive(Clone, Debug, Default)]
pub(crate) enum Payload {
    /// Nothing (intermediate drain barriers, or a rank unwinding).
    #[default]
    Empty,
    /// The arrival descriptor.
    Call(Call),
    /// At the last drain barrier: elements this rank read from each group member.
    Read(Vec<u64>),
}

/// The immutable result of one completed barrier.
#[derive(Debug, Default)]
pub(crate) struct Published {
    pub(crate) payloads: Vec<Payload>,
    /// For a completed split: `(color, group id)` of each new group, by color.
    pub(crate) split_groups: Vec<(usize, usize)>,
}

impl Published {
    /// The traffic of an op whose last drain barrier this is, measured from the elements read:
    /// this rank (group rank `me` of `members`) read `reads[j]` elements from group rank `j`, and
    /// each peer reported at this barrier what it read from us.
    pub(crate) fn traffic(
        &self,
        topology: &Topology,
        members: &[usize],
        me: usize,
        elem_bytes: usize,
        reads: &[u64],
    ) -> CollectiveTraffic {
        tally(topology, members, me, elem_bytes, reads, |j| {
            match &self.payloads[j] {
                Payload::Read(theirs) => theirs[me],
                _ => 0,
            }
        })
    }
}

/// Runs, on every rank alike, the checks of [`validate`] over the descriptors every member of a
/// group (global ranks `members`) posted at an op's arrival barrier.
pub(crate) fn check(calls: &[Call], members: &[usize]) -> Result<(), Error> {
    let descs: Vec<Desc> = calls.iter().map(|c| c.desc).collect();
    validate(&descs, members, members.len())
}

enum Wait {
    Arrival { timeout: Duration },
    Drain,
}

#[derive(Debug)]
enum WorldFailure {
    Rank {
        rank: usize,
        reason: FailureReason,
    },
    Timeout {
        group: usize,
        phase: u64,
        op: Op,
        rank: usize,
        missing: Vec<usize>,
    },
}

#[derive(Debug)]
struct GroupState {
    members: Arc<[usize]>,
    phase: u64,
    arrived: Vec<bool>,
    count: usize,
    slots: Vec<Payload>,
    published: Arc<Published>,
    /// A member (global rank) that dropped its communicator of this group.
    left: Option<usize>,
    /// Members whose communicator of this group is still alive.
    live: usize,
}

impl GroupState {
    fn new(members: Arc<[usize]>) -> Self {
        let n = members.len();
        GroupState {
            members,
            phase: 0,
            arrived: vec![false; n],
            count: 0,
            slots: vec![Payload::Empty; n],
            published: Arc::default(),
            left: None,
            live: n,
        }
    }
}

#[derive(Debug)]
struct WorldState {
    failure: Option<WorldFailure>,
    /// Indexed by group id. A split group whose members have all dropped their communicators is
    /// emptied and its id put on `free`, where the next split reuses it, so a program that splits
    /// in a loop keeps a bounded table.
    groups: Vec<GroupState>,
    free: Vec<usize>,
}

/// Shared state of one host world (the root communicator and everything split from it).
#[derive(Debug)]
pub(crate) struct World {
    pub(crate) topology: Topology,
    state: Mutex<WorldState>,
    cv: Condvar,
}

/// Group id of the root group.
pub(crate) const ROOT_GROUP: usize = 0;

impl World {
    pub(crate) fn new(topology: Topology) -> Arc<World> {
        let members: Arc<[usize]> = (0..topology.world_size()).collect();
        Arc::new(World {
            topology,
            state: Mutex::new(WorldState {
                failure: None,
                groups: vec![GroupState::new(members)],
                free: Vec::new(),
            }),
            cv: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, WorldState> {
        // Nothing panics while holding the lock; if something did, the state is still consistent
        // at every unlock point, so keep going rather than cascade panics through every rank.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Group ids in use and freed (for tests of the free list).
    #[cfg(test)]
    pub(crate) fn group_table(&self) -> (usize, usize) {
        let st = self.lock();
        (st.groups.len(), st.free.len())
    }

    pub(crate) fn members(&self, group: usize) -> Arc<[usize]> {
        self.lock().groups[group].members.clone()
    }

    /// Records that `global_rank` dropped its communicator of `group`, or, when its thread is
    /// panicking, that it failed (which fails the whole world). Wakes every waiter.
    pub(crate) fn leave(&self, group: usize, global_rank: usize, panicking: bool) {
        let mut st = self.lock();
        if panicking {
            if st.failure.is_none() {
                st.failure = Some(WorldFailure::Rank {
                    rank: global_rank,
                    reason: FailureReason::Panicked,
                });
            }
        } else {
            let g = &mut st.groups[group];
            if g.left.is_none() {
                g.left = Some(global_rank);
            }
            g.live = g.live.saturating_sub(1);
            if g.live == 0 && group != ROOT_GROUP {
                // Nobody can reach this group any more: free its state, keep the id for reuse.
                st.groups[group] = GroupState::new(Arc::from([]));
                st.free.push(group);
            }
        }
        drop(st);
        self.cv.notify_all();
    }

    /// The error a rank of `group` gets when the world or group has failed, if it has.
    /// `waiting` is `(phase, waited)` when the rank is waiting at an arrival barrier.
    fn failure(
        st: &WorldState,
        group: usize,
        op: Op,
        me: usize,
        waiting: Option<(u64, Duration)>,
    ) -> Option<Error> {
        match &st.failure {
            Some(WorldFailure::Rank { rank, reason }) => {
                return Some(Error::PeerFailed {
                    op,
                    rank: me,
                    failed_rank: *rank,
                    reason: reason.clone(),
                });
            }
            Some(WorldFailure::Timeout {
                group: g,
                phase,
                op: t_op,
                rank,
                missing,
            }) => {
                return Some(match waiting {
                    Some((p, waited)) if *g == group && p == *phase => Error::Timeout {
                        op,
                        rank: me,
                        waited,
                        missing: missing.clone(),
                    },
                    _ => Error::Aborted {
                        op,
                        rank: me,
                        cause: format!(
                            "{t_op} on rank {rank} timed out waiting for ranks {missing:?}"
                        ),
                    },
                });
            }
            None => {}
        }
        st.groups[group].left.map(|failed_rank| Error::PeerFailed {
            op,
            rank: me,
            failed_rank,
            reason: FailureReason::Dropped,
        })
    }

    /// Fails fast if the world or group has failed.
    pub(crate) fn check(&self, group: usize, op: Op, me_global: usize) -> Result<(), Error> {
        match Self::failure(&self.lock(), group, op, me_global, None) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The arrival barrier of an op; see the module docs.
    pub(crate) fn arrive(
        &self,
        group: usize,
        me: usize,
        op: Op,
        payload: Payload,
        timeout: Duration,
    ) -> Result<Arc<Published>, Error> {
        self.sync(group, me, op, payload, Wait::Arrival { timeout })
    }

    /// A drain barrier of an op; never gives up (see the module docs).
    pub(crate) fn drain(
        &self,
        group: usize,
        me: usize,
        op: Op,
        payload: Payload,
    ) -> Arc<Published> {
        match self.sync(group, me, op, payload, Wait::Drain) {
            Ok(p) => p,
            Err(e) => unreachable!("a drain barrier returned {e}"),
        }
    }

    /// One barrier of `group`: posts `payload` in slot `me` (a group rank) and waits for every
    /// member. Returns the published snapshot.
    fn sync(
        &self,
        group: usize,
        me: usize,
        op: Op,
        payload: Payload,
        wait: Wait,
    ) -> Result<Arc<Published>, Error> {
        let mut st = self.lock();
        let me_global = st.groups[group].members[me];
        if let Wait::Arrival { .. } = wait
            && let Some(e) = Self::failure(&st, group, op, me_global, None)
        {
            return Err(e);
        }
        let g = &mut st.groups[group];
        debug_assert!(!g.arrived[me], "rank {me} arrived twice at one barrier");
        let my_phase = g.phase;
        g.slots[me] = payload;
        g.arrived[me] = true;
        g.count += 1;
        if g.count == g.members.len() {
            let published = Self::complete(&mut st, group);
            drop(st);
            self.cv.notify_all();
            return Ok(published);
        }
        let start = Instant::now();
        loop {
            let g = &st.groups[group];
            if g.phase != my_phase {
                return Ok(g.published.clone());
            }
            match wait {
                Wait::Drain => {
                    st = self.cv.wait(st).unwrap_or_else(PoisonError::into_inner);
                }
                Wait::Arrival { timeout } => {
                    let waited = start.elapsed();
                    if let Some(e) =
                        Self::failure(&st, group, op, me_global, Some((my_phase, waited)))
                    {
                        return Err(e);
                    }
                    if waited >= timeout {
                        let g = &st.groups[group];
                        let missing: Vec<usize> = (0..g.members.len())
                            .filter(|&k| !g.arrived[k])
                            .map(|k| g.members[k])
                            .collect();
                        st.failure = Some(WorldFailure::Timeout {
                            group,
                            phase: my_phase,
                            op,
                            rank: me_global,
                            missing: missing.clone(),
                        });
                        drop(st);
                        self.cv.notify_all();
                        return Err(Error::Timeout {
                            op,
                            rank: me_global,
                            waited,
                            missing,
                        });
                    }
                    st = self
                        .cv
                        .wait_timeout(st, timeout - waited)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            }
        }
    }

    /// Completes the current barrier of `group` (every member has arrived).
    fn complete(st: &mut WorldState, group: usize) -> Arc<Published> {
        let g = &mut st.groups[group];
        let n = g.members.len();
        let payloads = std::mem::replace(&mut g.slots, vec![Payload::Empty; n]);
        g.arrived.fill(false);
        g.count = 0;
        g.phase += 1;
        // A split creates its groups here, once, so every member finds the same ids.
        let calls: Option<Vec<&Desc>> = payloads
            .iter()
            .map(|p| match p {
                Payload::Call(c) if c.desc.op == Op::Split => Some(&c.desc),
                _ => None,
            })
            .collect();
        let mut split_groups = Vec::new();
        if let Some(calls) = calls {
            let parent = g.members.clone();
            let mut colors: Vec<usize> = calls.iter().map(|c| c.color).collect();
            colors.sort_unstable();
            colors.dedup();
            for color in colors {
                let mut ranks: Vec<usize> = (0..n).filter(|&k| calls[k].color == color).collect();
                ranks.sort_by_key(|&k| (calls[k].key, k));
                let members: Arc<[usize]> = ranks.iter().map(|&k| parent[k]).collect();
                let id = match st.free.pop() {
                    Some(id) => {
                        st.groups[id] = GroupState::new(members);
                        id
                    }
                    None => {
                        st.groups.push(GroupState::new(members));
                        st.groups.len() - 1
                    }
                };
                split_groups.push((color, id));
            }
        }
        let published = Arc::new(Published {
            payloads,
            split_groups,
        });
        st.groups[group].published = published.clone();
        published
    }
}

/// While armed, arrives at the remaining drain barriers of an op if the op unwinds between its
/// arrival and its last barrier, so peers reading this rank's memory (or recording commands from
/// its buffers) finish before it goes away, and no peer waits forever.
pub(crate) struct DrainGuard<'a> {
    world: &'a World,
    group: usize,
    rank: usize,
    op: Op,
    remaining: usize,
}

impl<'a> DrainGuard<'a> {
    /// Armed for the `steps` drain barriers of `op` by group rank `rank` of `group`.
    pub(crate) fn new(world: &'a World, group: usize, rank: usize, op: Op, steps: usize) -> Self {
        DrainGuard {
            world,
            group,
            rank,
            op,
            remaining: steps,
        }
    }

    /// Runs the op's steps after its arrival barrier published `published`: each step runs
    /// `work(step, reads)`, then waits at its drain barrier; the last one publishes `reads`.
    /// Returns the last barrier's snapshot.
    pub(crate) fn run(
        mut self,
        published: Arc<Published>,
        reads: &mut [u64],
        mut work: impl FnMut(usize, &mut [u64]),
    ) -> Arc<Published> {
        let steps = self.remaining;
        let mut last = published;
        for step in 0..steps {
            work(step, reads);
            let payload = if step + 1 == steps {
                Payload::Read(reads.to_vec())
            } else {
                Payload::Empty
            };
            self.remaining -= 1;
            last = self.world.drain(self.group, self.rank, self.op, payload);
        }
        last
    }
}

impl Drop for DrainGuard<'_> {
    fn drop(&mut self) {
        for _ in 0..self.remaining {
            self.world
                .drain(self.group, self.rank, self.op, Payload::Empty);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use zero_core::Topology;

    use crate::Communicator;
    use crate::host::HostWorld;
    use crate::host::loopback::Loopback;

    #[test]
    fn dropped_split_groups_are_freed_and_their_ids_reused() {
        let topo = Topology::new(4, 2).unwrap();
        let res = HostWorld::new(topo, Duration::from_secs(20)).launch(|mut comm| {
            for round in 0..50 {
                let mut sub = comm.split(comm.rank() % 2, round).unwrap();
                sub.barrier().unwrap();
                drop(sub);
                // Every rank dropped its sub-communicator before anyone splits again.
                comm.barrier().unwrap();
            }
            comm.world().group_table()
        });
        for r in res {
            // The root group plus the two colours' groups, both freed again; 101 without reuse.
            assert_eq!(r.unwrap(), (3, 2));
        }
    }
}
