//! The codecs and the [`BlockCodec`] trait.

use crate::element::Element;
use crate::error::{Error, Result};
use crate::kernels::{self, I4, I8, QFormat};

/// Default int8 (qwZ) block size, in elements. See the crate docs for the
/// measurements behind it.
pub const DEFAULT_INT8_BLOCK: usize = 1024;

/// Default int4 (qgZ) block size, in elements. See the crate docs for the
/// measurements behind it.
pub const DEFAULT_INT4_BLOCK: usize = 512;

/// A parallel call gives each thread at least this many elements.
const MIN_ELEMS_PER_THREAD: usize = 1 << 16;

/// Byte layout of one encoded tensor of `n_elems` elements.
///
/// `[codes: codes_len][zero padding to a multiple of 4][scales: 4 * num_blocks]`,
/// with `scales_offset = codes_len` rounded up to a multiple of 4 and each
/// scale a little-endian `f32`. For [`Identity`], `codes_len = 4 * n_elems`
/// (raw little-endian `f32`) and there are no scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WireLayout {
    /// Elements in the tensor.
    pub n_elems: usize,
    /// Scale blocks (`ceil(n_elems / block_size)`; 0 for [`Identity`]).
    pub num_blocks: usize,
    /// Bytes of codes at the start of the buffer.
    pub codes_len: usize,
    /// Byte offset of the first scale (`codes_len` rounded up to 4).
    pub scales_offset: usize,
    /// Total bytes: `scales_offset + 4 * num_blocks`.
    pub total_len: usize,
}

pub(crate) mod sealed {
    use crate::element::Element;
    use crate::error::Result;

    /// Codec internals; not part of the public API. Sub-range kernels take
    /// whole blocks (the last may be partial) and report indices relative to
    /// the sub-range.
    pub trait Raw {
        fn name(&self) -> &'static str;
        /// Elements per block; any multiple of it is a valid split point.
        fn unit(&self) -> usize;
        /// Bytes of codes for `n` elements.
        fn codes_len(&self, n: usize) -> usize;
        /// Scale blocks for `n` elements.
        fn blocks(&self, n: usize) -> usize;
        /// Two codes per byte (the high nibble after an odd tensor is padding).
        fn packs_pairs(&self) -> bool {
            false
        }
        fn encode_raw<E: Element>(
            &self,
            src: &[E],
            codes: &mut [u8],
            scales: &mut [u8],
        ) -> Result<()>;
        fn decode_raw<E: Element>(&self, codes: &[u8], scales: &[u8], dst: &mut [E]) -> Result<()>;
        fn accumulate_raw(&self, codes: &[u8], scales: &[u8], acc: &mut [f32]) -> Result<()>;
    }
}
use sealed::Raw;

/// A codec with a fixed wire layout, encoding from and decoding into
/// caller-provided buffers.
///
/// Sealed: implemented by [`Int8Block`], [`Int4Block`], [`Identity`] and the
/// runtime-selected [`Codec`]. All methods are provided.
///
/// **Length rules** (checked on every call, [`Error::BufferLen`] otherwise):
/// the wire buffer is exactly [`encoded_len(n)`](BlockCodec::encoded_len)
/// bytes, where `n` is the length of the element slice (`src` for encode,
/// `dst`/`acc` for decode). The element count is not stored on the wire; both
/// sides must agree on it, as they do for any collective.
///
/// **Allocation:** the serial methods allocate nothing. The `_par` methods
/// spawn scoped threads (no pool) and give each at least 65 536 elements;
/// with `threads <= 1`, or a small tensor, they run on the calling thread.
/// Their results are bit-identical to the serial methods, including which
/// error is reported.
///
/// **Errors:** encode rejects NaN and infinities ([`Error::NonFinite`] with
/// the first offending index); decode validates scales, codes and padding
/// ([`Error::InvalidScale`], [`Error::InvalidCode`], [`Error::Padding`]) and
/// reports values that overflow a bf16/f16 destination ([`Error::Overflow`]),
/// so decoding never produces a non-finite value. On error the destination
/// contents are unspecified.
pub trait BlockCodec: Raw + std::fmt::Debug + Send + Sync {
    /// Elements per scale block (1 for [`Identity`]). Blocks are laid out
    /// from element 0; the last one may be partial.
    fn block_size(&self) -> usize {
        self.unit()
    }

    /// Number of scale blocks for `n` elements (0 for [`Identity`]).
    fn num_blocks(&self, n: usize) -> usize {
        self.blocks(n)
    }

    /// Byte layout of an encoded tensor of `n` elements.
    fn layout(&self, n: usize) -> WireLayout {
        let codes_len = self.codes_len(n);
        let num_blocks = self.blocks(n);
        let scales_offset = codes_len.next_multiple_of(4);
        WireLayout {
            n_elems: n,
            num_blocks,
            codes_len,
            scales_offset,
            total_len: scales_offset + 4 * num_blocks,
        }
    }

    /// Bytes of an encoded tensor of `n` elements.
    fn encoded_len(&self, n: usize) -> usize {
        self.layout(n).total_len
    }

    /// Encodes `src` into `dst` (`dst.len() == encoded_len(src.len())`).
    fn encode<E: Element>(&self, src: &[E], dst: &mut [u8]) -> Result<()> {
        self.encode_par(src, dst, 1)
    }

    /// Decodes `src` into `dst` (`src.len() == encoded_len(dst.len())`), in
    /// the element type of `dst`.
    fn decode<E: Element>(&self, src: &[u8], dst: &mut [E]) -> Result<()> {
        self.decode_par(src, dst, 1)
    }

    /// `acc[i] += x̂[i]` where `x̂` is what [`decode`](BlockCodec::decode)
    /// into `f32` would produce (bit for bit: each `x̂[i]` is rounded to
    /// `f32` before the add). `src.len() == encoded_len(acc.len())`.
    /// The reduction step of qgZ: dequantize and sum in fp32. The wire is
    /// validated as for `decode`; the sums themselves are plain `f32` adds
    /// (an accumulator near `f32::MAX` can overflow like any fp32 sum).
    fn decode_accumulate(&self, src: &[u8], acc: &mut [f32]) -> Result<()> {
        self.decode_accumulate_par(src, acc, 1)
    }

    /// [`encode`](BlockCodec::encode) on up to `threads` threads, split on
    /// block boundaries.
    fn encode_par<E: Element>(&self, src: &[E], dst: &mut [u8], threads: usize) -> Result<()> {
        let l = self.layout(src.len());
        check_len(self.name(), "encode dst bytes", l.total_len, dst.len())?;
        let (codes, rest) = dst.split_at_mut(l.codes_len);
        let (pad, scales) = rest.split_at_mut(l.scales_offset - l.codes_len);
        pad.fill(0);
        split_run(self, src.len(), threads, src, codes, scales, |x, c, s| {
            self.encode_raw(x, c, s)
        })
    }

    /// [`decode`](BlockCodec::decode) on up to `threads` threads.
    fn decode_par<E: Element>(&self, src: &[u8], dst: &mut [E], threads: usize) -> Result<()> {
        let (codes, scales) = split_wire(self, src, dst.len(), "decode src bytes")?;
        split_run(self, dst.len(), threads, dst, codes, scales, |y, c, s| {
            self.decode_raw(c, s, y)
        })
    }

    /// [`decode_accumulate`](BlockCodec::decode_accumulate) on up to
    /// `threads` threads.
    fn decode_accumulate_par(&self, src: &[u8], acc: &mut [f32], threads: usize) -> Result<()> {
        let (codes, scales) = split_wire(self, src, acc.len(), "decode_accumulate src bytes")?;
        split_run(self, acc.len(), threads, acc, codes, scales, |a, c, s| {
            self.accumulate_raw(c, s, a)
        })
    }
}

/// Checks the length and the zero padding of a wire buffer for `n` elements
/// and returns its codes and scales.
fn split_wire<'a, C: Raw + ?Sized>(
    codec: &C,
    src: &'a [u8],
    n: usize,
    what: &'static str,
) -> Result<(&'a [u8], &'a [u8])> {
    let codes_len = codec.codes_len(n);
    let scales_offset = codes_len.next_multiple_of(4);
    let total = scales_offset + 4 * codec.blocks(n);
    check_len(codec.name(), what, total, src.len())?;
    let (codes, rest) = src.split_at(codes_len);
    let (pad, scales) = rest.split_at(scales_offset - codes_len);
    // The high nibble after an odd int4 tensor is padding too.
    if codec.packs_pairs() && n % 2 == 1 && codes[codes_len - 1] & 0xf0 != 0 {
        return Err(Error::Padding {
            codec: codec.name(),
            offset: codes_len - 1,
            byte: codes[codes_len - 1],
        });
    }
    if let Some(i) = pad.iter().position(|&b| b != 0) {
        return Err(Error::Padding {
            codec: codec.name(),
            offset: codes_len + i,
            byte: pad[i],
        });
    }
    Ok((codes, scales))
}

fn check_len(codec: &'static str, what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::BufferLen {
            codec,
            what,
            expected,
            got,
        })
    }
}

/// A slice that can be split in two (shared or exclusive).
trait Part: Sized + Send {
    fn split(self, at: usize) -> (Self, Self);
}

impl<T: Sync> Part for &[T] {
    fn split(self, at: usize) -> (Self, Self) {
        self.split_at(at)
    }
}

impl<T: Send> Part for &mut [T] {
    fn split(self, at: usize) -> (Self, Self) {
        self.split_at_mut(at)
    }
}

/// Runs `f(elems, codes, scales)` over `n` elements split into at most
/// `threads` pieces on block boundaries; the first piece runs on the calling
/// thread. Returns the error of the lowest failing piece (the one a serial run
/// reports), with its indices made absolute.
fn split_run<C, X, K, S, F>(
    codec: &C,
    n: usize,
    threads: usize,
    elems: X,
    codes: K,
    scales: S,
    f: F,
) -> Result<()>
where
    C: Raw + ?Sized,
    X: Part,
    K: Part,
    S: Part,
    F: Fn(X, K, S) -> Result<()> + Sync,
{
    let unit = codec.unit();
    let units = n.div_ceil(unit);
    let pieces = threads.min(n / MIN_ELEMS_PER_THREAD).min(units).max(1);
    if pieces == 1 {
        return f(elems, codes, scales);
    }
    let per = units.div_ceil(pieces) * unit;
    std::thread::scope(|scope| {
        let (mut elems, mut codes, mut scales) = (elems, codes, scales);
        let mut handles = Vec::with_capacity(pieces - 1);
        let mut first = None;
        let mut start = 0;
        while start < n {
            let len = per.min(n - start);
            let (x, xr) = elems.split(len);
            let (c, cr) = codes.split(codec.codes_len(len));
            let (s, sr) = scales.split(4 * codec.blocks(len));
            (elems, codes, scales) = (xr, cr, sr);
            let offsets = (start, codec.blocks(start));
            if first.is_none() {
                first = Some((x, c, s, offsets));
            } else {
                let f = &f;
                handles.push((scope.spawn(move || f(x, c, s)), offsets));
            }
            start += len;
        }
        let (x, c, s, offsets) = first.expect("n > 0");
        let mut results = Vec::with_capacity(pieces);
        results.push((f(x, c, s), offsets));
        for (h, offsets) in handles {
            let r = h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
            results.push((r, offsets));
        }
        results
            .into_iter()
            .map(|(r, (e, b))| r.map_err(|err| err.offset(e, b)))
            .collect::<Result<Vec<()>>>()
            .map(|_| ())
    })
}

/// Symmetric int8 block quantization (qwZ weights).
///
/// Per block of [`block_size`](BlockCodec::block_size) elements with largest
/// magnitude `absmax`:
/// - `scale = absmax / 127` rounded to `f32`: the **dequantization
///   multiplier**, stored on the wire;
/// - `q = round_half_away_from_zero(x * (1 / scale))` clamped to `[-127, 127]`,
///   stored as the `i8` bit pattern (code `0x80`, i.e. -128, is never written
///   and is rejected on decode);
/// - `x̂ = q * scale`.
///
/// Error bound, per element: `|x - x̂| <= absmax / 254 + 1e-6 * absmax`
/// (the second term covers `f32` rounding of `1/scale`, `x * inv` and
/// `q * scale`; its true size is below `3e-7 * absmax`). `+absmax` itself
/// maps to 127 with no extra error, unlike DeepSpeed's `scale = 128/absmax`
/// whose `+absmax` clamps and errs by `absmax/128`. For blocks with
/// `absmax < 127 * 2^-126` (about 1.5e-36) the scale is subnormal and an
/// absolute term `2^-143` is added. An all-zero block has scale 0 and
/// decodes exactly (to `+0.0`; the sign of zero is not kept).
/// Re-encoding a decoded `f32` block reproduces its codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Int8Block {
    block_size: usize,
}

impl Int8Block {
    /// Largest code magnitude: codes lie in `[-127, 127]`.
    pub const QMAX: i32 = 127;

    /// An int8 codec with `block_size` elements per scale (must be non-zero).
    pub fn new(block_size: usize) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::BlockSize {
                codec: I8::NAME,
                multiple_of: 1,
                got: block_size,
            });
        }
        Ok(Self { block_size })
    }
}

impl Default for Int8Block {
    /// Block size [`DEFAULT_INT8_BLOCK`].
    fn default() -> Self {
        Self {
            block_size: DEFAULT_INT8_BLOCK,
        }
    }
}

impl Raw for Int8Block {
    fn name(&self) -> &'static str {
        I8::NAME
    }
    fn unit(&self) -> usize {
        self.block_size
    }
    fn codes_len(&self, n: usize) -> usize {
        I8::codes_len(n)
    }
    fn blocks(&self, n: usize) -> usize {
        n.div_ceil(self.block_size)
    }
    fn encode_raw<E: Element>(&self, src: &[E], codes: &mut [u8], scales: &mut [u8]) -> Result<()> {
        kernels::encode::<I8, E>(self.block_size, src, codes, scales)
    }
    fn decode_raw<E: Element>(&self, codes: &[u8], scales: &[u8], dst: &mut [E]) -> Result<()> {
        kernels::decode::<I8, E>(self.block_size, codes, scales, dst)
    }
    fn accumulate_raw(&self, codes: &[u8], scales: &[u8], acc: &mut [f32]) -> Result<()> {
        kernels::accumulate::<I8>(self.block_size, codes, scales, acc)
    }
}

impl BlockCodec for Int8Block {}

/// Symmetric int4 block quantization (qgZ gradients), two codes per byte.
///
/// As [`Int8Block`] with `qmax = 7`: `scale = absmax / 7`,
/// `q = round_half_away_from_zero(x * (1 / scale))` clamped to `[-7, 7]`,
/// `x̂ = q * scale`. Codes are packed two per byte: element `2i` in the low
/// nibble of byte `i`, element `2i + 1` in the high nibble, as two's
/// complement nibbles (nibble `0x8`, i.e. -8, is never written and is
/// rejected on decode). For an odd element count the last high nibble is 0.
/// The block size must be even so that every block starts on a byte.
///
/// Error bound, per element: `|x - x̂| <= absmax / 14 + 1e-6 * absmax`
/// (plus `2^-147` absolute when `absmax < 7 * 2^-126`); `+absmax` maps to 7
/// exactly. Re-encoding a decoded `f32` block reproduces its codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Int4Block {
    block_size: usize,
}

impl Int4Block {
    /// Largest code magnitude: codes lie in `[-7, 7]`.
    pub const QMAX: i32 = 7;

    /// An int4 codec with `block_size` elements per scale (must be non-zero
    /// and even).
    pub fn new(block_size: usize) -> Result<Self> {
        if block_size == 0 || !block_size.is_multiple_of(2) {
            return Err(Error::BlockSize {
                codec: I4::NAME,
                multiple_of: 2,
                got: block_size,
            });
        }
        Ok(Self { block_size })
    }
}

impl Default for Int4Block {
    /// Block size [`DEFAULT_INT4_BLOCK`].
    fn default() -> Self {
        Self {
            block_size: DEFAULT_INT4_BLOCK,
        }
    }
}

impl Raw for Int4Block {
    fn name(&self) -> &'static str {
        I4::NAME
    }
    fn unit(&self) -> usize {
        self.block_size
    }
    fn codes_len(&self, n: usize) -> usize {
        I4::codes_len(n)
    }
    fn packs_pairs(&self) -> bool {
        true
    }
    fn blocks(&self, n: usize) -> usize {
        n.div_ceil(self.block_size)
    }
    fn encode_raw<E: Element>(&self, src: &[E], codes: &mut [u8], scales: &mut [u8]) -> Result<()> {
        kernels::encode::<I4, E>(self.block_size, src, codes, scales)
    }
    fn decode_raw<E: Element>(&self, codes: &[u8], scales: &[u8], dst: &mut [E]) -> Result<()> {
        kernels::decode::<I4, E>(self.block_size, codes, scales, dst)
    }
    fn accumulate_raw(&self, codes: &[u8], scales: &[u8], acc: &mut [f32]) -> Result<()> {
        kernels::accumulate::<I4>(self.block_size, codes, scales, acc)
    }
}

impl BlockCodec for Int4Block {}

/// The exact codec: the wire is the elements widened to `f32`, little-endian
/// (`4 * n` bytes, no scales). Decoding returns the input bit for bit (for
/// bf16/f16, widening then narrowing is exact). It follows the same contract
/// as the quantizing codecs (rejects NaN and infinities), so a quantized
/// collective run with `Identity` must equal the unquantized collective bit
/// for bit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Identity;

impl Raw for Identity {
    fn name(&self) -> &'static str {
        "identity"
    }
    fn unit(&self) -> usize {
        1
    }
    fn codes_len(&self, n: usize) -> usize {
        4 * n
    }
    fn blocks(&self, _n: usize) -> usize {
        0
    }
    fn encode_raw<E: Element>(
        &self,
        src: &[E],
        codes: &mut [u8],
        _scales: &mut [u8],
    ) -> Result<()> {
        kernels::identity_encode(src, codes)
    }
    fn decode_raw<E: Element>(&self, codes: &[u8], _scales: &[u8], dst: &mut [E]) -> Result<()> {
        kernels::identity_decode(codes, dst)
    }
    fn accumulate_raw(&self, codes: &[u8], _scales: &[u8], acc: &mut [f32]) -> Result<()> {
        kernels::identity_accumulate(codes, acc)
    }
}

impl BlockCodec for Identity {}

/// A codec chosen at run time (e.g. from a config), dispatching to one of the
/// concrete codecs. Same layouts and results as the codec it wraps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    /// [`Identity`].
    Identity(Identity),
    /// [`Int8Block`].
    Int8(Int8Block),
    /// [`Int4Block`].
    Int4(Int4Block),
}

impl From<Identity> for Codec {
    fn from(c: Identity) -> Self {
        Codec::Identity(c)
    }
}

impl From<Int8Block> for Codec {
    fn from(c: Int8Block) -> Self {
        Codec::Int8(c)
    }
}

impl From<Int4Block> for Codec {
    fn from(c: Int4Block) -> Self {
        Codec::Int4(c)
    }
}

macro_rules! dispatch {
    ($self:ident, $c:ident => $e:expr) => {
        match $self {
            Codec::Identity($c) => $e,
            Codec::Int8($c) => $e,
            Codec::Int4($c) => $e,
        }
    };
}

impl Raw for Codec {
    fn name(&self) -> &'static str {
        dispatch!(self, c => c.name())
    }
    fn unit(&self) -> usize {
        dispatch!(self, c => c.unit())
    }
    fn codes_len(&self, n: usize) -> usize {
        dispatch!(self, c => c.codes_len(n))
    }
    fn blocks(&self, n: usize) -> usize {
        dispatch!(self, c => c.blocks(n))
    }
    fn packs_pairs(&self) -> bool {
        dispatch!(self, c => c.packs_pairs())
    }
    fn encode_raw<E: Element>(&self, src: &[E], codes: &mut [u8], scales: &mut [u8]) -> Result<()> {
        dispatch!(self, c => c.encode_raw(src, codes, scales))
    }
    fn decode_raw<E: Element>(&self, codes: &[u8], scales: &[u8], dst: &mut [E]) -> Result<()> {
        dispatch!(self, c => c.decode_raw(codes, scales, dst))
    }
    fn accumulate_raw(&self, codes: &[u8], scales: &[u8], acc: &mut [f32]) -> Result<()> {
        dispatch!(self, c => c.accumulate_raw(codes, scales, acc))
    }
}

impl BlockCodec for Codec {}
