//! Where a rank's collectives run during a micro-step: inline on the rank's thread, or on a
//! communication thread of its own that overlaps them with the forward and backward compute
//! (`overlap_comm`, DeepSpeed's side stream).
//!
//! The trainer submits [`Job`]s and takes their results back in submission order (FIFO), so
//! every rank issues the same collectives in the same order in both modes, and the reductions
//! see the same operands: overlapping changes when the bytes move, never the bits. Inline, a
//! job runs when it is submitted and its result waits in a queue, which makes the inline mode
//! the synchronous trainer exactly.
//!
//! The communication thread borrows the rank's communicators for the micro-step. It stops at the
//! first failed job (the rank's compute side returns that error when it reaches it); a panic in a
//! communicator is re-raised on the rank's thread.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread;

use zero_comm::Communicator;
use zero_comm::quantized::{QuantGroups, QuantScratch};
use zero_core::Plan;
use zero_quant::{Int4Block, Int8Block};

use crate::device::DeviceQuant;
use crate::error::{Error, Result};

mod jobs;

pub(crate) use jobs::{Elems, Job, Out, Wire};

/// A rank's communicators and the ZeRO++ codecs with their scratch space.
#[derive(Debug)]
pub(crate) struct Comms<C: Communicator> {
    /// The whole world.
    pub(crate) world: C,
    /// hpZ: the rank's secondary-shard group (its node, or `hpz_partition_size` ranks).
    pub(crate) hpz: Option<C>,
    /// qgZ's intra- and cross-node groups.
    pub(crate) qgroups: Option<QuantGroups<C>>,
    /// qwZ codec.
    pub(crate) qwz: Option<Int8Block>,
    /// qgZ codec.
    pub(crate) qgz: Option<Int4Block>,
    /// qwZ/qgZ codecs on the communicator's memory, for the device jobs.
    pub(crate) quant: Option<Arc<dyn DeviceQuant<C>>>,
    /// qwZ's wire buffers.
    pub(crate) qwz_scratch: QuantScratch,
    /// qgZ's wire buffers and accumulators (apart from qwZ's, as the plan counts them).
    pub(crate) qgz_scratch: QuantScratch,
}

impl<C: Communicator> Comms<C> {
    /// The communicators and codecs `plan` asks of rank `world.rank()`: the hpZ group, qgZ's
    /// groups (collectives: every rank builds its own at the same point), the ZeRO++ codecs.
    pub(crate) fn new(mut world: C, plan: &Plan) -> Result<Self> {
        let c = plan.config();
        let rank = world.rank();
        let hpz = if c.hpz() {
            let h = c.hpz_partition_size;
            Some(world.split(rank / h, rank)?)
        } else {
            None
        };
        let qgroups = if c.quantized_gradients {
            Some(QuantGroups::new(&mut world)?)
        } else {
            None
        };
        let qwz = if c.quantized_weights {
            Some(Int8Block::new(c.qwz_block_size)?)
        } else {
            None
        };
        let qgz = if c.quantized_gradients {
            Some(Int4Block::new(c.qgz_block_size)?)
        } else {
            None
        };
        Ok(Comms {
            world,
            hpz,
            qgroups,
            qwz,
            qgz,
            quant: None,
            qwz_scratch: QuantScratch::new(),
            qgz_scratch: QuantScratch::new(),
        })
    }
}

/// Runs a micro-step's collectives (see the module docs), each submitted with a ticket of the
/// caller's that says what to do with its result: the executor owns what is in flight, and
/// borrows the rank's communicators for as long as it lives.
pub(crate) struct Exec<'a, C: Communicator, T> {
    mode: Mode<'a, C, T>,
    /// Whether the communicators have [`DeviceQuant`] codecs (so qwZ/qgZ stay on the device).
    device_quant: bool,
}

/// Where the collectives run, and what is in flight, oldest first.
enum Mode<'a, C: Communicator, T> {
    /// On the rank's thread, each when submitted: its result waits with its ticket.
    Inline {
        comms: &'a mut Comms<C>,
        done: VecDeque<(T, Result<Out<C>>)>,
    },
    /// On the communication thread: the tickets wait for the results it sends back in order.
    Thread {
        rank: usize,
        jobs: Sender<Job<C>>,
        results: Receiver<Result<Out<C>>>,
        tickets: VecDeque<T>,
    },
}

impl<'a, C: Communicator, T> Exec<'a, C, T> {
    fn new(mode: Mode<'a, C, T>, device_quant: bool) -> Self {
        Exec { mode, device_quant }
    }

    /// Whether the communicators have [`DeviceQuant`] codecs, so qwZ and qgZ can run on
    /// tensors kept in the communicator's memory.
    pub(crate) fn device_quant(&self) -> bool {
        self.device_quant
    }

    /// Submits a collective with its ticket; both come back from [`Self::next`] after those
    /// submitted before them.
    pub(crate) fn submit(&mut self, job: Job<C>, ticket: T) -> Result<()> {
        match &mut self.mode {
            Mode::Inline { comms, done } => done.push_back((ticket, comms.run(job))),
            Mode::Thread {
                rank,
                jobs,
                tickets,
                ..
            } => {
                jobs.send(job).map_err(|_| stopped(*rank))?;
                tickets.push_back(ticket);
            }
        }
        Ok(())
    }

    /// The oldest collective in flight, waited for, with its ticket; `None` when none is.
    pub(crate) fn next(&mut self) -> Result<Option<(T, Out<C>)>> {
        match &mut self.mode {
            Mode::Inline { done, .. } => match done.pop_front() {
                Some((ticket, out)) => Ok(Some((ticket, out?))),
                None => Ok(None),
            },
            Mode::Thread {
                rank,
                results,
                tickets,
                ..
            } => match tickets.pop_front() {
                Some(ticket) => {
                    let out = results.recv().map_err(|_| stopped(*rank))??;
                    Ok(Some((ticket, out)))
                }
                None => Ok(None),
            },
        }
    }

    /// The tickets in flight, oldest first.
    pub(crate) fn in_flight(&self) -> impl Iterator<Item = &T> {
        let (inline, thread) = match &self.mode {
            Mode::Inline { done, .. } => (Some(done.iter().map(|(t, _)| t)), None),
            Mode::Thread { tickets, .. } => (None, Some(tickets.iter())),
        };
        inline
            .into_iter()
            .flatten()
            .chain(thread.into_iter().flatten())
    }
}

fn stopped(rank: usize) -> Error {
    // The results channel closes only when the thread ends, and it ends early only by panicking.
    Error::RankPanicked {
        rank,
        message: "its communication thread stopped before its collectives were done".into(),
    }
}

/// Runs `f` with an executor over `comms`: inline, or (`overlap`) on a communication thread for
/// the duration of `f`.
pub(crate) fn with_exec<C: Communicator, T, R>(
    comms: &mut Comms<C>,
    overlap: bool,
    rank: usize,
    f: impl FnOnce(&mut Exec<'_, C, T>) -> R,
) -> R {
    if !overlap {
        return inline(comms, f);
    }
    let device_quant = comms.quant.is_some();
    thread::scope(|s| {
        // The communicators travel to the worker once it runs, so a failed spawn keeps them.
        let (comms_tx, comms_rx) = channel::<&mut Comms<C>>();
        let (job_tx, job_rx) = channel::<Job<C>>();
        let (res_tx, res_rx) = channel::<Result<Out<C>>>();
        let worker = thread::Builder::new()
            .name(format!("zero-comm-rank{rank}"))
            .spawn_scoped(s, move || {
                let Ok(comms) = comms_rx.recv() else { return };
                for job in job_rx {
                    let r = comms.run(job);
                    let failed = r.is_err();
                    // Stop at the first failure: later collectives would only wait for peers
                    // that have already given up; the rank's thread reports this error.
                    if res_tx.send(r).is_err() || failed {
                        break;
                    }
                }
            });
        let Ok(worker) = worker else {
            // No thread to overlap on: the same collectives, inline.
            return inline(comms, f);
        };
        if let Err(back) = comms_tx.send(comms) {
            // The worker is gone before its first job (it cannot be, short of a panic in the
            // channel): the same collectives, inline.
            return inline(back.0, f);
        }
        let mut exec = Exec::new(
            Mode::Thread {
                rank,
                jobs: job_tx,
                results: res_rx,
                tickets: VecDeque::new(),
            },
            device_quant,
        );
        let r = f(&mut exec);
        // Closing the job channel ends the worker once it has finished what it holds.
        drop(exec);
        if let Err(panic) = worker.join() {
            std::panic::resume_unwind(panic);
        }
        r
    })
}

/// Runs `f` with an executor that runs each collective on the rank's thread when submitted.
fn inline<C: Communicator, T, R>(
    comms: &mut Comms<C>,
    f: impl FnOnce(&mut Exec<'_, C, T>) -> R,
) -> R {
    let device_quant = comms.quant.is_some();
    let done = VecDeque::new();
    f(&mut Exec::new(Mode::Inline { comms, done }, device_quant))
}

#[cfg(test)]
mod tests;
