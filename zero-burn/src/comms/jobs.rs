//! The collectives a rank runs, one [`Job`] each, on its [`Comms`]. Every job is defined for
//! every place its elements can be in: where a codec has no device kernels, it runs on the
//! values in host memory.

use burn::tensor::{bf16, f16};
use zero_comm::quantized::{
    qgz_reduce_scatter, qgz_reduce_scatter_device, qwz_all_gather, qwz_all_gather_device,
};
use zero_comm::{Communicator, Element, ReduceOp};
use zero_quant::Int8Block;

use super::Comms;
use crate::device::WordBuffer;
use crate::error::Result;
use crate::precision::Half;

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

/// Elements in host memory: what the host collectives take, and what every reduction returns.
#[derive(Clone, Debug)]
pub(crate) enum Wire {
    F32(Vec<f32>),
    U16(Half, Vec<u16>),
}

impl<B, Y> From<Wire> for Elems<B, Y> {
    fn from(w: Wire) -> Self {
        match w {
            Wire::F32(v) => Elems::F32(v),
            Wire::U16(h, v) => Elems::U16(h, v),
        }
    }
}

/// A job's result on communicator `C`.
pub(crate) type Out<C> = Elems<<C as Communicator>::Buffer<f32>, WordBuffer<C>>;

/// One collective.
pub(crate) enum Job<C: Communicator> {
    /// All-reduce a whole unit in host memory (stage 0); the result is the reduced unit.
    AllReduce { data: Wire, op: ReduceOp },
    /// Reduce-scatter a unit in host memory; the result is the rank's reduced chunk. `qgz`:
    /// through qgZ's hierarchical int4 all-to-all.
    ReduceScatter { data: Wire, op: ReduceOp, qgz: bool },
    /// All-gather a unit from this rank's `piece`, wherever it lives; `hpz`: within the hpZ
    /// group (from the secondary shard); `qwz`: through qwZ when it is on (16-bit values
    /// widened, int8 on the wire, rounded back; fp32 in the communicator's memory with the
    /// [`DeviceQuant`](crate::device::DeviceQuant) codecs, else in host memory). `device`: an
    /// fp32 unit is left in the communicator's memory (for a
    /// [`DeviceTensors`](crate::device::DeviceTensors) hook to install), unless qwZ runs in host
    /// memory. 16-bit words in host memory are gathered there, and in the communicator's memory
    /// plain.
    Gather {
        piece: Out<C>,
        hpz: bool,
        qwz: bool,
        device: bool,
    },
    /// [`Job::AllReduce`] of an f32 unit already in the communicator's memory (packed there by a
    /// [`DeviceTensors`](crate::device::DeviceTensors) hook), in place; the result is downloaded.
    AllReduceDevice { data: C::Buffer<f32>, op: ReduceOp },
    /// [`Job::AllReduce`] of 16-bit words already in the communicator's memory (rounded there by a
    /// [`DeviceTensors`](crate::device::DeviceTensors) hook), in place; the result is downloaded
    /// as bit patterns.
    AllReduceWords { data: WordBuffer<C>, op: ReduceOp },
    /// [`Job::ReduceScatter`] of 16-bit words already in the communicator's memory, plain; only
    /// the rank's reduced chunk is downloaded, as bit patterns. `qgz`: through qgZ when it is
    /// on, which quantizes them widened in host memory (downloaded first).
    ReduceScatterWords {
        data: WordBuffer<C>,
        op: ReduceOp,
        qgz: bool,
    },
    /// [`Job::ReduceScatter`] of an f32 unit already in the communicator's memory (`qgz`: through
    /// qgZ, on the device with [`DeviceQuant`](crate::device::DeviceQuant) codecs, else on its
    /// downloaded values); only the rank's reduced chunk is downloaded.
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
            Job::Gather {
                piece,
                hpz,
                qwz,
                device,
            } => self.gather(piece, hpz, qwz, device),
            Job::AllReduceDevice { mut data, op } => {
                self.world.all_reduce(&mut data, op)?;
                Ok(Elems::F32(self.world.download_vec(&data)?))
            }
            Job::ReduceScatterDevice { data, op, qgz } => {
                let n = self.world.world_size();
                if let (true, Some(groups), Some(codec)) = (qgz, &mut self.qgroups, &self.qgz) {
                    let Some(q) = &self.quant else {
                        let g = self.world.download_vec(&data)?;
                        let mut chunk = vec![0.0f32; g.len() / n];
                        qgz_reduce_scatter(groups, codec, &g, &mut chunk, &mut self.qgz_scratch)?;
                        return Ok(Elems::F32(chunk));
                    };
                    let mut out = self.world.alloc::<f32>(self.world.buffer_len(&data) / n)?;
                    qgz_reduce_scatter_device(groups, &**q, *codec, &data, &mut out)?;
                    return Ok(Elems::F32(self.world.download_vec(&out)?));
                }
                let mut out = self.world.alloc::<f32>(self.world.buffer_len(&data) / n)?;
                self.world.reduce_scatter(&data, &mut out, op)?;
                Ok(Elems::F32(self.world.download_vec(&out)?))
            }
            Job::AllReduceWords { data, op } => reduce_words(&mut self.world, data, op, true),
            Job::ReduceScatterWords { data, op, qgz } => match qgz && self.qgz.is_some() {
                true => {
                    let data = download_words(&mut self.world, &data)?;
                    self.run(Job::ReduceScatter { data, op, qgz })
                }
                false => reduce_words(&mut self.world, data, op, false),
            },
            Job::AllReduce { data, op } => Ok(match data {
                Wire::F32(g) => Elems::F32(self.world.all_reduce_vec(g, op)?),
                Wire::U16(h, mut g) => {
                    h.all_reduce(&mut self.world, &mut g, op)?;
                    Elems::U16(h, g)
                }
            }),
            Job::ReduceScatter { data, op, qgz } => {
                let quant = match (qgz, &mut self.qgroups, &self.qgz) {
                    (true, Some(groups), Some(codec)) => Some((groups, codec)),
                    _ => None,
                };
                let n = self.world.world_size();
                Ok(match (data, quant) {
                    (Wire::F32(g), Some((groups, codec))) => {
                        let mut chunk = vec![0.0f32; g.len() / n];
                        qgz_reduce_scatter(groups, codec, &g, &mut chunk, &mut self.qgz_scratch)?;
                        Elems::F32(chunk)
                    }
                    (Wire::F32(g), None) => Elems::F32(self.world.reduce_scatter_vec(g, op)?),
                    // qgZ quantizes the 16-bit gradient (widened) and dequantizes into f32.
                    (Wire::U16(h, g), Some((groups, codec))) => {
                        let mut chunk = vec![0.0f32; g.len() / n];
                        let wide = h.widen_all(&g);
                        qgz_reduce_scatter(
                            groups,
                            codec,
                            &wide,
                            &mut chunk,
                            &mut self.qgz_scratch,
                        )?;
                        Elems::U16(h, h.round_all(&chunk))
                    }
                    (Wire::U16(h, g), None) => {
                        Elems::U16(h, h.reduce_scatter(&mut self.world, &g, op)?)
                    }
                })
            }
        }
    }

    /// [`Job::Gather`].
    fn gather(&mut self, piece: Out<C>, hpz: bool, qwz: bool, device: bool) -> Result<Out<C>> {
        let comm = match (&mut self.hpz, hpz) {
            (Some(h), true) => h,
            _ => &mut self.world,
        };
        let codec = self.qwz.filter(|_| qwz);
        // qwZ in host memory: fp32 values (downloaded from the communicator's memory when they
        // are there and it has no device codecs), 16-bit ones widened and rounded back.
        let scratch = &mut self.qwz_scratch;
        let mut host = |comm: &mut C, codec: &Int8Block, p: &[f32]| -> Result<Vec<f32>> {
            let mut full = vec![0.0f32; p.len() * comm.world_size()];
            qwz_all_gather(comm, codec, p, &mut full, scratch)?;
            Ok(full)
        };
        let send = match (piece, codec, &self.quant) {
            (Elems::DeviceWords(w), ..) => {
                return Ok(Elems::DeviceWords(match w {
                    WordBuffer::Bf16(b) => WordBuffer::Bf16(gather(comm, &b)?),
                    WordBuffer::F16(b) => WordBuffer::F16(gather(comm, &b)?),
                }));
            }
            (Elems::U16(h, p), Some(c), _) => {
                let full = host(comm, &c, &h.widen_all(&p))?;
                return Ok(Elems::U16(h, h.round_all(&full)));
            }
            (Elems::U16(h, p), None, _) => return Ok(Elems::U16(h, h.all_gather(comm, &p)?)),
            (Elems::F32(p), Some(c), q) if !device || q.is_none() => {
                return Ok(Elems::F32(host(comm, &c, &p)?));
            }
            (Elems::Device(b), Some(c), None) => {
                let p = comm.download_vec(&b)?;
                return Ok(Elems::F32(host(comm, &c, &p)?));
            }
            (Elems::F32(p), None, _) if !device => return Ok(Elems::F32(comm.all_gather_vec(p)?)),
            (Elems::F32(p), ..) => comm.upload(&p)?,
            (Elems::Device(b), ..) => b,
        };
        let mut full = comm.alloc::<f32>(comm.buffer_len(&send) * comm.world_size())?;
        match (codec, &self.quant) {
            (Some(codec), Some(q)) => qwz_all_gather_device(comm, &**q, codec, &send, &mut full)?,
            _ => comm.all_gather(&send, &mut full)?,
        }
        Ok(Elems::Device(full))
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

/// 16-bit words in the communicator's memory, downloaded as bit patterns of their type.
fn download_words<C: Communicator>(comm: &mut C, data: &WordBuffer<C>) -> Result<Wire> {
    Ok(match data {
        WordBuffer::Bf16(b) => {
            let v = comm.download_vec(b)?;
            Wire::U16(Half::Bf16, v.into_iter().map(bf16::to_bits).collect())
        }
        WordBuffer::F16(b) => {
            let v = comm.download_vec(b)?;
            Wire::U16(Half::F16, v.into_iter().map(f16::to_bits).collect())
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
