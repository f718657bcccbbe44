//! Where the optimizer's state lives (`ZeroConfig::optimizer_placement`): on the model's device
//! (the default) or in host memory (DeepSpeed's optimizer offload).
//!
//! - On flex the model's device is host memory: both placements keep the state there, step it
//!   with the same loop and give the same bits; a checkpoint moves between them.
//! - On wgpu (lavapipe in CI, feature `wgpu`) the default puts the moments and the bf16 master on
//!   the wgpu device, stepped by burn tensor operations, and host placement keeps them in host
//!   memory, stepped on the CPU. Both run the same IEEE operations in the same order; only the
//!   device's `sqrt` and division may round differently. The tests state a bound, assert it, and
//!   print whether the bits were equal; on lavapipe they are, and the tests assert it there.
//! - The wgpu device's own memory pools (burn's `Device::memory_pool_usage`) see the state: with
//!   it on the device, once the ranks' work is done, they hold the state the plan books more
//!   than with it in host memory, within 64 KiB. At stage 3 in fp32 the pools
//!   hold the resident device bytes the plan books (shard, accumulator, moments; the shard only
//!   under offload), within 64 KiB, and the canonical tree's pending level beside them.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use zero_burn::checkpoint::{MemStorage, Storage};
use zero_burn::demo::data::Corpus;
use zero_burn::demo::gpt::Gpt;
use zero_burn::demo::run::{Checkpointing, HostRun, RankResult, TrainOptions, Work};
use zero_burn::demo::train::{self as launcher, On};
use zero_burn::{Plan, plan_for};
use zero_core::{Placement, Precision, Topology, ZeroConfig};

fn run(steps: u64, checkpoint: Option<Checkpointing>) -> HostRun {
    HostRun {
        steps,
        timeout: Duration::from_secs(60),
        keep_final_params: true,
        checkpoint,
    }
}

fn train_flex(cfg: &ZeroConfig, steps: u64, ckpt: Option<Checkpointing>) -> Runs {
    let (model, corpus) = common::tiny();
    let plan = Arc::new(plan_for(&model, Topology::new(2, 2).unwrap(), cfg).unwrap());
    on_host(plan, model, &corpus, common::options(), run(steps, ckpt))
}

/// `plan` trained from `model` on the host loopback (flex).
fn on_host(
    plan: Arc<Plan>,
    model: Gpt,
    corpus: &dyn Corpus,
    o: TrainOptions,
    run: HostRun,
) -> Runs {
    launcher::train(On::Host, plan, model, Work::new(corpus, o, &run)).unwrap()
}

type Runs = Vec<RankResult<Gpt>>;

/// On flex both placements keep the state in host memory and give the same bits at every stage,
/// in fp32 and bf16; the plan books host placement's optimizer state, master and gradients in host
/// memory, and a checkpoint saved under one placement resumes under the other, bit-identically.
#[test]
fn both_placements_give_the_same_bits_on_flex_and_share_checkpoints() {
    for stage in 0..=3u8 {
        for precision in [Precision::Fp32, Precision::Bf16] {
            let what = format!("stage {stage} {precision:?}");
            let dev = train_flex(
                &common::placed(stage, precision, Placement::Device),
                4,
                None,
            );
            let host = train_flex(&common::placed(stage, precision, Placement::Host), 4, None);
            for (d, h) in dev.iter().zip(&host) {
                assert_eq!(d.optimizer_device, None, "{what}: flex is host memory");
                assert_eq!(h.optimizer_device, None, "{what}");
                assert_eq!(d.losses, h.losses, "{what}: rank {} losses", d.rank);
                assert!(
                    common::bits(&d.final_params) == common::bits(&h.final_params),
                    "{what}: rank {} parameters",
                    d.rank
                );
                assert_eq!(d.memory, h.memory, "{what}: the same state, wherever it is");
            }
            let (model, _) = common::tiny();
            let topo = Topology::new(2, 2).unwrap();
            let booked_at = |placement| {
                let cfg = common::placed(stage, precision, placement);
                plan_for(&model, topo, &cfg).unwrap().memory()
            };
            let booked = booked_at(Placement::Host);
            assert_eq!(
                booked.host_bytes,
                booked.optimizer_states + booked.master_weights + booked.gradients
            );
            let held = &host[0].memory;
            assert_eq!(
                held.optimizer_states + held.master_weights + held.gradients,
                booked.host_bytes,
                "{what}: the state held equals the host bytes booked"
            );
            let on_device = booked_at(Placement::Device);
            assert_eq!(
                (on_device.host_bytes, on_device.device_bytes),
                (0, on_device.total_bytes)
            );

            // Save after 2 steps under device placement, resume under host placement.
            let store: Arc<dyn Storage> = Arc::new(MemStorage::new());
            let first = train_flex(
                &common::placed(stage, precision, Placement::Device),
                2,
                Some(common::checkpointing(&store, true)),
            );
            let rest = train_flex(
                &common::placed(stage, precision, Placement::Host),
                4,
                Some(common::checkpointing(&store, false)),
            );
            common::assert_resumes(&dev, &first, &rest, &what);
        }
    }
}

/// Ranks must agree on the placement: replicas stepped on different devices could drift apart.
#[test]
fn ranks_with_different_placements_are_refused() {
    use zero_burn::{Launch, ZeroEngine};
    let (model, _) = common::tiny();
    let topo = Topology::new(2, 2).unwrap();
    let err = Launch::new(topo)
        .timeout(Duration::from_secs(30))
        .run_with(&model, |comm, model| {
            let placement = if zero_comm::Communicator::rank(&comm) == 0 {
                Placement::Device
            } else {
                Placement::Host
            };
            let cfg = common::placed(1, Precision::Fp32, placement);
            ZeroEngine::builder(comm, model).config(cfg).build()?;
            Ok(())
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("plan or options"), "{err}");
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::*;
    use common::shared;
    use zero_burn::Reduction;
    use zero_burn::demo::data::MarkovLanguage;
    use zero_burn::demo::gpt::{Gpt, GptConfig};
    use zero_burn::demo::train::WgpuTensors;

    /// Largest relative gap allowed between the placements, per loss and per parameter element
    /// (relative to max(1, |value|)): the device's `sqrt` and division may differ from the CPU's
    /// by a few ulps per step, and the gaps compound over the steps.
    const BOUND: f32 = 1e-5;

    /// The wgpu tests of this file one at a time: the device's memory counts are the whole
    /// device's.
    static DEVICE: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        DEVICE.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn gpt() -> GptConfig {
        GptConfig {
            vocab: 32,
            context: 16,
            d_model: 32,
            heads: 2,
            layers: 2,
        }
    }

    fn train(
        shared: &zero_burn::WgpuShared,
        cfg: &ZeroConfig,
        steps: u64,
        ckpt: Option<Checkpointing>,
    ) -> Vec<RankResult<Gpt>> {
        train_gpt(shared, gpt(), cfg, steps, ckpt)
    }

    fn train_gpt(
        shared: &zero_burn::WgpuShared,
        gpt: GptConfig,
        cfg: &ZeroConfig,
        steps: u64,
        ckpt: Option<Checkpointing>,
    ) -> Vec<RankResult<Gpt>> {
        let model = gpt.init(&shared.autodiff_device(), 7);
        let plan = Arc::new(plan_for(&model, Topology::new(2, 2).unwrap(), cfg).unwrap());
        let corpus = MarkovLanguage::new(gpt.vocab, 3).unwrap();
        let mut options = common::options();
        options.seq = gpt.context;
        launcher::train(
            On::Wgpu(shared.clone(), WgpuTensors::Bridge),
            plan,
            model,
            Work::new(&corpus, options, &run(steps, ckpt)),
        )
        .unwrap()
    }

    /// The worst relative gap between two runs' losses and parameters, and whether every bit
    /// was equal.
    fn gap(a: &[RankResult<Gpt>], b: &[RankResult<Gpt>]) -> (f32, bool) {
        let rel = |x: f32, y: f32| (x - y).abs() / y.abs().max(1.0);
        let mut worst = 0f32;
        let mut same = true;
        for (x, y) in a.iter().zip(b) {
            for (p, q) in x.losses.iter().zip(&y.losses) {
                worst = worst.max(rel(*p, *q));
                same &= p.to_bits() == q.to_bits();
            }
            for (p, q) in x
                .final_params
                .iter()
                .flatten()
                .zip(y.final_params.iter().flatten())
            {
                worst = worst.max(rel(*p, *q));
                same &= p.to_bits() == q.to_bits();
            }
        }
        (worst, same)
    }

    /// The default placement keeps the optimizer's state on the wgpu device; host placement in
    /// host memory. Stages 0–3 in fp32 and bf16 with accumulation (at stage 1 also deferred,
    /// `accumulate_before_reduce`, whose fp32 accumulator follows the state; in bf16 also into
    /// an fp32 accumulator, `grad_accum_dtype = fp32`, which follows it too) agree within
    /// [`BOUND`].
    #[test]
    fn the_state_on_the_wgpu_device_matches_host_placement() {
        let _one = one_at_a_time();
        let Some(shared) = shared("the_state_on_the_wgpu_device_matches_host_placement") else {
            return;
        };
        let fp32 = Some(Precision::Fp32);
        // (stage, precision, accumulate_before_reduce, grad_accum_dtype)
        for (stage, precision, abr, acc) in [
            (0u8, Precision::Fp32, false, None),
            (1, Precision::Fp32, false, None),
            (1, Precision::Fp32, true, None),
            (1, Precision::Bf16, true, fp32),
            (2, Precision::Bf16, false, None),
            (2, Precision::Bf16, false, fp32),
            (3, Precision::Fp32, false, None),
            (3, Precision::Bf16, false, None),
            (3, Precision::Bf16, false, fp32),
            // fp16's 16-bit accumulator lives on the device too (bf16 has no WGSL type), and
            // the step widens, unscales and rounds there.
            (0, Precision::Fp16, false, None),
            (1, Precision::Fp16, false, None),
            (2, Precision::Fp16, false, None),
            (3, Precision::Fp16, false, None),
        ] {
            let what = format!(
                "stage {stage} {precision:?} accumulate_before_reduce={abr} grad_accum_dtype={acc:?}"
            );
            let cfg = |placement| ZeroConfig {
                accumulate_before_reduce: abr,
                grad_accum_dtype: acc,
                ..common::placed(stage, precision, placement)
            };
            let dev = train(&shared, &cfg(Placement::Device), 3, None);
            let host = train(&shared, &cfg(Placement::Host), 3, None);
            for (d, h) in dev.iter().zip(&host) {
                let name = d.optimizer_device.as_deref().unwrap_or("host memory");
                assert!(
                    name.contains("Cube"),
                    "{what}: the state is on the wgpu device: {name}"
                );
                assert_eq!(h.optimizer_device, None, "{what}: host placement");
                assert_eq!(d.memory, h.memory, "{what}: the same state, wherever it is");
            }
            let (worst, same) = gap(&dev, &host);
            println!(
                "placement {what} on {}: worst relative gap {worst:.2e}, bit-identical: {same}",
                shared.adapter_name()
            );
            assert!(worst <= BOUND, "{what}: gap {worst:.2e} > {BOUND:.0e}");
            // lavapipe rounds `sqrt` and division as the CPU does: measured bit-identical there.
            if shared.adapter_name().contains("llvmpipe") {
                assert!(same, "{what}: bit-identical on lavapipe");
            }
            assert!(dev[0].losses[2] < dev[0].losses[0], "{what}: it learns");
        }
    }

    /// A checkpoint saved with the state on the wgpu device resumes with it in host memory (and
    /// back), within [`BOUND`] of an uninterrupted run, at stage 3 in bf16 and in fp16 (whose
    /// shard lives on the device with either placement).
    #[test]
    fn a_checkpoint_moves_between_placements_on_wgpu() {
        let _one = one_at_a_time();
        let Some(shared) = shared("a_checkpoint_moves_between_placements_on_wgpu") else {
            return;
        };
        for precision in [Precision::Bf16, Precision::Fp16] {
            for (from, to) in [
                (Placement::Device, Placement::Host),
                (Placement::Host, Placement::Device),
            ] {
                let what = format!("{precision:?} {from:?} -> {to:?}");
                let cfg = |p| common::placed(3, precision, p);
                let whole = train(&shared, &cfg(to), 4, None);
                let store: Arc<dyn Storage> = Arc::new(MemStorage::new());
                let first = train(
                    &shared,
                    &cfg(from),
                    2,
                    Some(common::checkpointing(&store, true)),
                );
                let rest = train(
                    &shared,
                    &cfg(to),
                    4,
                    Some(common::checkpointing(&store, false)),
                );
                assert_eq!(rest[0].first_step, 2, "{what}: resumed at step 2");
                let mut resumed = rest;
                for (r, a) in resumed.iter_mut().zip(&first) {
                    r.losses = a.losses.iter().chain(&r.losses).copied().collect();
                }
                let (worst, same) = gap(&resumed, &whole);
                println!(
                    "placement checkpoint {what}: worst relative gap {worst:.2e}, bit-identical: \
                     {same}"
                );
                assert!(worst <= BOUND, "{what}: gap {worst:.2e} > {BOUND:.0e}");
                if shared.adapter_name().contains("llvmpipe") {
                    assert!(same, "{what}: bit-identical on lavapipe");
                }
            }
        }
    }

    /// The bytes in use in the wgpu device's own memory pools once 2 in-process ranks (host
    /// loopback, models on the device) have taken 3 steps under `cfg` and their device work is
    /// done, the ranks' engines still alive and the initial model dropped, beyond what was in use
    /// before; the state the ranks measured; and the plan.
    fn settled_device_bytes(
        shared: &zero_burn::WgpuShared,
        gpt: GptConfig,
        cfg: &ZeroConfig,
        reduction: Reduction,
    ) -> (u64, Vec<zero_burn::MeasuredMemory>, Arc<zero_core::Plan>) {
        use zero_burn::demo::run::{corpus_step, engine_builder};
        let device = shared.device();
        let in_use = || {
            device.sync().expect("the device's work finishes");
            device
                .memory_pool_usage()
                .expect("wgpu's pools count the device's memory")
                .bytes_in_use
        };
        // What earlier tests left in the shared device's pools.
        let before = in_use();
        let model = gpt.init(&shared.autodiff_device(), 7);
        let plan = Arc::new(plan_for(&model, Topology::new(2, 2).unwrap(), cfg).unwrap());
        let corpus = MarkovLanguage::new(gpt.vocab, 3).unwrap();
        let mut options = common::options();
        options.seq = gpt.context;
        options.reduction = reduction;
        let engines = zero_burn::Launch::new(*plan.topology())
            .timeout(Duration::from_secs(60))
            .reduction(reduction)
            .run_with(&model, |comm, mine| {
                let mut engine = engine_builder(&plan, comm, mine, options).build()?;
                for _ in 0..3 {
                    corpus_step(&mut engine, &corpus, &options)?;
                }
                // Each rank's queued work, which may still hold transient buffers, finishes.
                device.sync().expect("the device's work finishes");
                Ok(engine)
            })
            .unwrap();
        drop(model);
        let measured = engines.iter().map(|e| e.report().memory).collect();
        (in_use().saturating_sub(before), measured, plan)
    }

    const RANK_ORDERED: Reduction = Reduction::RankOrdered;

    /// About 0.5M parameters: a state of megabytes, far above the pools' granularity.
    fn wider() -> GptConfig {
        GptConfig {
            vocab: 256,
            context: 16,
            d_model: 128,
            heads: 4,
            layers: 2,
        }
    }

    /// The device's own memory pools count the optimizer's state where the engine says it is:
    /// with the default placement, once the ranks' work is done (3 steps at stage 1 in bf16 and
    /// fp16), the bytes in use exceed host placement's by the moments and master both ranks
    /// hold, and by the gradient accumulator where it lives there too (fp32's with
    /// `grad_accum_dtype = fp32`, fp16's where the device has 16-bit floats; bf16's stays in host
    /// memory on wgpu), as the plan books them, up to the pools' rounding (256 B per tensor) and
    /// 64 KiB of burn's own buffers.
    #[test]
    fn the_device_memory_pools_count_the_optimizer_state() {
        let _one = one_at_a_time();
        let Some(shared) = shared("the_device_memory_pools_count_the_optimizer_state") else {
            return;
        };
        let f16 = shared.device().supports_dtype(burn::tensor::DType::F16);
        for (precision, acc) in [
            (Precision::Bf16, None),
            (Precision::Bf16, Some(Precision::Fp32)),
            (Precision::Fp16, None),
        ] {
            let grads_there = acc.is_some() || (precision == Precision::Fp16 && f16);
            let cfg = |p| ZeroConfig {
                grad_accum_dtype: acc,
                ..common::placed(1, precision, p)
            };
            let (d, dm, _) =
                settled_device_bytes(&shared, wider(), &cfg(Placement::Device), RANK_ORDERED);
            let (h, hm, _) =
                settled_device_bytes(&shared, wider(), &cfg(Placement::Host), RANK_ORDERED);
            let state = |m: &[zero_burn::MeasuredMemory]| -> u64 {
                m.iter()
                    .map(|m| {
                        let grads = if grads_there { m.gradients } else { 0 };
                        m.optimizer_states + m.master_weights + grads
                    })
                    .sum()
            };
            let booked = state(&dm);
            let what = format!("{precision:?} grad_accum_dtype {acc:?}");
            assert_eq!(booked, state(&hm), "{what}: the same state, wherever it is");
            let extra = d as i64 - h as i64;
            println!(
                "{what}: device pools in use after 3 steps: state on the device {d} B, in host \
                 memory {h} B; difference {extra} B, booked state of both ranks {booked} B"
            );
            assert!(booked > 4 << 20, "a state of megabytes: {booked} B");
            assert!(
                (extra - booked as i64).abs() <= 64 << 10,
                "{what}: the pools' difference {extra} B is not the booked state {booked} B"
            );
        }
    }

    /// At stage 3 in fp32, and in fp16 (its accumulator fp32 or 16-bit), the device's pools
    /// hold, once the ranks' work is done (3 steps), what the plan books on the device for both
    /// ranks, apart from what lives only inside a step (gathered units, communication buffers):
    /// the shard (fp16's at 2 B per element; under parameter offload to host memory or NVMe,
    /// host or disk bytes) and persistent units (`parameters`), and with the default placement
    /// the gradient accumulator, the moments and fp16's fp32 master too (under optimizer offload
    /// those are host bytes). Up to the pools' rounding and 64 KiB of burn's
    /// own buffers.
    #[test]
    fn the_stage3_state_lives_where_the_plan_books_it() {
        let _one = one_at_a_time();
        let Some(shared) = shared("the_stage3_state_lives_where_the_plan_books_it") else {
            return;
        };
        let fp32 = Some(Precision::Fp32);
        let (device, host, nvme) = (Placement::Device, Placement::Host, Placement::Nvme);
        let tmp = tempfile::tempdir().unwrap();
        for (precision, acc, placement, params) in [
            (Precision::Fp32, None, device, device),
            (Precision::Fp32, None, host, device),
            (Precision::Fp32, None, device, host),
            (Precision::Fp16, fp32, device, device),
            (Precision::Fp16, fp32, host, device),
            (Precision::Fp16, None, device, device),
            (Precision::Fp16, None, device, nvme),
        ] {
            let cfg = ZeroConfig {
                grad_accum_dtype: acc,
                param_placement: params,
                nvme_path: Some(tmp.path().display().to_string()),
                ..common::placed(3, precision, placement)
            };
            let (in_use, _, plan) = settled_device_bytes(&shared, wider(), &cfg, RANK_ORDERED);
            let m = plan.memory();
            let resident = m.device_bytes - m.gathered_working_set - m.communication_buffers;
            let booked = 2 * resident;
            println!(
                "{precision:?} {acc:?} {placement:?} {params:?}: device pools in use after 3 stage-3 steps {in_use} \
                 B; both ranks' resident device bytes booked {booked} B (parameters {} B, \
                 gradients {} B, optimizer states {} B, host {} B)",
                2 * m.parameters,
                2 * m.gradients,
                2 * m.optimizer_states,
                2 * m.host_bytes
            );
            assert!(m.parameters > 256 << 10, "a shard of megabytes");
            assert!(
                (in_use as i64 - booked as i64).abs() <= 64 << 10,
                "{precision:?} {acc:?} {placement:?} {params:?}: the pools hold {in_use} B, not the booked {booked} B"
            );
        }
    }

    /// Stage 3's fp16 shard and hpZ secondary slices live on the device (lavapipe has 16-bit
    /// floats), rounded there from a device master (the default placement) or uploaded as bits
    /// rounded in host memory (optimizer offload). Both give the bits of stage 1, whose working
    /// weights are rounded in host memory by `half`, on lavapipe; within [`BOUND`] elsewhere.
    #[test]
    fn the_fp16_shard_on_the_device_rounds_as_the_host_does() {
        let _one = one_at_a_time();
        let name = "the_fp16_shard_on_the_device_rounds_as_the_host_does";
        let Some(shared) = shared(name) else {
            return;
        };
        let train = |stage: u8, hpz: usize, placement| {
            let model = gpt().init(&shared.autodiff_device(), 7);
            let cfg = ZeroConfig {
                hpz_partition_size: hpz,
                ..common::placed(stage, Precision::Fp16, placement)
            };
            let plan = Arc::new(plan_for(&model, Topology::new(4, 2).unwrap(), &cfg).unwrap());
            let corpus = MarkovLanguage::new(gpt().vocab, 3).unwrap();
            let mut options = common::options();
            options.seq = gpt().context;
            on_host(plan, model, &corpus, options, run(3, None))
        };
        let reference = train(1, 1, Placement::Device);
        for (hpz, placement) in [
            (1, Placement::Device),
            (2, Placement::Device),
            (1, Placement::Host),
        ] {
            let what = format!("stage 3 fp16 hpz {hpz} {placement:?}");
            let got = train(3, hpz, placement);
            let (worst, same) = gap(&got, &reference);
            println!(
                "{what} against stage 1 on {}: worst relative gap {worst:.2e}, bit-identical: \
                 {same}",
                shared.adapter_name()
            );
            assert!(worst <= BOUND, "{what}: gap {worst:.2e} > {BOUND:.0e}");
            if shared.adapter_name().contains("llvmpipe") {
                assert!(same, "{what}: bit-identical on lavapipe");
            }
        }
    }

    /// The canonical tree's fp32 accumulator, its pending subtree and its final division follow
    /// the optimizer's state onto the device. Over the host loopback (the one communicator that
    /// sums in the tree's order), 3 micro-steps (one pending level) at stages 0 and 3 give host
    /// placement's bits on lavapipe, within [`BOUND`] elsewhere. At stage 3 the device's pools
    /// then hold the booked resident device bytes plus the pending level (an accumulator's
    /// length per rank) with the default placement, and no accumulator under offload, within
    /// 64 KiB.
    #[test]
    fn the_canonical_tree_accumulates_where_the_optimizer_state_lives() {
        let _one = one_at_a_time();
        let name = "the_canonical_tree_accumulates_where_the_optimizer_state_lives";
        let Some(shared) = shared(name) else {
            return;
        };
        let tree = Reduction::CanonicalTree;
        let cfg = |stage, placement| ZeroConfig {
            gradient_accumulation_steps: 3,
            ..common::placed(stage, Precision::Fp32, placement)
        };
        for stage in [0u8, 3] {
            let train = |placement| {
                let model = gpt().init(&shared.autodiff_device(), 7);
                let topo = Topology::new(2, 2).unwrap();
                let plan = Arc::new(plan_for(&model, topo, &cfg(stage, placement)).unwrap());
                let corpus = MarkovLanguage::new(gpt().vocab, 3).unwrap();
                let mut options = common::options();
                options.seq = gpt().context;
                options.reduction = tree;
                on_host(plan, model, &corpus, options, run(3, None))
            };
            let (dev, host) = (train(Placement::Device), train(Placement::Host));
            let (worst, same) = gap(&dev, &host);
            println!(
                "canonical tree, stage {stage} on {}: worst relative gap {worst:.2e}, \
                 bit-identical: {same}",
                shared.adapter_name()
            );
            assert!(
                worst <= BOUND,
                "stage {stage}: gap {worst:.2e} > {BOUND:.0e}"
            );
            if shared.adapter_name().contains("llvmpipe") {
                assert!(same, "stage {stage}: bit-identical on lavapipe");
            }
            assert!(
                dev[0].losses[2] < dev[0].losses[0],
                "stage {stage}: it learns"
            );
        }
        for placement in [Placement::Device, Placement::Host] {
            let (in_use, _, plan) =
                settled_device_bytes(&shared, wider(), &cfg(3, placement), tree);
            let m = plan.memory();
            let resident = m.device_bytes - m.gathered_working_set - m.communication_buffers;
            let level = match placement {
                Placement::Device => m.gradients,
                Placement::Host | Placement::Nvme => 0,
            };
            let booked = 2 * (resident + level);
            println!(
                "canonical tree {placement:?}: device pools in use after 3 stage-3 steps \
                 {in_use} B; both ranks' resident device bytes and pending level {booked} B"
            );
            assert!(m.gradients > 256 << 10, "an accumulator of megabytes");
            assert!(
                (in_use as i64 - booked as i64).abs() <= 64 << 10,
                "{placement:?}: the pools hold {in_use} B, not the booked {booked} B"
            );
        }
    }

    /// Runs report the peak the device's pools counted; on flex there is none.
    #[test]
    fn runs_report_the_device_pools_peak() {
        let _one = one_at_a_time();
        let Some(shared) = shared("runs_report_the_device_pools_peak") else {
            return;
        };
        let dev = train(
            &shared,
            &common::placed(3, Precision::Fp32, Placement::Device),
            1,
            None,
        );
        assert!(
            dev.iter()
                .all(|r| r.device_peak_bytes.is_some_and(|b| b > 0))
        );
        let flex = train_flex(
            &common::placed(3, Precision::Fp32, Placement::Device),
            1,
            None,
        );
        assert!(flex.iter().all(|r| r.device_peak_bytes.is_none()));
    }
}
