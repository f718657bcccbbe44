//! A counting global allocator: the bytes live on the heap ([`LIVE`]) and their high-water mark
//! ([`PEAK`]). A test binary or bench that installs it counts every allocation of its process:
//!
//! ```
//! #[global_allocator]
//! static ALLOC: zero_testkit::alloc::Counting = zero_testkit::alloc::Counting;
//!
//! let before = zero_testkit::alloc::LIVE.load(std::sync::atomic::Ordering::SeqCst);
//! let v = vec![0u8; 1 << 20];
//! assert!(zero_testkit::alloc::PEAK.load(std::sync::atomic::Ordering::SeqCst) >= before + v.len());
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Counts the bytes live on the heap and their high-water mark; forwards to [`System`].
#[derive(Debug)]
pub struct Counting;

/// Bytes live on the heap now.
pub static LIVE: AtomicUsize = AtomicUsize::new(0);
/// The most bytes live at once (lower it to [`LIVE`] to start a new measurement).
pub static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::SeqCst) + n;
    PEAK.fetch_max(now, Ordering::SeqCst);
}

// SAFETY: every call is forwarded to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Ordering::SeqCst);
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            LIVE.fetch_sub(l.size(), Ordering::SeqCst);
            grew(new);
        }
        q
    }
}
