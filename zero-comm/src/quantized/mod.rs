//! ZeRO++'s quantized collectives: **qwZ** (block-int8 weight all-gather) and **qgZ**
//! (hierarchical block-int4 gradient reduce-scatter), generic over any [`Communicator`] and over
//! zero-quant's [`BlockCodec`]s.
//!
//! Both move raw `u8` wires (zero-quant's layout `[codes][pad to 4][f32 LE scales]`, exactly
//! [`BlockCodec::encoded_len`] bytes per piece) through the ordinary collectives, so every backend
//! gets them for free and the bytes land in the ordinary traffic tables. Element types are `f32`,
//! bf16 and f16 ([`QuantElement`]); the output has the input's type (DeepSpeed's kernels return
//! fp16 whatever went in).
//!
//! # qwZ: [`qwz_all_gather`]
//!
//! Each rank encodes **its own** chunk of `c` elements (so blocks never span ranks), the group runs
//! **one** [`all_gather`](Communicator::all_gather) of `encoded_len(c)` bytes per rank, and every
//! rank decodes every piece, its own included, into its slot of the output. All ranks therefore
//! hold bit-identical full weights, and the owner's own slot is the dequantized value too, not its
//! original. There is no shortcut for a group of one: the output is always the dequantized values.
//!
//! # qgZ: [`qgz_reduce_scatter`]
//!
//! `N` ranks on `M` nodes of `L` ranks each (node `k` holds global ranks `k·L..(k+1)·L`), an input
//! of `N·c` elements whose chunk `p` belongs to global rank `p`. [`QuantGroups::new`] splits the
//! world into the intra-node group (`L` members, by local rank) and the cross-node group (`M`
//! members with the same local rank, by node). With `e = encoded_len(c)`:
//!
//! 1. **Swizzle and quantize.** Chunk `p = m·L + l` is encoded on its own into slot `l·M + m` of a
//!    wire of `L·M·e` bytes (DeepSpeed's `swizzle_quant`: `[0 1 2 3 4 5 6 7] → [0 4 1 5 2 6 3 7]`
//!    for `M = 2`, `L = 4`). One intra-node [`all_to_all`](Communicator::all_to_all) of `L·M·e`
//!    bytes per rank (splits of `M·e`) hands local peer `l` the `M` chunks meant for the ranks with
//!    local index `l`, node-major.
//! 2. **Reduce within the node.** For each of its `M` destinations a rank dequantizes the `L`
//!    received pieces and sums them in `f32` in local-rank order (the first piece is decoded, the
//!    others added with [`BlockCodec::decode_accumulate`]), then re-quantizes each partial sum.
//! 3. **Exchange across nodes.** One cross-node all-to-all of `M·e` bytes per rank sends the
//!    partial for node `m`'s rank to it.
//! 4. **Finish.** The `M` received partials are dequantized and summed in `f32` in node order, and
//!    the sum is divided by `N` (a division, like [`ReduceOp::Mean`](crate::ReduceOp::Mean)) and
//!    rounded once to the element type: the output is **the mean over all `N` ranks**, the
//!    reduce-scatter contract. (DeepSpeed's port divides by `M` only, giving `L` times the mean.)
//!
//! With `L = 1` stages 1-2 are skipped and stage 3 encodes the input chunks directly; with `M = 1`
//! stage 3 is skipped and stage 4 divides the stage-2 sum. Either way the data is quantized once.
//! With `N = 1` nothing moves: the output is the input (after the finiteness check below).
//!
//! **Summation order.** Per element, node `k`'s partial is `x̂_{k,0} + x̂_{k,1} + … + x̂_{k,L−1}`
//! (local-rank order, `f32`); the output is `(Ŝ_0 + Ŝ_1 + … + Ŝ_{M−1}) / N` with `Ŝ_k` the
//! re-quantized partials (node order, `f32`). With the exact [`zero_quant::Identity`] codec the
//! result equals [`Communicator::reduce_scatter`] with `Mean` bit for bit when `L = 1` or `M = 1`
//! (the order is then rank order), and otherwise whenever the partial sums are exact (e.g.
//! integer-valued inputs).
//!
//! # On device memory: [`qwz_all_gather_device`], [`qgz_reduce_scatter_device`]
//!
//! The same two algorithms on a communicator's own buffers, written once over [`DeviceCodec`]
//! (a backend's encode, decode and finish kernels): the wgpu loopback's WGSL codecs, NCCL's CUDA
//! codecs, and [`HostCodec`] on the host loopback. Same collectives, bytes, results and errors as
//! the host functions; only the failure path reads a wire back to the host.
//!
//! # Accounting
//!
//! These are exactly the collectives zero-core's plan schedules (`comm_model.rs`), so measured
//! bytes equal planned bytes with `==`, with `e` from `zero_core::quant_wire`:
//!
//! | | collective | group | count (bytes, elem size 1) |
//! |---|---|---|---|
//! | qwZ | all-gather | the group passed | `int8_wire_len(c, block)` per rank |
//! | qgZ, `L > 1` | all-to-all | intra-node ([`QuantGroups::intra`]) | `L·M·int4_wire_len(c, block)` |
//! | qgZ, `M > 1` | all-to-all | cross-node ([`QuantGroups::cross`]) | `M·int4_wire_len(c, block)` |
//!
//! qwZ moves `c + 4·⌈c/block⌉` bytes (plus ≤ 3 pad) per rank, about ½ of fp16; qgZ's cross-node
//! all-to-all moves `M·e ≈ M·(c/2 + 4·⌈c/block⌉)` bytes, about ¼ of the fp16 chunks it replaces.
//!
//! # Error bounds
//!
//! zero-quant's per-element bound for one round trip through a block with largest magnitude `a`
//! is `β(a) = a/(2·qmax) + 1e-6·a` (plus `(qmax+1)·2^-150` for blocks whose scale is subnormal),
//! `qmax = 127` (int8) or `7` (int4).
//!
//! - **qwZ** (f32): `|x̂ − x| ≤ β(a)` with `a` the absmax of the element's block in its owner's
//!   chunk; for bf16/f16 add the rounding of `x̂` to the type (zero-quant's crate docs).
//! - **qgZ** (f32): for element `i` of rank `p`'s output chunk, with `a_r` the absmax of the stage-1
//!   block (of chunk `p` on rank `r`) holding `i` and `A_k` the absmax of the stage-3 block (of
//!   node `k`'s partial sum for `p`) holding `i`,
//!
//!   ```text
//!   |ĝ_i − ḡ_i| ≤ ( Σ_r β(a_r) + Σ_k β(A_k) ) / N  +  f32 rounding of the sums and the division
//!   ```
//!
//!   where the second sum is absent when `L = 1` or `M = 1` (one quantization round; `a_r` is
//!   then the block absmax of that single quantization of rank `r`'s input). The `f32` rounding of
//!   the sums (relative `2^-24` per addition) is far below the quantization terms; the tests allow
//!   `1e-5·Σ_r a_r / N` for it. Since `A_k ≤ Σ_{r∈k} (a_r + β(a_r))`, a bound from the inputs
//!   alone is, for int4 and ignoring the `1e-6` terms,
//!
//!   ```text
//!   |ĝ_i − ḡ_i| ≤ (Σ_r a_r) · (2 + 1/14) / (14·N)        (L > 1 and M > 1)
//!   |ĝ_i − ḡ_i| ≤ (Σ_r a_r) / (14·N)                     (L = 1 or M = 1)
//!   ```
//!
//!   Every element goes through at most two quantizations, independent of `N` (a ring would need
//!   `N − 1`). This is invariant I10's `Σ_stage absmax/16` with zero-quant's `absmax/14` step
//!   (scale `absmax/7`, so `+absmax` is exact) and the division by `N`.
//!
//! # Failures
//!
//! - **Validation** (lengths: `len % N != 0`, an output of the wrong length, a world group that is
//!   not the whole topology): [`Error::LengthMismatch`] / [`Error::Topology`] on the calling rank
//!   before anything moves; every rank that passes the same lengths reports the same error.
//! - **Data** (a non-finite input element, a partial sum that overflows `f32`, a corrupt wire):
//!   the failing rank still takes part in every collective of the call but sends a **poisoned**
//!   wire (zero codes and a negative quiet-NaN marker carrying its rank in the first scale, or in
//!   the first value for the identity codec; no valid wire contains one), and its peers forward the
//!   poison through qgZ's second stage. Every rank then returns [`Error::Quant`] naming the failing
//!   rank; nothing non-finite is decoded. Nobody hangs and the groups stay usable, which is what
//!   an fp16 trainer needs to skip a step on every rank together. An `f32` overflow in qgZ's
//!   *final* sum or its rounding to bf16/f16 is seen only by the rank that owns the chunk.
//! - **Communication** errors ([`Error::PeerFailed`], [`Error::Timeout`], ...) are returned as the
//!   collective reported them; a rank that panics makes its peers fail fast.
//!
//! # Allocation
//!
//! [`QuantScratch`] keeps the host wires and the `f32` accumulators between calls; it grows to the
//! largest call and is not shrunk. The host path allocates each collective's send and receive
//! buffers afresh (host `Vec`s for the loopback); the device paths write into existing buffers with
//! [`Communicator::upload_into`].

mod device;
mod fault;

use std::fmt;

pub use device::{DeviceCodec, HostCodec, qgz_reduce_scatter_device, qwz_all_gather_device};
use zero_core::{Collective, TrafficTable};
use zero_quant::{BlockCodec, WireLayout};

use crate::communicator::Communicator;
use crate::element::Element;
use crate::error::{Error, Op, Result};
use fault::{Fault, length, poison};

/// An element type both zero-comm and zero-quant handle: `f32`, [`half::bf16`], [`half::f16`].
pub trait QuantElement: Element + zero_quant::Element {}

impl<T: Element + zero_quant::Element> QuantElement for T {}

/// Reusable host buffers of the quantized collectives (wires and `f32` accumulators).
///
/// One per thread (rank); any number of calls of any size may share it. It grows to the largest
/// call and keeps its capacity.
#[derive(Debug, Default, Clone)]
pub struct QuantScratch {
    send: Vec<u8>,
    recv: Vec<u8>,
    acc: Vec<f32>,
    tmp: Vec<f32>,
    /// The most wire bytes (send plus receive) one exchange has held.
    peak_wire: usize,
}

impl QuantScratch {
    /// Empty scratch; buffers are sized on first use.
    pub fn new() -> Self {
        Self::default()
    }

    /// The most bytes of encoded wire (send plus receive buffer) any one exchange through this
    /// scratch has held: the figure the plan's `communication_buffers` predicts for qwZ and qgZ.
    pub fn peak_wire_bytes(&self) -> usize {
        self.peak_wire
    }

    /// Bytes currently reserved.
    pub fn capacity_bytes(&self) -> usize {
        self.send.capacity()
            + self.recv.capacity()
            + 4 * (self.acc.capacity() + self.tmp.capacity())
    }
}

/// The two sub-groups of qgZ, split from a world communicator by [`QuantGroups::new`].
///
/// - `intra`: the `L` ranks of this rank's node, ordered by local rank (`split(color = node, key =
///   local)`); absent when `L = 1`.
/// - `cross`: the `M` ranks with this rank's local index on every node, ordered by node
///   (`split(color = local, key = node)`); absent when `M = 1`.
///
/// Each keeps its own traffic table ([`QuantGroups::traffic`] sums them).
pub struct QuantGroups<C> {
    intra: Option<C>,
    cross: Option<C>,
    world_size: usize,
    ranks_per_node: usize,
    num_nodes: usize,
    global_rank: usize,
}

impl<C: Communicator> fmt::Debug for QuantGroups<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuantGroups")
            .field("global_rank", &self.global_rank)
            .field("world_size", &self.world_size)
            .field("ranks_per_node", &self.ranks_per_node)
            .field("num_nodes", &self.num_nodes)
            .field("intra", &self.intra.as_ref().map(|c| c.members().to_vec()))
            .field("cross", &self.cross.as_ref().map(|c| c.members().to_vec()))
            .finish()
    }
}

impl<C: Communicator> QuantGroups<C> {
    /// Splits `world` into qgZ's intra- and cross-node groups. A collective over `world` (up to
    /// two [`split`](Communicator::split)s, the same on every rank).
    ///
    /// `world` must be the whole topology in rank order (members `0..N`), since qgZ's chunk `p`
    /// goes to global rank `p` and its stages follow the topology's contiguous nodes; any other
    /// group gives [`Error::Topology`] (on every rank, before anything moves).
    pub fn new(world: &mut C) -> Result<Self> {
        let topo = *world.topology();
        let n = topo.world_size();
        if world.world_size() != n || !world.members().iter().copied().eq(0..n) {
            return Err(Error::Topology(zero_core::Error::Invalid {
                field: "qgZ world group".into(),
                got: format!("members {:?}", world.members()),
                expected: format!("every global rank 0..{n} in order"),
            }));
        }
        let (l, m) = (topo.ranks_per_node(), topo.num_nodes());
        let g = world.global_rank();
        let (node, local) = (topo.node_of(g), topo.local_rank(g));
        let intra = if l > 1 {
            Some(world.split(node, local)?)
        } else {
            None
        };
        let cross = if m > 1 {
            Some(world.split(local, node)?)
        } else {
            None
        };
        Ok(QuantGroups {
            intra,
            cross,
            world_size: n,
            ranks_per_node: l,
            num_nodes: m,
            global_rank: g,
        })
    }

    /// The intra-node group (`None` when `L = 1`).
    pub fn intra(&self) -> Option<&C> {
        self.intra.as_ref()
    }

    /// The cross-node group (`None` when `M = 1`).
    pub fn cross(&self) -> Option<&C> {
        self.cross.as_ref()
    }

    /// `N`.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// `L`.
    pub fn ranks_per_node(&self) -> usize {
        self.ranks_per_node
    }

    /// `M`.
    pub fn num_nodes(&self) -> usize {
        self.num_nodes
    }

    /// This rank's global rank.
    pub fn global_rank(&self) -> usize {
        self.global_rank
    }

    /// Both sub-groups, mutably (`intra`, `cross`), for the device-side qgZ.
    fn groups_mut(&mut self) -> (Option<&mut C>, Option<&mut C>) {
        (self.intra.as_mut(), self.cross.as_mut())
    }

    /// The traffic of both sub-groups, merged (all-to-alls only).
    pub fn traffic(&self) -> TrafficTable {
        let mut t = TrafficTable::new();
        for c in self.intra.iter().chain(&self.cross) {
            t.merge(c.traffic());
        }
        t
    }
}

/// Error-feedback state of one gradient tensor on one rank, for [`qgz_reduce_scatter_ef`].
///
/// Holds the quantization residual of each quantization this rank performs: `r₁` (`N·c`) for the
/// first (of the input, per destination chunk) and `r₂` (`M·c`) for the second (of the node partial
/// sums, only when `L > 1` and `M > 1`). Each call quantizes `v = x + r` instead of `x` and keeps
/// `r ← v − x̂`, so what was lost in one step is sent in the next: the time average of the outputs
/// converges to the time average of the true means (plain qgZ keeps a fixed bias for a fixed input).
/// This is plain error feedback (`β = 1`, residuals kept in `f32`); LoCo-ZeRO++ blends with
/// `err_beta`, stores residuals in int8 and resets every `reset_T` calls, which a caller can
/// approximate with [`ErrorFeedback::reset`]. Sized by its first use; a later call with another length is [`Error::LengthMismatch`].
#[derive(Debug, Default, Clone)]
pub struct ErrorFeedback {
    first: Vec<f32>,
    second: Vec<f32>,
    len: Option<usize>,
}

impl ErrorFeedback {
    /// Empty state (zero residuals).
    pub fn new() -> Self {
        Self::default()
    }

    /// Zeroes the residuals (keeps the length), e.g. after a skipped step or every `reset_T` calls.
    pub fn reset(&mut self) {
        self.first.fill(0.0);
        self.second.fill(0.0);
    }

    /// The residual of the first quantization, per destination chunk (`N·c`; empty before use).
    pub fn first_residual(&self) -> &[f32] {
        &self.first
    }

    /// The residual of the second quantization (`M·c`; empty unless `L > 1` and `M > 1`).
    pub fn second_residual(&self) -> &[f32] {
        &self.second
    }
}

/// One equal-split all-to-all of `send`'s pieces of `layout` over `comm`, into `recv` (resized
/// to `send.len()`): every piece poisoned first when `fault` has a failure to pass on, every
/// received piece checked for poison after. `peak_wire` keeps the largest wire held.
fn exchange<C: Communicator>(
    comm: &mut C,
    layout: &WireLayout,
    (send, recv): (&mut [u8], &mut Vec<u8>),
    fault: &mut Fault,
    peak_wire: &mut usize,
) -> Result<()> {
    let e = layout.total_len.max(1);
    if let Some(o) = fault.origin() {
        for piece in send.chunks_exact_mut(e) {
            poison(piece, layout, o);
        }
    }
    let s = comm.upload(send)?;
    let mut r = comm.alloc::<u8>(send.len())?;
    comm.all_to_all(&s, &mut r)?;
    drop(s);
    recv.resize(send.len(), 0);
    comm.download(&r, recv)?;
    *peak_wire = (*peak_wire).max(send.len() + recv.len());
    for piece in recv.chunks_exact(e) {
        fault.check(piece, layout);
    }
    Ok(())
}

/// Decodes `pieces` into `acc` summed in `f32` in their order: the first decoded, the others
/// added with [`BlockCodec::decode_accumulate`].
fn decode_sum<'a, K: BlockCodec>(
    codec: &K,
    pieces: impl IntoIterator<Item = &'a [u8]>,
    acc: &mut [f32],
) -> zero_quant::Result<()> {
    for (k, piece) in pieces.into_iter().enumerate() {
        if k == 0 {
            codec.decode(piece, acc)?;
        } else {
            codec.decode_accumulate(piece, acc)?;
        }
    }
    Ok(())
}

/// qwZ: all-gathers every rank's `chunk` through `codec` (the plan uses [`zero_quant::Int8Block`];
/// [`zero_quant::Identity`] gives an exact all-gather with the same structure).
///
/// `out` must hold `n · chunk.len()` elements (`n = comm.world_size()`); rank `k`'s dequantized
/// chunk lands at `[k·c, (k+1)·c)`, on every rank including `k`. One
/// [`all_gather`](Communicator::all_gather) of `codec.encoded_len(c)` bytes per rank over `comm`,
/// which may be any group (the world, an hpZ group). Errors and bounds: see the [module
/// docs](self).
pub fn qwz_all_gather<C, K, E>(
    comm: &mut C,
    codec: &K,
    chunk: &[E],
    out: &mut [E],
    scratch: &mut QuantScratch,
) -> Result<()>
where
    C: Communicator,
    K: BlockCodec,
    E: QuantElement,
{
    let op = Op::Collective(Collective::AllGather);
    let (n, c, me) = (comm.world_size(), chunk.len(), comm.global_rank());
    if out.len() != n * c {
        return Err(length(op, me, n * c, out.len()));
    }
    let layout = codec.layout(c);
    let w = layout.total_len;
    let mut fault = Fault::new(op, me);

    scratch.send.resize(w, 0);
    if let Err(e) = codec.encode(chunk, &mut scratch.send) {
        fault.local(e);
        poison(&mut scratch.send, &layout, me);
    }
    let send = comm.upload(&scratch.send)?;
    let mut recv = comm.alloc::<u8>(n * w)?;
    comm.all_gather(&send, &mut recv)?;
    drop(send);
    scratch.recv.resize(n * w, 0);
    scratch.peak_wire = scratch.peak_wire.max(w + n * w);
    comm.download(&recv, &mut scratch.recv)?;
    drop(recv);

    for (j, piece) in scratch.recv.chunks_exact(w.max(1)).take(n).enumerate() {
        fault.check(piece, &layout);
        if fault.origin().is_none()
            && let Err(e) = codec.decode(piece, &mut out[j * c..(j + 1) * c])
        {
            fault.local(e);
        }
    }
    fault.finish()
}

/// qgZ: the mean over all `N` ranks of chunk `rank` of every rank's `input`, through `codec`
/// (the plan uses [`zero_quant::Int4Block`]; [`zero_quant::Identity`] gives an exact
/// reduce-scatter with the same structure), by the hierarchical all-to-all of the [module
/// docs](self).
///
/// `input.len()` must be a multiple of `N` (the plan pads units to multiples of `2N`), else
/// [`Error::LengthMismatch`] with the next multiple as `expected`; `out` must hold `input.len()/N`
/// elements. Issues at most one intra-node all-to-all (`L > 1`) and one cross-node all-to-all
/// (`M > 1`).
pub fn qgz_reduce_scatter<C, K, E>(
    groups: &mut QuantGroups<C>,
    codec: &K,
    input: &[E],
    out: &mut [E],
    scratch: &mut QuantScratch,
) -> Result<()>
where
    C: Communicator,
    K: BlockCodec,
    E: QuantElement,
{
    qgz(groups, codec, input, out, scratch, None)
}

/// [`qgz_reduce_scatter`] with error feedback: each quantization this rank performs adds the
/// residual it left last time (see [`ErrorFeedback`]). Same collectives and bytes. One
/// `feedback` per gradient tensor per rank. The per-call error is no longer bounded by the
/// plain bound alone (it also carries the previous residual, itself at most one quantization
/// step), but errors do not accumulate over calls. After an error the residuals are unspecified:
/// [`ErrorFeedback::reset`] them.
pub fn qgz_reduce_scatter_ef<C, K, E>(
    groups: &mut QuantGroups<C>,
    codec: &K,
    input: &[E],
    out: &mut [E],
    scratch: &mut QuantScratch,
    feedback: &mut ErrorFeedback,
) -> Result<()>
where
    C: Communicator,
    K: BlockCodec,
    E: QuantElement,
{
    qgz(groups, codec, input, out, scratch, Some(feedback))
}

/// Encodes `x + r` (or `x` without feedback) into `dst`; with feedback, `r ← (x + r) − x̂`.
fn encode_fb<K: BlockCodec, E: QuantElement>(
    codec: &K,
    x: &[E],
    residual: Option<&mut [f32]>,
    tmp: &mut Vec<f32>,
    dst: &mut [u8],
) -> zero_quant::Result<()> {
    let Some(r) = residual else {
        return codec.encode(x, dst);
    };
    tmp.clear();
    tmp.extend(x.iter().zip(r.iter()).map(|(&v, &r)| v.widen() + r));
    codec.encode(tmp.as_slice(), dst)?;
    // r = v − x̂, with x̂ decoded from the very bytes sent.
    r.copy_from_slice(tmp);
    tmp.fill(0.0);
    codec.decode_accumulate(dst, tmp)?;
    for (r, &q) in r.iter_mut().zip(tmp.iter()) {
        *r -= q;
    }
    Ok(())
}

fn qgz<C, K, E>(
    groups: &mut QuantGroups<C>,
    codec: &K,
    input: &[E],
    out: &mut [E],
    scratch: &mut QuantScratch,
    mut feedback: Option<&mut ErrorFeedback>,
) -> Result<()>
where
    C: Communicator,
    K: BlockCodec,
    E: QuantElement,
{
    let op = Op::Collective(Collective::ReduceScatter);
    let (n, l, m, me) = (
        groups.world_size,
        groups.ranks_per_node,
        groups.num_nodes,
        groups.global_rank,
    );
    let len = input.len();
    if !len.is_multiple_of(n) {
        return Err(length(op, me, len.next_multiple_of(n), len));
    }
    let c = len / n;
    if out.len() != c {
        return Err(length(op, me, c, out.len()));
    }
    if let Some(fb) = feedback.as_deref_mut() {
        match fb.len {
            Some(prev) if prev != len => return Err(length(op, me, prev, len)),
            Some(_) => {}
            None => {
                fb.len = Some(len);
                fb.first = vec![0.0; len];
                fb.second = if l > 1 && m > 1 {
                    vec![0.0; m * c]
                } else {
                    Vec::new()
                };
            }
        }
    }
    let mut fault = Fault::new(op, me);

    if n == 1 {
        if let Some(i) = input.iter().position(|v| !v.widen().is_finite()) {
            fault.local(zero_quant::Error::NonFinite {
                index: i,
                value: input[i].widen(),
            });
            return fault.finish();
        }
        out.copy_from_slice(input);
        return Ok(());
    }

    let layout = codec.layout(c);
    let e = layout.total_len;
    let QuantScratch {
        send,
        recv,
        acc,
        tmp,
        peak_wire,
    } = scratch;
    acc.resize((m * c).max(c), 0.0);

    // Stages 1-2: intra-node exchange, node partial sums for the M destinations in `acc`.
    if let Some(intra) = groups.intra.as_mut() {
        send.resize(l * m * e, 0);
        'encode: for lp in 0..l {
            for mp in 0..m {
                let p = mp * l + lp;
                let slot = (lp * m + mp) * e;
                let r = feedback
                    .as_deref_mut()
                    .map(|fb| &mut fb.first[p * c..(p + 1) * c]);
                let x = &input[p * c..(p + 1) * c];
                if let Err(err) = encode_fb(codec, x, r, tmp, &mut send[slot..slot + e]) {
                    fault.local(err);
                    break 'encode;
                }
            }
        }
        exchange(intra, &layout, (send, recv), &mut fault, peak_wire)?;
        if fault.origin().is_none() {
            for mp in 0..m {
                let pieces = (0..l).map(|j| &recv[(j * m + mp) * e..(j * m + mp + 1) * e]);
                if let Err(err) = decode_sum(codec, pieces, &mut acc[mp * c..(mp + 1) * c]) {
                    fault.local(err);
                    break;
                }
            }
        }
    }

    // Stage 3: cross-node exchange of the partials (or, with L = 1, of the input chunks).
    if let Some(cross) = groups.cross.as_mut() {
        send.resize(m * e, 0);
        if fault.origin().is_none() {
            for mp in 0..m {
                let dst = &mut send[mp * e..(mp + 1) * e];
                let r = if l > 1 {
                    let res = feedback
                        .as_deref_mut()
                        .map(|fb| &mut fb.second[mp * c..(mp + 1) * c]);
                    encode_fb(codec, &acc[mp * c..(mp + 1) * c], res, tmp, dst)
                } else {
                    // L = 1: destination p = mp·1 + 0; this is the first quantization.
                    let res = feedback
                        .as_deref_mut()
                        .map(|fb| &mut fb.first[mp * c..(mp + 1) * c]);
                    encode_fb(codec, &input[mp * c..(mp + 1) * c], res, tmp, dst)
                };
                if let Err(err) = r {
                    fault.local(err);
                    break;
                }
            }
        }
        exchange(cross, &layout, (send, recv), &mut fault, peak_wire)?;
        if fault.origin().is_none() {
            let pieces = (0..m).map(|k| &recv[k * e..(k + 1) * e]);
            if let Err(err) = decode_sum(codec, pieces, &mut acc[..c]) {
                fault.local(err);
            }
        }
    }

    if fault.origin().is_some() {
        return fault.finish();
    }
    // Stage 4: the mean, rounded once to E.
    let nf = n as f32;
    for (i, (o, &s)) in out.iter_mut().zip(acc[..c].iter()).enumerate() {
        let v = s / nf;
        let y = E::narrow(v);
        if !y.widen().is_finite() {
            fault.local(zero_quant::Error::Overflow {
                index: i,
                value: v,
                dtype: <E as zero_quant::Element>::DTYPE,
            });
            return fault.finish();
        }
        *o = y;
    }
    Ok(())
}
