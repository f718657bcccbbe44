//! The backend's mean kernels, `x[i] = x[i] / n` in place, which turn NCCL's `Sum` into the
//! contract's `Mean`; and the PTX pieces that the two other hand-written kernel modules share,
//! qgZ's finish (`finish.rs`) and the CUDA loopback's accumulation (`loopback.rs`): the
//! grid-stride loop (`grid_stride`), one module with an entry point per reducible type
//! (`per_type_module`, `acc_and_other_module`), an element's address (`element`), its exact
//! widening to f32 (`widen`) and its rounding back (`narrow`), and the loaded module
//! (`PtxModule`).
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

/// The element types the kernels reduce, in the order of every module's entry points.
const REDUCIBLE: [(DType, &str); 3] = [
    (DType::F32, "f32"),
    (DType::F16, "f16"),
    (DType::BF16, "bf16"),
];

/// The index of `dtype`'s entry point in the mean, accumulation and finish modules (`u8` has
/// none: the contract refuses to reduce it before anything moves).
pub(in crate::nccl) fn entry(dtype: DType) -> Option<usize> {
    REDUCIBLE.iter().position(|(d, _)| *d == dtype)
}

/// One module with an entry point `{prefix}_{f32,f16,bf16}` for each reducible type, in
/// [`entry`]'s order: `body(dtype)` is the loop body of [`grid_stride`].
pub(in crate::nccl) fn per_type_module(
    prefix: &str,
    params: &[&str],
    setup: &str,
    body: impl Fn(DType) -> String,
) -> String {
    ptx_module(&REDUCIBLE.map(|(dtype, name)| {
        grid_stride(
            &format!("{prefix}_{name}"),
            params,
            setup,
            body(dtype).trim_end(),
        )
    }))
}

/// A [`per_type_module`] whose kernels take `(u64 acc, u64 {other}, u64 len, {scalar})`: the
/// loop finds the global addresses of `acc` in `%rd1` and of `other` in `%rd8`, and
/// `load_scalar` has loaded the last parameter.
pub(in crate::nccl) fn acc_and_other_module(
    prefix: &str,
    other: &str,
    scalar: &str,
    load_scalar: &str,
    body: impl Fn(DType) -> String,
) -> String {
    let setup = format!(
        "\tld.param.u64 \t%rd1, [p_acc];\n\
         \tld.param.u64 \t%rd8, [p_{other}];\n\
         \tld.param.u64 \t%rd2, [p_len];\n\
         \tcvta.to.global.u64 \t%rd1, %rd1;\n\
         \tcvta.to.global.u64 \t%rd8, %rd8;\n\
         {load_scalar}"
    );
    let other = format!(".param .u64 p_{other}");
    let scalar = format!(".param {scalar}");
    let params = [".param .u64 p_acc", &other, ".param .u64 p_len", &scalar];
    per_type_module(prefix, &params, &setup, body)
}

/// `dst = base + i * size_of(dtype)` for the loop's element `%rd3 = i`.
pub(in crate::nccl) fn element(dst: &str, base: &str, dtype: DType) -> String {
    let shift = if dtype == DType::F32 { 2 } else { 1 };
    format!("\tshl.b64 \t{dst}, %rd3, {shift};\n\tadd.s64 \t{dst}, {base}, {dst};\n")
}

/// Loads the `dtype` element at `[addr]` into `%f2`, widened to f32 exactly (uses `%rs1`, `%r6`).
pub(in crate::nccl) fn widen(dtype: DType, addr: &str) -> String {
    match dtype {
        DType::F16 => format!("\tld.global.u16 \t%rs1, [{addr}];\n\tcvt.f32.f16 \t%f2, %rs1;\n"),
        DType::BF16 => format!(
            "\tld.global.u16 \t%rs1, [{addr}];\n\
             \tcvt.u32.u16 \t%r6, %rs1;\n\
             \tshl.b32 \t%r6, %r6, 16;\n\
             \tmov.b32 \t%f2, %r6;\n"
        ),
        _ => format!("\tld.global.f32 \t%f2, [{addr}];\n"),
    }
}

/// Rounds `%f3` to `dtype` once and stores it at `[addr]` (uses `%rs1`, `%r6`–`%r9` and `%p2`,
/// so a kernel that keeps a flag in `%p2` cannot call it):
/// `cvt.rn.f16.f32` for f16, for bf16 the integer round-to-nearest-even of `half`'s `from_f32`
/// (NaNs stay quiet NaNs).
pub(in crate::nccl) fn narrow(dtype: DType, addr: &str) -> String {
    match dtype {
        DType::F16 => format!("\tcvt.rn.f16.f32 \t%rs1, %f3;\n\tst.global.u16 \t[{addr}], %rs1;\n"),
        DType::BF16 => format!(
            "\tmov.b32 \t%r6, %f3;\n\
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
             \tst.global.u16 \t[{addr}], %rs1;\n"
        ),
        _ => format!("\tst.global.f32 \t[{addr}], %f3;\n"),
    }
}

/// The mean kernels `zero_div_{f32,f16,bf16}(u64 buf, u64 len, f32 divisor)`: a grid-stride loop
/// doing `buf[i] = round(widen(buf[i]) / divisor)` in place.
fn mean_ptx() -> String {
    let setup = "\tld.param.u64 \t%rd1, [p_buf];\n\
                 \tld.param.u64 \t%rd2, [p_len];\n\
                 \tld.param.f32 \t%f1, [p_div];\n\
                 \tcvta.to.global.u64 \t%rd1, %rd1;";
    let params = [
        ".param .u64 p_buf",
        ".param .u64 p_len",
        ".param .f32 p_div",
    ];
    per_type_module("zero_div", &params, setup, |dtype| {
        format!(
            "{}{}\tdiv.rn.f32 \t%f3, %f2, %f1;\n{}",
            element("%rd7", "%rd1", dtype),
            widen(dtype, "%rd7"),
            narrow(dtype, "%rd7")
        )
    })
}

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
                PtxModule::load(
                    ctx,
                    &mean_ptx(),
                    &["zero_div_f32", "zero_div_f16", "zero_div_bf16"],
                )
            })
            .as_ref()
            .map_err(|e| Error::Backend(format!("nccl mean kernel: {e}")))?;
        let Some(f) = entry(dtype) else {
            return Err(Error::Backend(
                "nccl mean kernel: u8 is not reducible".into(),
            ));
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
pub(in crate::nccl) mod tests {
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

    /// Every PTX module the project ships assembles with NVIDIA's `ptxas` (`$ZERO_PTXAS`, which
    /// `cargo xtask test` installs with `.ci/ptxas.sh`) for the GPUs it targets: the hand-written
    /// mean, qgZ finish and loopback accumulation modules for sm_52 (their `.target`), sm_80 and
    /// sm_90; zero-quant's NVRTC-compiled codecs for sm_80 (theirs) and sm_90. A module a driver's
    /// JIT would refuse fails here, without a GPU.
    #[test]
    fn every_ptx_module_assembles_for_the_gpus_it_targets() {
        let Some(ptxas) = std::env::var_os("ZERO_PTXAS").map(std::path::PathBuf::from) else {
            zero_testkit::record_skip!(
                "",
                "ZERO_PTXAS is not set (cargo xtask test installs ptxas with .ci/ptxas.sh)",
            );
            return;
        };
        let quant = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../zero-quant/src/cuda/kernels.ptx"
        );
        let quant = std::fs::read_to_string(quant).expect("zero-quant's kernels.ptx");
        let hand_written = ["sm_52", "sm_80", "sm_90"];
        let modules = [
            ("mean", super::mean_ptx(), &hand_written[..]),
            (
                "qgz_finish",
                crate::nccl::backend::finish::finish_ptx(),
                &hand_written[..],
            ),
            (
                "loopback_acc",
                crate::nccl::backend::loopback::acc_ptx(),
                &hand_written[..],
            ),
            ("zero_quant", quant, &["sm_80", "sm_90"][..]),
        ];
        let dir = tempfile::tempdir().expect("a temp dir");
        for (name, ptx, archs) in modules {
            let file = dir.path().join(format!("{name}.ptx"));
            std::fs::write(&file, ptx).expect("writing the module");
            for arch in archs {
                let out = std::process::Command::new(&ptxas)
                    .arg(format!("-arch={arch}"))
                    .arg(&file)
                    .args(["-o", "/dev/null"])
                    .output()
                    .unwrap_or_else(|e| panic!("cannot run {}: {e}", ptxas.display()));
                assert!(
                    out.status.success(),
                    "ptxas refuses the {name} module for {arch} ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }

    /// The next of a 64-bit LCG's draws, as 32 random bits.
    #[cfg(feature = "gpu-tests")]
    pub(in crate::nccl) fn lcg(z: &mut u64) -> u32 {
        *z = z
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*z >> 32) as u32
    }

    /// GPU 0's context and a new stream for GPU test `name`. It is compiled only for gpu-check
    /// (feature `gpu-tests`), which sets `ZERO_GPU_TESTS=1`: then a missing library or device is
    /// a failure, not a skip. Without it, `None`, said on stderr.
    #[cfg(feature = "gpu-tests")]
    pub(in crate::nccl) fn gpu(name: &str) -> Option<(Arc<CudaContext>, Arc<CudaStream>)> {
        if !zero_testkit::cookie::gpu_tests() {
            eprintln!("did not run {name}: ZERO_GPU_TESTS=1 is not set");
            return None;
        }
        match crate::nccl::probe() {
            Ok(rt) if rt.devices > 0 => {}
            other => {
                panic!("{name}: ZERO_GPU_TESTS=1 but there is no usable CUDA device: {other:?}")
            }
        }
        let ctx = CudaContext::new(0).unwrap();
        let stream = ctx.new_stream().unwrap();
        Some((ctx, stream))
    }

    /// Runs the PTX on a GPU (feature `gpu-tests`, `ZERO_GPU_TESTS=1`, a device) and compares every
    /// element with the host's `x / n` rounded once, for each dtype, including a length past the
    /// grid cap (so the grid-stride loop runs) and random bit patterns (subnormals, infinities).
    #[cfg(feature = "gpu-tests")]
    #[test]
    fn gpu_mean_kernels_divide_like_the_host() {
        use crate::element::Element;
        use zero_quant::cuda::CudaElement;

        fn check<E: CudaElement + Element>(
            (k, ctx, stream): (&MeanKernels, &Arc<CudaContext>, &Arc<CudaStream>),
            x: &[E],
            n: f32,
        ) {
            let dev = stream.clone_htod(x).unwrap();
            {
                let (p, _g) = dev.device_ptr(stream);
                k.divide(ctx, stream, p, x.len(), <E as Element>::DTYPE, n)
                    .unwrap();
            }
            let got = stream.clone_dtoh(&dev).unwrap();
            let nan = |v: E| zero_quant::Element::to_f32(v).is_nan();
            for (i, (&g, &v)) in got.iter().zip(x).enumerate() {
                let w = <E as zero_quant::Element>::from_f32(zero_quant::Element::to_f32(v) / n);
                assert!(
                    bytemuck::bytes_of(&g) == bytemuck::bytes_of(&w) || (nan(g) && nan(w)),
                    "{:?} {i}: {v:?} / {n} = {g:?}, expected {w:?}",
                    <E as Element>::DTYPE
                );
            }
        }

        const NAME: &str = "gpu_mean_kernels_divide_like_the_host";
        let Some((ctx, stream)) = gpu(NAME) else {
            return;
        };
        let k = MeanKernels::default();
        let len = (MAX_GRID * BLOCK) as usize + 3;
        let mut z = 7u64;
        let bits: Vec<u32> = (0..len).map(|_| lcg(&mut z)).collect();
        let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let h: Vec<f16> = bits.iter().map(|&b| f16::from_bits(b as u16)).collect();
        let b: Vec<bf16> = bits.iter().map(|&b| bf16::from_bits(b as u16)).collect();
        for n in [1.0f32, 2.0, 3.0, 7.0] {
            check((&k, &ctx, &stream), &x, n);
            check((&k, &ctx, &stream), &h, n);
            check((&k, &ctx, &stream), &b, n);
        }
        zero_testkit::cookie::passed(NAME);
    }
}
