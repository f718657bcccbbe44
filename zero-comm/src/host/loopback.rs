//! The communicator plumbing the loopback backends (host and wgpu) share around the rendezvous:
//! launching one thread per rank, `Debug`, leaving on drop, the arrival prologue of every op,
//! `split`, and traffic accounting. Error messages name the backend ([`Loopback::NAME`]).

use std::fmt;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use zero_core::TrafficTable;

use super::rendezvous::{Call, Payload, Published, World, check};
use crate::communicator::Communicator;
use crate::error::{Error, Op, Result};
use crate::validate::Desc;

/// Runs `f` once per communicator, each on its own scoped thread named `rank-<k>`, and returns each
/// rank's result in rank order (a rank that panics yields `Err` with its panic payload).
pub(crate) fn launch<C, R, F>(comms: Vec<C>, f: F) -> Vec<thread::Result<R>>
where
    C: Communicator,
    R: Send,
    F: Fn(C) -> R + Sync,
{
    let f = &f;
    thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let name = format!("rank-{}", comm.global_rank());
                thread::Builder::new()
                    .name(name)
                    .spawn_scoped(s, move || f(comm))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h.join(),
                Err(e) => Err(Box::new(e) as Box<dyn std::any::Any + Send>),
            })
            .collect()
    })
}

/// The [`Loopback`] accessors of a communicator with fields `group`, `timeout`, `aborted` and
/// `traffic`, its world's rendezvous at the field path given.
macro_rules! loopback_fields {
    ($($world:ident).+) => {
        fn world(&self) -> &Arc<World> {
            &self.$($world).+
        }

        fn group(&self) -> usize {
            self.group
        }

        fn wait(&self) -> Duration {
            self.timeout
        }

        fn aborted(&self) -> Option<&String> {
            self.aborted.as_ref()
        }

        fn traffic_mut(&mut self) -> &mut TrafficTable {
            &mut self.traffic
        }
    };
}
pub(crate) use loopback_fields;

/// One rank of a loopback group, as the shared plumbing sees it.
pub(crate) trait Loopback: Communicator {
    /// The backend's name in error messages, e.g. `"host loopback"`.
    const NAME: &'static str;

    /// The rendezvous of this rank's world.
    fn world(&self) -> &Arc<World>;

    /// This communicator's group in the rendezvous.
    fn group(&self) -> usize;

    /// The timeout every wait uses.
    fn wait(&self) -> Duration;

    /// Why this communicator was aborted, if it was.
    fn aborted(&self) -> Option<&String>;

    /// The traffic table ops record into.
    fn traffic_mut(&mut self) -> &mut TrafficTable;

    /// Turns a rendezvous error into this backend's.
    fn translate(&self, e: Error) -> Error {
        e
    }

    /// The body of `Debug::fmt`.
    fn fmt_comm(&self, f: &mut fmt::Formatter<'_>, name: &str) -> fmt::Result {
        f.debug_struct(name)
            .field("rank", &self.rank())
            .field("world_size", &self.members().len())
            .field("global_rank", &self.global_rank())
            .field("members", &self.members())
            .field("timeout", &self.wait())
            .finish_non_exhaustive()
    }

    /// The body of `Drop::drop`: leaves the group (failing the world if panicking).
    fn leave(&self) {
        self.world()
            .leave(self.group(), self.global_rank(), thread::panicking());
    }

    /// Fails fast if this communicator or its world was aborted or failed.
    fn check_aborted(&self, op: Op) -> Result<()> {
        match self.aborted() {
            Some(cause) => Err(Error::Aborted {
                op,
                rank: self.global_rank(),
                cause: cause.clone(),
            }),
            None => self
                .world()
                .check(self.group(), op, self.global_rank())
                .map_err(|e| self.translate(e)),
        }
    }

    /// Posts `call` at the arrival barrier.
    fn arrive(&self, call: Call) -> Result<Arc<Published>> {
        self.world()
            .arrive(
                self.group(),
                self.rank(),
                call.desc.op,
                Payload::Call(call),
                self.wait(),
            )
            .map_err(|e| self.translate(e))
    }

    /// The call descriptors every rank posted.
    fn calls(&self, op: Op, published: &Published) -> Result<Vec<Call>> {
        published
            .payloads
            .iter()
            .map(|p| match p {
                Payload::Call(c) => Ok(*c),
                _ => Err(Error::Backend(format!(
                    "{}: {op} on rank {} found a peer at another barrier",
                    Self::NAME,
                    self.global_rank()
                ))),
            })
            .collect()
    }

    /// The prologue of every op: abort check, arrival barrier, identical validation on every rank.
    fn open(&self, call: Call) -> Result<(Arc<Published>, Vec<Call>)> {
        let op = call.desc.op;
        self.check_aborted(op)?;
        let published = self.arrive(call)?;
        let calls = self.calls(op, &published)?;
        check(&calls, self.members())?;
        Ok((published, calls))
    }

    /// Records the traffic of an op that ended with `last`, `reads[j]` elements read from group
    /// rank `j`.
    fn account(&mut self, op: Op, last: &Published, elem_bytes: usize, reads: &[u64]) {
        let t = last.traffic(
            &self.world().topology,
            self.members(),
            self.rank(),
            elem_bytes,
            reads,
        );
        if let Some(c) = op.collective() {
            self.traffic_mut().record(c, t);
        }
    }

    /// The rendezvous part of `split`: the new group, its members and this rank's place in it.
    fn split_group(&self, color: usize, key: usize) -> Result<(usize, Arc<[usize]>, usize)> {
        let (published, _) = self.open(Call::from(Desc {
            color,
            key,
            ..Desc::new(Op::Split)
        }))?;
        let group = published
            .split_groups
            .iter()
            .find(|&&(c, _)| c == color)
            .map(|&(_, g)| g)
            .ok_or_else(|| {
                Error::Backend(format!(
                    "{}: split lost the group of color {color}",
                    Self::NAME
                ))
            })?;
        let members = self.world().members(group);
        let me = self.global_rank();
        let rank = members.iter().position(|&g| g == me).ok_or_else(|| {
            Error::Backend(format!(
                "{}: rank {me} missing from its split group",
                Self::NAME
            ))
        })?;
        Ok((group, members, rank))
    }
}
