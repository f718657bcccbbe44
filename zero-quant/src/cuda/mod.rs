//! CUDA device kernels for the block codecs (feature `cuda`): [`CudaQuantizer`].
//!
//! Encode, decode and decode-accumulate of [`Int8Block`](crate::Int8Block) and
//! [`Int4Block`](crate::Int4Block) wires on device memory, for `f32`, `bf16` and `f16` tensors,
//! **bit-identical to the host codecs**: the same wire bytes, the same decoded values, and the
//! same first error for a non-finite input or a corrupt wire. The kernels
//! (`src/cuda/kernels.cu`) use explicit IEEE-rounded intrinsics for every float step and keep
//! subnormals, so nothing depends on compiler contraction or flush-to-zero; the module docs of
//! the source say how each host step is mirrored.
//!
//! The PTX is compiled offline (`cargo xtask ptx`, NVRTC, `compute_80`: Ampere or newer) and
//! checked in; the driver JIT-compiles it when a quantizer is made, so building needs neither
//! nvcc nor a GPU, and running needs only libcuda (loaded dynamically by cudarc: a machine
//! without it gets [`Error::Cuda`], never a panic). bf16 on the device is first-class: the
//! conversions are `cvt.rn.bf16.f32` and `cvt.f32.f16`/`cvt.rn.f16.f32`.
//!
//! Each call enqueues its kernels on the quantizer's stream and then reads back one 8-byte error
//! word, so it returns when the work is done (a synchronisation per call, like the wgpu
//! kernels). On any error the destination's contents are unspecified.
//!
//! Limits: block sizes up to 2³⁰ elements and fewer than 2³¹ blocks per tensor; the
//! [`Identity`](crate::Identity) codec has no device kernel (it is a copy) and returns
//! [`Error::Cuda`].

use std::ffi::{CString, c_void};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUdeviceptr, CUfunction, CUmodule};
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
    result,
};
use half::{bf16, f16};

use crate::codec::{BlockCodec, Codec, sealed::Raw};
use crate::cuda_src::CUDA_PTX;
use crate::element::{DType, Element};
use crate::error::{Error, Result};

/// Element types the device kernels read and write: `f32`, `bf16`, `f16`.
pub trait CudaElement: Element + DeviceRepr + ValidAsZeroBits + private::Sealed {}
impl CudaElement for f32 {}
impl CudaElement for bf16 {}
impl CudaElement for f16 {}
mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

const THREADS: u32 = 256;
const MAX_GRID: usize = 1 << 20;
const MAX_BLOCK: usize = 1 << 30;
const MAX_BLOCKS: usize = 1 << 31;

fn dev(msg: impl std::fmt::Display) -> Error {
    Error::Cuda(msg.to_string())
}

/// The loaded module and its functions, indexed by `[codec][dtype]`.
struct Module {
    ctx: Arc<CudaContext>,
    module: CUmodule,
    encode: [[CUfunction; 3]; 2],
    decode: [[CUfunction; 3]; 2],
    accumulate: [CUfunction; 2],
    padding: CUfunction,
}

// SAFETY: module and function handles are plain driver handles valid in every thread once their
// context is bound (done before each use); the driver API is thread-safe.
unsafe impl Send for Module {}
// SAFETY: as above; the handles are never mutated after loading.
unsafe impl Sync for Module {}

impl Drop for Module {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: loaded by `Module::load`, no function of it is used after this.
            let _ = unsafe { result::module::unload(self.module) };
        }
    }
}

impl Module {
    fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(|e| dev(format!("binding the context: {e}")))?;
        let src = CString::new(CUDA_PTX).map_err(dev)?;
        // SAFETY: a NUL-terminated PTX text, which the driver JIT-compiles.
        let module = unsafe { result::module::load_data(src.as_ptr().cast()) }.map_err(|e| {
            dev(format!(
                "cuModuleLoadData (needs compute capability 8.0+): {e}"
            ))
        })?;
        let get = |name: &str| -> Result<CUfunction> {
            let c = CString::new(name).map_err(dev)?;
            // SAFETY: `module` was just loaded.
            unsafe { result::module::get_function(module, c) }
                .map_err(|e| dev(format!("cuModuleGetFunction({name}): {e}")))
        };
        let load = || -> Result<Self> {
            let per = |op: &str, q: &str| -> Result<[CUfunction; 3]> {
                Ok([
                    get(&format!("zq_{op}_{q}_f32"))?,
                    get(&format!("zq_{op}_{q}_bf16"))?,
                    get(&format!("zq_{op}_{q}_f16"))?,
                ])
            };
            Ok(Self {
                ctx: ctx.clone(),
                module,
                encode: [per("encode", "i8")?, per("encode", "i4")?],
                decode: [per("decode", "i8")?, per("decode", "i4")?],
                accumulate: [get("zq_accumulate_i8")?, get("zq_accumulate_i4")?],
                padding: get("zq_check_padding")?,
            })
        };
        load().inspect_err(|_| {
            // SAFETY: loaded above, no function of it escapes.
            let _ = unsafe { result::module::unload(module) };
        })
    }
}

/// Runs the block codecs' CUDA kernels on one stream. See the [module docs](self).
pub struct CudaQuantizer {
    stream: Arc<CudaStream>,
    module: Module,
    /// The error word, reset before and read after every call.
    err: Mutex<CudaSlice<u64>>,
}

impl std::fmt::Debug for CudaQuantizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaQuantizer")
            .field("device", &self.stream.context().ordinal())
            .finish_non_exhaustive()
    }
}

/// The codec's index in the kernel tables and its name, or the reason there is no kernel.
fn pick(codec: &Codec) -> Result<usize> {
    match codec {
        Codec::Int8(_) => Ok(0),
        Codec::Int4(_) => Ok(1),
        Codec::Identity(_) => Err(dev(
            "the identity codec has no device kernel (it is a copy)",
        )),
    }
}

fn dtype_index(d: DType) -> usize {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
    }
}

fn check_len(codec: &Codec, what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::BufferLen {
            codec: codec.name(),
            what,
            expected,
            got,
        })
    }
}

/// A 64-bit kernel parameter.
fn p64(v: &mut u64) -> *mut c_void {
    (v as *mut u64).cast()
}

impl CudaQuantizer {
    /// Loads the kernels into `stream`'s context; every call runs on `stream`.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self> {
        let module = Module::load(stream.context())?;
        let err = stream
            .alloc_zeros::<u64>(1)
            .map_err(|e| dev(format!("allocating the error word: {e}")))?;
        Ok(Self {
            stream,
            module,
            err: Mutex::new(err),
        })
    }

    /// A quantizer on the default stream of CUDA device `ordinal`, or [`Error::Cuda`] when
    /// there is no libcuda or no such device.
    pub fn on_device(ordinal: usize) -> Result<Self> {
        // SAFETY: only probes for the library (dlopen); calls nothing in it.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(dev("libcuda not found (no NVIDIA driver on this machine)"));
        }
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| dev("the CUDA driver panicked while creating a context"))?
            .map_err(|e| dev(format!("device {ordinal}: {e}")))?;
        Self::new(ctx.default_stream())
    }

    /// The stream the kernels run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Launches `f` over `blocks` codec blocks with the given parameters, then returns the error
    /// word (`u64::MAX`: none). The caller keeps the buffers alive and stream-ordered.
    fn launch(&self, what: &str, kernels: &[(CUfunction, u32, &[*mut c_void])]) -> Result<u64> {
        let mut err = self.err.lock().unwrap_or_else(|p| p.into_inner());
        self.stream
            .memcpy_htod(&[u64::MAX], &mut *err)
            .map_err(|e| dev(format!("{what}: resetting the error word: {e}")))?;
        {
            let (err_ptr, _g) = err.device_ptr_mut(&self.stream);
            let mut err_ptr: CUdeviceptr = err_ptr;
            self.module
                .ctx
                .bind_to_thread()
                .map_err(|e| dev(format!("{what}: binding the context: {e}")))?;
            for (f, grid, params) in kernels {
                // The error word is every kernel's last parameter.
                let mut all: Vec<*mut c_void> = params.to_vec();
                all.push(p64(&mut err_ptr));
                // SAFETY: `f` is from the live module; `all` matches its parameter list (checked
                // by the kernel tables in kernels.cu); the device pointers are valid for the
                // lengths passed, on this stream's device, and outlive the launch (the caller
                // holds them and `launch` synchronises below).
                unsafe {
                    result::launch_kernel(
                        *f,
                        (*grid, 1, 1),
                        (THREADS, 1, 1),
                        0,
                        self.stream.cu_stream(),
                        &mut all,
                    )
                }
                .map_err(|e| dev(format!("{what}: cuLaunchKernel: {e}")))?;
            }
        }
        let mut word = [0u64];
        self.stream
            .memcpy_dtoh(&*err, &mut word)
            .map_err(|e| dev(format!("{what}: reading the error word: {e}")))?;
        self.stream
            .synchronize()
            .map_err(|e| dev(format!("{what}: {e}")))?;
        Ok(word[0])
    }

    fn grid(blocks: usize) -> u32 {
        blocks.clamp(1, MAX_GRID) as u32
    }

    fn limits(codec: &Codec, n: usize) -> Result<()> {
        let bs = codec.unit();
        if bs > MAX_BLOCK || codec.blocks(n) >= MAX_BLOCKS {
            return Err(dev(format!(
                "{}: block size {bs} or {} blocks exceeds the device kernels' limits (2^30, 2^31)",
                codec.name(),
                codec.blocks(n)
            )));
        }
        Ok(())
    }

    /// Encodes `src` into the `codec` wire `dst` (`codec.encoded_len(src.len())` bytes, 4-byte
    /// aligned): the host [`encode`](BlockCodec::encode)'s bytes, bit for bit. A non-finite
    /// input is [`Error::NonFinite`] with the first such index.
    pub fn encode<E: CudaElement>(
        &self,
        codec: impl Into<Codec>,
        src: &impl DevicePtr<E>,
        dst: &mut impl DevicePtrMut<u8>,
    ) -> Result<()> {
        let codec = codec.into();
        let q = pick(&codec)?;
        let n = src.len();
        let l = codec.layout(n);
        check_len(&codec, "cuda encode dst bytes", l.total_len, dst.len())?;
        Self::limits(&codec, n)?;
        if n == 0 {
            return Ok(());
        }
        let (x, _gx) = src.device_ptr(&self.stream);
        let word = {
            let (w, _gw) = dst.device_ptr_mut(&self.stream);
            if w % 4 != 0 {
                return Err(dev(
                    "encode dst must be 4-byte aligned (its scales are f32)",
                ));
            }
            // The padding between codes and scales is zero on the wire.
            if l.scales_offset > l.codes_len {
                // SAFETY: the range lies inside `dst` (its length was checked).
                unsafe {
                    result::memset_d8_async(
                        w + l.codes_len as u64,
                        0,
                        l.scales_offset - l.codes_len,
                        self.stream.cu_stream(),
                    )
                }
                .map_err(|e| dev(format!("zeroing the padding: {e}")))?;
            }
            let (mut x, mut nn, mut bs) = (x, n as u64, codec.unit() as u64);
            let (mut codes, mut scales) = (w, w + l.scales_offset as u64);
            let params = [
                p64(&mut x),
                p64(&mut nn),
                p64(&mut bs),
                p64(&mut codes),
                p64(&mut scales),
            ];
            let f = self.module.encode[q][dtype_index(E::DTYPE)];
            self.launch("encode", &[(f, Self::grid(l.num_blocks), &params)])?
        };
        if word == u64::MAX {
            return Ok(());
        }
        let index = word as usize;
        let mut v = [E::from_f32(0.0)];
        // SAFETY: `index < n`, so the element lies inside `src`, which is borrowed and whose
        // writes the stream has finished (`launch` synchronised).
        unsafe { result::memcpy_dtoh_sync(&mut v, x + (index * std::mem::size_of::<E>()) as u64) }
            .map_err(|e| dev(format!("reading the non-finite element: {e}")))?;
        Err(Error::NonFinite {
            index,
            value: v[0].to_f32(),
        })
    }

    /// Decodes the `codec` wire `src` into `dst` (rounded to `E` like the host), validating it
    /// like the host [`decode`](BlockCodec::decode): same values, same first error.
    pub fn decode<E: CudaElement>(
        &self,
        codec: impl Into<Codec>,
        src: &impl DevicePtr<u8>,
        dst: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        let codec = codec.into();
        let q = pick(&codec)?;
        let f = self.module.decode[q][dtype_index(E::DTYPE)];
        self.decode_into(&codec, f, "cuda decode src bytes", src, dst, E::DTYPE)
    }

    /// `acc += decode(src)` in `f32`, like the host
    /// [`decode_accumulate`](BlockCodec::decode_accumulate), bit for bit.
    pub fn decode_accumulate(
        &self,
        codec: impl Into<Codec>,
        src: &impl DevicePtr<u8>,
        acc: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let codec = codec.into();
        let q = pick(&codec)?;
        let f = self.module.accumulate[q];
        self.decode_into(
            &codec,
            f,
            "cuda decode_accumulate src bytes",
            src,
            acc,
            DType::F32,
        )
    }

    fn decode_into<E: CudaElement>(
        &self,
        codec: &Codec,
        f: CUfunction,
        what: &'static str,
        src: &impl DevicePtr<u8>,
        dst: &mut impl DevicePtrMut<E>,
        dtype: DType,
    ) -> Result<()> {
        let n = dst.len();
        let l = codec.layout(n);
        check_len(codec, what, l.total_len, src.len())?;
        Self::limits(codec, n)?;
        if n == 0 {
            return Ok(());
        }
        let (w, _gw) = src.device_ptr(&self.stream);
        let word = {
            let (y, _gy) = dst.device_ptr_mut(&self.stream);
            if w % 4 != 0 {
                return Err(dev(
                    "decode src must be 4-byte aligned (its scales are f32)",
                ));
            }
            let (mut wire, mut codes_len, mut scales_offset) =
                (w, l.codes_len as u64, l.scales_offset as u64);
            let mut odd: u32 = u32::from(codec.packs_pairs() && n % 2 == 1);
            let pad = [
                p64(&mut wire),
                p64(&mut codes_len),
                p64(&mut scales_offset),
                (&mut odd as *mut u32).cast(),
            ];
            let (mut codes, mut scales, mut nn, mut bs, mut y) = (
                w,
                w + l.scales_offset as u64,
                n as u64,
                codec.unit() as u64,
                y,
            );
            let params = [
                p64(&mut codes),
                p64(&mut scales),
                p64(&mut nn),
                p64(&mut bs),
                p64(&mut y),
            ];
            self.launch(
                "decode",
                &[
                    (self.module.padding, 1, &pad),
                    (f, Self::grid(l.num_blocks), &params),
                ],
            )?
        };
        if word == u64::MAX {
            return Ok(());
        }
        Err(Self::decode_error(codec, w, word, dtype, l.scales_offset))
    }

    /// Reads the bytes an error key points at and builds the host codec's error.
    fn decode_error(
        codec: &Codec,
        wire: CUdeviceptr,
        key: u64,
        dtype: DType,
        scales_offset: usize,
    ) -> Error {
        let read = |at: usize, len: usize| -> std::result::Result<Vec<u8>, Error> {
            let mut b = vec![0u8; len];
            // SAFETY: every key points inside the wire (whose length was checked), which is
            // borrowed and whose stream work has finished (`launch` synchronised).
            unsafe { result::memcpy_dtoh_sync(&mut b, wire + at as u64) }
                .map_err(|e| dev(format!("reading the corrupt wire bytes: {e}")))?;
            Ok(b)
        };
        let build = || -> Result<Error> {
            if key >> 63 == 0 {
                let offset = key as usize;
                return Ok(Error::Padding {
                    codec: codec.name(),
                    offset,
                    byte: read(offset, 1)?[0],
                });
            }
            let block = ((key >> 32) & 0x7fff_ffff) as usize;
            let kind = (key >> 30) & 3;
            let index = block * codec.unit() + (key & ((1 << 30) - 1)) as usize;
            let s = read(scales_offset + 4 * block, 4)?;
            let scale = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            if kind == 0 {
                return Ok(Error::InvalidScale {
                    codec: codec.name(),
                    block,
                    value: scale,
                });
            }
            let raw = if codec.packs_pairs() {
                let b = read(index / 2, 1)?[0];
                if index.is_multiple_of(2) {
                    b & 0x0f
                } else {
                    b >> 4
                }
            } else {
                read(index, 1)?[0]
            };
            if kind == 1 {
                return Ok(Error::InvalidCode {
                    codec: codec.name(),
                    index,
                    code: raw,
                });
            }
            let code = if codec.packs_pairs() {
                ((raw << 4) as i8) >> 4
            } else {
                raw as i8
            };
            Ok(Error::Overflow {
                index,
                value: f32::from(code) * scale,
                dtype,
            })
        };
        build().unwrap_or_else(|e| e)
    }

    /// Host-memory convenience: uploads `x`, encodes on the device, downloads the wire.
    pub fn encode_host<E: CudaElement>(&self, codec: impl Into<Codec>, x: &[E]) -> Result<Vec<u8>> {
        let codec = codec.into();
        if x.is_empty() {
            pick(&codec)?;
            return Ok(Vec::new());
        }
        let src = self.upload(x)?;
        let mut dst = self.zeros::<u8>(codec.encoded_len(x.len()))?;
        self.encode(codec, &src, &mut dst)?;
        self.download(&dst)
    }

    /// Host-memory convenience: uploads the wire, decodes `n` elements on the device, downloads.
    pub fn decode_host<E: CudaElement>(
        &self,
        codec: impl Into<Codec>,
        wire: &[u8],
        n: usize,
    ) -> Result<Vec<E>> {
        let codec = codec.into();
        if n == 0 {
            pick(&codec)?;
            check_len(&codec, "cuda decode src bytes", 0, wire.len())?;
            return Ok(Vec::new());
        }
        let src = self.upload(wire)?;
        let mut dst = self.zeros::<E>(n)?;
        self.decode(codec, &src, &mut dst)?;
        self.download(&dst)
    }

    /// Host-memory convenience: `acc += decode(wire)` on the device.
    pub fn decode_accumulate_host(
        &self,
        codec: impl Into<Codec>,
        wire: &[u8],
        acc: &mut [f32],
    ) -> Result<()> {
        let codec = codec.into();
        if acc.is_empty() {
            pick(&codec)?;
            return check_len(&codec, "cuda decode_accumulate src bytes", 0, wire.len());
        }
        let src = self.upload(wire)?;
        let mut d = self.upload(acc)?;
        self.decode_accumulate(codec, &src, &mut d)?;
        let v = self.download(&d)?;
        acc.copy_from_slice(&v);
        Ok(())
    }

    fn upload<T: DeviceRepr>(&self, x: &[T]) -> Result<CudaSlice<T>> {
        self.stream
            .clone_htod(x)
            .map_err(|e| dev(format!("upload: {e}")))
    }

    fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros::<T>(n)
            .map_err(|e| dev(format!("alloc: {e}")))
    }

    fn download<T: DeviceRepr>(&self, x: &CudaSlice<T>) -> Result<Vec<T>> {
        self.stream
            .clone_dtoh(x)
            .map_err(|e| dev(format!("download: {e}")))
    }
}
