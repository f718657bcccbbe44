//! The Hugging Face Trainer run the DeepSpeed config tests resolve `"auto"` values from.

use zero_core::Precision;
use zero_core::config::{AdamWValues, RunBatch, RunValues};
use zero_core::model::preset_hidden_size;

/// A run of gpt2-medium (hidden size 1024) on 8 ranks, 4 sequences each, 2 micro-steps, bf16,
/// AdamW at lr 2e-5, clipping at 1.
pub(crate) fn trainer_run() -> RunValues {
    RunValues {
        hidden_size: preset_hidden_size("gpt2-medium"),
        batch: Some(RunBatch {
            world_size: 8,
            micro_batch_per_rank: 4,
        }),
        gradient_accumulation_steps: Some(2),
        gradient_clipping: Some(1.0),
        precision: Some(Precision::Bf16),
        adamw: Some(AdamWValues {
            lr: 2e-5,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }),
    }
}
