//! A resharding load reads about what it restores: each rank reads only the checksum
//! blocks its part of the state lies in, not every saved file it touches. A 2-rank stage-3
//! checkpoint of one 4096 × 2048 linear layer (rank files of 50 MB, tensors of 17 MB, far larger
//! than the 1 MiB blocks) loaded on 4 ranks: each new rank needs half of one old rank's file,
//! and the four together read about two files (plus the blocks' rounding and the headers),
//! where reading whole files would take four; at stage 2 a new rank restores the whole weights
//! but only its chunk of the optimizer state, and reads no more of it. The weights outside its
//! chunk it reads twice (verified and let go, then read and verified again as it restores them),
//! so that it never holds them all.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use common::store::Hooked;
use zero_burn::checkpoint::{MemStorage, Storage, join, read_manifest};
use zero_burn::{Error, Launch, Whole, ZeroEngine};
use zero_core::{CheckpointError, Topology, ZeroConfig};

fn values<M: Module>(m: &M) -> Vec<Vec<u32>> {
    struct V(Vec<Vec<u32>>);
    impl ModuleVisitor for V {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let v = p.val().into_data().try_into_vec_as::<f32>().unwrap();
            self.0.push(v.iter().map(|x| x.to_bits()).collect());
        }
    }
    let mut v = V(Vec::new());
    m.visit(&mut v);
    v.0
}

type Layer = Whole<Linear, Tensor<2>, fn(&Linear, &Tensor<2>) -> Tensor<1>>;

fn sum(m: &Linear, x: &Tensor<2>) -> Tensor<1> {
    m.forward(x.clone()).sum().reshape([1])
}

/// A `d_in` × `d_out` linear layer trained on the sum of its output.
fn layer(d_in: usize, d_out: usize) -> Layer {
    let f: fn(&Linear, &Tensor<2>) -> Tensor<1> = sum;
    Whole::new(
        LinearConfig::new(d_in, d_out).init(&Device::flex().autodiff()),
        f,
    )
}

/// `n` fresh ranks of `model` at `stage` save into `store` or load it resharded (`load`); per
/// rank: the outcome, the weights before and the weights after.
#[allow(clippy::type_complexity)]
fn run(
    model: &Layer,
    store: &dyn Storage,
    n: usize,
    stage: u8,
    load: bool,
) -> Vec<(zero_burn::Result<()>, Vec<Vec<u32>>, Vec<Vec<u32>>)> {
    let cfg = ZeroConfig {
        stage,
        ..Default::default()
    };
    Launch::new(Topology::single_node(n).unwrap())
        .timeout(Duration::from_secs(60))
        .run_with(model, |comm, model| {
            let mut e = ZeroEngine::builder(comm, model)
                .config(cfg.clone())
                .build()?;
            let before = values(&e.consolidated_model()?);
            let r = if load {
                e.load_resharded(store).map(|_| ())
            } else {
                e.save(store, serde_json::json!(null)).map(|_| ())
            };
            Ok((r, before, values(&e.consolidated_model()?)))
        })
        .unwrap()
}

/// Saves a 2-rank checkpoint at `stage`, loads it resharded on 4 ranks: the bytes the four read
/// together and the size of a rank file. The weights must come back.
fn reshard_2_to_4(stage: u8) -> (u64, u64) {
    let model = layer(4096, 2048);
    // A store that counts the bytes it hands out.
    let read = Arc::new(AtomicU64::new(0));
    let counter = read.clone();
    let store = Hooked::new(
        MemStorage::new(),
        Box::new(move |_, _, got| {
            let n = got.as_ref().map_or(0, |b| b.len() as u64);
            counter.fetch_add(n, Ordering::SeqCst);
        }),
    );
    let saved = run(&model, &store, 2, stage, false);
    let (_, m) = read_manifest(&store.inner, None).unwrap();
    let rank_file = m.files.iter().map(|f| f.bytes).max().unwrap();
    assert!(
        rank_file > 16 << 20,
        "rank files of {rank_file} bytes are too small to tell"
    );
    read.store(0, Ordering::SeqCst);
    let loaded = run(&model, &store, 4, stage, true);
    for (r, (got, _, after)) in loaded.iter().enumerate() {
        assert!(got.is_ok(), "rank {r}: {got:?}");
        assert_eq!(
            after[0], saved[0].2[0],
            "stage {stage}: the weights came back"
        );
    }
    (read.load(Ordering::SeqCst), rank_file)
}

/// Reshards a stage-`stage` checkpoint from 2 to 4 ranks and checks the bytes read against
/// `files` whole rank files per new rank (what reading every touched file whole took): their
/// ratio within `lo..hi` percent.
fn reads_within(stage: u8, files: u64, lo: u64, hi: u64) {
    let (read, rank_file) = reshard_2_to_4(stage);
    let whole = 4 * files * rank_file;
    println!(
        "stage {stage}, 2 -> 4 ranks: {read} bytes read by the 4 ranks, rank files of \
         {rank_file} bytes ({:.2} of reading the {files} file(s) each rank touches whole)",
        read as f64 / whole as f64
    );
    assert!(
        read < whole * hi / 100,
        "read {read} bytes; whole files: {whole}"
    );
    assert!(
        read >= whole * lo / 100,
        "{read} bytes cannot hold the state"
    );
}

/// Stage 3: each new rank restores half of one old file (its chunk of the weights, `m`, `v`);
/// block rounding and the headers add little.
#[test]
fn a_stage_3_reshard_reads_about_what_it_restores() {
    reads_within(3, 1, 45, 65);
}

/// Stage 2: each new rank restores the whole weights (the model holds them) but only its chunk
/// of `m` and `v` (a quarter of the unit's). A file `F` is a third weights, so the weights are
/// 2F/3 in all: the rank reads its quarter of them and of `m` and `v` once (F/6 + F/3) and the
/// other three quarters of the weights twice (2 × F/2), 1.5F of the 2F of both files: 0.75, plus
/// the blocks' rounding. Reading `m` and `v` whole as well would be over 1.
#[test]
fn a_stage_2_reshard_reads_the_weights_and_its_chunk_of_the_state() {
    reads_within(2, 2, 70, 90);
}

/// A flipped bit in any checksum block of a rank file fails a resharding load on every rank
/// before any state changes, some rank naming the file and the block: whether a rank holds that
/// block (its new chunk, weights and optimizer state) or streams it (the other rank's chunk of
/// the weights, which it restores too). A 2-rank stage-3 checkpoint of a 1024 × 1024 layer
/// (rank files of 6 MiB: 7 blocks) loaded at stage 2 on 2 ranks.
#[test]
fn a_flipped_block_fails_a_resharding_load_wherever_it_lies() {
    let model = layer(1024, 1024);
    let store = MemStorage::new();
    assert!(run(&model, &store, 2, 3, false).iter().all(|r| r.0.is_ok()));
    let (_, m) = read_manifest(&store, None).unwrap();
    let file = &m.files[1];
    let path = join(&m.tag, &file.path);
    let blocks = file.bytes.div_ceil(file.block_size);
    assert!(blocks >= 6, "{blocks} blocks are too few to tell");
    // Blocks between the header's and the last (where small tensors of both new chunks lie) that
    // both ranks found flipped themselves: rank 1 holds them, rank 0 streams them (it restores
    // rank 1's chunk of the weights too).
    let mut by_both = 0;
    for b in 0..blocks {
        let s = store.fork();
        let at = (b * file.block_size + 100).min(file.bytes - 1);
        s.flip(&path, at as usize, 3).unwrap();
        let got = run(&model, &s, 2, 2, true);
        let mut named = 0;
        for (r, (res, before, after)) in got.iter().enumerate() {
            let err = res
                .as_ref()
                .err()
                .unwrap_or_else(|| panic!("block {b}: rank {r} loaded"));
            assert_eq!(before, after, "block {b}: rank {r}'s weights changed");
            if let Error::Checkpoint(c) = err
                && let CheckpointError::Checksum { file, block, .. } = &**c
            {
                named += usize::from(*file == path && *block == b);
            }
        }
        by_both += usize::from(b > 0 && b + 1 < blocks && named == 2);
        assert!(
            named > 0,
            "block {b}: no rank named it: {:?}",
            got.iter().map(|g| &g.0).collect::<Vec<_>>()
        );
    }
    assert!(
        by_both > 0,
        "no rank that streams a block of the weights found it flipped"
    );
    // The same store unflipped loads.
    assert!(run(&model, &store, 2, 2, true).iter().all(|r| r.0.is_ok()));
}
