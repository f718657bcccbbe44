//! The collectives of [`LoopbackComm`], written once for every device [`Memory`].

use std::marker::PhantomData;

use zero_core::{Collective, Topology, TrafficTable};

use super::{Loc, LoopbackComm, Memory, Recorder, loc, peer, post};
use crate::communicator::{Communicator, group_methods};
use crate::element::{Element, ReduceOp};
use crate::error::{Error, Result};
use crate::host::loopback::Loopback;
use crate::host::rendezvous::Call;
use crate::validate::{Desc, ar_chunk};

/// Records `out = op(x₀, x₁, …)` over elements `[at, at + len)` of every rank's posted buffer, in
/// group-rank order, and counts the elements read from each peer into `reads` (not from `me`).
///
/// # Safety
///
/// Every call must come from the arrival barrier of the op in progress, its buffer must hold
/// `at + len` elements, and nobody may write those ranges in this step, except `out` when it is
/// exactly one of them.
unsafe fn reduce_all<M: Memory, E: Element>(
    batch: &mut M::Batch<'_>,
    calls: &[Call],
    (at, len): (usize, usize),
    out: Loc<'_, M::View>,
    op: ReduceOp,
    reads: &mut [u64],
    me: usize,
) {
    if len > 0 {
        let es = size_of::<E>();
        let inputs: Vec<Loc<'_, M::View>> = calls
            .iter()
            // SAFETY: per the function's contract.
            .map(|cj| loc(unsafe { peer::<M::View>(cj) }, at, es))
            .collect();
        batch.reduce(&inputs, out, len as u64, E::DTYPE, op);
    }
    for (j, r) in reads.iter_mut().enumerate() {
        if j != me {
            *r += len as u64;
        }
    }
}

impl<M: Memory> LoopbackComm<M> {
    fn all_gather_impl<E: Element>(
        &mut self,
        src: &M::View,
        chunk: usize,
        in_place: bool,
        recv: &M::View,
        recv_len: usize,
    ) -> Result<()> {
        let me = self.rank;
        let es = size_of::<E>();
        let call = Call::new(
            Desc {
                in_place,
                ..Desc::of(Collective::AllGather, E::DTYPE, chunk, recv_len)
            },
            post(src),
        );
        self.run(call, es, 1, |_, calls, reads, batch| {
            let c = chunk;
            for (j, cj) in calls.iter().enumerate() {
                if j == me && in_place {
                    continue;
                }
                let off = if cj.desc.in_place { j * c } else { 0 };
                // SAFETY: posted at this op's arrival; used before its drain barrier. Peer `j`'s
                // buffer holds `recv_len` (in place) or `c` elements (checked), so chunk `[off,
                // off + c)` is in bounds, and no rank writes it in this op: out-of-place send
                // buffers are never written, and an in-place rank writes only chunks other than its
                // own. We write only our chunk `j`, which nobody reads (in place, our own chunk
                // `me`, the one peers read, is skipped).
                let pj = unsafe { peer::<M::View>(cj) };
                batch.copy(loc(pj, off, es), loc(recv, j * c, es), (c * es) as u64);
                if j != me {
                    reads[j] += c as u64;
                }
            }
        })
    }
}

impl<M: Memory> Communicator for LoopbackComm<M> {
    type Buffer<E: Element> = M::Buffer<E>;

    group_methods!(shared.world.topology);

    fn alloc<E: Element>(&self, len: usize) -> Result<M::Buffer<E>> {
        self.shared.device.alloc(len)
    }

    fn upload<E: Element>(&self, src: &[E]) -> Result<M::Buffer<E>> {
        self.shared.device.upload(src, self.timeout)
    }

    fn upload_into<E: Element>(&self, src: &[E], dst: &mut M::Buffer<E>) -> Result<()> {
        if src.len() != M::len(dst) {
            return Err(Error::BufferLength {
                what: "upload_into",
                buffer: M::len(dst),
                host: src.len(),
            });
        }
        if src.is_empty() {
            return Ok(());
        }
        self.shared.device.upload_into(src, dst, self.timeout)
    }

    fn download<E: Element>(&self, buf: &M::Buffer<E>, dst: &mut [E]) -> Result<()> {
        if dst.len() != M::len(buf) {
            return Err(Error::BufferLength {
                what: "download",
                buffer: M::len(buf),
                host: dst.len(),
            });
        }
        self.shared.device.download(buf, dst, self.timeout)
    }

    fn buffer_len<E: Element>(&self, buf: &M::Buffer<E>) -> usize {
        M::len(buf)
    }

    fn all_gather<E: Element>(
        &mut self,
        send: &M::Buffer<E>,
        recv: &mut M::Buffer<E>,
    ) -> Result<()> {
        let recv_len = M::len(recv);
        self.all_gather_impl::<E>(M::view(send), M::len(send), false, M::view(recv), recv_len)
    }

    fn all_gather_in_place<E: Element>(&mut self, buf: &mut M::Buffer<E>) -> Result<()> {
        let len = M::len(buf);
        let view = M::view(buf);
        self.all_gather_impl::<E>(view, len / self.members.len(), true, view, len)
    }

    fn reduce_scatter<E: Element>(
        &mut self,
        send: &M::Buffer<E>,
        recv: &mut M::Buffer<E>,
        op: ReduceOp,
    ) -> Result<()> {
        let me = self.rank;
        let es = size_of::<E>();
        let c = M::len(recv);
        let out = M::view(recv);
        let call = Call::new(
            Desc::of(Collective::ReduceScatter, E::DTYPE, M::len(send), c).reduce(op),
            post(M::view(send)),
        );
        self.run(call, es, 1, |_, calls, reads, batch| {
            // SAFETY: posted at this op's arrival; used before its drain barrier. Every send
            // buffer holds `n · c` elements (checked), so chunk `me` is in bounds; send buffers are
            // never written during the op, and our receive buffer is read by no peer.
            unsafe {
                reduce_all::<M, E>(batch, calls, (me * c, c), loc(out, 0, es), op, reads, me)
            };
        })
    }

    fn all_reduce<E: Element>(&mut self, buf: &mut M::Buffer<E>, op: ReduceOp) -> Result<()> {
        let n = self.members.len();
        let me = self.rank;
        let es = size_of::<E>();
        let len = M::len(buf);
        let view = M::view(buf);
        let call = Call::new(
            Desc::of(Collective::AllReduce, E::DTYPE, len, len).reduce(op),
            post(view),
        );
        self.run(call, es, 2, |step, calls, reads, batch| {
            if step == 0 {
                // Reduce-scatter half: reduce chunk `me` of every buffer into ours.
                let (off, cl) = ar_chunk(len, n, me);
                // SAFETY: posted at this op's arrival; used before its drain barrier. Every buffer
                // holds `len` elements (checked). In this step each rank writes only its own chunk
                // of its own buffer and reads only that chunk of everyone's, so nobody writes the
                // ranges we read except us, at exactly our input `me`, which `reduce` allows (it
                // reads every input before writing).
                let out = loc(view, off, es);
                // SAFETY: as above.
                unsafe { reduce_all::<M, E>(batch, calls, (off, cl), out, op, reads, me) };
            } else {
                // All-gather half: copy each peer's reduced chunk into ours.
                for (j, cj) in calls.iter().enumerate() {
                    if j == me {
                        continue;
                    }
                    let (off, cl) = ar_chunk(len, n, j);
                    // SAFETY: as above. In this step every rank reads only the owner's chunk of the
                    // owner's buffer (reduced in step 0, submitted before the barrier between the
                    // steps) and writes only non-owned chunks of its own.
                    let pj = unsafe { peer::<M::View>(cj) };
                    batch.copy(loc(pj, off, es), loc(view, off, es), (cl * es) as u64);
                    reads[j] += cl as u64;
                }
            }
        })
    }

    fn broadcast<E: Element>(&mut self, buf: &mut M::Buffer<E>, root: usize) -> Result<()> {
        let me = self.rank;
        let es = size_of::<E>();
        let len = M::len(buf);
        let view = M::view(buf);
        let call = Call::new(
            Desc::of(Collective::Broadcast, E::DTYPE, len, len).root(root),
            post(view),
        );
        self.run(call, es, 1, |_, calls, reads, batch| {
            if me != root {
                // SAFETY: posted at this op's arrival; used before its drain barrier. The root's
                // buffer holds `len` elements (checked) and the root writes nothing; ours is read
                // by nobody.
                let pr = unsafe { peer::<M::View>(&calls[root]) };
                batch.copy(loc(pr, 0, es), loc(view, 0, es), (len * es) as u64);
                reads[root] += len as u64;
            }
        })
    }

    fn all_to_all<E: Element>(
        &mut self,
        send: &M::Buffer<E>,
        recv: &mut M::Buffer<E>,
    ) -> Result<()> {
        let n = self.members.len();
        let me = self.rank;
        let es = size_of::<E>();
        let len = M::len(send);
        let out = M::view(recv);
        let call = Call::new(
            Desc::of(Collective::AllToAll, E::DTYPE, len, M::len(recv)),
            post(M::view(send)),
        );
        self.run(call, es, 1, |_, calls, reads, batch| {
            let c = len / n;
            for (j, cj) in calls.iter().enumerate() {
                // SAFETY: posted at this op's arrival; used before its drain barrier. Every send
                // buffer holds `n · c` elements (checked) and is never written during the op; our
                // receive buffer is read by nobody.
                let pj = unsafe { peer::<M::View>(cj) };
                batch.copy(loc(pj, me * c, es), loc(out, j * c, es), (c * es) as u64);
                if j != me {
                    reads[j] += c as u64;
                }
            }
        })
    }

    fn barrier(&mut self) -> Result<()> {
        self.run(
            Call::from(Desc::new(Collective::Barrier)),
            0,
            0,
            |_, _, _, _| {},
        )
    }

    fn split(&mut self, color: usize, key: usize) -> Result<LoopbackComm<M>> {
        let (group, members, rank) = self.split_group(color, key)?;
        Ok(LoopbackComm {
            shared: self.shared.clone(),
            group,
            rank,
            members,
            timeout: self.timeout,
            traffic: TrafficTable::new(),
            aborted: None,
            scratch: M::Scratch::default(),
            _not_sync: PhantomData,
        })
    }

    fn traffic(&self) -> &TrafficTable {
        &self.traffic
    }

    fn abort(&mut self, cause: String) {
        self.aborted.get_or_insert(cause);
    }
}
