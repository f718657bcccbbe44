//! DeepSpeed configs as Hugging Face Trainer users write them: `"auto"` resolves from the model's
//! hidden size and the run's own settings (as `transformers.integrations.deepspeed` does), while
//! what zero-rs does not implement is still refused with the key named.

#[path = "common/hf_run.rs"]
mod hf_run;

use zero_core::config::RunValues;
use zero_core::{ModelDesc, Plan, Precision, Topology, ZeroConfig};

/// The HF Trainer's ZeRO-3 config in the style of its docs: everything the Trainer knows is
/// `"auto"`.
const HF_ZERO3: &str = r#"{
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}
    },
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": true,
        "contiguous_gradients": true,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": true
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}"#;

/// The Trainer's run (see `common/hf_run.rs`).
fn run() -> RunValues {
    hf_run::trainer_run()
}

#[test]
fn hf_zero3_config_resolves_to_the_stated_values_for_gpt2_medium() {
    let imp = ZeroConfig::from_deepspeed_json_with(HF_ZERO3, &run()).unwrap();
    let c = &imp.config;
    // h = 1024: h² = 1,048,576; 0.9·h² = 943,718.4 → 943,718; 10·h = 10,240.
    assert_eq!(c.reduce_bucket_size, 1_048_576);
    assert_eq!(c.prefetch_bucket_size, 943_718);
    assert_eq!(c.param_persistence_threshold, 10_240);
    assert_eq!(c.gradient_accumulation_steps, 2);
    assert_eq!(c.gradient_clipping, 1.0);
    assert_eq!(c.precision, Precision::Bf16);
    assert_eq!(c.stage, 3);
    assert!(c.overlap_comm);
    assert_eq!(c.max_live_parameters, 1_000_000_000);

    let lines: Vec<String> = imp.resolved.iter().map(|r| r.to_string()).collect();
    let want = [
        "zero_optimization.reduce_bucket_size = 1048576 (hidden_size² with the model's hidden_size 1024)",
        "zero_optimization.stage3_prefetch_bucket_size = 943718 (0.9 × hidden_size², rounded down with the model's hidden_size 1024)",
        "zero_optimization.stage3_param_persistence_threshold = 10240 (10 × hidden_size with the model's hidden_size 1024)",
        "gradient_accumulation_steps = 2 (the run's gradient accumulation)",
        "gradient_clipping = 1 (the run's clipping threshold; 0 = off)",
        "fp16.enabled = false (the run's precision bf16)",
        "bf16.enabled = true (the run's precision bf16)",
        "train_micro_batch_size_per_gpu = 4 (the run's sequences per rank per micro-step)",
        "train_batch_size = 64 (world size 8 × micro-batch 4 × accumulation 2)",
        "optimizer.params.lr = 0.00002 (the run's learning rate)",
        "optimizer.params.betas = [0.9,0.999] (the trainer's AdamW, which no flag changes)",
        "optimizer.params.eps = 1e-8 (the trainer's AdamW, which no flag changes)",
        "optimizer.params.weight_decay = 0 (the trainer's AdamW, which no flag changes)",
    ];
    assert_eq!(lines, want, "{lines:#?}");
    // The scheduler is the one section left unresolved, and the import says so.
    assert!(
        imp.notes
            .iter()
            .any(|n| n.contains("`scheduler` is not read")),
        "{:?}",
        imp.notes
    );

    // The resolved config plans for the model it was resolved for.
    let model = ModelDesc::preset("gpt2-medium").unwrap();
    Plan::new(&model, Topology::new(8, 8).unwrap(), c).unwrap();
}

/// HF's ZeRO-3 offload example: the optimizer offloaded to the CPU is host placement.
#[test]
fn the_optimizer_offloaded_to_the_cpu_is_host_placement() {
    let text = HF_ZERO3.replace(
        r#""stage": 3,"#,
        r#""stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true},"#,
    );
    let imp = ZeroConfig::from_deepspeed_json_with(&text, &run()).unwrap();
    assert_eq!(imp.config.optimizer_placement, zero_core::Placement::Host);
    assert!(imp.notes.iter().any(|n| n.contains("host memory")));
    let model = ModelDesc::preset("gpt2-medium").unwrap();
    let m = Plan::new(&model, Topology::new(8, 8).unwrap(), &imp.config)
        .unwrap()
        .memory();
    assert_eq!(
        m.host_bytes,
        m.optimizer_states + m.master_weights + m.gradients
    );
    assert_eq!(m.device_bytes + m.host_bytes, m.total_bytes);
    assert!(m.host_bytes > 0);
}

#[test]
fn an_unsupported_key_is_still_refused_by_name() {
    for (key, value) in [
        ("mics_shard_size", "8"),
        ("zeropp_loco_param", r#"{"err_beta": 0.8, "reset_T": 1024}"#),
        ("zero_quantized_nontrainable_weights", "true"),
    ] {
        let text = HF_ZERO3.replace(
            r#""stage": 3,"#,
            &format!(r#""stage": 3, "{key}": {value},"#),
        );
        let e = ZeroConfig::from_deepspeed_json_with(&text, &run())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!(
                "zero_optimization.{key}: got {}",
                value.replace(": ", ":").replace(", ", ",")
            )),
            "{key}: {e}"
        );
        assert!(e.contains("is not supported by zero-rs yet"), "{key}: {e}");
        // The refusal is about that key alone: every "auto" resolved.
        assert!(!e.contains("auto"), "{key}: {e}");
    }
}

/// ZeRO-Infinity as HF's docs write it: both parts on NVMe under one folder, with the `aio`
/// section's tunings accepted as notes.
#[test]
fn zero_infinity_is_nvme_placement() {
    let text = HF_ZERO3
        .replace(
            r#""stage": 3,"#,
            r#""stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
                                  "buffer_count": 4, "fast_init": false},
            "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
                              "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},"#,
        )
        .replacen(
            '{',
            r#"{"aio": {"block_size": 262144, "queue_depth": 32},"#,
            1,
        );
    let imp = ZeroConfig::from_deepspeed_json_with(&text, &run()).unwrap();
    let c = &imp.config;
    assert_eq!(c.optimizer_placement, zero_core::Placement::Nvme);
    assert_eq!(c.param_placement, zero_core::Placement::Nvme);
    assert_eq!(c.nvme_path.as_deref(), Some("/local_nvme"));
    assert_eq!(c.offload_buffer_count, 5);
    assert!(imp.notes.iter().any(|n| n.starts_with("aio.queue_depth")));
    let model = ModelDesc::preset("gpt2-medium").unwrap();
    let plan = Plan::new(&model, Topology::new(8, 8).unwrap(), c).unwrap();
    let m = plan.memory();
    // On disk: the moments and masters, and the parameter shard; in host memory: the gradients
    // and the ring.
    let shard = plan.shard_len() * plan.working_bytes();
    assert_eq!(m.disk_bytes, m.optimizer_states + m.master_weights + shard);
    assert_eq!(m.host_bytes, m.gradients + m.offload_buffers);
    assert!(m.offload_buffers > 0);
    assert_eq!(m.device_bytes + m.host_bytes + m.disk_bytes, m.total_bytes);
}

#[test]
fn auto_without_a_hidden_size_says_what_is_missing() {
    let run = RunValues {
        hidden_size: None,
        ..run()
    };
    let e = ZeroConfig::from_deepspeed_json_with(HF_ZERO3, &run)
        .unwrap_err()
        .to_string();
    for key in [
        "reduce_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
    ] {
        assert!(
            e.contains(&format!(
                "zero_optimization.{key}: got \"auto\", expected a number of elements"
            )),
            "{key}: {e}"
        );
    }
    assert!(e.contains("no model hidden size was given"), "{e}");
}

#[test]
fn explicit_values_that_disagree_with_the_run_are_errors() {
    let text = HF_ZERO3
        .replace(
            r#""train_micro_batch_size_per_gpu": "auto""#,
            r#""train_micro_batch_size_per_gpu": 16"#,
        )
        .replace(r#""train_batch_size": "auto""#, r#""train_batch_size": 64"#)
        .replace(r#""lr": "auto""#, r#""lr": 3e-4"#)
        .replace(r#""weight_decay": "auto""#, r#""weight_decay": 0.01"#);
    let e = ZeroConfig::from_deepspeed_json_with(&text, &run())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("train_micro_batch_size_per_gpu: got 16, expected \"auto\" or the run's 4"),
        "{e}"
    );
    assert!(
        e.contains("optimizer.params.lr: got 0.0003, expected \"auto\" or the run's 0.00002"),
        "{e}"
    );
    assert!(
        e.contains("optimizer.params.weight_decay: got 0.01, expected \"auto\" or the run's 0"),
        "{e}"
    );
    // 64 = 8 × 4 × 2 agrees with the run.
    assert!(!e.contains("train_batch_size:"), "{e}");

    // Values equal to the run's are accepted as they are.
    let text = HF_ZERO3
        .replace(r#""lr": "auto""#, r#""lr": 2e-5"#)
        .replace(r#""betas": "auto""#, r#""betas": [0.9, 0.999]"#)
        .replace(r#""train_batch_size": "auto""#, r#""train_batch_size": 64"#);
    let imp = ZeroConfig::from_deepspeed_json_with(&text, &run()).unwrap();
    assert!(!imp.resolved.iter().any(|r| r.key == "optimizer.params.lr"));
    assert!(
        imp.notes
            .iter()
            .any(|n| n.starts_with("train_batch_size: 64"))
    );
}

#[test]
fn auto_elsewhere_is_refused_by_the_key_itself() {
    let text = HF_ZERO3.replace(
        r#""stage3_max_live_parameters": 1e9"#,
        r#""stage3_max_live_parameters": "auto""#,
    );
    let e = ZeroConfig::from_deepspeed_json_with(&text, &run())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(
            "zero_optimization.stage3_max_live_parameters: got \"auto\", expected a \
             non-negative integer (\"auto\" is resolved only for reduce_bucket_size, \
             stage3_prefetch_bucket_size, stage3_param_persistence_threshold"
        ),
        "{e}"
    );
}

#[test]
fn without_run_settings_auto_means_the_defaults() {
    // Only the hidden size known (as for `cargo xtask plan --preset ...`): accumulation 1, no
    // clipping, fp32; batch sizes and optimizer parameters are not read.
    let run = RunValues {
        hidden_size: Some(64),
        ..Default::default()
    };
    let imp = ZeroConfig::from_deepspeed_json_with(HF_ZERO3, &run).unwrap();
    let c = imp.config;
    assert_eq!(
        (
            c.reduce_bucket_size,
            c.prefetch_bucket_size,
            c.param_persistence_threshold
        ),
        (4096, 3686, 640)
    );
    assert_eq!(c.gradient_accumulation_steps, 1);
    assert_eq!(c.gradient_clipping, 0.0);
    assert_eq!(c.precision, Precision::Fp32);
    let keys: Vec<&str> = imp.resolved.iter().map(|r| r.key.as_str()).collect();
    assert!(
        !keys
            .iter()
            .any(|k| k.starts_with("optimizer") || k.starts_with("train_"))
    );

    // fp16 from the run turns the fp16 section on, with its loss scaler.
    let run = RunValues {
        hidden_size: Some(64),
        precision: Some(Precision::Fp16),
        ..Default::default()
    };
    let c = ZeroConfig::from_deepspeed_json_with(HF_ZERO3, &run)
        .unwrap()
        .config;
    assert_eq!(c.precision, Precision::Fp16);
    assert_eq!(c.loss_scaler.initial_scale(), 65536.0);
}
