//! Public DeepSpeed configs, byte for byte as published (`tests/configs`, sources in its
//! `SOURCES.md`), read as a config file is read: each imports to the configuration stated here.
//! (The refusals, each naming its key, are tested on the keys themselves in `hf_auto.rs` and the
//! importer's unit tests.)

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

#[path = "common/hf_run.rs"]
mod hf_run;

use zero_core::config::RunValues;
use zero_core::model::preset_hidden_size;
use zero_core::{Placement, Precision, ZeroConfig};

/// What a config is read for.
#[derive(Clone, Copy)]
enum Run {
    /// A Hugging Face Trainer run, which resolves `"auto"` and checks explicit batch sizes and
    /// AdamW parameters against its own (the run of `hf_auto.rs`).
    Trainer,
    /// Only the model known, as `cargo xtask plan --preset gpt2-medium` reads a config: batch
    /// sizes and optimizer parameters are not read.
    ModelOnly,
}

impl Run {
    fn values(self) -> RunValues {
        match self {
            Run::Trainer => hf_run::trainer_run(),
            Run::ModelOnly => RunValues {
                hidden_size: preset_hidden_size("gpt2-medium"),
                ..Default::default()
            },
        }
    }
}

/// Every config in `tests/configs`: its file, what it is read for, and what reading it gives.
fn rows() -> Vec<(&'static str, Run, ZeroConfig)> {
    vec![
        (
            "transformers_zero2_offload_auto.json",
            Run::Trainer,
            // bf16 and fp16 "auto" follow the run's bf16; accumulation and clipping the run's.
            ZeroConfig {
                stage: 2,
                precision: Precision::Bf16,
                optimizer_placement: Placement::Host,
                reduce_bucket_size: 200_000_000,
                allgather_bucket_size: 200_000_000,
                overlap_comm: true,
                gradient_accumulation_steps: 2,
                gradient_clipping: 1.0,
                ..ZeroConfig::default()
            },
        ),
        (
            // Both offloads to the CPU are read; the "auto" values from hidden size 1024, and
            // fp16's "auto" off in a bf16 run that has no bf16 section: fp32.
            "transformers_zero3_offload_auto.json",
            Run::Trainer,
            ZeroConfig {
                stage: 3,
                optimizer_placement: Placement::Host,
                param_placement: Placement::Host,
                reduce_bucket_size: 1_048_576,
                prefetch_bucket_size: 943_718,
                param_persistence_threshold: 10_240,
                max_live_parameters: 1_000_000_000,
                overlap_comm: true,
                gradient_accumulation_steps: 2,
                gradient_clipping: 1.0,
                ..ZeroConfig::default()
            },
        ),
        (
            "accelerate_zero3.json",
            Run::Trainer,
            // The bucket sizes and the persistence threshold "auto" from hidden size 1024; the
            // explicit fp16 and accumulation stand (a flag of the run would override them).
            ZeroConfig {
                stage: 3,
                precision: Precision::Fp16,
                reduce_bucket_size: 1_048_576,
                prefetch_bucket_size: 943_718,
                param_persistence_threshold: 10_240,
                max_live_parameters: 1_000_000_000,
                overlap_comm: true,
                gradient_accumulation_steps: 1,
                gradient_clipping: 1.0,
                ..ZeroConfig::default()
            },
        ),
        (
            "deepspeed_zeropp_tutorial.json",
            Run::ModelOnly,
            ZeroConfig {
                stage: 3,
                reduce_bucket_size: 10_000_000,
                quantized_weights: true,
                hpz_partition_size: 16,
                quantized_gradients: true,
                overlap_comm: true,
                ..ZeroConfig::default()
            },
        ),
        (
            "deepspeed_test_zero2_cpu_offload.json",
            Run::ModelOnly,
            ZeroConfig {
                stage: 2,
                precision: Precision::Fp16,
                optimizer_placement: Placement::Host,
                reduce_bucket_size: 7_000_000,
                allgather_bucket_size: 7_000_000,
                gradient_accumulation_steps: 1,
                gradient_clipping: 1.0,
                ..ZeroConfig::default()
            },
        ),
        (
            "megatron_deepspeed_zero1_bf16.json",
            Run::ModelOnly,
            ZeroConfig {
                stage: 1,
                precision: Precision::Bf16,
                grad_accum_dtype: Some(Precision::Fp32),
                ..ZeroConfig::default()
            },
        ),
        (
            // `bfloat16` (DeepSpeed's legacy spelling of `bf16`) and `cpu_offload` are read, and
            // the disabled `amp` section is accepted.
            "openfold_bfloat16_zero2.json",
            Run::ModelOnly,
            ZeroConfig {
                stage: 2,
                precision: Precision::Bf16,
                optimizer_placement: Placement::Host,
                gradient_clipping: 0.1,
                ..ZeroConfig::default()
            },
        ),
    ]
}

fn configs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/configs")
}

#[test]
fn every_config_file_has_a_row_and_a_source() {
    let dir = configs_dir();
    let files: BTreeSet<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|name| name != "SOURCES.md")
        .collect();
    let rows = rows();
    let named: BTreeSet<String> = rows.iter().map(|r| r.0.to_string()).collect();
    assert_eq!(named.len(), rows.len(), "a file has two rows");
    let unlisted: Vec<&String> = files.difference(&named).collect();
    let missing: Vec<&String> = named.difference(&files).collect();
    assert!(
        unlisted.is_empty(),
        "configs without a row in rows(): {unlisted:?}"
    );
    assert!(missing.is_empty(), "rows without a file: {missing:?}");
    let sources = std::fs::read_to_string(dir.join("SOURCES.md")).unwrap();
    for name in &named {
        assert!(
            sources.contains(&format!("`{name}`")),
            "{name} has no source in SOURCES.md"
        );
    }
}

#[test]
fn every_config_imports_to_its_stated_configuration() {
    let dir = configs_dir();
    for (name, run, want) in rows() {
        let path = dir.join(name);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let got = ZeroConfig::from_any_with(&text, &run.values());
        match got {
            Ok(imp) => assert_eq!(imp.config, want, "{name}: notes {:#?}", imp.notes),
            Err(e) => panic!("{name}: expected to import, refused: {e}"),
        }
    }
}
