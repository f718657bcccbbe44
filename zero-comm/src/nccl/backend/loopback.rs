//! The CUDA loopback (feature `nccl`): N ranks, one thread each, on **one** GPU and one CUDA
//! stream, with [`NcclBuffer`]s in device memory. The collectives are the device loopbacks'
//! ([`crate::device_loopback`], shared with the wgpu loopback); this file adds the memory: device
//! copies (`cuMemcpyDtoDAsync`) and the reduction, an `f32` accumulation kernel per input in rank
//! order followed by qgZ's finish kernel (`div.rn.f32` by `n` for `Mean`, by 1 for `Sum`, then one
//! rounding to the element type). Both are hand-written PTX, JIT-compiled by the driver. NCCL is
//! not involved, so one GPU runs any world size, and results are bit-identical to the host
//! loopback, except that a NaN comes out as the GPU's canonical NaN (its payload is not kept).
//!
//! Every rank enqueues on the device's one stream, which executes in order; that is the whole
//! synchronisation between ranks, as with the wgpu queue. Work of another stream on the same
//! buffers (burn-cuda's) must be ordered with [`CudaDevice::stream`] by the caller.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use zero_core::Topology;

use super::finish::Finish;
use super::kernels::{PtxModule, acc_and_other_module, element, entry, widen};
use super::{NcclBuffer, driver, ffi};
use crate::device_loopback::{Loc, LoopbackComm, LoopbackWorld, Memory, Recorder, Sealed};
use crate::element::{DType, Element, ReduceOp};
use crate::error::{Error, Result};

/// `acc[i] = start ? widen(x[i]) : acc[i] + widen(x[i])` (`add.rn.f32`, subnormals kept), a
/// grid-stride loop; parameters `(u64 acc, u64 x, u64 len, u32 start)`, the start flag kept in
/// `%p2` (so the body never calls `narrow`, which writes it). `widen` leaves `x[i]` widened
/// exactly in `%f2`.
pub(in crate::nccl) fn acc_ptx() -> String {
    let load_start = "\tld.param.u32 \t%r5, [p_start];\n\tsetp.ne.u32 \t%p2, %r5, 0;";
    acc_and_other_module("zero_acc", "x", ".u32 p_start", load_start, |dtype| {
        format!(
            "{}{}{}\
             \t@%p2 mov.f32 \t%f3, %f2;\n\
             \t@!%p2 ld.global.f32 \t%f4, [%rd7];\n\
             \t@!%p2 add.rn.f32 \t%f3, %f4, %f2;\n\
             \tst.global.f32 \t[%rd7], %f3;",
            element("%rd10", "%rd8", dtype),
            widen(dtype, "%rd10"),
            element("%rd7", "%rd1", DType::F32)
        )
    })
}

/// One GPU, shared by every rank of a CUDA loopback world: the context (the device's primary
/// context, which burn-cuda also uses), the one stream every rank enqueues on, and the kernels.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    acc: PtxModule,
    finish: Arc<Finish>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ctx.ordinal())
            .finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal` (its primary context) with a new stream, and loads the kernels. No
    /// driver or no such device is an [`Error::Backend`] saying so, never a panic.
    pub fn new(ordinal: usize) -> Result<Arc<CudaDevice>> {
        ffi::guarded("opening the CUDA loopback's device", || {
            // SAFETY: only tries to open the library (and closes it again).
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err(Error::Backend(
                    "cuda loopback: libcuda not found (no NVIDIA driver on this machine)".into(),
                ));
            }
            let ctx = CudaContext::new(ordinal).map_err(|e| driver("CudaContext::new", e))?;
            let stream = ctx
                .new_stream()
                .map_err(|e| driver("creating the loopback's stream", e))?;
            Self::from_stream(stream)
        })
    }

    /// Adopts `stream` (e.g. one that burn-cuda's work is ordered with) as the stream every rank
    /// enqueues on, and loads the kernels into its context.
    pub fn from_stream(stream: Arc<CudaStream>) -> Result<Arc<CudaDevice>> {
        let ctx = stream.context().clone();
        let names = ["zero_acc_f32", "zero_acc_f16", "zero_acc_bf16"];
        let acc = PtxModule::load(&ctx, &acc_ptx(), &names)
            .map_err(|e| Error::Backend(format!("cuda loopback: loading the kernels: {e}")))?;
        let finish = Finish::get(&ctx)?;
        Ok(Arc::new(CudaDevice {
            ctx,
            stream,
            acc,
            finish,
        }))
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every rank's collectives run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("binding the context", e))
    }

    fn ptr(&self, loc: Loc<'_, CudaSlice<u8>>) -> u64 {
        let (p, _guard) = loc.view.device_ptr(&self.stream);
        p + loc.byte
    }
}

/// The communicators of one CUDA loopback world, before they are handed to threads.
pub type CudaWorld = LoopbackWorld<CudaDevice>;

/// One rank of a CUDA loopback group ([`Communicator`](crate::Communicator) with
/// [`NcclBuffer`]s). `Send`, not `Sync`: one thread drives it.
pub type CudaComm = LoopbackComm<CudaDevice>;

impl LoopbackWorld<CudaDevice> {
    /// One communicator per rank of `topology` on GPU `ordinal` ([`CudaDevice::new`]), all
    /// waiting at most `timeout` for their peers.
    pub fn new(ordinal: usize, topology: Topology, timeout: Duration) -> Result<CudaWorld> {
        Ok(Self::with_device(
            CudaDevice::new(ordinal)?,
            topology,
            timeout,
        ))
    }
}

#[derive(Debug)]
enum Cmd {
    Copy {
        src: u64,
        dst: u64,
        bytes: u64,
    },
    Reduce {
        inputs: Vec<u64>,
        out: u64,
        count: u64,
        kernel: usize,
        divisor: f32,
    },
}

/// The commands of one step, enqueued on the stream by [`Recorder::submit`].
#[derive(Debug)]
pub struct CudaBatch<'a> {
    dev: &'a CudaDevice,
    cmds: Vec<Cmd>,
    /// A dtype no kernel reduces (refused by validation before anything is recorded).
    refused: Option<DType>,
}

impl Recorder<CudaSlice<u8>, Option<CudaSlice<f32>>> for CudaBatch<'_> {
    fn copy(&mut self, src: Loc<'_, CudaSlice<u8>>, dst: Loc<'_, CudaSlice<u8>>, bytes: u64) {
        if bytes > 0 {
            let (src, dst) = (self.dev.ptr(src), self.dev.ptr(dst));
            self.cmds.push(Cmd::Copy { src, dst, bytes });
        }
    }

    fn reduce(
        &mut self,
        inputs: &[Loc<'_, CudaSlice<u8>>],
        out: Loc<'_, CudaSlice<u8>>,
        count: u64,
        dtype: DType,
        op: ReduceOp,
    ) {
        let Some(kernel) = entry(dtype) else {
            self.refused = Some(dtype);
            return;
        };
        if count == 0 || inputs.is_empty() {
            return;
        }
        self.cmds.push(Cmd::Reduce {
            inputs: inputs.iter().map(|&x| self.dev.ptr(x)).collect(),
            out: self.dev.ptr(out),
            count,
            kernel,
            divisor: match op {
                ReduceOp::Mean => inputs.len() as f32,
                ReduceOp::Sum => 1.0,
            },
        });
    }

    fn submit(self, scratch: &mut Option<CudaSlice<f32>>) -> std::result::Result<(), String> {
        if let Some(d) = self.refused {
            return Err(format!("no reduction kernel for {d}"));
        }
        if self.cmds.is_empty() {
            return Ok(());
        }
        let dev = self.dev;
        dev.bind().map_err(|e| e.to_string())?;
        let stream = &dev.stream;
        for cmd in &self.cmds {
            match *cmd {
                Cmd::Copy { src, dst, bytes } => {
                    // SAFETY: both ranges lie in live buffers of this context (the collective
                    // checked the lengths; peers keep theirs alive until the drain barrier), and
                    // do not overlap.
                    unsafe {
                        cudarc::driver::result::memcpy_dtod_async(
                            dst,
                            src,
                            bytes as usize,
                            stream.cu_stream(),
                        )
                    }
                    .map_err(|e| format!("cuMemcpyDtoDAsync: {e}"))?;
                }
                Cmd::Reduce {
                    ref inputs,
                    out,
                    count,
                    kernel,
                    divisor,
                } => {
                    let len = count as usize;
                    if scratch.as_ref().is_none_or(|s| s.len() < len) {
                        *scratch = Some(
                            stream
                                .alloc_zeros::<f32>(len)
                                .map_err(|e| format!("allocating {len} f32 of scratch: {e}"))?,
                        );
                    }
                    let acc = scratch.as_ref().map(|s| s.device_ptr(stream).0);
                    let acc = acc.ok_or("no scratch")?;
                    for (k, &x) in inputs.iter().enumerate() {
                        let (mut p_acc, mut p_x, mut p_len) = (acc, x, count);
                        let mut p_start = u32::from(k == 0);
                        let mut params: [*mut c_void; 4] = [
                            (&mut p_acc as *mut u64).cast(),
                            (&mut p_x as *mut u64).cast(),
                            (&mut p_len as *mut u64).cast(),
                            (&mut p_start as *mut u32).cast(),
                        ];
                        // SAFETY: the parameters match `zero_acc_*`; `acc` holds at least `len`
                        // f32 and `x` `len` elements of the kernel's type, alive and ordered on
                        // this stream.
                        unsafe { dev.acc.launch(kernel, stream, len, &mut params) }?;
                    }
                    // SAFETY: `acc` holds `len` f32 and `out` `len` elements of the kernel's type,
                    // alive and ordered on this stream; `out` may be an input, read before.
                    unsafe {
                        dev.finish
                            .launch_raw(kernel, stream, acc, out, len, divisor)
                    }?;
                }
            }
        }
        Ok(())
    }
}

impl Sealed for CudaDevice {}

impl Memory for CudaDevice {
    const NAME: &'static str = "cuda loopback";
    const COMM: &'static str = "CudaComm";
    type View = CudaSlice<u8>;
    type Buffer<E: Element> = NcclBuffer<E>;
    type Scratch = Option<CudaSlice<f32>>;
    type Batch<'a> = CudaBatch<'a>;

    fn view<E: Element>(buf: &NcclBuffer<E>) -> &CudaSlice<u8> {
        &buf.bytes
    }

    fn len<E: Element>(buf: &NcclBuffer<E>) -> usize {
        buf.len
    }

    fn batch(&self) -> CudaBatch<'_> {
        CudaBatch {
            dev: self,
            cmds: Vec::new(),
            refused: None,
        }
    }

    fn alloc<E: Element>(&self, len: usize) -> Result<NcclBuffer<E>> {
        NcclBuffer::zeroed(&self.stream, len)
    }

    fn upload<E: Element>(&self, src: &[E], timeout: Duration) -> Result<NcclBuffer<E>> {
        let mut buf = self.alloc::<E>(src.len())?;
        if !src.is_empty() {
            self.upload_into(src, &mut buf, timeout)?;
        }
        Ok(buf)
    }

    fn upload_into<E: Element>(
        &self,
        src: &[E],
        dst: &mut NcclBuffer<E>,
        timeout: Duration,
    ) -> Result<()> {
        // A copy from pageable memory waits for the stream: wait with a timeout first, so a hung
        // stream cannot block it forever.
        self.synchronize(timeout)?;
        dst.write(&self.stream, src)
    }

    fn download<E: Element>(
        &self,
        buf: &NcclBuffer<E>,
        dst: &mut [E],
        timeout: Duration,
    ) -> Result<()> {
        // Wait with a timeout first: the copy itself would block on a hung stream forever.
        self.synchronize(timeout)?;
        buf.read(&self.stream, dst)
    }

    fn synchronize(&self, timeout: Duration) -> Result<()> {
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| driver("recording an event", e))?;
        let started = Instant::now();
        let mut backoff = ffi::Backoff::default();
        loop {
            if event
                .try_is_complete()
                .map_err(|e| driver("waiting for the stream", e))?
            {
                return Ok(());
            }
            let waited = started.elapsed();
            if waited >= timeout {
                return Err(Error::Backend(format!(
                    "cuda loopback: the stream did not finish within {waited:?}"
                )));
            }
            backoff.pause();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acc_ptx_has_three_kernels_that_add_once_each() {
        let ptx = acc_ptx();
        for name in ["f32", "f16", "bf16"] {
            assert_eq!(ptx.matches(&format!(".entry zero_acc_{name}(")).count(), 1);
        }
        assert_eq!(ptx.matches("add.rn.f32").count(), 3);
        assert!(!ptx.contains(".ftz"), "subnormals must be kept");
        assert_eq!(entry(DType::U8), None);
        assert_eq!(entry(DType::BF16), Some(2));
    }
}
