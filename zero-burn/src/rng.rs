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

use std::sync::Mutex;

use burn::tensor::Device;

/// Serialises seeding and drawing across the threads of this process.
static RNG: Mutex<()> = Mutex::new(());

/// Runs `f` with `device`'s generator seeded with `seed`, holding the process-wide lock that the
/// engine's seeded forwards hold.
pub fn with_seed<T>(device: &Device, seed: u64, f: impl FnOnce() -> T) -> T {
    let _guard = RNG.lock().unwrap_or_else(|e| e.into_inner());
    device.seed(seed);
    f()
}

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
