//! Public DeepSpeed configs, byte for byte as published (`tests/configs`, sources in its
//! `SOURCES.md`), read as a config file is read: each imports to the configuration stated here,
//! or is refused naming one key and no other.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

#[path = "common/hf_run.rs"]
mod hf_run;

use zero_core::config::RunValues;
use zero_core::model::preset_hidden_size;
use zero_core::{Error, Placement, Precision, ZeroConfig};

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

/// What reading a config must give.
enum Expect {
    /// It imports to exactly this configuration.
    Imports(Box<ZeroConfig>),
    /// It is refused, and the refusal names this key and no other.
    Refused(&'static str),
}

/// Every config in `tests/configs`: its file, what it is read for, and what reading it gives.
fn rows() -> Vec<(&'static str, Run, Expect)> {
    vec![
        (
            "transformers_zero2_offload_auto.json",
            Run::Trainer,
            // bf16 and fp16 "auto" follow the run's bf16; accumulation and clipping the run's.
            Expect::Imports(Box::new(ZeroConfig {
                stage: 2,
                precision: Precision::Bf16,
                optimizer_placement: Placement::Host,
                reduce_bucket_size: 200_000_000,
                allgather_bucket_size: 200_000_000,
                overlap_comm: true,
                gradient_accumulation_steps: 2,
                gradient_clipping: 1.0,
                ..ZeroConfig::default()
            })),
        ),
        (
            // The optimizer's offload to the CPU is read; the parameters' is not supported.
            "transformers_zero3_offload_auto.json",
            Run::Trainer,
            Expect::Refused("zero_optimization.offload_param"),
        ),
        (
            "accelerate_zero3.json",
            Run::Trainer,
            // The bucket sizes and the persistence threshold "auto" from hidden size 1024; the
            // explicit fp16 and accumulation stand (a flag of the run would override them).
            Expect::Imports(Box::new(ZeroConfig {
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
            })),
        ),
        (
            "deepspeed_zeropp_tutorial.json",
            Run::ModelOnly,
            Expect::Imports(Box::new(ZeroConfig {
                stage: 3,
                reduce_bucket_size: 10_000_000,
                quantized_weights: true,
                hpz_partition_size: 16,
                quantized_gradients: true,
                overlap_comm: true,
                ..ZeroConfig::default()
            })),
        ),
        (
            "deepspeed_test_zero2_cpu_offload.json",
            Run::ModelOnly,
            Expect::Imports(Box::new(ZeroConfig {
                stage: 2,
                precision: Precision::Fp16,
                optimizer_placement: Placement::Host,
                reduce_bucket_size: 7_000_000,
                allgather_bucket_size: 7_000_000,
                gradient_accumulation_steps: 1,
                gradient_clipping: 1.0,
                ..ZeroConfig::default()
            })),
        ),
        (
            "megatron_deepspeed_zero1_bf16.json",
            Run::ModelOnly,
            Expect::Imports(Box::new(ZeroConfig {
                stage: 1,
                precision: Precision::Bf16,
                grad_accum_dtype: Some(Precision::Fp32),
                ..ZeroConfig::default()
            })),
        ),
        (
            // `bfloat16` (DeepSpeed's legacy spelling of `bf16`) and `cpu_offload` are read, and
            // the disabled `amp` section is accepted.
            "openfold_bfloat16_zero2.json",
            Run::ModelOnly,
            Expect::Imports(Box::new(ZeroConfig {
                stage: 2,
                precision: Precision::Bf16,
                optimizer_placement: Placement::Host,
                gradient_clipping: 0.1,
                ..ZeroConfig::default()
            })),
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
fn every_config_imports_or_is_refused_naming_one_key() {
    let dir = configs_dir();
    for (name, run, expect) in rows() {
        let path = dir.join(name);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let got = ZeroConfig::from_any_with(&text, &run.values());
        match (expect, got) {
            (Expect::Imports(want), Ok(imp)) => {
                assert_eq!(imp.config, *want, "{name}: notes {:#?}", imp.notes);
            }
            (Expect::Refused(key), Err(e)) => {
                let message = e.to_string();
                assert!(
                    message.contains(key),
                    "{name}: {key} not named in: {message}"
                );
                let Error::UnsupportedKeys(keys) = e else {
                    panic!("{name}: refused for another reason than its keys: {message}");
                };
                assert_eq!(
                    keys.len(),
                    1,
                    "{name}: expected {key} alone refused, got {keys:#?}"
                );
            }
            (Expect::Imports(_), Err(e)) => panic!("{name}: expected to import, refused: {e}"),
            (Expect::Refused(key), Ok(imp)) => {
                panic!("{name}: expected {key} refused, imported {:#?}", imp.config)
            }
        }
    }
}
