//! The recompute guard's cost: the 10M-parameter GPT of BENCHMARKS.md (vocabulary 2,048, context
//! 128, width 384, 6 heads, 5 blocks; 4 sequences per rank) at stage 3 with activation
//! checkpointing on 2 in-process ranks, with the guard on (every recomputed segment compared
//! with its forward: a crc32c of each output activation, in the forward and in the recompute)
//! and off, in alternating order over `ROUNDS` rounds of `STEPS` timed steps each (after one
//! untimed step). Prints each run's ms/step, each variant's mean and the ratio on ÷ off.
//!
//! `cargo build --release -p zero-burn --example recompute_guard && $CARGO_TARGET_DIR/release/examples/recompute_guard [ROUNDS [STEPS]]`

use std::time::Instant;

use burn::tensor::Device;
use zero_burn::demo::data::{Corpus, Draw, MarkovLanguage};
use zero_burn::demo::gpt::GptConfig;
use zero_burn::{Launch, ZeroEngine};
use zero_comm::Communicator;
use zero_core::{Topology, ZeroConfig};

/// Ranks, sequences per rank.
const N: usize = 2;
const B: usize = 4;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arg = |k: usize, d: usize| std::env::args().nth(k).map_or(Ok(d), |a| a.parse());
    let (rounds, steps) = (arg(1, 3)?, arg(2, 10)?);
    let cfg = GptConfig {
        vocab: 2048,
        context: 128,
        d_model: 384,
        heads: 6,
        layers: 5,
    };
    let model = cfg.init(&Device::flex().autodiff(), 0);
    let corpus = MarkovLanguage::new(cfg.vocab, 0)?;
    let zero = ZeroConfig {
        stage: 3,
        checkpoint_activations: Some(true),
        prefetch_bucket_size: 0,
        ..Default::default()
    };
    let mut means = [0.0f64; 2];
    for round in 0..rounds {
        // Alternate which variant runs first, so a drift of the machine's speed cancels.
        let order = if round % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for check in order {
            let per_rank = Launch::new(Topology::single_node(N)?).run_with(&model, |comm, m| {
                let rank = comm.rank();
                let mut e = ZeroEngine::builder(comm, m)
                    .config(zero.clone())
                    .recompute_check(check)
                    .build()?;
                let batches = |step: u64| {
                    corpus.rank_batches(Draw {
                        step,
                        rank,
                        ranks: N,
                        micro_steps: 1,
                        micro_batch: B,
                        seq: cfg.context,
                    })
                };
                e.step(1e-3, &batches(0))?;
                let t = Instant::now();
                for s in 1..=steps as u64 {
                    e.step(1e-3, &batches(s))?;
                }
                Ok(t.elapsed().as_secs_f64() * 1e3 / steps as f64)
            })?;
            let ms = per_rank.iter().copied().fold(0.0, f64::max);
            means[usize::from(!check)] += ms / rounds as f64;
            println!(
                "round {round}: guard {:<3} {ms:.1} ms/step",
                if check { "on" } else { "off" }
            );
        }
    }
    println!(
        "mean: guard on {:.1} ms/step, off {:.1} ms/step, on/off {:.4}x",
        means[0],
        means[1],
        means[0] / means[1]
    );
    Ok(())
}
