//! The unsafe edge: library probes, the owned `ncclComm_t`, NCCL calls with their result codes,
//! and the polling loop every wait uses.
//!
//! cudarc's `safe::Comm` is not used: it hides the raw handle (so neither
//! `ncclCommGetAsyncError` nor `ncclCommSplit` can be called on it), its `Drop` panics when
//! `ncclCommAbort` fails, its `Group` unwraps, and its `NcclError` Debug drops the code. The
//! `sys` layer is used instead, always after [`libs`] proved both libraries and every symbol
//! called here present (cudarc's dynamic loader panics on a missing library or symbol).

use std::ffi::{CStr, c_char, c_int};
use std::panic::AssertUnwindSafe;
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

use cudarc::nccl::sys;

use super::super::{Runtime, UniqueId};
use crate::error::{Error, Result};

/// Symbols the backend calls unconditionally (present in every NCCL 2.x this backend supports).
const REQUIRED: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommAbort",
    "ncclCommGetAsyncError",
    "ncclGetErrorString",
    "ncclCommCount",
    "ncclCommUserRank",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclAllReduce",
    "ncclBroadcast",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
];

/// What the loaded libraries offer.
#[derive(Debug)]
pub(super) struct Libs {
    /// `ncclGetVersion`'s code.
    pub(super) version: (u32, u32, u32),
    pub(super) driver_version: (u32, u32),
    /// `ncclCommInitRankConfig` (NCCL ≥ 2.14): non-blocking communicators.
    pub(super) init_config: bool,
    /// `ncclCommSplit` (NCCL ≥ 2.18).
    pub(super) split: bool,
    /// `ncclGetLastError` (NCCL ≥ 2.13).
    pub(super) last_error: bool,
}

static LIBS: OnceLock<std::result::Result<Libs, String>> = OnceLock::new();

/// Runs `f`, turning a panic inside cudarc (a missing library or symbol, an `unwrap` on an
/// unexpected driver state) into an error.
pub(super) fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "<non-string panic>".into());
            Err(Error::Backend(format!(
                "nccl: {what}: cudarc panicked: {msg}"
            )))
        }
    }
}

fn has_symbol(name: &str) -> bool {
    // SAFETY: only called once `is_culib_present` returned true, so `culib()` loads instead of
    // panicking; looking a symbol up does not call it.
    unsafe {
        sys::culib()
            .get::<unsafe extern "C" fn()>(name.as_bytes())
            .is_ok()
    }
}

fn decode_version(code: c_int) -> (u32, u32, u32) {
    let c = code.max(0) as u32;
    if c >= 10000 {
        (c / 10000, (c % 10000) / 100, c % 100)
    } else {
        (c / 1000, (c % 1000) / 100, c % 100)
    }
}

/// cudarc's library names for `lib`, without repeats.
fn candidates(lib: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for c in cudarc::get_lib_name_candidates(lib) {
        if !out.contains(&c) {
            out.push(c);
        }
    }
    out
}

fn load_libs() -> std::result::Result<Libs, String> {
    // SAFETY: `is_culib_present` only tries to open the library (and closes it again).
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(format!(
            "libcuda not found: cudarc searched {:?} (no NVIDIA driver on this machine; expected \
             without a GPU)",
            candidates("cuda")
        ));
    }
    // SAFETY: as above.
    if !unsafe { sys::is_culib_present() } {
        return Err(format!(
            "libnccl not found: cudarc searched {:?}, which does not include libnccl.so.2; install \
             the NCCL development package (libnccl.so) or put a libnccl.so symlink to libnccl.so.2 \
             on LD_LIBRARY_PATH",
            candidates("nccl")
        ));
    }
    let missing: Vec<&str> = REQUIRED
        .iter()
        .copied()
        .filter(|s| !has_symbol(s))
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "libnccl lacks {missing:?}; this backend needs NCCL 2.14 or newer"
        ));
    }
    let mut code: c_int = 0;
    // SAFETY: the symbol is present; the out-pointer is valid.
    let r = unsafe { sys::ncclGetVersion(&mut code) };
    if r != sys::ncclResult_t::ncclSuccess {
        return Err(format!("ncclGetVersion returned {r:?}"));
    }
    let mut drv: c_int = 0;
    // SAFETY: libcuda is present and cuDriverGetVersion exists in every CUDA driver; it needs no
    // cuInit.
    let dr = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut drv) };
    let driver_version = if dr == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        let d = drv.max(0) as u32;
        (d / 1000, (d % 1000) / 10)
    } else {
        (0, 0)
    };
    Ok(Libs {
        version: decode_version(code),
        driver_version,
        init_config: has_symbol("ncclCommInitRankConfig"),
        split: has_symbol("ncclCommSplit"),
        last_error: has_symbol("ncclGetLastError"),
    })
}

/// Probes libcuda and libnccl (once per process) without calling anything that could panic.
pub(super) fn libs() -> Result<&'static Libs> {
    LIBS.get_or_init(|| match std::panic::catch_unwind(load_libs) {
        Ok(r) => r,
        Err(_) => Err("probing libcuda/libnccl panicked inside cudarc".into()),
    })
    .as_ref()
    .map_err(|e| Error::Backend(e.clone()))
}

/// What [`super::super::probe`] reports.
pub(super) fn runtime() -> Result<Runtime> {
    let l = libs()?;
    let devices = guarded("counting CUDA devices", || {
        cudarc::driver::CudaContext::device_count().map_err(|e| {
            Error::Backend(format!(
                "no usable CUDA device: cuInit/cuDeviceGetCount failed: {e}"
            ))
        })
    })?;
    Ok(Runtime {
        devices: devices.max(0) as usize,
        nccl_version: l.version,
        cuda_driver_version: l.driver_version,
        comm_split: l.split,
        nonblocking_init: l.init_config,
    })
}

fn c_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: NCCL returns pointers to static, NUL-terminated strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// `call` failed with `code`: the code's name and number, NCCL's string for it, and NCCL's last
/// error message when the library has `ncclGetLastError`.
pub(super) fn describe(call: &str, code: sys::ncclResult_t, comm: sys::ncclComm_t) -> String {
    // SAFETY: the symbol is present (checked by `libs`); any code is accepted.
    let s = c_str(unsafe { sys::ncclGetErrorString(code) });
    let last = match libs() {
        // SAFETY: present; NCCL ignores `comm` (may be null) and returns a static buffer.
        Ok(l) if l.last_error => c_str(unsafe { sys::ncclGetLastError(comm) }),
        _ => String::new(),
    };
    let last = if last.trim().is_empty() {
        String::new()
    } else {
        format!("; last error: {}", last.trim())
    };
    format!(
        "{call} returned {code:?} (ncclResult_t {}): {s}{last}",
        code as u32
    )
}

/// An owned `ncclComm_t`. Dropping it calls `ncclCommAbort`, which is local, never waits for peers,
/// and stops any kernel of this communicator still running on the device.
pub(super) struct RawComm(sys::ncclComm_t);

// SAFETY: NCCL communicators may be used from any thread as long as one thread at a time does so;
// `RawComm` is owned by exactly one `NcclComm`, whose methods take `&self`/`&mut self` on one
// thread (it is not `Sync`).
unsafe impl Send for RawComm {}

impl RawComm {
    pub(super) fn ptr(&self) -> sys::ncclComm_t {
        self.0
    }
}

impl std::fmt::Debug for RawComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ncclComm_t({:p})", self.0)
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: a handle written by NCCL's init or split, never aborted before (this is the
            // only owner). The result is ignored: there is nothing left to do on failure.
            let _ = unsafe { sys::ncclCommAbort(self.0) };
            self.0 = std::ptr::null_mut();
        }
    }
}

/// Why a wait or call failed, before the caller turns it into an [`Error`] with its op and rank.
#[derive(Debug)]
pub(super) enum Fail {
    /// An NCCL call or the communicator's asynchronous state reported an error.
    Nccl(String),
    /// The deadline passed.
    Timeout(Duration),
}

/// A polling loop's pause: spin briefly, then yield, then sleep up to 1 ms.
#[derive(Debug, Default)]
pub(super) struct Backoff(u32);

impl Backoff {
    pub(super) fn pause(&mut self) {
        self.0 = self.0.saturating_add(1);
        match self.0 {
            0..=64 => std::hint::spin_loop(),
            65..=256 => thread::yield_now(),
            n => thread::sleep(Duration::from_micros(u64::from((n - 256).min(50)) * 20)),
        }
    }
}

/// The asynchronous state of `comm` (`ncclCommGetAsyncError`).
pub(super) fn async_state(comm: sys::ncclComm_t) -> std::result::Result<sys::ncclResult_t, Fail> {
    let mut state = sys::ncclResult_t::ncclSuccess;
    // SAFETY: `comm` is a live handle (the caller holds its `RawComm`); the out-pointer is valid.
    let r = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
    if r != sys::ncclResult_t::ncclSuccess {
        return Err(Fail::Nccl(describe("ncclCommGetAsyncError", r, comm)));
    }
    Ok(state)
}

/// Polls `comm` until it leaves `ncclInProgress` (non-blocking mode) or `deadline` passes.
pub(super) fn wait_ready(
    comm: sys::ncclComm_t,
    what: &str,
    started: Instant,
    timeout: Duration,
) -> std::result::Result<(), Fail> {
    let mut backoff = Backoff::default();
    loop {
        match async_state(comm)? {
            sys::ncclResult_t::ncclSuccess => return Ok(()),
            sys::ncclResult_t::ncclInProgress => {}
            e => return Err(Fail::Nccl(describe(what, e, comm))),
        }
        let waited = started.elapsed();
        if waited >= timeout {
            return Err(Fail::Timeout(waited));
        }
        backoff.pause();
    }
}

/// Treats `code` from `call` on `comm`: success, in progress (then waits), or an error.
pub(super) fn settle(
    code: sys::ncclResult_t,
    call: &str,
    comm: sys::ncclComm_t,
    started: Instant,
    timeout: Duration,
) -> std::result::Result<(), Fail> {
    match code {
        sys::ncclResult_t::ncclSuccess => Ok(()),
        sys::ncclResult_t::ncclInProgress if !comm.is_null() => {
            wait_ready(comm, call, started, timeout)
        }
        e => Err(Fail::Nccl(describe(call, e, comm))),
    }
}

/// `ncclGetUniqueId`.
pub(super) fn unique_id() -> Result<UniqueId> {
    libs()?;
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    // SAFETY: present (checked by `libs`); the out-pointer is valid.
    let r = unsafe { sys::ncclGetUniqueId(&mut id) };
    if r != sys::ncclResult_t::ncclSuccess {
        return Err(Error::Backend(format!(
            "nccl: {}",
            describe("ncclGetUniqueId", r, std::ptr::null_mut())
        )));
    }
    Ok(UniqueId(id.internal.map(|c| c as u8)))
}

/// NCCL's `NCCL_CONFIG_UNDEF_INT`.
const UNDEF_INT: c_int = c_int::MIN;

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`, for cudarc's NCCL 2.30 bindings. `version` is
/// the loaded library's, capped at 2.30: NCCL copies `min(size, its own sizeof)` bytes, so a newer
/// struct is read correctly by an older library.
fn nonblocking_config(libs: &Libs) -> sys::ncclConfig_t {
    let (a, b, c) = libs.version;
    let version = (a * 10000 + b * 100 + c).min(23099);
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version,
        blocking: 0,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
        graphUsageMode: UNDEF_INT,
        numRmaCtx: UNDEF_INT,
        maxP2pPeers: UNDEF_INT,
    }
}

/// `ncclCommInitRank(Config)` for `rank` of `world`, waiting (non-blocking mode) at most `timeout`.
/// The caller has bound the device's context to this thread. Returns the handle and whether it is
/// non-blocking.
pub(super) fn init_rank(
    id: &UniqueId,
    rank: usize,
    world: usize,
    nonblocking: bool,
    timeout: Duration,
) -> Result<(RawComm, bool)> {
    let l = libs()?;
    let too_big =
        |what: &str, v: usize| Error::Backend(format!("nccl: {what} {v} does not fit NCCL's int"));
    let nranks = c_int::try_from(world).map_err(|_| too_big("world size", world))?;
    let r = c_int::try_from(rank).map_err(|_| too_big("rank", rank))?;
    let uid = sys::ncclUniqueId {
        internal: id.0.map(|b| b as c_char),
    };
    let nonblocking = nonblocking && l.init_config;
    let mut handle: sys::ncclComm_t = std::ptr::null_mut();
    let started = Instant::now();
    let (call, code) = if nonblocking {
        let mut cfg = nonblocking_config(l);
        // SAFETY: present (checked); valid out-pointer and config, which NCCL copies.
        let code = unsafe { sys::ncclCommInitRankConfig(&mut handle, nranks, uid, r, &mut cfg) };
        ("ncclCommInitRankConfig", code)
    } else {
        // SAFETY: present (checked); valid out-pointer. Blocks until every rank joined.
        let code = unsafe { sys::ncclCommInitRank(&mut handle, nranks, uid, r) };
        ("ncclCommInitRank", code)
    };
    // Owns the handle from here on, so any failure below aborts it.
    let raw = RawComm(handle);
    settle(code, call, raw.ptr(), started, timeout).map_err(|f| match f {
        Fail::Nccl(m) => Error::Backend(format!("nccl: rank {rank}: {m}")),
        Fail::Timeout(w) => Error::Backend(format!(
            "nccl: rank {rank}: {call} did not complete within {w:?} (a peer never joined or \
             could not connect); communicator aborted"
        )),
    })?;
    if raw.ptr().is_null() {
        return Err(Error::Backend(format!(
            "nccl: rank {rank}: {call} returned success but no communicator"
        )));
    }
    Ok((raw, nonblocking))
}

/// `ncclCommSplit(parent, color, key)` with the parent's config. Waits at most `timeout`.
///
/// NCCL leaves `*newcomm` null until the split has fully completed, and in non-blocking mode it
/// returns `ncclInProgress` and writes `*newcomm` later, from its init thread (`job->newcomm` in
/// NCCL's `ncclCommInitChildComm`). So the out-slot lives on the heap, is read only after the
/// parent reports success (`ncclCommGetAsyncError` on the parent joins the init job), and is
/// leaked rather than freed if we give up first, since NCCL may still write it. (Reading a stack
/// copy taken before the wait was the bug the first GPU run found: "returned success but no
/// communicator".)
pub(super) fn split(
    parent: sys::ncclComm_t,
    color: c_int,
    key: c_int,
    timeout: Duration,
) -> std::result::Result<RawComm, Fail> {
    let slot: *mut sys::ncclComm_t = Box::into_raw(Box::new(std::ptr::null_mut()));
    // SAFETY: `slot` is a live heap allocation (freed below only once NCCL is done with it).
    let read = || unsafe { std::ptr::read_volatile(slot) };
    let started = Instant::now();
    // SAFETY: `parent` is live; presence of the symbol was checked by the caller; a null config
    // makes the child inherit the parent's; `slot` stays valid for as long as NCCL may write it.
    let code = unsafe { sys::ncclCommSplit(parent, color, key, slot, std::ptr::null_mut()) };
    let settled = settle(code, "ncclCommSplit", parent, started, timeout).and_then(|()| {
        // The parent reported success, so the init job was joined and the slot written; wait a
        // little in case a library writes it just after.
        let mut backoff = Backoff::default();
        loop {
            let child = read();
            if !child.is_null() {
                return Ok(child);
            }
            if started.elapsed() >= timeout {
                return Err(Fail::Nccl(
                    "ncclCommSplit returned success but no communicator".into(),
                ));
            }
            backoff.pause();
        }
    });
    match settled {
        Ok(child) => {
            // SAFETY: allocated by `Box::into_raw` above; NCCL wrote it and is done with it.
            drop(unsafe { Box::from_raw(slot) });
            // Owns the child from here on, so a failure below aborts it.
            let raw = RawComm(child);
            wait_ready(raw.ptr(), "ncclCommSplit", started, timeout)?;
            Ok(raw)
        }
        Err(e) => {
            // NCCL may still write the slot: leak it (one pointer). A child already written is
            // owned, and aborted, by the `RawComm`.
            let child = read();
            if !child.is_null() {
                drop(RawComm(child));
            }
            Err(e)
        }
    }
}

/// `(ncclCommCount, ncclCommUserRank)` of a ready communicator.
pub(super) fn count_and_rank(comm: sys::ncclComm_t) -> std::result::Result<(usize, usize), Fail> {
    let (mut n, mut r): (c_int, c_int) = (0, 0);
    // SAFETY: live handle, valid out-pointers, symbols present.
    let a = unsafe { sys::ncclCommCount(comm, &mut n) };
    if a != sys::ncclResult_t::ncclSuccess {
        return Err(Fail::Nccl(describe("ncclCommCount", a, comm)));
    }
    // SAFETY: as above.
    let b = unsafe { sys::ncclCommUserRank(comm, &mut r) };
    if b != sys::ncclResult_t::ncclSuccess {
        return Err(Fail::Nccl(describe("ncclCommUserRank", b, comm)));
    }
    Ok((n.max(0) as usize, r.max(0) as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_decode_both_schemes() {
        assert_eq!(decode_version(22105), (2, 21, 5));
        assert_eq!(decode_version(2804), (2, 8, 4));
    }

    #[test]
    fn config_has_nccl_s_magic_and_is_non_blocking() {
        let l = Libs {
            version: (2, 21, 5),
            driver_version: (12, 4),
            init_config: true,
            split: true,
            last_error: true,
        };
        let c = nonblocking_config(&l);
        assert_eq!((c.magic, c.version, c.blocking), (0xcafe_beef, 22105, 0));
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
        let newer = Libs {
            version: (2, 31, 0),
            ..l
        };
        assert_eq!(nonblocking_config(&newer).version, 23099);
    }
}
