//! qwZ and qgZ on a communicator's own memory, written once for every backend over
//! [`DeviceCodec`]: the wgpu loopback's WGSL kernels (`WgpuQuantizer`, feature `wgpu`), NCCL's
//! CUDA kernels (`CudaQuantizer`, feature `nccl`) and the host loopback's codecs ([`HostCodec`],
//! the reference the others are tested against).
//!
//! The same collectives, bytes and results as [`qwz_all_gather`](super::qwz_all_gather) and
//! [`qgz_reduce_scatter`](super::qgz_reduce_scatter) bit for bit (every backend's codecs give the
//! host codecs' bits), with the same error contract: a rank whose data cannot be encoded sends
//! poisoned pieces, and every rank fails with [`Error::Quant`] naming it. Only the failure path
//! reads a wire back to the host, to find the poison marker. Error feedback has no device form.

use zero_core::Collective;
use zero_quant::{BlockCodec, Codec, WireLayout};

use super::{Fault, QuantElement, QuantGroups, length, poison};
use crate::Communicator;
use crate::error::{Error, Op, Result};
use crate::host::{HostBuffer, HostComm};

/// A block codec's kernels on the memory of the communicator `C`, for elements `E`: what
/// [`qwz_all_gather_device`] and [`qgz_reduce_scatter_device`] need from a backend.
///
/// Offsets and lengths are in elements for values and in bytes for wires (`slot`); a wire piece of
/// `len` values is `codec.layout(len).total_len` bytes. Every method must give the host codecs'
/// bits and errors ([`BlockCodec`]), and nothing for `len = 0`. The callers keep every range
/// inside its buffer.
pub trait DeviceCodec<C: Communicator, E: QuantElement> {
    /// Who runs the kernels, for error messages (`"wgpu loopback"`, `"nccl"`).
    fn name(&self) -> &'static str;

    /// Whether the kernels implement `codec` (the device kernels have no identity codec).
    fn supports(&self, codec: &Codec) -> bool;

    /// Why these kernels cannot work on `comm`'s buffers (another device, another stream), if so.
    fn check(&self, comm: &C) -> std::result::Result<(), String>;

    /// The number of elements of `buf`.
    fn buffer_len(&self, buf: &C::Buffer<E>) -> usize;

    /// Encodes `len` values of `src` from element `at` into `wire` at byte `slot`.
    fn encode_piece(
        &self,
        codec: Codec,
        src: (&C::Buffer<E>, usize),
        len: usize,
        wire: (&mut C::Buffer<u8>, usize),
    ) -> zero_quant::Result<()>;

    /// Encodes the whole `f32` buffer `sums` (qgZ's node partials) into `wire` at byte `slot`.
    fn encode_sum(
        &self,
        codec: Codec,
        sums: &C::Buffer<f32>,
        wire: (&mut C::Buffer<u8>, usize),
    ) -> zero_quant::Result<()>;

    /// Decodes the piece of `len` values at byte `slot` of `wire` into `out` from element `at`.
    fn decode_piece(
        &self,
        codec: Codec,
        wire: (&C::Buffer<u8>, usize),
        len: usize,
        out: (&mut C::Buffer<E>, usize),
    ) -> zero_quant::Result<()>;

    /// Decodes the piece at byte `slot` of `wire` into the whole `f32` buffer `sums`, or with
    /// `accumulate` adds it there ([`BlockCodec::decode_accumulate`]).
    fn decode_sum(
        &self,
        codec: Codec,
        wire: (&C::Buffer<u8>, usize),
        sums: &mut C::Buffer<f32>,
        accumulate: bool,
    ) -> zero_quant::Result<()>;

    /// qgZ's last step: `out[i] = E(sums[i] / n)`, a true division rounded once to `E`. The first
    /// element whose result is not finite is [`zero_quant::Error::Overflow`] (its index and
    /// `sums[i] / n`), as on the host; `comm` is one of the groups, for backends whose kernels
    /// need it. The outer `Err` is a backend failure.
    fn finish_mean(
        &self,
        comm: &mut C,
        codec: Codec,
        sums: &C::Buffer<f32>,
        n: usize,
        out: &mut C::Buffer<E>,
    ) -> Result<zero_quant::Result<()>>;

    /// qgZ at `N = 1`: copies `src` into `out` after the host path's finiteness check (the first
    /// non-finite element as [`zero_quant::Error::NonFinite`]).
    fn copy_finite(
        &self,
        codec: Codec,
        src: &C::Buffer<E>,
        out: &mut C::Buffer<E>,
    ) -> Result<zero_quant::Result<()>>;
}

fn refused<C: Communicator, E: QuantElement>(
    kernels: &(impl DeviceCodec<C, E> + ?Sized),
    function: &str,
    why: impl std::fmt::Display,
) -> Error {
    Error::Backend(format!("{}: {function}: {why}", kernels.name()))
}

/// qwZ all-gather on the communicator's memory: `chunk` is encoded with `codec` by `kernels`, the
/// wires are all-gathered by `comm`, and rank `k`'s decoded chunk lands at `[k·c, (k+1)·c)` of
/// `out` (`n · c` elements). Kernels that cannot work on `comm`'s buffers
/// ([`DeviceCodec::check`]) or lack `codec` are refused before anything moves.
pub fn qwz_all_gather_device<C, Q, E>(
    comm: &mut C,
    kernels: &Q,
    codec: impl Into<Codec>,
    chunk: &C::Buffer<E>,
    out: &mut C::Buffer<E>,
) -> Result<()>
where
    C: Communicator,
    Q: DeviceCodec<C, E> + ?Sized,
    E: QuantElement,
{
    const NAME: &str = "qwz_all_gather_device";
    let codec: Codec = codec.into();
    let op = Op::Collective(Collective::AllGather);
    let (n, c, me) = (
        comm.world_size(),
        kernels.buffer_len(chunk),
        comm.global_rank(),
    );
    let got = kernels.buffer_len(out);
    if got != n * c {
        return Err(length(op, me, n * c, got));
    }
    if !kernels.supports(&codec) {
        return Err(refused(
            kernels,
            NAME,
            format!("no device kernel for {codec:?}"),
        ));
    }
    kernels
        .check(comm)
        .map_err(|why| refused(kernels, NAME, why))?;
    let layout = codec.layout(c);
    let w = layout.total_len;
    let mut fault = Fault::new(op, me);

    let mut send = comm.alloc::<u8>(w)?;
    if let Err(e) = kernels.encode_piece(codec, (chunk, 0), c, (&mut send, 0)) {
        fault.local(e);
        let mut host = vec![0u8; w];
        poison(&mut host, &layout, me);
        comm.upload_into(&host, &mut send)?;
    }
    let mut recv = comm.alloc::<u8>(n * w)?;
    comm.all_gather(&send, &mut recv)?;
    drop(send);

    let mut decode_error = None;
    for j in 0..n {
        if let Err(e) = kernels.decode_piece(codec, (&recv, j * w), c, (&mut *out, j * c)) {
            decode_error.get_or_insert(e);
        }
    }
    fault.finish_device(decode_error, &layout, n, || comm.download_vec(&recv))
}

/// Sends `send` (every piece poisoned first if this rank has a fault) through one equal-split
/// all-to-all of `comm`, as the host path's exchange does, and returns the received wire.
fn exchange<C: Communicator>(
    comm: &mut C,
    fault: &Fault,
    layout: &WireLayout,
    mut send: C::Buffer<u8>,
) -> Result<C::Buffer<u8>> {
    let len = comm.buffer_len(&send);
    if let Some(o) = fault.origin() {
        let mut host = vec![0u8; len];
        for piece in host.chunks_exact_mut(layout.total_len.max(1)) {
            poison(piece, layout, o);
        }
        comm.upload_into(&host, &mut send)?;
    }
    let mut recv = comm.alloc::<u8>(len)?;
    comm.all_to_all(&send, &mut recv)?;
    Ok(recv)
}

/// qgZ reduce-scatter on the communicators' memory: the mean over all `N` ranks of chunk `rank`
/// of every rank's `input` (`N·c` elements), through `codec`, into `out` (`c` elements), by the
/// hierarchical all-to-all of [`qgz_reduce_scatter`](super::qgz_reduce_scatter): the same
/// collectives and bytes, the same result bit for bit, the same errors.
///
/// The wires are encoded, exchanged and decoded by `kernels`; the partial sums are `f32` buffers
/// of the groups (`M` of `c` elements), and the mean is rounded once to `E` by
/// [`DeviceCodec::finish_mean`]. A codec the kernels lack (the device kernels have no identity
/// codec) and kernels that cannot work on the groups' buffers are refused before anything moves.
/// With `N = 1` nothing moves: `out` is a copy of `input` after the host path's finiteness check.
/// On an error the contents of `out` are unspecified.
pub fn qgz_reduce_scatter_device<C, Q, E>(
    groups: &mut QuantGroups<C>,
    kernels: &Q,
    codec: impl Into<Codec>,
    input: &C::Buffer<E>,
    out: &mut C::Buffer<E>,
) -> Result<()>
where
    C: Communicator,
    Q: DeviceCodec<C, E> + ?Sized,
    E: QuantElement,
{
    const NAME: &str = "qgz_reduce_scatter_device";
    let codec: Codec = codec.into();
    let op = Op::Collective(Collective::ReduceScatter);
    let (n, l, m, me) = (
        groups.world_size(),
        groups.ranks_per_node(),
        groups.num_nodes(),
        groups.global_rank(),
    );
    let len = kernels.buffer_len(input);
    if !len.is_multiple_of(n) {
        return Err(length(op, me, len.next_multiple_of(n), len));
    }
    let c = len / n;
    let got = kernels.buffer_len(out);
    if got != c {
        return Err(length(op, me, c, got));
    }
    if !kernels.supports(&codec) {
        return Err(refused(
            kernels,
            NAME,
            format!("no device kernel for {codec:?} (use the host qgz_reduce_scatter)"),
        ));
    }
    let (mut intra, mut cross) = groups.groups_mut();
    let mut fault = Fault::new(op, me);
    let Some(comm0) = intra.as_deref().or(cross.as_deref()) else {
        // N = 1: nothing moves.
        return match kernels.copy_finite(codec, input, out)? {
            Ok(()) => Ok(()),
            Err(err) => {
                fault.local(err);
                fault.finish()
            }
        };
    };
    kernels
        .check(comm0)
        .map_err(|why| refused(kernels, NAME, why))?;
    let layout = codec.layout(c);
    let e = layout.total_len;
    // The f32 sums of the M destinations (the stage-2 partials; `acc[0]` also holds the stage-4
    // sum).
    let mut acc = (0..if l > 1 { m } else { 1 })
        .map(|_| comm0.alloc::<f32>(c))
        .collect::<Result<Vec<_>>>()?;

    // Stages 1-2: intra-node exchange, node partial sums for the M destinations in `acc`.
    if let Some(intra) = intra.as_deref_mut() {
        let mut send = intra.alloc::<u8>(l * m * e)?;
        'encode: for lp in 0..l {
            for mp in 0..m {
                let p = mp * l + lp;
                let slot = (lp * m + mp) * e;
                let r = kernels.encode_piece(codec, (input, p * c), c, (&mut send, slot));
                if let Err(err) = r {
                    fault.local(err);
                    break 'encode;
                }
            }
        }
        let recv = exchange(intra, &fault, &layout, send)?;
        let mut decode_error = None;
        if fault.origin().is_none() {
            'reduce: for (mp, a) in acc.iter_mut().enumerate() {
                for j in 0..l {
                    let slot = (j * m + mp) * e;
                    if let Err(err) = kernels.decode_sum(codec, (&recv, slot), a, j > 0) {
                        decode_error = Some(err);
                        break 'reduce;
                    }
                }
            }
        }
        fault.after_exchange_device(decode_error, &layout, || intra.download_vec(&recv))?;
    }

    // Stage 3: cross-node exchange of the partials (or, with L = 1, of the input chunks).
    if let Some(cross) = cross.as_deref_mut() {
        let mut send = cross.alloc::<u8>(m * e)?;
        if fault.origin().is_none() {
            for mp in 0..m {
                let dst = (&mut send, mp * e);
                // The partial for node mp's rank, or with L = 1 the input chunk of destination
                // p = mp·1 + 0 (then this is the first quantization).
                let r = match acc.get(mp).filter(|_| l > 1) {
                    Some(partial) => kernels.encode_sum(codec, partial, dst),
                    None => kernels.encode_piece(codec, (input, mp * c), c, dst),
                };
                if let Err(err) = r {
                    fault.local(err);
                    break;
                }
            }
        }
        let recv = exchange(cross, &fault, &layout, send)?;
        let mut decode_error = None;
        if fault.origin().is_none() {
            for k in 0..m {
                if let Err(err) = kernels.decode_sum(codec, (&recv, k * e), &mut acc[0], k > 0) {
                    decode_error = Some(err);
                    break;
                }
            }
        }
        fault.after_exchange_device(decode_error, &layout, || cross.download_vec(&recv))?;
    }

    if fault.origin().is_some() || c == 0 {
        return fault.finish();
    }
    // Stage 4: the mean, rounded once to E.
    let Some(comm) = intra.or(cross) else {
        return Err(refused(kernels, NAME, "no sub-group for N > 1"));
    };
    match kernels.finish_mean(comm, codec, &acc[0], n, out)? {
        Ok(()) => Ok(()),
        Err(err) => {
            fault.local(err);
            fault.finish()
        }
    }
}

impl Fault {
    /// After one exchange: when anything failed (this rank already had a fault, or decoding the
    /// received pieces gave `decode_error`), reads the received wire back (`wire`, called only
    /// then) and records the poisoned pieces' origins, as the host path's check of every received
    /// piece does; a decode error with no poisoned piece (and no earlier fault) is this rank's
    /// own. Decoding stops at the first error and a poisoned piece always fails to decode (its
    /// first scale is a NaN), so this names the same rank as the host path.
    fn after_exchange_device(
        &mut self,
        decode_error: Option<zero_quant::Error>,
        layout: &WireLayout,
        wire: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<()> {
        self.read_poison(decode_error, layout, usize::MAX, wire)
    }

    /// The end of a qwZ: when anything failed, reads the received wire of `n` pieces (`wire`,
    /// called only then) and names the failing rank from the poison markers, as the host path
    /// does; a decode error with no poisoned piece is this rank's own.
    fn finish_device(
        mut self,
        decode_error: Option<zero_quant::Error>,
        layout: &WireLayout,
        n: usize,
        wire: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<()> {
        self.read_poison(decode_error, layout, n, wire)?;
        self.finish()
    }

    fn read_poison(
        &mut self,
        decode_error: Option<zero_quant::Error>,
        layout: &WireLayout,
        pieces: usize,
        wire: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<()> {
        if decode_error.is_some() || self.origin().is_some() {
            let host = wire()?;
            for piece in host.chunks_exact(layout.total_len.max(1)).take(pieces) {
                self.check(piece, layout);
            }
            if self.origin().is_none()
                && let Some(e) = decode_error
            {
                self.local(e);
            }
        }
        Ok(())
    }
}

/// The host codecs as a [`DeviceCodec`] of the host loopback: the device algorithm on host
/// memory, every codec included. The reference the device kernels are tested against, and a way
/// to run the device algorithm where there is no device.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostCodec;

impl<E: QuantElement> DeviceCodec<HostComm, E> for HostCodec {
    fn name(&self) -> &'static str {
        "host loopback"
    }

    fn supports(&self, _codec: &Codec) -> bool {
        true
    }

    fn check(&self, _comm: &HostComm) -> std::result::Result<(), String> {
        Ok(())
    }

    fn buffer_len(&self, buf: &HostBuffer<E>) -> usize {
        buf.len()
    }

    fn encode_piece(
        &self,
        codec: Codec,
        (src, at): (&HostBuffer<E>, usize),
        len: usize,
        (wire, slot): (&mut HostBuffer<u8>, usize),
    ) -> zero_quant::Result<()> {
        let e = codec.layout(len).total_len;
        codec.encode(
            &src.as_slice()[at..at + len],
            &mut wire.as_mut_slice()[slot..slot + e],
        )
    }

    fn encode_sum(
        &self,
        codec: Codec,
        sums: &HostBuffer<f32>,
        (wire, slot): (&mut HostBuffer<u8>, usize),
    ) -> zero_quant::Result<()> {
        let e = codec.layout(sums.len()).total_len;
        codec.encode(sums.as_slice(), &mut wire.as_mut_slice()[slot..slot + e])
    }

    fn decode_piece(
        &self,
        codec: Codec,
        (wire, slot): (&HostBuffer<u8>, usize),
        len: usize,
        (out, at): (&mut HostBuffer<E>, usize),
    ) -> zero_quant::Result<()> {
        let e = codec.layout(len).total_len;
        codec.decode(
            &wire.as_slice()[slot..slot + e],
            &mut out.as_mut_slice()[at..at + len],
        )
    }

    fn decode_sum(
        &self,
        codec: Codec,
        (wire, slot): (&HostBuffer<u8>, usize),
        sums: &mut HostBuffer<f32>,
        accumulate: bool,
    ) -> zero_quant::Result<()> {
        let e = codec.layout(sums.len()).total_len;
        let piece = &wire.as_slice()[slot..slot + e];
        if accumulate {
            codec.decode_accumulate(piece, sums.as_mut_slice())
        } else {
            codec.decode(piece, sums.as_mut_slice())
        }
    }

    fn finish_mean(
        &self,
        _comm: &mut HostComm,
        _codec: Codec,
        sums: &HostBuffer<f32>,
        n: usize,
        out: &mut HostBuffer<E>,
    ) -> Result<zero_quant::Result<()>> {
        let nf = n as f32;
        for (i, (o, &s)) in out
            .as_mut_slice()
            .iter_mut()
            .zip(sums.as_slice())
            .enumerate()
        {
            let v = s / nf;
            let y = E::narrow(v);
            if !y.widen().is_finite() {
                return Ok(Err(zero_quant::Error::Overflow {
                    index: i,
                    value: v,
                    dtype: <E as zero_quant::Element>::DTYPE,
                }));
            }
            *o = y;
        }
        Ok(Ok(()))
    }

    fn copy_finite(
        &self,
        _codec: Codec,
        src: &HostBuffer<E>,
        out: &mut HostBuffer<E>,
    ) -> Result<zero_quant::Result<()>> {
        let x = src.as_slice();
        if let Some(index) = x.iter().position(|v| !v.widen().is_finite()) {
            let value = x[index].widen();
            return Ok(Err(zero_quant::Error::NonFinite { index, value }));
        }
        out.as_mut_slice().copy_from_slice(x);
        Ok(Ok(()))
    }
}
