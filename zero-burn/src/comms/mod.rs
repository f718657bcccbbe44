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

use burn::tensor::{bf16, f16};
use zero_comm::quantized::{
    QuantGroups, QuantScratch, qgz_reduce_scatter, qgz_reduce_scatter_device, qwz_all_gather,
    qwz_all_gather_device,
};
use zero_comm::{Communicator, Element, ReduceOp};
use zero_core::Plan;
use zero_quant::{Int4Block, Int8Block};

use crate::device::{DeviceQuant, WordBuffer};
use crate::error::{Error, Result};
use crate::precision::Half;

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

/// Elements in flight: f32, or 16-bit (bit patterns of their [`Half`] type), in host memory; or
/// in the communicator's memory: f32 (`B`, its f32 buffer type), or 16-bit words (`Y`, a
/// [`WordBuffer`]).
#[derive(Debug)]
pub(crate) enum Elems<B, Y> {
    F32(Vec<f32>),
    U16(Half, Vec<u16>),
    Device(B),
    DeviceWords(Y),
}

/// A job's result on communicator `C`.
pub(crate) type Out<C> = Elems<<C as Communicator>::Buffer<f32>, WordBuffer<C>>;

/// One collective.
pub(crate) enum Job<C: Communicator> {
    /// All-reduce a whole unit (stage 0); the result is the reduced unit.
    AllReduce { data: Out<C>, op: ReduceOp },
    /// Reduce-scatter a unit; the result is the rank's reduced chunk. `qgz`: through qgZ's
    /// hierarchical int4 all-to-all.
    ReduceScatter {
        data: Out<C>,
        op: ReduceOp,
        qgz: bool,
    },
    /// All-gather a unit from this rank's `piece`; `hpz`: within the hpZ group (from the
    /// secondary shard). qwZ applies when it is on.
    Gather { piece: Out<C>, hpz: bool },
    /// [`Job::Gather`] of an fp32 `piece` (in host memory, or already in the communicator's),
    /// leaving the unit in the communicator's memory (for a
    /// [`DeviceTensors`](crate::device::DeviceTensors) hook to install); `qwz`: through qwZ
    /// when it is on (with the [`DeviceQuant`] codecs), else plain (the post-step gathers).
    /// A piece of 16-bit words in the communicator's memory is gathered plain.
    GatherDevice { piece: Out<C>, hpz: bool, qwz: bool },
    /// [`Job::AllReduce`] of an f32 unit already in the communicator's memory (packed there by a
    /// [`DeviceTensors`](crate::device::DeviceTensors) hook), in place; the result is downloaded.
    AllReduceDevice { data: C::Buffer<f32>, op: ReduceOp },
    /// [`Job::AllReduce`] of 16-bit words already in the communicator's memory (rounded there by a
    /// [`DeviceTensors`](crate::device::DeviceTensors) hook), in place; the result is downloaded
    /// as bit patterns.
    AllReduceWords { data: WordBuffer<C>, op: ReduceOp },
    /// [`Job::ReduceScatter`] of 16-bit words already in the communicator's memory, plain; only
    /// the rank's reduced chunk is downloaded, as bit patterns.
    ReduceScatterWords { data: WordBuffer<C>, op: ReduceOp },
    /// [`Job::ReduceScatter`] of an f32 unit already in the communicator's memory (`qgz`: through
    /// the device qgZ when the communicators have [`DeviceQuant`] codecs); only the rank's
    /// reduced chunk is downloaded.
    ReduceScatterDevice {
        data: C::Buffer<f32>,
        op: ReduceOp,
        qgz: bool,
    },
}

impl<C: Communicator> Comms<C> {
    /// Runs one collective.
    pub(crate) fn run(&mut self, job: Job<C>) -> Result<Out<C>> {
        match job {
            Job::GatherDevice { piece, hpz, qwz } => {
                let comm = match (&mut self.hpz, hpz) {
                    (Some(h), true) => h,
                    _ => &mut self.world,
                };
                let send = match piece {
                    Elems::Device(b) => b,
                    Elems::F32(v) => comm.upload(&v)?,
                    Elems::DeviceWords(w) => {
                        return Ok(Elems::DeviceWords(match w {
                            WordBuffer::Bf16(b) => WordBuffer::Bf16(gather(comm, &b)?),
                            WordBuffer::F16(b) => WordBuffer::F16(gather(comm, &b)?),
                        }));
                    }
                    Elems::U16(..) => {
                        return Err(Error::Internal(
                            "a device gather of 16-bit elements in host memory".into(),
                        ));
                    }
                };
                let n = comm.world_size();
                let mut full = comm.alloc::<f32>(comm.buffer_len(&send) * n)?;
                match (qwz, &self.qwz, &self.quant) {
                    (true, Some(codec), Some(q)) => {
                        qwz_all_gather_device(comm, &**q, *codec, &send, &mut full)?
                    }
                    (true, Some(_), None) => return Err(no_device_codec("qwZ")),
                    _ => comm.all_gather(&send, &mut full)?,
                }
                Ok(Elems::Device(full))
            }
            Job::AllReduceDevice { mut data, op } => {
                self.world.all_reduce(&mut data, op)?;
                Ok(Elems::F32(self.world.download_vec(&data)?))
            }
            Job::ReduceScatterDevice { data, op, qgz } => {
                let n = self.world.world_size();
                let mut out = self.world.alloc::<f32>(self.world.buffer_len(&data) / n)?;
                match (qgz, &mut self.qgroups, &self.qgz, &self.quant) {
                    (true, Some(groups), Some(codec), Some(q)) => {
                        qgz_reduce_scatter_device(groups, &**q, *codec, &data, &mut out)?
                    }
                    (true, Some(_), Some(_), None) => return Err(no_device_codec("qgZ")),
                    _ => self.world.reduce_scatter(&data, &mut out, op)?,
                }
                Ok(Elems::F32(self.world.download_vec(&out)?))
            }
            Job::AllReduceWords { data, op } => reduce_words(&mut self.world, data, op, true),
            Job::ReduceScatterWords { data, op } => reduce_words(&mut self.world, data, op, false),
            Job::AllReduce { data, op } => match data {
                Elems::F32(g) => Ok(Elems::F32(self.world.all_reduce_vec(g, op)?)),
                Elems::U16(h, mut g) => {
                    h.all_reduce(&mut self.world, &mut g, op)?;
                    Ok(Elems::U16(h, g))
                }
                _ => Err(mixed()),
            },
            Job::ReduceScatter { data, op, qgz } => {
                let quant = match (qgz, &mut self.qgroups, &self.qgz) {
                    (true, Some(groups), Some(codec)) => Some((groups, codec)),
                    _ => None,
                };
                match (data, quant) {
                    (Elems::F32(g), Some((groups, codec))) => {
                        let mut chunk = vec![0.0f32; g.len() / self.world.world_size()];
                        qgz_reduce_scatter(groups, codec, &g, &mut chunk, &mut self.qgz_scratch)?;
                        Ok(Elems::F32(chunk))
                    }
                    (Elems::F32(g), None) => Ok(Elems::F32(self.world.reduce_scatter_vec(g, op)?)),
                    // qgZ quantizes the 16-bit gradient (widened) and dequantizes into f32.
                    (Elems::U16(h, g), Some((groups, codec))) => {
                        let mut chunk = vec![0.0f32; g.len() / self.world.world_size()];
                        qgz_reduce_scatter(
                            groups,
                            codec,
                            &h.widen_all(&g),
                            &mut chunk,
                            &mut self.qgz_scratch,
                        )?;
                        Ok(Elems::U16(h, h.round_all(&chunk)))
                    }
                    (Elems::U16(h, g), None) => {
                        Ok(Elems::U16(h, h.reduce_scatter(&mut self.world, &g, op)?))
                    }
                    _ => Err(mixed()),
                }
            }
            Job::Gather { piece, hpz } => {
                let comm = match (&mut self.hpz, hpz) {
                    (Some(h), true) => h,
                    _ => &mut self.world,
                };
                match (piece, &self.qwz) {
                    (Elems::F32(p), Some(codec)) => {
                        let mut full = vec![0.0f32; p.len() * comm.world_size()];
                        qwz_all_gather(comm, codec, &p, &mut full, &mut self.qwz_scratch)?;
                        Ok(Elems::F32(full))
                    }
                    (Elems::F32(p), None) => Ok(Elems::F32(comm.all_gather_host(&p)?)),
                    // qwZ on 16-bit weights: widened, int8 on the wire, rounded back.
                    (Elems::U16(h, p), Some(codec)) => {
                        let p = h.widen_all(&p);
                        let mut full = vec![0.0f32; p.len() * comm.world_size()];
                        qwz_all_gather(comm, codec, &p, &mut full, &mut self.qwz_scratch)?;
                        Ok(Elems::U16(h, h.round_all(&full)))
                    }
                    (Elems::U16(h, p), None) => Ok(Elems::U16(h, h.all_gather(comm, &p)?)),
                    _ => Err(mixed()),
                }
            }
        }
    }
}

/// The all-reduce (`whole`) or reduce-scatter of the 16-bit words `data`, downloaded as bit
/// patterns of their type (the whole unit, or the rank's chunk).
fn reduce_words<C: Communicator>(
    comm: &mut C,
    data: WordBuffer<C>,
    op: ReduceOp,
    whole: bool,
) -> Result<Out<C>> {
    Ok(match data {
        WordBuffer::Bf16(b) => {
            let v = reduce(comm, b, op, whole)?;
            Elems::U16(Half::Bf16, v.into_iter().map(bf16::to_bits).collect())
        }
        WordBuffer::F16(b) => {
            let v = reduce(comm, b, op, whole)?;
            Elems::U16(Half::F16, v.into_iter().map(f16::to_bits).collect())
        }
    })
}

/// The all-reduce (`whole`) or reduce-scatter of `data`, downloaded.
fn reduce<C: Communicator, E: Element>(
    comm: &mut C,
    mut data: C::Buffer<E>,
    op: ReduceOp,
    whole: bool,
) -> Result<Vec<E>> {
    if whole {
        comm.all_reduce(&mut data, op)?;
        return Ok(comm.download_vec(&data)?);
    }
    let mut out = comm.alloc::<E>(comm.buffer_len(&data) / comm.world_size())?;
    comm.reduce_scatter(&data, &mut out, op)?;
    Ok(comm.download_vec(&out)?)
}

/// A plain all-gather of `send` into a new buffer of the group's size.
fn gather<C: Communicator, E: Element>(comm: &mut C, send: &C::Buffer<E>) -> Result<C::Buffer<E>> {
    let mut full = comm.alloc::<E>(comm.buffer_len(send) * comm.world_size())?;
    comm.all_gather(send, &mut full)?;
    Ok(full)
}

fn no_device_codec(which: &str) -> Error {
    Error::Internal(format!(
        "{which} on the communicator's memory without device codecs"
    ))
}

fn mixed() -> Error {
    Error::Internal(
        "16-bit elements in an fp32 trainer's collective, or device elements where \
         host ones belong"
            .into(),
    )
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
