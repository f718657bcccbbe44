//! The tiny model, data and options the trainer tests share.
#![allow(dead_code)]

use burn::tensor::Device;
use zero_burn::data::MarkovLanguage;
use zero_burn::optim::Optimizer;
use zero_burn::{Gpt, GptConfig, Reduction, TrainOptions};
use zero_core::{Plan, TrafficTable};

/// A 2-block GPT with d_model 16 on flex, and a 16-token Markov language.
pub(crate) fn tiny() -> (Gpt, MarkovLanguage) {
    let cfg = GptConfig {
        vocab: 16,
        context: 8,
        d_model: 16,
        heads: 2,
        layers: 2,
    };
    let device = Device::flex().autodiff();
    (cfg.init(&device, 42), MarkovLanguage::new(16, 3).unwrap())
}

/// AdamW at 1e-2, micro-batch 2 of 8 tokens, with the given reduction.
pub(crate) fn options_with(reduction: Reduction) -> TrainOptions {
    TrainOptions {
        lr: 1e-2,
        optimizer: Optimizer::default(),
        micro_batch: 2,
        seq: 8,
        reduction,
    }
}

/// [`options_with`] rank-ordered reduction.
pub(crate) fn options() -> TrainOptions {
    options_with(Reduction::RankOrdered)
}

/// The plan's traffic for `rank` over `steps` optimizer steps (none skipped).
pub(crate) fn planned_traffic(plan: &Plan, rank: usize, steps: u64) -> TrafficTable {
    let per_step = plan.comm(rank).by_collective;
    let mut t = TrafficTable::new();
    for _ in 0..steps {
        t.merge(&per_step);
    }
    t
}

/// Every parameter's values as bits, for bit-exact comparisons.
pub(crate) fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|p| p.iter().map(|x| x.to_bits()).collect())
        .collect()
}
