//! qwZ and qgZ on device memory (feature `nccl`): the quantized all-gather and the hierarchical
//! quantized reduce-scatter with zero-quant's CUDA kernels, so a GPU trainer's weights and
//! gradients never pass through the host.
//!
//! The same collectives, bytes and results as [`qwz_all_gather`](crate::quantized::qwz_all_gather)
//! and [`qgz_reduce_scatter`](crate::quantized::qgz_reduce_scatter) bit for bit (the CUDA codecs
//! are bit-identical to the host ones, and qgZ's final division is a hand-written PTX kernel with
//! IEEE `div.rn.f32` and the host's rounding to bf16/f16), with the same error contract: a rank
//! whose data cannot be encoded sends poisoned pieces, and every rank fails with
//! [`Error::Quant`](crate::Error::Quant) naming it. Only the failure path reads a wire back to the
//! host (to find the poison marker).

use std::ffi::c_void;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use zero_core::Collective;
use zero_quant::cuda::CudaElement;
use zero_quant::{BlockCodec, Codec, CudaQuantizer, WireLayout};

use super::backend::kernels::PtxModule;
use super::{NcclBuffer, NcclComm};
use crate::Communicator;
use crate::element::Element;
use crate::error::{Error, Op, Result};
use crate::quantized::{Fault, QuantElement, QuantGroups, length, poison};

/// qwZ all-gather on device: every rank's `chunk` is encoded with `codec` by `quantizer` on the
/// GPU, the wires are all-gathered by NCCL, and rank `k`'s decoded chunk lands at
/// `[k·c, (k+1)·c)` of `out` (`n · c` elements). `quantizer` must run on the communicator's
/// stream (`CudaQuantizer::new(comm.stream().clone())`), which orders its kernels with the
/// collective; a quantizer on another stream is refused.
pub fn qwz_all_gather_device<E>(
    comm: &mut NcclComm,
    quantizer: &CudaQuantizer,
    codec: impl Into<Codec>,
    chunk: &NcclBuffer<E>,
    out: &mut NcclBuffer<E>,
) -> Result<()>
where
    E: Element + CudaElement,
{
    let codec: Codec = codec.into();
    let op = Op::Collective(Collective::AllGather);
    let (n, c, me) = (comm.world_size(), chunk.len(), comm.global_rank());
    if out.len() != n * c {
        return Err(length(op, me, n * c, out.len()));
    }
    if quantizer.stream().cu_stream() != comm.stream().cu_stream() {
        return Err(Error::Backend(
            "nccl: qwz_all_gather_device: the quantizer runs on another stream than the \
             communicator (make it with CudaQuantizer::new(comm.stream().clone()))"
                .into(),
        ));
    }
    let layout = codec.layout(c);
    let w = layout.total_len;
    let mut fault = Fault::new(op, me);

    let mut send = comm.alloc::<u8>(w)?;
    if let Err(e) = quantizer.encode(codec, &chunk.view(), &mut send.view_mut()) {
        fault.local(e);
        let mut host = vec![0u8; w];
        poison(&mut host, &layout, me);
        comm.upload_into(&host, &mut send)?;
    }
    let mut recv = comm.alloc::<u8>(n * w)?;
    comm.all_gather(&send, &mut recv)?;
    drop(send);

    let mut decode_error = None;
    {
        let wire = recv.view();
        let mut dst = out.view_mut();
        for j in 0..n {
            let piece = wire.slice(j * w..(j + 1) * w);
            let mut part = dst.slice_mut(j * c..(j + 1) * c);
            if let Err(e) = quantizer.decode(codec, &piece, &mut part) {
                decode_error.get_or_insert(e);
            }
        }
    }
    fault.finish_device(decode_error, &layout, n, || comm.download_vec(&recv))
}

// ---------------------------------------------------------------------------------------------
// qgZ's final step: `out[i] = E(acc[i] / n)`

/// The PTX of `zero_qgz_finish_{f32,f16,bf16}(u64 acc, u64 out, u64 len, f32 divisor)`: a
/// grid-stride loop doing `out[i] = round_E(acc[i] / divisor)` with IEEE `div.rn.f32` (a true
/// division, as the host's `/`), then `cvt.rn.f16.f32` for f16, or for bf16 the integer
/// round-to-nearest-even of `half`'s `from_f32` (NaNs stay quiet NaNs), step for step as the
/// backend's mean kernels (`backend/kernels.rs`) do it in place.
fn finish_ptx() -> String {
    let body = |name: &str, store: &str| {
        format!(
            r#"
.visible .entry zero_qgz_finish_{name}(
	.param .u64 p_acc,
	.param .u64 p_out,
	.param .u64 p_len,
	.param .f32 p_div
)
{{
	.reg .pred 	%p<3>;
	.reg .b16 	%rs<2>;
	.reg .b32 	%r<10>;
	.reg .b64 	%rd<10>;
	.reg .f32 	%f<4>;

	ld.param.u64 	%rd1, [p_acc];
	ld.param.u64 	%rd8, [p_out];
	ld.param.u64 	%rd2, [p_len];
	ld.param.f32 	%f1, [p_div];
	cvta.to.global.u64 	%rd1, %rd1;
	cvta.to.global.u64 	%rd8, %rd8;
	mov.u32 	%r1, %ctaid.x;
	mov.u32 	%r2, %ntid.x;
	mov.u32 	%r3, %tid.x;
	mov.u32 	%r4, %nctaid.x;
	mul.wide.u32 	%rd3, %r1, %r2;
	cvt.u64.u32 	%rd4, %r3;
	add.s64 	%rd3, %rd3, %rd4;
	mul.wide.u32 	%rd5, %r4, %r2;
$L_{name}_loop:
	setp.ge.u64 	%p1, %rd3, %rd2;
	@%p1 bra 	$L_{name}_done;
	shl.b64 	%rd6, %rd3, 2;
	add.s64 	%rd7, %rd1, %rd6;
	ld.global.f32 	%f2, [%rd7];
	div.rn.f32 	%f3, %f2, %f1;
{store}
	add.s64 	%rd3, %rd3, %rd5;
	bra 	$L_{name}_loop;
$L_{name}_done:
	ret;
}}
"#
        )
    };
    let f32 = "\tadd.s64 \t%rd9, %rd8, %rd6;\n\tst.global.f32 \t[%rd9], %f3;";
    let f16 = "\tcvt.rn.f16.f32 \t%rs1, %f3;\n\
               \tshl.b64 \t%rd6, %rd3, 1;\n\
               \tadd.s64 \t%rd9, %rd8, %rd6;\n\
               \tst.global.u16 \t[%rd9], %rs1;";
    let bf16 = "\tmov.b32 \t%r6, %f3;\n\
                \tshr.u32 \t%r7, %r6, 16;\n\
                \tand.b32 \t%r7, %r7, 1;\n\
                \tadd.s32 \t%r7, %r7, 32767;\n\
                \tadd.s32 \t%r7, %r6, %r7;\n\
                \tshr.u32 \t%r7, %r7, 16;\n\
                \tshr.u32 \t%r8, %r6, 16;\n\
                \tor.b32 \t%r8, %r8, 64;\n\
                \tsetp.nan.f32 \t%p2, %f3, %f3;\n\
                \tselp.b32 \t%r9, %r8, %r7, %p2;\n\
                \tcvt.u16.u32 \t%rs1, %r9;\n\
                \tshl.b64 \t%rd6, %rd3, 1;\n\
                \tadd.s64 \t%rd9, %rd8, %rd6;\n\
                \tst.global.u16 \t[%rd9], %rs1;";
    format!(
        ".version 7.0\n.target sm_52\n.address_size 64\n{}{}{}",
        body("f32", f32),
        body("f16", f16),
        body("bf16", bf16)
    )
}

/// The finish kernels of one context, JIT-compiled (`cuModuleLoadData`) on first use and kept
/// for the life of the process (one module per context; the context is retained with it).
struct Finish(PtxModule);

static FINISH: Mutex<Vec<Arc<Finish>>> = Mutex::new(Vec::new());

fn backend(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Backend(format!("nccl: qgz_reduce_scatter_device: {what}: {e}"))
}

impl Finish {
    fn get(ctx: &Arc<CudaContext>) -> Result<Arc<Finish>> {
        let mut cache = FINISH.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(k) = cache
            .iter()
            .find(|k| k.0.context().cu_ctx() == ctx.cu_ctx())
        {
            return Ok(k.clone());
        }
        let names = [
            "zero_qgz_finish_f32",
            "zero_qgz_finish_f16",
            "zero_qgz_finish_bf16",
        ];
        let k = PtxModule::load(ctx, &finish_ptx(), &names)
            .map_err(|e| backend("loading the finish kernels", e))?;
        let k = Arc::new(Finish(k));
        cache.push(k.clone());
        Ok(k)
    }

    /// Enqueues `out[i] = E(acc[i] / divisor)` for `acc.len()` elements on `stream`.
    fn run<E: CudaElement>(
        &self,
        stream: &Arc<CudaStream>,
        acc: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<E>,
        divisor: f32,
    ) -> Result<()> {
        let len = acc.len();
        if out.len() != len {
            return Err(backend(
                "finish",
                format!("{len} sums for {} outputs", out.len()),
            ));
        }
        if len == 0 {
            return Ok(());
        }
        let f = match <E as zero_quant::Element>::DTYPE {
            zero_quant::DType::F32 => 0,
            zero_quant::DType::F16 => 1,
            zero_quant::DType::BF16 => 2,
        };
        let (a, _ga) = acc.device_ptr(stream);
        let (o, _go) = out.device_ptr_mut(stream);
        let (mut p_acc, mut p_out, mut p_len, mut p_div) = (a, o, len as u64, divisor);
        let mut params: [*mut c_void; 4] = [
            (&mut p_acc as *mut u64).cast(),
            (&mut p_out as *mut u64).cast(),
            (&mut p_len as *mut u64).cast(),
            (&mut p_div as *mut f32).cast(),
        ];
        // SAFETY: the four parameters match the kernel's signature and are read by the driver
        // during this call; `acc` holds `len` f32 and `out` `len` elements of `E` on the
        // stream's device, alive (borrowed) and stream-ordered by the guards above.
        unsafe { self.0.launch(f, stream, len, &mut params) }.map_err(|e| backend("launch", e))
    }
}

/// Sends `send` (every piece poisoned first if this rank has a fault) through one equal-split
/// all-to-all of `comm`, as the host path's `exchange` does, and returns the received wire.
fn exchange(
    comm: &mut NcclComm,
    fault: &Fault,
    layout: &WireLayout,
    mut send: NcclBuffer<u8>,
) -> Result<NcclBuffer<u8>> {
    if let Some(o) = fault.origin() {
        let mut host = vec![0u8; send.len()];
        for piece in host.chunks_exact_mut(layout.total_len.max(1)) {
            poison(piece, layout, o);
        }
        comm.upload_into(&host, &mut send)?;
    }
    let mut recv = comm.alloc::<u8>(send.len())?;
    comm.all_to_all(&send, &mut recv)?;
    Ok(recv)
}

/// Decodes the `count` pieces of `e` bytes at `slots(k)` of `wire` into `acc` in order (the first
/// decoded, the others added with `decode_accumulate`); the first error, if any.
fn reduce_pieces(
    quantizer: &CudaQuantizer,
    codec: Codec,
    wire: &NcclBuffer<u8>,
    e: usize,
    slots: impl Iterator<Item = usize>,
    acc: &mut impl DevicePtrMut<f32>,
) -> Option<zero_quant::Error> {
    let w = wire.view();
    for (k, slot) in slots.enumerate() {
        let piece = w.slice(slot..slot + e);
        let r = if k == 0 {
            quantizer.decode(codec, &piece, acc)
        } else {
            quantizer.decode_accumulate(codec, &piece, acc)
        };
        if let Err(err) = r {
            return Some(err);
        }
    }
    None
}

/// qgZ reduce-scatter on device: the mean over all `N` ranks of chunk `rank` of every rank's
/// `input` (`N·c` elements of `E`), through `codec` (int8 or int4; the identity codec has no device
/// kernel and is refused), into `out` (`c` elements of `E`), by the hierarchical all-to-all of
/// [`qgz_reduce_scatter`](crate::quantized::qgz_reduce_scatter): the same collectives and bytes,
/// the same result bit for bit, the same errors.
///
/// The wires are encoded, exchanged by NCCL and decoded on the GPU; the partial sums are `f32`
/// device buffers (`M·c` elements), and the mean is rounded once to `E` by a PTX kernel. An
/// output whose mean is not finite in `E` is found on the device (the encoder's first-non-finite
/// check); only then are the wire or that one sum read back. `quantizer` must run on the groups'
/// stream (`CudaQuantizer::new(comm.stream().clone())` with the world communicator the groups
/// were split from); a quantizer on another stream is refused. With `N = 1` there is no group
/// and nothing moves: `out` is a copy of `input` (on the quantizer's stream) after the host
/// path's finiteness check. Error feedback has no device form yet. On an error the contents of
/// `out` are unspecified.
pub fn qgz_reduce_scatter_device<E>(
    groups: &mut QuantGroups<NcclComm>,
    quantizer: &CudaQuantizer,
    codec: impl Into<Codec>,
    input: &NcclBuffer<E>,
    out: &mut NcclBuffer<E>,
) -> Result<()>
where
    E: QuantElement + CudaElement,
{
    let codec: Codec = codec.into();
    let op = Op::Collective(Collective::ReduceScatter);
    let (n, l, m, me) = (
        groups.world_size(),
        groups.ranks_per_node(),
        groups.num_nodes(),
        groups.global_rank(),
    );
    let len = input.len();
    if !len.is_multiple_of(n) {
        return Err(length(op, me, len.next_multiple_of(n), len));
    }
    let c = len / n;
    if out.len() != c {
        return Err(length(op, me, c, out.len()));
    }
    if matches!(codec, Codec::Identity(_)) {
        return Err(Error::Backend(
            "nccl: qgz_reduce_scatter_device: the identity codec has no device kernel (use the \
             host qgz_reduce_scatter)"
                .into(),
        ));
    }
    let (intra, cross) = groups.groups_mut();
    if let Some(comm) = intra.as_deref().or(cross.as_deref())
        && quantizer.stream().cu_stream() != comm.stream().cu_stream()
    {
        return Err(Error::Backend(
            "nccl: qgz_reduce_scatter_device: the quantizer runs on another stream than the \
             communicators (make it with CudaQuantizer::new(comm.stream().clone()))"
                .into(),
        ));
    }
    let stream = quantizer.stream().clone();
    let layout = codec.layout(c);
    let e = layout.total_len;
    let mut fault = Fault::new(op, me);
    let x = input.view();

    if intra.is_none() && cross.is_none() {
        // N = 1: nothing moves; the output is the input, after the host's finiteness check (the
        // encoder reports the first non-finite element and its value, as the host does).
        if c > 0 {
            let mut wire = stream
                .alloc_zeros::<u8>(e)
                .map_err(|err| backend("allocating a wire", err))?;
            if let Err(err) = quantizer.encode(codec, &x, &mut wire) {
                fault.local(err);
                return fault.finish();
            }
            stream
                .memcpy_dtod(&x, &mut out.view_mut())
                .map_err(|err| backend("copying the input", err))?;
        }
        return Ok(());
    }
    let Some(comm0) = intra.as_deref().or(cross.as_deref()) else {
        return Err(backend("groups", "no sub-group for N > 1"));
    };
    // The f32 accumulators of the M destinations (the stage-2 partials; the first `c` also hold
    // the stage-4 sum).
    let mut acc = comm0.alloc::<f32>(if l > 1 { m * c } else { c })?;
    let context = comm0.context().clone();

    // Stages 1-2: intra-node exchange, node partial sums for the M destinations in `acc`.
    if let Some(intra) = intra {
        let mut send = intra.alloc::<u8>(l * m * e)?;
        {
            let mut sv = send.view_mut();
            'encode: for lp in 0..l {
                for mp in 0..m {
                    let p = mp * l + lp;
                    let slot = (lp * m + mp) * e;
                    let chunk = x.slice(p * c..(p + 1) * c);
                    let mut dst = sv.slice_mut(slot..slot + e);
                    if let Err(err) = quantizer.encode(codec, &chunk, &mut dst) {
                        fault.local(err);
                        break 'encode;
                    }
                }
            }
        }
        let recv = exchange(intra, &fault, &layout, send)?;
        let mut decode_error = None;
        if fault.origin().is_none() {
            let mut av = acc.view_mut();
            for mp in 0..m {
                let mut a = av.slice_mut(mp * c..(mp + 1) * c);
                let slots = (0..l).map(|j| (j * m + mp) * e);
                decode_error = reduce_pieces(quantizer, codec, &recv, e, slots, &mut a);
                if decode_error.is_some() {
                    break;
                }
            }
        }
        fault.after_exchange_device(decode_error, &layout, || intra.download_vec(&recv))?;
    }

    // Stage 3: cross-node exchange of the partials (or, with L = 1, of the input chunks).
    if let Some(cross) = cross {
        let mut send = cross.alloc::<u8>(m * e)?;
        if fault.origin().is_none() {
            let mut sv = send.view_mut();
            let av = acc.view();
            for mp in 0..m {
                let mut dst = sv.slice_mut(mp * e..(mp + 1) * e);
                let r = if l > 1 {
                    quantizer.encode(codec, &av.slice(mp * c..(mp + 1) * c), &mut dst)
                } else {
                    // L = 1: destination p = mp·1 + 0; this is the first quantization.
                    quantizer.encode(codec, &x.slice(mp * c..(mp + 1) * c), &mut dst)
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
            let mut av = acc.view_mut();
            let mut a = av.slice_mut(0..c);
            decode_error = reduce_pieces(quantizer, codec, &recv, e, (0..m).map(|k| k * e), &mut a);
        }
        fault.after_exchange_device(decode_error, &layout, || cross.download_vec(&recv))?;
    }

    if fault.origin().is_some() || c == 0 {
        return fault.finish();
    }
    // Stage 4: the mean, rounded once to E. The host fails on the first element whose rounded
    // mean is not finite: the encoder finds it in `out`; only then is its sum read back.
    let sums = acc.view().slice(0..c);
    Finish::get(&context)?.run(&stream, &sums, &mut out.view_mut(), n as f32)?;
    let mut wire = stream
        .alloc_zeros::<u8>(e)
        .map_err(|err| backend("allocating a wire", err))?;
    match quantizer.encode(codec, &out.view(), &mut wire) {
        Ok(()) => Ok(()),
        Err(zero_quant::Error::NonFinite { index, .. }) => {
            let s = stream
                .clone_dtoh(&sums.slice(index..index + 1))
                .map_err(|err| backend("reading a sum", err))?;
            fault.local(zero_quant::Error::Overflow {
                index,
                value: s[0] / n as f32,
                dtype: <E as zero_quant::Element>::DTYPE,
            });
            fault.finish()
        }
        Err(err) => {
            fault.local(err);
            fault.finish()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    // The GPU test's (compiled with `gpu-tests` only).
    #[cfg(feature = "gpu-tests")]
    use half::{bf16, f16};

    #[cfg(feature = "gpu-tests")]
    fn lcg(z: &mut u64) -> u32 {
        *z = z
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*z >> 32) as u32
    }

    #[test]
    fn finish_ptx_has_three_kernels() {
        let ptx = finish_ptx();
        for name in ["f32", "f16", "bf16"] {
            assert_eq!(
                ptx.matches(&format!(".entry zero_qgz_finish_{name}("))
                    .count(),
                1
            );
        }
        assert_eq!(ptx.matches("div.rn.f32").count(), 3);
    }

    /// Runs the finish kernels on a GPU (feature `gpu-tests`, `ZERO_GPU_TESTS=1`, a device) and
    /// compares every element with the host's `E::narrow(s / n)`, for random f32 bit patterns
    /// (subnormals, infinities, NaNs, sums whose mean overflows bf16/f16) and a length past the
    /// grid cap (so the grid-stride loop runs). This is qgZ's stage 4 at any world size, which
    /// the world-size-1 test of `tests/nccl.rs` cannot reach.
    #[cfg(feature = "gpu-tests")]
    #[test]
    fn gpu_qgz_finish_kernels_divide_and_round_like_the_host() {
        let name = "gpu_qgz_finish_kernels_divide_and_round_like_the_host";
        // Compiled only for gpu-check (feature `gpu-tests`), which sets ZERO_GPU_TESTS=1: then a
        // missing library or device is a failure, not a skip.
        if std::env::var("ZERO_GPU_TESTS").as_deref() != Ok("1") {
            eprintln!("did not run {name}: ZERO_GPU_TESTS=1 is not set");
            return;
        }
        match crate::nccl::probe() {
            Ok(rt) if rt.devices > 0 => {}
            other => panic!("ZERO_GPU_TESTS=1 but there is no usable CUDA device: {other:?}"),
        }
        let ctx = CudaContext::new(0).unwrap();
        let stream = ctx.new_stream().unwrap();
        let k = Finish::get(&ctx).unwrap();
        assert!(Arc::ptr_eq(&k, &Finish::get(&ctx).unwrap()), "cached");
        // More than one grid-stride pass of the launch (4096 blocks of 256 threads).
        let len = 4096 * 256 + 3;
        let mut z = 11u64;
        let sums: Vec<f32> = (0..len).map(|_| f32::from_bits(lcg(&mut z))).collect();
        let acc = stream.clone_htod(&sums).unwrap();
        fn check<E: CudaElement + Copy>(
            k: &Finish,
            stream: &Arc<CudaStream>,
            acc: &cudarc::driver::CudaSlice<f32>,
            sums: &[f32],
            n: f32,
            narrow: impl Fn(f32) -> E,
            bits: impl Fn(E) -> u32,
        ) {
            let mut out = stream.alloc_zeros::<E>(sums.len()).unwrap();
            k.run(stream, acc, &mut out, n).unwrap();
            let got = stream.clone_dtoh(&out).unwrap();
            for (i, (&g, &s)) in got.iter().zip(sums).enumerate() {
                let w = narrow(s / n);
                let (gb, wb) = (bits(g), bits(w));
                let nan = |v: E| <E as zero_quant::Element>::to_f32(v).is_nan();
                assert!(
                    gb == wb || (nan(g) && nan(w)),
                    "{:?} {i}: {s:e} / {n} = bits {gb:#x}, expected {wb:#x}",
                    <E as zero_quant::Element>::DTYPE
                );
            }
        }
        for n in [1.0f32, 2.0, 3.0, 6.0, 7.0, 64.0] {
            check(&k, &stream, &acc, &sums, n, |v| v, f32::to_bits);
            check(&k, &stream, &acc, &sums, n, f16::from_f32, |v| {
                u32::from(v.to_bits())
            });
            check(&k, &stream, &acc, &sums, n, bf16::from_f32, |v| {
                u32::from(v.to_bits())
            });
        }
        crate::nccl::gpu_test_ran(name);
    }
}
