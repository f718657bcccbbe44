//! qgZ's final step on the GPU, `out[i] = E(acc[i] / n)`: hand-written PTX with IEEE
//! `div.rn.f32` and the host's rounding to bf16/f16, shared by NCCL's
//! [`DeviceCodec`](crate::quantized::DeviceCodec) and the CUDA loopback's reduction (which
//! divides by 1 for `Sum`).

use std::ffi::c_void;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use zero_quant::cuda::CudaElement;

use super::kernels::{PtxModule, acc_and_other_module, element, narrow, widen};
use crate::element::DType;
use crate::error::{Error, Result};

/// The PTX of `zero_qgz_finish_{f32,f16,bf16}(u64 acc, u64 out, u64 len, f32 divisor)`: a
/// grid-stride loop doing `out[i] = round_E(acc[i] / divisor)` with IEEE `div.rn.f32` (a true
/// division, as the host's `/`), then `cvt.rn.f16.f32` for f16, or for bf16 the integer
/// round-to-nearest-even of `half`'s `from_f32` (NaNs stay quiet NaNs), step for step as the
/// mean kernels (`kernels.rs`) do it in place.
pub(in crate::nccl) fn finish_ptx() -> String {
    let load_divisor = "\tld.param.f32 \t%f1, [p_div];";
    acc_and_other_module(
        "zero_qgz_finish",
        "out",
        ".f32 p_div",
        load_divisor,
        |dtype| {
            format!(
                "{}{}\tdiv.rn.f32 \t%f3, %f2, %f1;\n{}{}",
                element("%rd7", "%rd1", DType::F32),
                widen(DType::F32, "%rd7"),
                element("%rd9", "%rd8", dtype),
                narrow(dtype, "%rd9")
            )
        },
    )
}

/// The finish kernels of one context, JIT-compiled (`cuModuleLoadData`) on first use and kept
/// for the life of the process (one module per context; the context is retained with it).
pub(in crate::nccl) struct Finish(PtxModule);

static FINISH: Mutex<Vec<Arc<Finish>>> = Mutex::new(Vec::new());

pub(in crate::nccl) fn backend(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Backend(format!("nccl: qgz_reduce_scatter_device: {what}: {e}"))
}

impl Finish {
    pub(in crate::nccl) fn get(ctx: &Arc<CudaContext>) -> Result<Arc<Finish>> {
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
    pub(in crate::nccl) fn run<E: CudaElement>(
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
        // SAFETY: `acc` holds `len` f32 and `out` `len` elements of `E` on the stream's device,
        // alive (borrowed) and stream-ordered by the guards above.
        unsafe { self.launch_raw(f, stream, a, o, len, divisor) }.map_err(|e| backend("launch", e))
    }

    /// Enqueues `out[i] = round(acc[i] / divisor)` for `len` elements on `stream`, with kernel
    /// `f` (0: f32, 1: f16, 2: bf16).
    ///
    /// # Safety
    ///
    /// `acc` must hold `len` f32 and `out` `len` elements of kernel `f`'s type, on the stream's
    /// device, alive and ordered on `stream` until the kernel has run. `out` may be `acc`'s memory
    /// only if the element is f32 (each thread reads before it writes).
    pub(in crate::nccl) unsafe fn launch_raw(
        &self,
        f: usize,
        stream: &CudaStream,
        acc: u64,
        out: u64,
        len: usize,
        divisor: f32,
    ) -> std::result::Result<(), String> {
        let (mut p_acc, mut p_out, mut p_len, mut p_div) = (acc, out, len as u64, divisor);
        let mut params: [*mut c_void; 4] = [
            (&mut p_acc as *mut u64).cast(),
            (&mut p_out as *mut u64).cast(),
            (&mut p_len as *mut u64).cast(),
            (&mut p_div as *mut f32).cast(),
        ];
        // SAFETY: the four parameters match the kernel's signature and are read by the driver
        // during this call; the caller vouches for the memory.
        unsafe { self.0.launch(f, stream, len, &mut params) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    // The GPU test's (compiled with `gpu-tests` only).
    #[cfg(feature = "gpu-tests")]
    use crate::nccl::backend::kernels::tests::{gpu, lcg};
    #[cfg(feature = "gpu-tests")]
    use half::{bf16, f16};

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
        let Some((ctx, stream)) = gpu(name) else {
            return;
        };
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
        zero_testkit::cookie::passed(name);
    }
}
