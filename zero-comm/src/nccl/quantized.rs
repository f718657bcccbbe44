//! zero-quant's CUDA kernels as NCCL's [`DeviceCodec`] (feature `nccl`), so that
//! [`qwz_all_gather_device`](crate::quantized::qwz_all_gather_device) and
//! [`qgz_reduce_scatter_device`](crate::quantized::qgz_reduce_scatter_device) keep a GPU trainer's
//! weights and gradients in device memory.
//!
//! The CUDA codecs are bit-identical to the host ones, and qgZ's final division is a hand-written
//! PTX kernel with IEEE `div.rn.f32` and the host's rounding to bf16/f16. The quantizer must run
//! on the communicator's stream (`CudaQuantizer::new(comm.stream().clone())`), which orders its
//! kernels with the collectives; a quantizer on another stream is refused.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use zero_quant::cuda::CudaElement;
use zero_quant::{BlockCodec, Codec, CudaQuantizer};

use super::backend::kernels::PtxModule;
use super::{NcclBuffer, NcclComm};
use crate::error::{Error, Result};
use crate::quantized::{DeviceCodec, QuantElement};

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

fn wire_len(codec: Codec, len: usize) -> usize {
    codec.layout(len).total_len
}

impl<E: QuantElement + CudaElement> DeviceCodec<NcclComm, E> for CudaQuantizer {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn supports(&self, codec: &Codec) -> bool {
        !matches!(codec, Codec::Identity(_))
    }

    fn check(&self, comm: &NcclComm) -> std::result::Result<(), String> {
        if self.stream().cu_stream() == comm.stream().cu_stream() {
            Ok(())
        } else {
            Err(
                "the quantizer runs on another stream than the communicator (make it with \
                 CudaQuantizer::new(comm.stream().clone()))"
                    .into(),
            )
        }
    }

    fn buffer_len(&self, buf: &NcclBuffer<E>) -> usize {
        buf.len()
    }

    fn encode_piece(
        &self,
        codec: Codec,
        (src, at): (&NcclBuffer<E>, usize),
        len: usize,
        (wire, slot): (&mut NcclBuffer<u8>, usize),
    ) -> zero_quant::Result<()> {
        let x = src.view();
        let mut w = wire.view_mut();
        let mut dst = w.slice_mut(slot..slot + wire_len(codec, len));
        self.encode(codec, &x.slice(at..at + len), &mut dst)
    }

    fn encode_sum(
        &self,
        codec: Codec,
        sums: &NcclBuffer<f32>,
        (wire, slot): (&mut NcclBuffer<u8>, usize),
    ) -> zero_quant::Result<()> {
        let mut w = wire.view_mut();
        let mut dst = w.slice_mut(slot..slot + wire_len(codec, sums.len()));
        self.encode(codec, &sums.view(), &mut dst)
    }

    fn decode_piece(
        &self,
        codec: Codec,
        (wire, slot): (&NcclBuffer<u8>, usize),
        len: usize,
        (out, at): (&mut NcclBuffer<E>, usize),
    ) -> zero_quant::Result<()> {
        let w = wire.view();
        let piece = w.slice(slot..slot + wire_len(codec, len));
        let mut o = out.view_mut();
        self.decode(codec, &piece, &mut o.slice_mut(at..at + len))
    }

    fn decode_sum(
        &self,
        codec: Codec,
        (wire, slot): (&NcclBuffer<u8>, usize),
        sums: &mut NcclBuffer<f32>,
        accumulate: bool,
    ) -> zero_quant::Result<()> {
        let w = wire.view();
        let piece = w.slice(slot..slot + wire_len(codec, sums.len()));
        let mut acc = sums.view_mut();
        if accumulate {
            self.decode_accumulate(codec, &piece, &mut acc)
        } else {
            self.decode(codec, &piece, &mut acc)
        }
    }

    fn finish_mean(
        &self,
        comm: &mut NcclComm,
        codec: Codec,
        sums: &NcclBuffer<f32>,
        n: usize,
        out: &mut NcclBuffer<E>,
    ) -> Result<zero_quant::Result<()>> {
        // The host fails on the first element whose rounded mean is not finite: the encoder finds
        // it in `out`; only then is its sum read back.
        let stream = self.stream();
        let s = sums.view();
        Finish::get(comm.context())?.run(stream, &s, &mut out.view_mut(), n as f32)?;
        let mut wire = stream
            .alloc_zeros::<u8>(wire_len(codec, sums.len()))
            .map_err(|err| backend("allocating a wire", err))?;
        Ok(match self.encode(codec, &out.view(), &mut wire) {
            Ok(()) => Ok(()),
            Err(zero_quant::Error::NonFinite { index, .. }) => {
                let sum = stream
                    .clone_dtoh(&s.slice(index..index + 1))
                    .map_err(|err| backend("reading a sum", err))?;
                Err(zero_quant::Error::Overflow {
                    index,
                    value: sum[0] / n as f32,
                    dtype: <E as zero_quant::Element>::DTYPE,
                })
            }
            Err(err) => Err(err),
        })
    }

    fn copy_finite(
        &self,
        codec: Codec,
        src: &NcclBuffer<E>,
        out: &mut NcclBuffer<E>,
    ) -> Result<zero_quant::Result<()>> {
        // The encoder reports the first non-finite element and its value, as the host does.
        if src.is_empty() {
            return Ok(Ok(()));
        }
        let stream = self.stream();
        let mut wire = stream
            .alloc_zeros::<u8>(wire_len(codec, src.len()))
            .map_err(|err| backend("allocating a wire", err))?;
        if let Err(err) = self.encode(codec, &src.view(), &mut wire) {
            return Ok(Err(err));
        }
        stream
            .memcpy_dtod(&src.view(), &mut out.view_mut())
            .map_err(|err| backend("copying the input", err))?;
        Ok(Ok(()))
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
