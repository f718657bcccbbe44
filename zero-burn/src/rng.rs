//! Randomness the engine can replay: a seed for every segment's forward.
//!
//! A layer that draws random numbers in training (burn's `Dropout`) draws them from the backend's
//! generator. With activation checkpointing the engine runs a segment twice, once in the forward
//! and again in the backward's recompute; both runs must draw the same numbers, or the gradients
//! belong to neither forward (PyTorch's `checkpoint(preserve_rng_state=True)`). So before every
//! forward of segment `i` (the first, the recompute, and the single forward without
//! checkpointing alike) the engine seeds the model's device with [`segment_seed`] of
//! `(seed, step, micro-step, segment, rank)`: checkpointing on and off draw the same masks, a run
//! is reproducible, and a plain-burn oracle can draw them too.
//!
//! burn's CPU backend keeps one generator per process, which the ranks of an in-process
//! [`crate::Launch`] share; [`with_seed`] holds a process-wide lock from the seed to the end of
//! the segment's forward, so no other rank (or other user of [`with_seed`]) draws in between.
//! Code that draws from burn's generator on another thread without it can still shift a
//! segment's numbers; the engine then fails the step (the recomputed loss differs from the
//! forward's) rather than train on mismatched gradients.
//!
//! Most forwards draw nothing (no dropout, or dropout with probability 0), and holding the lock
//! through them would run the forwards of in-process ranks one at a time. So the engine finds
//! out, at the first forward of each segment and of each kind (recording a graph or not), whether
//! it draws (`Draws`): under the lock it seeds, draws a probe, seeds again, runs the forward
//! and draws the probe again; the two probes differ exactly when the forward drew. A segment
//! whose first forward drew nothing runs later forwards of that kind without the lock and
//! without seeding, in parallel with the other ranks. A segment that starts to draw only after
//! its first forward (a dropout probability raised mid-run) is then not seeded: its numbers
//! are not reproducible, and with activation checkpointing the recompute check fails the step.

use std::sync::{Mutex, OnceLock};

use burn::tensor::{Device, Distribution, Tensor, TensorData};

/// Serialises seeding and drawing across the threads of this process.
static RNG: Mutex<()> = Mutex::new(());

/// Runs `f` with `device`'s generator seeded with `seed`, holding the process-wide lock that the
/// engine's seeded forwards hold.
pub fn with_seed<T>(device: &Device, seed: u64, f: impl FnOnce() -> T) -> T {
    let _guard = RNG.lock().unwrap_or_else(|e| e.into_inner());
    device.seed(seed);
    f()
}

/// Whether each segment's forwards draw from the generator, learnt at the first forward of each
/// kind (see the module docs); one per engine.
#[derive(Debug, Default)]
pub(crate) struct Draws {
    /// Per segment: whether a forward without a graph (`[0]`) and with one (`[1]`) draws.
    seen: Vec<[OnceLock<bool>; 2]>,
}

impl Draws {
    /// Nothing known yet about the forwards of `segments` segments.
    pub(crate) fn new(segments: usize) -> Self {
        Self {
            seen: (0..segments).map(|_| Default::default()).collect(),
        }
    }

    /// Runs `f`, the forward of `segment` (recording a graph when `graph`), seeded with `seed`
    /// under the process-wide lock, unless that segment's first forward of this kind drew
    /// nothing: then without either. The first forward of each kind also finds out which.
    pub(crate) fn run<T>(
        &self,
        device: &Device,
        seed: u64,
        segment: usize,
        graph: bool,
        f: impl FnOnce() -> T,
    ) -> T {
        let Some(known) = self.seen.get(segment).map(|s| &s[usize::from(graph)]) else {
            return with_seed(device, seed, f);
        };
        match known.get() {
            Some(false) => f(),
            Some(true) => with_seed(device, seed, f),
            None => {
                let (out, drew) = probe(device, seed, f);
                // One engine runs on one thread at a time: nobody else sets it.
                let _ = known.set(drew);
                out
            }
        }
    }
}

/// Runs `f` seeded with `seed` under the lock, as [`with_seed`] does, and tells whether it drew
/// from the generator: the draw that follows it differs from the first draw after the seed.
fn probe<T>(device: &Device, seed: u64, f: impl FnOnce() -> T) -> (T, bool) {
    let _guard = RNG.lock().unwrap_or_else(|e| e.into_inner());
    let draw = || -> TensorData {
        Tensor::<1>::random([PROBE_LEN], Distribution::Default, device).into_data()
    };
    device.seed(seed);
    let fresh = draw();
    device.seed(seed);
    let out = f();
    let after = draw();
    (out, after != fresh)
}

/// Values in a probe: a forward that drew is told from one that did not with certainty but for
/// a chance of 2⁻⁹⁶ or so.
const PROBE_LEN: usize = 4;

/// The seed of segment `segment`'s forward in micro-step `micro` (0-based within the optimizer
/// step) of optimizer step `step` (0-based: the steps taken before it) on rank `rank`, from the
/// engine's base `seed` (`EngineBuilder::seed`, 0 by default). A SplitMix64 mix of the five.
pub fn segment_seed(seed: u64, step: u64, micro: usize, segment: usize, rank: usize) -> u64 {
    [step, micro as u64, segment as u64, rank as u64]
        .into_iter()
        .fold(splitmix(seed), |h, x| splitmix(h ^ splitmix(x)))
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_differ_in_every_coordinate() {
        let base = segment_seed(0, 1, 2, 3, 4);
        assert_eq!(base, segment_seed(0, 1, 2, 3, 4));
        for other in [
            segment_seed(1, 1, 2, 3, 4),
            segment_seed(0, 2, 2, 3, 4),
            segment_seed(0, 1, 3, 3, 4),
            segment_seed(0, 1, 2, 4, 4),
            segment_seed(0, 1, 2, 3, 5),
            // The coordinates are not interchangeable.
            segment_seed(0, 2, 1, 3, 4),
        ] {
            assert_ne!(base, other);
        }
    }

    /// A forward that draws keeps the lock and the seed; one that does not runs without them, so
    /// two ranks' forwards overlap in time (with the lock held through them, the barrier inside
    /// would never fill and its wait would time out).
    #[test]
    fn forwards_that_draw_nothing_run_in_parallel_and_unseeded() {
        use std::sync::{Arc, Barrier};
        use std::time::{Duration, Instant};
        let device = Device::flex();
        let draw = || Tensor::<1>::random([8], Distribution::Default, &device).into_data();

        let drawing = Draws::new(1);
        let first = drawing.run(&device, 5, 0, true, draw);
        assert_eq!(drawing.seen[0][1].get(), Some(&true));
        assert_eq!(
            drawing.seen[0][0].get(),
            None,
            "the other kind is learnt on its own"
        );
        assert_eq!(
            drawing.run(&device, 5, 0, true, draw),
            first,
            "seeded again"
        );
        assert_eq!(first, with_seed(&device, 5, draw));

        let barrier = Arc::new(Barrier::new(2));
        let overlapped = |draws: &Draws| {
            let barrier = Arc::clone(&barrier);
            let start = Instant::now();
            draws.run(&device, 9, 0, false, || {
                // A hand-made wait with a deadline: `Barrier` has no timeout.
                let (tx, rx) = std::sync::mpsc::channel();
                std::thread::spawn(move || tx.send(barrier.wait()).ok());
                rx.recv_timeout(Duration::from_secs(20)).is_ok()
            }) && start.elapsed() < Duration::from_secs(20)
        };
        let quiet = [Draws::new(1), Draws::new(1)];
        // The first forward of each rank is probed under the lock, one at a time.
        for d in &quiet {
            assert_eq!(d.run(&device, 9, 0, false, || 1), 1);
            assert_eq!(d.seen[0][0].get(), Some(&false));
        }
        let both = std::thread::scope(|s| {
            let a = s.spawn(|| overlapped(&quiet[0]));
            let b = s.spawn(|| overlapped(&quiet[1]));
            (a.join().unwrap(), b.join().unwrap())
        });
        assert_eq!(both, (true, true), "the two forwards ran at the same time");
    }

    #[test]
    fn with_seed_replays_the_same_numbers() {
        use burn::tensor::{Distribution, Tensor};
        let device = Device::flex();
        let draw = || Tensor::<1>::random([16], Distribution::Default, &device).into_data();
        let a = with_seed(&device, 7, draw);
        let b = with_seed(&device, 7, draw);
        let c = with_seed(&device, 8, draw);
        assert_eq!(a, b);
        assert_ne!(a, c);
    }
}
