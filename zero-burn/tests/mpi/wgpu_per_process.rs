//! wgpu per process (feature `wgpu` too): 2 processes under `mpirun`, each training on
//! its own wgpu device (lavapipe in CI) with the optimizer's state on that device, the
//! collectives over MPI staged through host memory. The same job on 2 in-process ranks over the
//! host loopback, the models on this process's wgpu device, must give the same bits: the same
//! kernels on the same values, and MPI's reductions are the host loopback's.
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use zero_burn::demo::data::MarkovLanguage;
use zero_burn::demo::gpt::Gpt;
use zero_burn::demo::run::{HostRun, Work};
use zero_burn::demo::train::{On, train};
use zero_burn::{WgpuShared, plan_for};
use zero_comm::Communicator;
use zero_core::{Precision, Topology, ZeroConfig};

use super::common::{self, bits, options};
use super::harness::{self, is_rank, launch, rank_ok};
use super::out_file;

/// The test's path in this binary, which the harness runs under `mpirun` with `--exact`.
const NAME: &str = "wgpu_per_process::wgpu_ranks_as_processes_match_in_process_ranks";
const OUT: &str = "ZERO_MPI_WGPU_TEST_OUT";

fn topo() -> Topology {
    Topology::new(2, 2).unwrap()
}

fn configs() -> Vec<(&'static str, ZeroConfig)> {
    vec![
        (
            "stage1",
            ZeroConfig {
                stage: 1,
                gradient_accumulation_steps: 2,
                ..ZeroConfig::default()
            },
        ),
        (
            "stage3-bf16",
            ZeroConfig {
                stage: 3,
                precision: Precision::Bf16,
                param_persistence_threshold: 64,
                ..ZeroConfig::default()
            },
        ),
    ]
}

/// [`common::tiny`] on this process's wgpu device.
fn model(shared: &WgpuShared) -> (Gpt, MarkovLanguage) {
    (
        common::tiny_config().init(&shared.autodiff_device(), 42),
        MarkovLanguage::new(16, 3).unwrap(),
    )
}

fn run() -> HostRun {
    super::host_run(Duration::from_secs(120))
}

/// What one rank writes for one configuration.
#[derive(Serialize, Deserialize)]
struct RankOut {
    losses: Vec<u32>,
    params: Vec<Vec<u32>>,
    optimizer_device: Option<String>,
}

fn rank_side() {
    let dir = std::env::var(OUT).unwrap();
    let anchor = harness::world();
    let (n, me) = (anchor.world_size(), anchor.rank());
    let shared = WgpuShared::get().expect("a wgpu adapter in every rank process");
    for (name, cfg) in configs() {
        let (model, corpus) = model(&shared);
        let plan = Arc::new(plan_for(&model, topo(), &cfg).unwrap());
        let (res, _) = super::train_this_rank(plan, model, &corpus, Duration::from_secs(120));
        let out = RankOut {
            losses: res.losses.iter().map(|l| l.to_bits()).collect(),
            params: bits(&res.final_params),
            optimizer_device: res.optimizer_device,
        };
        std::fs::write(out_file(&dir, name, me), serde_json::to_vec(&out).unwrap()).unwrap();
    }
    rank_ok(me, n);
}

#[test]
fn wgpu_ranks_as_processes_match_in_process_ranks() {
    if is_rank() {
        return rank_side();
    }
    let Some(shared) = common::shared(NAME) else {
        return;
    };
    let (_tmp, dir) = super::scratch("zero-burn-mpi-wgpu-");
    let env = [(OUT, dir.display().to_string())];
    let limit = Duration::from_secs(600);
    let Some(job) = launch(NAME, 2, 2, Duration::from_secs(120), &env, limit) else {
        return;
    };
    job.assert_ranks_ok(2);
    eprintln!("2 MPI ranks on wgpu: {:?}", job.elapsed);
    for (name, cfg) in configs() {
        let (model, corpus) = model(&shared);
        let plan = Arc::new(plan_for(&model, topo(), &cfg).unwrap());
        let reference =
            train(On::Host, plan, model, Work::new(&corpus, options(), &run())).unwrap();
        for r in &reference {
            let got: RankOut = serde_json::from_slice(
                &std::fs::read(out_file(&dir.display().to_string(), name, r.rank)).unwrap(),
            )
            .unwrap();
            let what = format!("{name} rank {}", r.rank);
            let state = got.optimizer_device.as_deref().unwrap_or("host memory");
            assert!(state.contains("Cube"), "{what}: optimizer state on {state}");
            let want: Vec<u32> = r.losses.iter().map(|l| l.to_bits()).collect();
            assert_eq!(got.losses, want, "{what}: losses");
            assert!(
                got.params == bits(&r.final_params),
                "{what}: final parameters"
            );
        }
    }
}
