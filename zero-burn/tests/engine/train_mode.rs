//! Training mode through the engine: burn's `BatchNorm` (batch statistics in the forward, running
//! statistics as buffers) and `Dropout` (random masks) behave exactly as in plain burn at every
//! stage, with activation checkpointing on or off.
//!
//! What it checks, all through the public API:
//!
//! 1. A small CNN (Conv2d → BatchNorm → ReLU → Dropout(0.25) → Linear, cross-entropy), as a
//!    [`Whole`] and as a two-segment [`Segmented`] model, world 2, accumulation 2: stages 0–3 with
//!    checkpointing on and off (stage 3 really sharded: persistence threshold 0) give the same bits
//!    — every micro-batch loss on every rank, the consolidated parameters and the buffers (running
//!    mean and variance) — and every rank holds the same buffers, in its own model and in the
//!    consolidated one.
//! 2. The same CNN against plain burn: one process, no zero-rs engine, burn's own SGD, each
//!    (rank, micro-step) micro-batch forwarded on its own (BatchNorm statistics are per
//!    micro-batch, as in DDP without SyncBatchNorm) with the engine's dropout masks replayed
//!    through [`zero_burn::rng::with_seed`] and [`zero_burn::rng::segment_seed`]. Every micro-batch
//!    loss, every parameter tensor and every buffer lie within [`TOL`] (the worst per-tensor
//!    absolute gap is printed and named in the failure), the buffers being rank 0's chain of
//!    running statistics (`BufferSync::Broadcast`). World 2 at stage 3 with checkpointing (the
//!    case that trained on eval-mode forwards before) and at stage 1 (also with another base seed),
//!    world 4 (2 nodes × 2) at stage 3.
//! 3. `BufferSync::Average` at stage 2, world 2: the buffers are the per-micro-step mean over ranks
//!    of plain burn's running statistics, identical on every rank, and not rank 0's chain.
//! 4. burn's own `TransformerEncoder` (dropout 0.1) through [`Whole`] with a mean-pooled linear
//!    head: stages 1 and 3, checkpointing on and off bit-identical, and within [`TOL`] of plain
//!    burn with the same masks.
//! 5. A checkpoint round trip with buffers: the CNN trained 2 steps at stage 2 and saved loads
//!    (resharded) into a fresh stage-3 engine with the saved buffers and parameters on every
//!    rank, and one more step gives the bits of a stage-3 run that never stopped.
//!
//! The CNN, its data, the engine run and the plain-burn oracle live in `common::train_mode`,
//! shared with `train_mode_zeropp.rs` (ZeRO++, the report and bf16 with buffers).

use crate::common;

use std::time::Duration;

use burn::module::Module;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::Tensor;
use serde_json::json;
use zero_burn::checkpoint::MemStorage;
use zero_burn::demo::gpt::deterministic_init;
use zero_burn::params::buffers;
use zero_burn::rng::with_seed;
use zero_burn::{BufferSync, Launch, Segmented, Whole, ZeroEngine};
use zero_core::Topology;

use common::points::cross_entropy;
use common::train_mode::{
    B, CH, CLASSES, Cnn, Labelled, Named, Run, Seeds, Seen, TOL, assert_near_plain_burn,
    assert_ranks_agree, assert_state_bits, bits, cnn_forward, device, fresh, images, labelled,
    loss_bits, max_gap, params_of, plain_burn, rank_batches, train, whole_cnn, world2,
};

/// AdamW's learning rate (the checkpoint test).
const ADAM_LR: f32 = 1e-2;

// ------------------------------------------------------------------------------------------------
// The transformer's data and model (the CNN's are in `common::train_mode`)
// ------------------------------------------------------------------------------------------------

const SEQ: usize = 4;
const FEATURES: usize = 6;
const D_MODEL: usize = 8;

/// A micro-batch of sequences `[B, SEQ, FEATURES]` and labels.
type Seqs = Labelled<3>;

/// Global micro-batch `k`: noise plus a label-dependent offset on two features at every position.
fn seqs(k: usize) -> Seqs {
    let on = |label, j: usize| {
        if (j % FEATURES) % CLASSES == label {
            0.8
        } else {
            0.0
        }
    };
    labelled((k, 0xA7), (5, 2), [B, SEQ, FEATURES], on)
}

/// A linear input projection, burn's `TransformerEncoder` (d_model 8, d_ff 16, 2 heads, 2 layers,
/// dropout 0.1), mean pooling over the sequence and a linear head.
#[derive(Module, Debug)]
struct Tfm {
    input: Linear,
    encoder: TransformerEncoder,
    head: Linear,
}

impl Tfm {
    fn new() -> Self {
        let device = device();
        with_seed(&device, 0, || {
            deterministic_init(
                Tfm {
                    input: LinearConfig::new(FEATURES, D_MODEL).init(&device),
                    encoder: TransformerEncoderConfig::new(D_MODEL, 16, 2, 2)
                        .with_dropout(0.1)
                        .init(&device),
                    head: LinearConfig::new(D_MODEL, CLASSES).init(&device),
                },
                13,
            )
        })
    }

    fn loss(&self, b: &Seqs) -> Tensor<1> {
        let h = self.encoder.forward(TransformerEncoderInput::new(
            self.input.forward(b.x.clone()),
        ));
        let pooled = h.mean_dim(1).squeeze_dim::<2>(1);
        cross_entropy(self.head.forward(pooled), b.y.clone())
    }
}

fn whole_tfm(
    tfm: Tfm,
) -> Whole<Tfm, Seqs, impl Fn(&Tfm, &Seqs) -> Tensor<1> + Clone + Send + 'static> {
    Whole::new(tfm, |m: &Tfm, b: &Seqs| m.loss(b))
}

/// The transformer's forward as the engine runs it: one segment under its seed.
fn tfm_forward(m: &Tfm, b: &Seqs, seeds: Seeds) -> Tensor<1> {
    with_seed(&device(), seeds.of(0), || m.loss(b))
}

// ------------------------------------------------------------------------------------------------
// 1. Bit-identical across stages and checkpointing
// ------------------------------------------------------------------------------------------------

/// Stages 0–3 × checkpointing on/off, world 2: the same bits everywhere, and the run trained.
fn stages_and_checkpointing_agree<M, T, F>(model: &M, what: &str, data: F)
where
    M: Segmented<Batch = T> + Clone + Send,
    F: Fn(usize) -> T + Sync + Copy,
{
    type Bits = (
        Vec<Vec<Vec<u32>>>,
        Vec<(String, Vec<u32>)>,
        Vec<(String, Vec<u32>)>,
    );
    let mut reference: Option<(String, Bits)> = None;
    for stage in 0..=3u8 {
        for ckpt in [true, false] {
            let run = Run::new(world2(), stage, Some(ckpt));
            let label = format!("{what} stage {stage} checkpointing {ckpt}");
            let seen = train(model, &run, data);
            assert_ranks_agree(&label, &seen);
            let got: Bits = (
                seen.iter().map(|s| loss_bits(&s.losses)).collect(),
                bits(&seen[0].params),
                bits(&seen[0].buffers),
            );
            match &reference {
                None => reference = Some((label, got)),
                Some((first, want)) => {
                    assert_eq!(got.0, want.0, "{label} vs {first}: micro-batch losses");
                    assert_eq!(got.1, want.1, "{label} vs {first}: parameters");
                    assert_eq!(got.2, want.2, "{label} vs {first}: buffers");
                }
            }
        }
    }
    // The run trained: the weights and (where there are some) the running statistics moved.
    let (_, (_, params, bufs)) = reference.expect("ran");
    assert_ne!(params, bits(&params_of(model)), "{what}: the weights moved");
    assert_eq!(
        bufs.len(),
        buffers(model).len(),
        "{what}: the buffers are all there"
    );
    if !bufs.is_empty() {
        assert_ne!(
            bufs,
            bits(&buffers(model)),
            "{what}: the running statistics moved"
        );
    }
}

#[test]
fn cnn_is_bit_identical_across_stages_and_checkpointing() {
    let cnn = Cnn::new();
    assert_eq!(
        buffers(&cnn)
            .iter()
            .map(|(p, v)| (p.as_str(), v.len()))
            .collect::<Vec<_>>(),
        [("bn.running_mean", CH), ("bn.running_var", CH)],
        "BatchNorm's running statistics are the buffers"
    );
    stages_and_checkpointing_agree(&whole_cnn(fresh(&cnn)), "whole cnn", images);
    stages_and_checkpointing_agree(&cnn, "segmented cnn", images);
}

// ------------------------------------------------------------------------------------------------
// 2. Against plain burn
// ------------------------------------------------------------------------------------------------

#[test]
fn cnn_matches_plain_burn_with_seeded_dropout_and_batch_statistics() {
    let cnn = Cnn::new();
    let want = plain_burn(&cnn, 2, BufferSync::Broadcast, 0, images, cnn_forward);
    // The oracle's masks and statistics are live: its first loss is not the eval-mode loss.
    let eval = cnn
        .valid()
        .head_loss(cnn.valid().features(&images(0).x), &images(0).y)
        .into_data()
        .try_into_vec_as::<f32>()
        .unwrap()[0];
    assert!(
        (eval - want.losses[0][0][0]).abs() > 1e-3,
        "training-mode loss {} vs eval-mode loss {eval}",
        want.losses[0][0][0]
    );
    for run in [
        Run::new(world2(), 3, Some(true)),
        Run::new(world2(), 1, None),
    ] {
        let what = format!(
            "stage {} checkpointing {:?}",
            run.config.stage, run.config.checkpoint_activations
        );
        let seen = train(&cnn, &run, images);
        assert_near_plain_burn(&format!("segmented cnn {what}"), &seen, &want);
        let seen = train(&whole_cnn(fresh(&cnn)), &run, images);
        assert_near_plain_burn(&format!("whole cnn {what}"), &seen, &want);
    }
    // Another base seed: other masks, which plain burn replays too.
    let run = Run {
        seed: Some(7),
        ..Run::new(world2(), 1, None)
    };
    let seven = plain_burn(&cnn, 2, BufferSync::Broadcast, 7, images, cnn_forward);
    let seen = train(&cnn, &run, images);
    assert_near_plain_burn("segmented cnn stage 1 seed 7", &seen, &seven);
    let apart = max_gap(&seven.params, &want.params);
    eprintln!("seed 7 vs seed 0: parameters {apart:e} apart");
    assert!(
        apart > 100.0 * TOL,
        "seed 7 draws other masks than seed 0 (gap {apart:e})"
    );
}

#[test]
fn cnn_matches_plain_burn_on_four_ranks_at_stage_3() {
    let cnn = Cnn::new();
    let want = plain_burn(&cnn, 4, BufferSync::Broadcast, 0, images, cnn_forward);
    let topo = Topology::new(4, 2).unwrap();
    for ckpt in [true, false] {
        let run = Run::new(topo, 3, Some(ckpt));
        let seen = train(&cnn, &run, images);
        assert_near_plain_burn(
            &format!("4 ranks stage 3 checkpointing {ckpt}"),
            &seen,
            &want,
        );
    }
}

// ------------------------------------------------------------------------------------------------
// 3. BufferSync::Average
// ------------------------------------------------------------------------------------------------

#[test]
fn average_buffer_sync_is_the_per_micro_step_mean_over_ranks() {
    let cnn = Cnn::new();
    let want = plain_burn(&cnn, 2, BufferSync::Average, 0, images, cnn_forward);
    let chain = plain_burn(&cnn, 2, BufferSync::Broadcast, 0, images, cnn_forward);
    // Averaging changes the buffers only: losses and weights do not read the running statistics.
    assert_eq!(loss_bits(&want.losses[1]), loss_bits(&chain.losses[1]));
    assert_eq!(bits(&want.params), bits(&chain.params));
    let apart = max_gap(&want.buffers, &chain.buffers);
    eprintln!("average vs rank 0's chain: buffers {apart:e} apart");
    assert!(
        apart > 100.0 * TOL,
        "the mean over ranks is not rank 0's chain (gap {apart:e})"
    );
    let run = Run {
        sync: BufferSync::Average,
        ..Run::new(world2(), 2, None)
    };
    let seen = train(&cnn, &run, images);
    assert_near_plain_burn("segmented cnn stage 2 average", &seen, &want);
    let seen = train(&whole_cnn(fresh(&cnn)), &run, images);
    assert_near_plain_burn("whole cnn stage 2 average", &seen, &want);
}

// ------------------------------------------------------------------------------------------------
// 4. burn's TransformerEncoder
// ------------------------------------------------------------------------------------------------

#[test]
fn transformer_encoder_is_bit_identical_with_checkpointing_and_matches_plain_burn() {
    let tfm = Tfm::new();
    assert!(buffers(&tfm).is_empty(), "no buffers in a transformer");
    let want = plain_burn(&tfm, 2, BufferSync::Broadcast, 0, seqs, tfm_forward);
    let model = whole_tfm(fresh(&tfm));
    for stage in [1u8, 3] {
        let mut reference: Option<Vec<Seen>> = None;
        for ckpt in [true, false] {
            let what = format!("transformer stage {stage} checkpointing {ckpt}");
            let seen = train(&model, &Run::new(world2(), stage, Some(ckpt)), seqs);
            assert_near_plain_burn(&what, &seen, &want);
            match &reference {
                None => reference = Some(seen),
                Some(first) => {
                    for (r, (a, b)) in seen.iter().zip(first).enumerate() {
                        assert_eq!(
                            loss_bits(&a.losses),
                            loss_bits(&b.losses),
                            "{what}: rank {r}'s losses vs checkpointing on"
                        );
                    }
                    assert_eq!(
                        bits(&seen[0].params),
                        bits(&first[0].params),
                        "{what}: parameters vs checkpointing on"
                    );
                }
            }
        }
    }
    let moved = max_gap(&want.params, &params_of(&tfm));
    eprintln!("transformer: parameters moved by up to {moved:e}");
    assert!(
        moved > 100.0 * TOL,
        "the transformer trained (moved {moved:e})"
    );
}

// ------------------------------------------------------------------------------------------------
// 5. Checkpoints carry the buffers
// ------------------------------------------------------------------------------------------------

/// What a rank of a checkpoint world saw.
#[derive(Debug)]
struct Ck {
    /// Right after the load: the engine's own buffers, the consolidated buffers and parameters,
    /// the step loaded.
    loaded: Option<(Named, Named, Named, u64)>,
    /// Losses of the steps this world ran.
    losses: Vec<Vec<f32>>,
    params: Named,
    buffers: Named,
    own_buffers: Named,
}

/// A fresh world at `stage` (AdamW, the engine's default): loads `from` (resharded) if given,
/// trains up to step `to`, saves into `save` if given.
fn ck_world(
    cnn: &Cnn,
    stage: u8,
    from: Option<&MemStorage>,
    to: u64,
    save: Option<&MemStorage>,
) -> Vec<Ck> {
    let run = Run::new(world2(), stage, None);
    let cfg = run.config.clone();
    Launch::new(run.topo)
        .timeout(Duration::from_secs(120))
        .run_with(&fresh(cnn), |comm, model| {
            let rank = zero_comm::Communicator::rank(&comm);
            let mut e = ZeroEngine::builder(comm, model)
                .config(cfg.clone())
                .build()?;
            let loaded = match from {
                Some(store) => {
                    let l = e.load_resharded(store)?;
                    let own = buffers(e.model());
                    let full = e.consolidated_model()?;
                    Some((own, buffers(&full), params_of(&full), l.step))
                }
                None => None,
            };
            let mut losses = Vec::new();
            while e.steps() < to {
                let s = e.steps() as usize;
                losses.push(
                    e.step(ADAM_LR, &rank_batches(&images, s, 2, rank))?
                        .micro_losses,
                );
            }
            if let Some(store) = save {
                e.save(store, json!({ "next_step": e.steps() }))?;
            }
            let own_buffers = buffers(e.model());
            let full = e.consolidated_model()?;
            Ok(Ck {
                loaded,
                losses,
                params: params_of(&full),
                buffers: buffers(&full),
                own_buffers,
            })
        })
        .unwrap_or_else(|e| panic!("stage {stage}: {e}"))
}

#[test]
fn checkpoint_round_trip_restores_buffers_across_a_reshard() {
    let cnn = Cnn::new();
    let saved = MemStorage::new();
    let first = ck_world(&cnn, 2, None, 2, Some(&saved));
    let resumed = ck_world(&cnn, 3, Some(&saved), 3, None);
    let straight = ck_world(&cnn, 3, None, 3, None);
    let (p0, b0) = (&first[0].params, &first[0].buffers);
    assert_ne!(
        bits(b0),
        bits(&buffers(&cnn)),
        "two steps moved the running statistics"
    );
    for (r, c) in first.iter().enumerate() {
        let got = [&c.params, &c.buffers, &c.own_buffers];
        assert_state_bits(&format!("rank {r} at the save"), got, [p0, b0, b0]);
    }
    for (r, c) in resumed.iter().enumerate() {
        let (own, full, params, step) = c.loaded.as_ref().expect("loaded");
        assert_eq!(*step, 2, "rank {r}: the step loaded");
        let what = format!("rank {r} right after the load");
        assert_state_bits(&what, [params, full, own], [p0, b0, b0]);
    }
    // The third step, resumed at stage 3, is the third step of a stage-3 run that never stopped.
    for (r, (c, s)) in resumed.iter().zip(&straight).enumerate() {
        assert_eq!(
            loss_bits(&c.losses),
            loss_bits(&s.losses[2..]),
            "rank {r}: step 3's losses"
        );
        let got = [&c.params, &c.buffers, &c.own_buffers];
        let want = [&s.params, &s.buffers, &s.buffers];
        assert_state_bits(&format!("rank {r} after step 3"), got, want);
    }
    // And the first two steps at stage 2 were the straight run's too.
    for (r, (c, s)) in first.iter().zip(&straight).enumerate() {
        assert_eq!(
            loss_bits(&c.losses),
            loss_bits(&s.losses[..2]),
            "rank {r}: steps 1-2's losses, stage 2 vs stage 3"
        );
    }
}
