//! A resharding load reads about what it restores (issue 11): each rank reads only the checksum
//! blocks its part of the state lies in, not every saved file it touches. A 2-rank stage-3
//! checkpoint of one 4096 × 2048 linear layer (rank files of 50 MB, tensors of 17 MB, far larger
//! than the 1 MiB blocks) loaded on 4 ranks: each new rank needs half of one old rank's file,
//! and the four together read about two files (plus the blocks' rounding and the headers),
//! where reading whole files would take four; at stage 2 a new rank restores the whole weights
//! but only its chunk of the optimizer state, and reads no more of it.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use common::store::Hooked;
use zero_burn::checkpoint::{MemStorage, read_manifest};
use zero_burn::{Launch, Whole, ZeroEngine};
use zero_core::{Topology, ZeroConfig};

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

/// Saves a 2-rank checkpoint at `stage`, loads it resharded on 4 ranks: the bytes the four read
/// together and the size of a rank file. The weights must come back.
fn reshard_2_to_4(stage: u8) -> (u64, u64) {
    let layer = LinearConfig::new(4096, 2048).init(&Device::flex().autodiff());
    let model = Whole::new(layer, |m: &Linear, x: &Tensor<2>| {
        m.forward(x.clone()).sum().reshape([1])
    });
    let cfg = ZeroConfig {
        stage,
        ..Default::default()
    };
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
    let run = |n: usize, load: bool| {
        Launch::new(Topology::single_node(n).unwrap())
            .timeout(Duration::from_secs(60))
            .run_with(&model, |comm, model| {
                let mut e = ZeroEngine::builder(comm, model)
                    .config(cfg.clone())
                    .build()?;
                if load {
                    e.load_resharded(&store)?;
                } else {
                    e.save(&store, serde_json::json!(null))?;
                }
                Ok(values(&e.consolidated_model()?))
            })
            .unwrap()
    };
    let saved = run(2, false);
    let (_, m) = read_manifest(&store.inner, None).unwrap();
    let rank_file = m.files.iter().map(|f| f.bytes).max().unwrap();
    assert!(
        rank_file > 16 << 20,
        "rank files of {rank_file} bytes are too small to tell"
    );
    read.store(0, Ordering::SeqCst);
    let loaded = run(4, true);
    assert_eq!(loaded[0], saved[0], "stage {stage}: the weights came back");
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
/// of `m` and `v` (a quarter of the unit's), so it reads both old files' weights and half of one
/// file's optimizer state: about 0.5 of both files, where reading them whole would be 1.
#[test]
fn a_stage_2_reshard_reads_the_weights_and_its_chunk_of_the_state() {
    reads_within(2, 2, 45, 60);
}
