//! On Linux the engine's binary allocates with jemalloc, keeping freed pages for reuse and backing
//! them with transparent huge pages.
//!
//! A CPU training step allocates unit-sized buffers (gradients, the all-gathered weights) and
//! burn's activations afresh. With glibc's allocator each large one is mapped anew, faulted in
//! 4 KiB at a time (the kernel zeroing every page) and unmapped with a TLB flush on every core the
//! process runs on: about 8% of a step of the 10M GPT on two cores. jemalloc configured as below
//! reuses the pages it holds instead (BENCHMARKS.md, "Against PyTorch on the same CPU: the
//! allocator"). Only the allocator changes, never an arithmetic operation: every loss is the same
//! to the bit. The engine's booked bytes do not change either; the peak RSS a report shows is the
//! kernel's, and it grows by what jemalloc keeps (744–774 MiB against glibc's 701 for the 10M GPT
//! at stage 0).

#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read once when it initialises (before `main`): transparent huge pages for
/// its memory, and freed pages kept for reuse (never returned to the kernel while the process
/// lives).
#[allow(non_upper_case_globals)]
#[unsafe(export_name = "_rjem_malloc_conf")]
pub(crate) static malloc_conf: &[u8] = b"thp:always,dirty_decay_ms:-1,muzzy_decay_ms:-1\0";
