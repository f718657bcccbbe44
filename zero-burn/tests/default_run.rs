//! Determinism guard: a short run of the embedded default job (`cargo xtask train`'s) has a fixed
//! loss trajectory, and its measured bytes equal the plan.
//!
//! The snapshot holds the losses rounded to 4 decimals, not their bits: gemm chooses its kernels
//! at run time by the CPU (AVX-512 or AVX2), which moves the last bits of a sum, so a bit snapshot
//! would hold on one kind of CPU only. 4 decimals still catch a change of arithmetic (turning on
//! flex's SIMD kernels moved the 4th decimal at steps 5 and 6). Bits are checked here too: the
//! same job run twice in one process gives the same losses bit for bit, and the equivalence tests
//! compare stages, world sizes and plain burn bit for bit.

use zero_burn::demo::job::{JobConfig, run_job};

#[test]
fn default_job_loss_trajectory() {
    let job = JobConfig {
        steps: 6,
        ..JobConfig::default_job()
    };
    let report = run_job(&job, &|_, _| {}).unwrap();
    assert!(report.comm_matches_plan, "traffic differs from the plan");
    assert!(
        report.memory_matches_plan,
        "model-state bytes differ from the plan"
    );
    let rounded: Vec<String> = report.loss.iter().map(|l| format!("{l:.4}")).collect();
    insta::assert_snapshot!(rounded.join("\n"));
    // The same job again gives the same bits.
    let again = run_job(&job, &|_, _| {}).unwrap();
    assert_eq!(report.loss, again.loss);
}
