//! Determinism guard: a short run of the embedded default job (`cargo xtask train`'s) has a fixed
//! loss trajectory, and its measured bytes equal the plan.

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
