//! Training mode (BatchNorm buffers, seeded Dropout) through the engine with ZeRO++, in the
//! engine's report and plan, and in bf16. The CNN, the engine run and the plain-burn oracle are
//! `common::train_mode`'s, as in `train_mode.rs`.
//!
//! 1. Eight ranks (4 nodes × 2) at stage 3 with qwZ (int8 weights), hpZ (groups of 2) and qgZ
//!    (int4 gradients), checkpointing on: every rank holds the same buffers, the losses are
//!    finite, two runs give the same bits, and losses, parameters and buffers lie within a
//!    stated bound of plain burn with the same masks (quantization is lossy). In fp32 with hpZ
//!    alone, the bits of hpZ off (as `equivalence.rs` and `families.rs` show for models without
//!    buffers), within `TOL` of plain burn.
//! 2. The engine's report with buffers, world 2, stages 3 and 1: the step traffic is the plan's,
//!    the buffer broadcast is other traffic, and the plan counts the buffers (in no unit).
//! 3. bf16 at stage 2, world 2: the buffers stay f32 (not rounded to bf16) and equal on every
//!    rank, and checkpointing on and off give the same bits.

use crate::common;

use zero_burn::BufferSync;
use zero_core::{Precision, Topology};

use common::assert_traffic_as_planned;
use common::train_mode::{
    A, Bounds, CH, Cnn, Run, STEPS, Seen, Want, assert_near_plain_burn, assert_ranks_agree,
    assert_state_bits, assert_within_of_plain_burn, bits, cnn_forward, images, loss_bits, max_gap,
    plain_burn, train, world2,
};

/// A stage-3 run on 8 ranks, 4 nodes of 2, checkpointing on (hpZ needs it), every tensor sharded.
fn four_nodes_of_two(qwz: bool, hpz: usize, qgz: bool) -> Run {
    let mut run = Run::new(Topology::new(8, 2).unwrap(), 3, Some(true));
    run.config.quantized_weights = qwz;
    run.config.hpz_partition_size = hpz;
    run.config.quantized_gradients = qgz;
    run
}

/// `a` and `b` are the same bits: every rank's losses, consolidated parameters and buffers and
/// own buffers.
fn assert_same_bits(what: &str, a: &[Seen], b: &[Seen]) {
    assert_eq!(a.len(), b.len(), "{what}: ranks");
    for (r, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(
            loss_bits(&x.losses),
            loss_bits(&y.losses),
            "{what}: rank {r}'s losses"
        );
        let (got, want) = (
            [&x.params, &x.buffers, &x.own_buffers],
            [&y.params, &y.buffers, &y.own_buffers],
        );
        assert_state_bits(&format!("{what}: rank {r}"), got, want);
    }
}

// ------------------------------------------------------------------------------------------------
// 1. ZeRO++ on 4 nodes of 2
// ------------------------------------------------------------------------------------------------

/// The gap allowed between ZeRO++ (qwZ + hpZ + qgZ, default blocks: 1024 for int8 weights, 512
/// for int4 gradients) and plain burn, 8 ranks, 3 SGD steps of 2 micro-steps at lr 0.1. Both
/// codecs are lossy: the forward runs on int8 weights (off by up to 1/254 of their block's
/// largest magnitude, the conv weights' being 1.04) and the update on gradients rounded to int4
/// at each quantized hop (up to 1/14 of their block's largest gradient), so ZeRO++ is not
/// bit-exact to plain burn. The run is deterministic (the test runs it twice); its worst gaps are
/// 7.8e-3 (losses, rank 5), 4.5e-3 (parameters, `head.weight`; the weights moved by up to 0.116
/// in the 3 steps) and 9.0e-4 (buffers, `bn.running_mean`). Each bound is about 3-4× that, and
/// what the test is there to catch stays outside it: other dropout masks (base seed 7) move the
/// losses by 0.138 (4.6× the bound), and other running statistics (the mean over ranks instead
/// of rank 0's) move the buffers by 8.6e-3 (2.9× the bound); the test checks both. Other masks
/// move the parameters by 0.016-0.025 only, so the losses, not the parameters, tell masks apart.
const ZEROPP: Bounds = Bounds {
    losses: 3e-2,
    params: 1.5e-2,
    buffers: 3e-3,
};

/// The largest gap between two oracles' micro-batch losses, over ranks, steps and micro-steps.
fn loss_gap(a: &Want, b: &Want) -> f32 {
    let (a, b) = (a.losses.iter().flatten(), b.losses.iter().flatten());
    a.flatten()
        .zip(b.flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn cnn_with_zeropp_on_four_nodes_of_two_stays_near_plain_burn() {
    let cnn = Cnn::new();
    let want = plain_burn(&cnn, 8, BufferSync::Broadcast, 0, images, cnn_forward);
    let run = four_nodes_of_two(true, 2, true);
    let seen = train(&cnn, &run, images);
    let what = "zero++ (qwZ + hpZ 2 + qgZ), 8 ranks";
    for (r, s) in seen.iter().enumerate() {
        assert!(
            s.losses.iter().flatten().all(|l| l.is_finite()),
            "{what}: rank {r}'s losses {:?}",
            s.losses
        );
        assert_traffic_as_planned(what, &s.report);
        assert!(
            s.report.memory.hpz_secondary > 0,
            "{what}: rank {r} held an hpZ secondary"
        );
    }
    // Every rank holds the same buffers, in its own model and in the consolidated one.
    let gaps = assert_within_of_plain_burn(what, &seen, &want, ZEROPP);
    eprintln!("{what}: worst gaps to plain burn {gaps:?}");
    // Reproducible: a second run gives the same bits.
    assert_same_bits(
        &format!("{what}, run twice"),
        &train(&cnn, &run, images),
        &seen,
    );
    // The quantization is live: the bits are not those of fp32 ZeRO-3 with hpZ.
    let fp32 = train(&cnn, &four_nodes_of_two(false, 2, false), images);
    assert_ne!(
        loss_bits(&seen[0].losses),
        loss_bits(&fp32[0].losses),
        "{what}: qwZ changes the losses"
    );
    assert_ne!(
        bits(&seen[0].params),
        bits(&fp32[0].params),
        "{what}: quantization changes the weights"
    );
    // The bounds still catch wrong masks (in the losses) and wrong running statistics.
    let seven = plain_burn(&cnn, 8, BufferSync::Broadcast, 7, images, cnn_forward);
    let masks = loss_gap(&seven, &want);
    assert!(
        masks > ZEROPP.losses,
        "other masks move the losses by {masks:e}"
    );
    let average = plain_burn(&cnn, 8, BufferSync::Average, 0, images, cnn_forward);
    let stats = max_gap(&average.buffers, &want.buffers);
    assert!(
        stats > ZEROPP.buffers,
        "other running statistics move the buffers by {stats:e}"
    );
}

#[test]
fn cnn_with_hpz_alone_on_four_nodes_of_two_is_bit_identical_to_hpz_off() {
    let cnn = Cnn::new();
    let want = plain_burn(&cnn, 8, BufferSync::Broadcast, 0, images, cnn_forward);
    let on = train(&cnn, &four_nodes_of_two(false, 2, false), images);
    let off = train(&cnn, &four_nodes_of_two(false, 1, false), images);
    for (r, s) in on.iter().enumerate() {
        assert!(
            s.report.memory.hpz_secondary > 0,
            "hpZ on: rank {r} held a secondary"
        );
        assert!(
            s.report.traffic_matches_plan(),
            "hpZ on: rank {r}'s traffic vs the plan"
        );
    }
    assert_same_bits("8 ranks stage 3, hpZ 2 vs off", &on, &off);
    assert_near_plain_burn("8 ranks stage 3 hpZ 2", &on, &want);
}

// ------------------------------------------------------------------------------------------------
// 2. The report and the plan with buffers
// ------------------------------------------------------------------------------------------------

#[test]
fn report_books_the_buffer_sync_as_other_traffic_and_the_plan_counts_the_buffers() {
    let cnn = Cnn::new();
    for stage in [3u8, 1] {
        let seen = train(&cnn, &Run::new(world2(), stage, None), images);
        let what = format!("stage {stage}");
        assert_ranks_agree(&what, &seen);
        for (r, s) in seen.iter().enumerate() {
            let report = &s.report;
            assert_eq!(report.steps, STEPS as u64);
            // The buffers' broadcast after each micro-step is not step traffic...
            assert_traffic_as_planned(&what, report);
            // ... but other traffic, which moved bytes: one broadcast of the 2·CH f32 running
            // statistics per micro-step, rank 0 sending them and rank 1 receiving them.
            let other = &report.other_traffic;
            let bytes = other.sent().total() + other.received().total();
            assert!(
                bytes > 0,
                "{what}: rank {r}'s other traffic {other:?} moved bytes"
            );
            let micro_steps = (STEPS * A) as u64;
            assert_eq!(other.calls(), micro_steps, "{what}: rank {r}'s {other:?}");
            assert_eq!(
                bytes,
                micro_steps * 2 * CH as u64 * 4,
                "{what}: rank {r}'s {other:?}"
            );
        }
        // The plan counts the buffers (running mean and variance), and puts them in no unit.
        let plan = &seen[0].plan;
        assert_eq!(
            plan.model().buffer_numel(),
            2 * CH as u64,
            "{what}: buffer elements"
        );
        let params = &plan.model().params;
        assert_eq!(
            params.iter().filter(|p| p.buffer).count(),
            2,
            "{what}: two buffers"
        );
        for (i, p) in params.iter().enumerate() {
            assert_eq!(
                plan.locate(i).is_none(),
                p.buffer,
                "{what}: `{}` (buffer: {}) is in a unit iff it is a parameter",
                p.name,
                p.buffer
            );
        }
        let text = plan.report(0).to_string();
        assert!(
            text.contains(&format!("buffers: {} elements", 2 * CH)),
            "{what}: the plan's report names the buffer elements:\n{text}"
        );
    }
}

// ------------------------------------------------------------------------------------------------
// 3. bf16
// ------------------------------------------------------------------------------------------------

#[test]
fn bf16_keeps_the_buffers_in_f32_and_checkpointing_keeps_the_bits() {
    let cnn = Cnn::new();
    let run = |ckpt: bool| {
        let mut run = Run::new(world2(), 2, Some(ckpt));
        run.config.precision = Precision::Bf16;
        train(&cnn, &run, images)
    };
    let on = run(true);
    let off = run(false);
    assert_ranks_agree("bf16 stage 2 checkpointing on", &on);
    assert_ranks_agree("bf16 stage 2 checkpointing off", &off);
    assert_same_bits("bf16 stage 2, checkpointing on vs off", &on, &off);
    // A bf16 value is an f32 whose low 16 bits are zero.
    let in_bf16 = |x: &f32| x.to_bits() & 0xFFFF == 0;
    // The weights are the bf16 working weights...
    for (path, v) in &on[0].params {
        assert!(
            v.iter().all(in_bf16),
            "bf16: parameter `{path}` {v:?} is bf16"
        );
    }
    // ... but the running statistics are kept in f32.
    let bufs = &on[0].buffers;
    assert!(
        bufs.iter().flat_map(|(_, v)| v).any(|x| !in_bf16(x)),
        "bf16: the buffers {bufs:?} are not rounded to bf16"
    );
}
