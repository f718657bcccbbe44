//! The placements zero-core plans and books that the engine does not execute yet: NVMe, and
//! stage 3's parameter shard off the device. The engine refuses them when it is built.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use zero_burn::demo::run::{HostRun, train_host};
use zero_burn::plan_for;
use zero_core::{Placement, Topology, ZeroConfig};

/// NVMe and parameter offload are planned and booked by zero-core, not executed: the engine
/// refuses them when it is built, naming the field, before a step runs.
#[test]
fn placements_the_engine_does_not_run_are_refused_at_build() {
    for (cfg, field) in [
        (
            ZeroConfig {
                stage: 3,
                optimizer_placement: Placement::Nvme,
                nvme_path: Some("/nvme".into()),
                ..ZeroConfig::default()
            },
            "optimizer_placement",
        ),
        (
            ZeroConfig {
                stage: 3,
                param_placement: Placement::Host,
                ..ZeroConfig::default()
            },
            "param_placement",
        ),
    ] {
        let (model, corpus) = common::tiny();
        let plan = Arc::new(plan_for(&model, Topology::new(2, 2).unwrap(), &cfg).unwrap());
        let Err(err) = train_host(
            plan,
            model,
            &corpus,
            common::options(),
            HostRun {
                steps: 1,
                timeout: Duration::from_secs(60),
                keep_final_params: false,
                checkpoint: None,
            },
            &|_, _| {},
        ) else {
            panic!("{field}: an offload the engine does not run trained");
        };
        let text = err.to_string();
        assert!(text.contains(&format!("invalid {field}")), "{text}");
        assert!(
            text.contains("does not run NVMe or parameter offload"),
            "{text}"
        );
    }
}
