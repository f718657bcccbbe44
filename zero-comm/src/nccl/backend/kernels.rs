//! The backend's mean kernels, `x[i] = x[i] / n` in place, which turn NCCL's `Sum` into the
//! contract's `Mean`; and the PTX scaffolding (`ptx_module`, `grid_stride`, `PtxModule`) that the
//! two other hand-written kernel modules share: qgZ's finish (`finish.rs`) and the CUDA
//! loopback's accumulation (`loopback.rs`).
//!
//! The PTX is written by hand and JIT-compiled by the driver (`cuModuleLoadData`), so the backend
//! needs neither nvcc at build time nor NVRTC at run time (cudarc's `nvrtc` feature is off). Each
//! element is widened to `f32`, divided with IEEE round-to-nearest (`div.rn.f32`, a true division,
//! not a multiplication by `1/n`), and rounded back once: `cvt.rn.f16.f32` for `f16`, integer
//! round-to-nearest-even for `bf16` (NaNs stay quiet NaNs), exactly as `half`'s `from_f32` does.

use std::ffi::{CString, c_void};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::{CUdeviceptr, CUfunction, CUmodule};
use cudarc::driver::{CudaContext, CudaStream, result};

use crate::element::DType;
use crate::error::{Error, Result};

const BLOCK: u32 = 256;
const MAX_GRID: u32 = 4096;

/// Grid-stride loops over `len` elements at `buf`; parameters `(u64 buf, u64 len, f32 divisor)`.
const PTX: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.visible .entry zero_div_f32(
	.param .u64 p_buf,
	.param .u64 p_len,
	.param .f32 p_div
)
{
	.reg .pred 	%p<2>;
	.reg .b32 	%r<5>;
	.reg .b64 	%rd<8>;
	.reg .f32 	%f<4>;

	ld.param.u64 	%rd1, [p_buf];
	ld.param.u64 	%rd2, [p_len];
	ld.param.f32 	%f1, [p_div];
	cvta.to.global.u64 	%rd1, %rd1;
	mov.u32 	%r1, %ctaid.x;
	mov.u32 	%r2, %ntid.x;
	mov.u32 	%r3, %tid.x;
	mov.u32 	%r4, %nctaid.x;
	mul.wide.u32 	%rd3, %r1, %r2;
	cvt.u64.u32 	%rd4, %r3;
	add.s64 	%rd3, %rd3, %rd4;
	mul.wide.u32 	%rd5, %r4, %r2;
$L_f32_loop:
	setp.ge.u64 	%p1, %rd3, %rd2;
	@%p1 bra 	$L_f32_done;
	shl.b64 	%rd6, %rd3, 2;
	add.s64 	%rd7, %rd1, %rd6;
	ld.global.f32 	%f2, [%rd7];
	div.rn.f32 	%f3, %f2, %f1;
	st.global.f32 	[%rd7], %f3;
	add.s64 	%rd3, %rd3, %rd5;
	bra 	$L_f32_loop;
$L_f32_done:
	ret;
}

.visible .entry zero_div_f16(
	.param .u64 p_buf,
	.param .u64 p_len,
	.param .f32 p_div
)
{
	.reg .pred 	%p<2>;
	.reg .b16 	%rs<3>;
	.reg .b32 	%r<5>;
	.reg .b64 	%rd<8>;
	.reg .f32 	%f<4>;

	ld.param.u64 	%rd1, [p_buf];
	ld.param.u64 	%rd2, [p_len];
	ld.param.f32 	%f1, [p_div];
	cvta.to.global.u64 	%rd1, %rd1;
	mov.u32 	%r1, %ctaid.x;
	mov.u32 	%r2, %ntid.x;
	mov.u32 	%r3, %tid.x;
	mov.u32 	%r4, %nctaid.x;
	mul.wide.u32 	%rd3, %r1, %r2;
	cvt.u64.u32 	%rd4, %r3;
	add.s64 	%rd3, %rd3, %rd4;
	mul.wide.u32 	%rd5, %r4, %r2;
$L_f16_loop:
	setp.ge.u64 	%p1, %rd3, %rd2;
	@%p1 bra 	$L_f16_done;
	shl.b64 	%rd6, %rd3, 1;
	add.s64 	%rd7, %rd1, %rd6;
	ld.global.u16 	%rs1, [%rd7];
	cvt.f32.f16 	%f2, %rs1;
	div.rn.f32 	%f3, %f2, %f1;
	cvt.rn.f16.f32 	%rs2, %f3;
	st.global.u16 	[%rd7], %rs2;
	add.s64 	%rd3, %rd3, %rd5;
	bra 	$L_f16_loop;
$L_f16_done:
	ret;
}

.visible .entry zero_div_bf16(
	.param .u64 p_buf,
	.param .u64 p_len,
	.param .f32 p_div
)
{
	.reg .pred 	%p<3>;
	.reg .b16 	%rs<3>;
	.reg .b32 	%r<10>;
	.reg .b64 	%rd<8>;
	.reg .f32 	%f<4>;

	ld.param.u64 	%rd1, [p_buf];
	ld.param.u64 	%rd2, [p_len];
	ld.param.f32 	%f1, [p_div];
	cvta.to.global.u64 	%rd1, %rd1;
	mov.u32 	%r1, %ctaid.x;
	mov.u32 	%r2, %ntid.x;
	mov.u32 	%r3, %tid.x;
	mov.u32 	%r4, %nctaid.x;
	mul.wide.u32 	%rd3, %r1, %r2;
	cvt.u64.u32 	%rd4, %r3;
	add.s64 	%rd3, %rd3, %rd4;
	mul.wide.u32 	%rd5, %r4, %r2;
$L_bf16_loop:
	setp.ge.u64 	%p1, %rd3, %rd2;
	@%p1 bra 	$L_bf16_done;
	shl.b64 	%rd6, %rd3, 1;
	add.s64 	%rd7, %rd1, %rd6;
	ld.global.u16 	%rs1, [%rd7];
	cvt.u32.u16 	%r5, %rs1;
	shl.b32 	%r5, %r5, 16;
	mov.b32 	%f2, %r5;
	div.rn.f32 	%f3, %f2, %f1;
	mov.b32 	%r6, %f3;
	shr.u32 	%r7, %r6, 16;
	and.b32 	%r7, %r7, 1;
	add.s32 	%r7, %r7, 32767;
	add.s32 	%r7, %r6, %r7;
	shr.u32 	%r7, %r7, 16;
	shr.u32 	%r8, %r6, 16;
	or.b32 	%r8, %r8, 64;
	setp.nan.f32 	%p2, %f3, %f3;
	selp.b32 	%r9, %r8, %r7, %p2;
	cvt.u16.u32 	%rs2, %r9;
	st.global.u16 	[%rd7], %rs2;
	add.s64 	%rd3, %rd3, %rd5;
	bra 	$L_bf16_loop;
$L_bf16_done:
	ret;
}
"#;

/// A PTX module of `entries` for the driver to JIT-compile: PTX ISA 7.0, any GPU from sm_52 on.
pub(in crate::nccl) fn ptx_module(entries: &[String]) -> String {
    format!(
        ".version 7.0\n.target sm_52\n.address_size 64\n{}",
        entries.concat()
    )
}

/// One grid-stride PTX entry point `name(params)`: `setup` loads the parameters, the element count
/// into `%rd2`; then each thread runs `body` for elements `%rd3 = i`, `i + stride`, … below it.
/// Declared registers: `%p<3>`, `%rs<3>`, `%r<10>`, `%rd<12>`, `%f<5>`; the loop itself uses `%p1`,
/// `%r1`–`%r4` and `%rd2`–`%rd5`.
pub(in crate::nccl) fn grid_stride(name: &str, params: &[&str], setup: &str, body: &str) -> String {
    let params = params.join(",\n\t");
    format!(
        r#"
.visible .entry {name}(
	{params}
)
{{
	.reg .pred 	%p<3>;
	.reg .b16 	%rs<3>;
	.reg .b32 	%r<10>;
	.reg .b64 	%rd<12>;
	.reg .f32 	%f<5>;

{setup}
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
{body}
	add.s64 	%rd3, %rd3, %rd5;
	bra 	$L_{name}_loop;
$L_{name}_done:
	ret;
}}
"#
    )
}

/// A PTX module JIT-compiled (`cuModuleLoadData`) into one context, with its entry points,
/// unloaded on drop. Shared by the mean kernels here and qgZ's finish kernels
/// (`nccl::quantized`).
pub(in crate::nccl) struct PtxModule {
    ctx: Arc<CudaContext>,
    module: CUmodule,
    funcs: Vec<CUfunction>,
}

// SAFETY: module and function handles belong to a context, not to a thread; they are only used
// after binding that context, and the module is unloaded once, in `Drop`.
unsafe impl Send for PtxModule {}
// SAFETY: launching a function from several threads is allowed by the driver.
unsafe impl Sync for PtxModule {}

impl Drop for PtxModule {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: loaded by `load`, unloaded only here.
            let _ = unsafe { result::module::unload(self.module) };
        }
    }
}

impl PtxModule {
    /// Loads `ptx` into `ctx` and looks up `names`, in order.
    pub(in crate::nccl) fn load(
        ctx: &Arc<CudaContext>,
        ptx: &str,
        names: &[&str],
    ) -> std::result::Result<PtxModule, String> {
        ctx.bind_to_thread()
            .map_err(|e| format!("binding the context: {e}"))?;
        let src = CString::new(ptx).map_err(|e| e.to_string())?;
        // SAFETY: a NUL-terminated PTX text, which the driver JIT-compiles.
        let module = unsafe { result::module::load_data(src.as_ptr().cast()) }
            .map_err(|e| format!("cuModuleLoadData: {e}"))?;
        let funcs = names
            .iter()
            .map(|name| {
                let c = CString::new(*name).map_err(|e| e.to_string())?;
                // SAFETY: `module` was just loaded.
                unsafe { result::module::get_function(module, c) }
                    .map_err(|e| format!("cuModuleGetFunction({name}): {e}"))
            })
            .collect::<std::result::Result<Vec<_>, String>>();
        match funcs {
            Ok(funcs) => Ok(PtxModule {
                ctx: ctx.clone(),
                module,
                funcs,
            }),
            Err(e) => {
                // SAFETY: loaded above, not referenced anywhere else.
                let _ = unsafe { result::module::unload(module) };
                Err(e)
            }
        }
    }

    /// The context the module lives in.
    pub(in crate::nccl) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Launches entry point `func` (an index into the names given to [`Self::load`]) as a
    /// grid-stride loop over `len` elements on `stream`.
    ///
    /// # Safety
    ///
    /// `params` must match the kernel's signature, and the memory it points the kernel at must
    /// hold `len` elements on the stream's device, alive and stream-ordered.
    pub(in crate::nccl) unsafe fn launch(
        &self,
        func: usize,
        stream: &CudaStream,
        len: usize,
        params: &mut [*mut c_void],
    ) -> std::result::Result<(), String> {
        let blocks = len.div_ceil(BLOCK as usize).min(MAX_GRID as usize) as u32;
        self.ctx
            .bind_to_thread()
            .map_err(|e| format!("binding the context: {e}"))?;
        // SAFETY: `funcs[func]` comes from the live module; the caller vouches for `params`.
        unsafe {
            result::launch_kernel(
                self.funcs[func],
                (blocks, 1, 1),
                (BLOCK, 1, 1),
                0,
                stream.cu_stream(),
                params,
            )
        }
        .map_err(|e| format!("cuLaunchKernel: {e}"))
    }
}

/// The division kernels of one context, JIT-compiled on first use and shared by every
/// communicator split from the same world.
#[derive(Default)]
pub(super) struct MeanKernels {
    loaded: OnceLock<std::result::Result<PtxModule, String>>,
}

impl std::fmt::Debug for MeanKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeanKernels")
            .field("loaded", &matches!(self.loaded.get(), Some(Ok(_))))
            .finish()
    }
}

impl MeanKernels {
    /// Enqueues `buf[i] /= divisor` for `len` elements of `dtype` on `stream`.
    pub(super) fn divide(
        &self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        buf: CUdeviceptr,
        len: usize,
        dtype: DType,
        divisor: f32,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let k = self
            .loaded
            .get_or_init(|| {
                PtxModule::load(ctx, PTX, &["zero_div_f32", "zero_div_f16", "zero_div_bf16"])
            })
            .as_ref()
            .map_err(|e| Error::Backend(format!("nccl mean kernel: {e}")))?;
        let f = match dtype {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::BF16 => 2,
            DType::U8 => {
                return Err(Error::Backend(
                    "nccl mean kernel: u8 is not reducible".into(),
                ));
            }
        };
        let mut p_buf: u64 = buf;
        let mut p_len: u64 = len as u64;
        let mut p_div: f32 = divisor;
        let mut params: [*mut c_void; 3] = [
            (&mut p_buf as *mut u64).cast(),
            (&mut p_len as *mut u64).cast(),
            (&mut p_div as *mut f32).cast(),
        ];
        // SAFETY: the three parameters match the kernel's signature and are read by the driver
        // during this call; `buf` holds `len` elements of `dtype` on the stream's device (the
        // caller's buffer, kept alive and stream-ordered).
        unsafe { k.launch(f, stream, len, &mut params) }
            .map_err(|e| Error::Backend(format!("nccl mean kernel: {e}")))
    }
}

#[cfg(test)]
mod tests {
    // The GPU test's (compiled with `gpu-tests` only).
    #[cfg(feature = "gpu-tests")]
    use super::*;
    #[cfg(feature = "gpu-tests")]
    use cudarc::driver::DevicePtr;
    #[cfg(feature = "gpu-tests")]
    use half::{bf16, f16};

    /// The bf16 rounding of `zero_div_bf16`, step for step in Rust.
    fn ptx_bf16_bits(x: f32) -> u16 {
        let r6 = x.to_bits();
        let r7 = (r6.wrapping_add(((r6 >> 16) & 1).wrapping_add(32767))) >> 16;
        let r8 = (r6 >> 16) | 64;
        (if x.is_nan() { r8 } else { r7 }) as u16
    }

    #[test]
    fn bf16_rounding_matches_half() {
        let mut z = 0x1234_5678_9abc_def0u64;
        let check = |bits: u32| {
            let x = f32::from_bits(bits);
            assert_eq!(
                ptx_bf16_bits(x),
                half::bf16::from_f32(x).to_bits(),
                "bits {bits:#x}"
            );
        };
        for special in [
            0u32,
            0x8000_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0x7f80_0001,
            0xffff_ffff,
            0x7f7f_ffff,
            0x0000_0001,
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_8001,
        ] {
            check(special);
        }
        for _ in 0..200_000 {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            check((z >> 32) as u32);
        }
    }

    #[cfg(feature = "gpu-tests")]
    fn lcg(z: &mut u64) -> u32 {
        *z = z
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*z >> 32) as u32
    }

    /// Runs the PTX on a GPU (feature `gpu-tests`, `ZERO_GPU_TESTS=1`, a device) and compares every
    /// element with the host's `x / n` rounded once, for each dtype, including a length past the
    /// grid cap (so the grid-stride loop runs) and random bit patterns (subnormals, infinities).
    #[cfg(feature = "gpu-tests")]
    #[test]
    fn gpu_mean_kernels_divide_like_the_host() {
        // Compiled only for gpu-check (feature `gpu-tests`), which sets ZERO_GPU_TESTS=1: then a
        // missing library or device is a failure, not a skip.
        if std::env::var("ZERO_GPU_TESTS").as_deref() != Ok("1") {
            eprintln!(
                "did not run gpu_mean_kernels_divide_like_the_host: ZERO_GPU_TESTS=1 is not set"
            );
            return;
        }
        match crate::nccl::probe() {
            Ok(rt) if rt.devices > 0 => {}
            other => panic!("ZERO_GPU_TESTS=1 but there is no usable CUDA device: {other:?}"),
        }
        let ctx = CudaContext::new(0).unwrap();
        let stream = ctx.new_stream().unwrap();
        let k = MeanKernels::default();
        let len = (MAX_GRID * BLOCK) as usize + 3;
        let mut z = 7u64;
        let bits: Vec<u32> = (0..len).map(|_| lcg(&mut z)).collect();
        for n in [1.0f32, 2.0, 3.0, 7.0] {
            let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            let dev = stream.clone_htod(&x).unwrap();
            {
                let (p, _g) = dev.device_ptr(&stream);
                k.divide(&ctx, &stream, p, len, DType::F32, n).unwrap();
            }
            let got = stream.clone_dtoh(&dev).unwrap();
            for (i, (&g, &v)) in got.iter().zip(&x).enumerate() {
                let w = v / n;
                assert!(
                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "f32 {i}: {v:e} / {n} = {g:e}, expected {w:e}"
                );
            }

            let h: Vec<f16> = bits.iter().map(|&b| f16::from_bits(b as u16)).collect();
            let dev = stream.clone_htod(&h).unwrap();
            {
                let (p, _g) = dev.device_ptr(&stream);
                k.divide(&ctx, &stream, p, len, DType::F16, n).unwrap();
            }
            let got = stream.clone_dtoh(&dev).unwrap();
            for (i, (&g, &v)) in got.iter().zip(&h).enumerate() {
                let w = f16::from_f32(v.to_f32() / n);
                assert!(
                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "f16 {i}: {v} / {n} = {g}, expected {w}"
                );
            }

            let b: Vec<bf16> = bits.iter().map(|&b| bf16::from_bits(b as u16)).collect();
            let dev = stream.clone_htod(&b).unwrap();
            {
                let (p, _g) = dev.device_ptr(&stream);
                k.divide(&ctx, &stream, p, len, DType::BF16, n).unwrap();
            }
            let got = stream.clone_dtoh(&dev).unwrap();
            for (i, (&g, &v)) in got.iter().zip(&b).enumerate() {
                let w = bf16::from_f32(v.to_f32() / n);
                assert!(
                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "bf16 {i}: {v} / {n} = {g}, expected {w}"
                );
            }
        }
        zero_testkit::cookie::passed("gpu_mean_kernels_divide_like_the_host");
    }
}
