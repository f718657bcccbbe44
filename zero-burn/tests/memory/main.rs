//! Memory measured by a counting global allocator (the test kit's), which counts every allocation
//! of this process: the training steps (`measured`) and the checkpoint's save, load and export
//! (`checkpoint`). The tests take turns ([`one_at_a_time`]), so that a peak is one test's alone.

#[path = "../common/mod.rs"]
mod common;

mod checkpoint;
mod measured;

use std::sync::{Mutex, MutexGuard};

#[global_allocator]
static ALLOC: zero_testkit::alloc::Counting = zero_testkit::alloc::Counting;

/// Held for the whole of each test: while one measures, no other allocates.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock().unwrap_or_else(|p| p.into_inner())
}
