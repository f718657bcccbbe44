//! The memory bounds of a save, a load and an export, besides the engine's own state:
//! no rank holds more than its shard plus about one tensor's worth of buffer. The save and the
//! export stream, each within one rank file plus the largest tensor per rank, and well under it.
//! A load verifies every byte before any state changes: it holds its own rank file (its shard);
//! the other ranks' blocks it needs (the other chunks of the units it holds whole: every unit at
//! stages 0–2, stage 3's persistent ones) are verified and let go, then read and verified again
//! as they are restored, one parameter at a time. Measured with a counting global allocator
//! around the save and the load (both ranks at once; the load into fresh engines, after their
//! build) and the export of a 2-rank stage-3 checkpoint of a GPT whose rank files are 20 MB,
//! around a load at stage 1, where every rank restores the whole weights, and around a reshard
//! of the stage-3 checkpoint into stage 1, where every rank restores the whole weights from
//! chunks in both files and holds only those of its new shard.

use std::sync::Barrier;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use burn::tensor::Device;
use zero_burn::checkpoint::{DirStorage, ExportDtype, export_safetensors, read_manifest};
use zero_burn::demo::gpt::GptConfig;
use zero_burn::{Launch, ZeroEngine};
use zero_comm::Communicator;
use zero_core::{Topology, ZeroConfig};

use zero_testkit::alloc::{LIVE, PEAK};

use crate::one_at_a_time;

#[test]
fn save_load_and_export_stay_within_their_memory_bounds() {
    let _alone = one_at_a_time();
    let tmp = tempfile::Builder::new()
        .prefix("zero-export-mem-")
        .tempdir()
        .expect("a temp dir");
    let dir = tmp.path().to_path_buf();
    let store = DirStorage::new(dir.join("ckpt")).unwrap();
    let out = DirStorage::new(dir.join("out")).unwrap();
    let cfg = GptConfig {
        vocab: 512,
        context: 32,
        d_model: 256,
        heads: 4,
        layers: 4,
    };
    let model = cfg.init(&Device::flex().autodiff(), 3);
    let both = Barrier::new(2);
    let base = AtomicUsize::new(0);
    // The peak above the engines' build of `act` on both ranks at once.
    let measured =
        |stage: u8, act: &(dyn Fn(&mut ZeroEngine<_, _>) -> zero_burn::Result<()> + Sync)| {
            let peaks = Launch::new(Topology::single_node(2).unwrap())
                .timeout(Duration::from_secs(60))
                .run_with(&model, |comm, model| {
                    let rank = comm.rank();
                    let mut e = ZeroEngine::builder(comm, model)
                        .config(ZeroConfig {
                            stage,
                            ..Default::default()
                        })
                        .build()?;
                    both.wait();
                    if rank == 0 {
                        base.store(LIVE.load(Ordering::SeqCst), Ordering::SeqCst);
                        PEAK.store(LIVE.load(Ordering::SeqCst), Ordering::SeqCst);
                    }
                    both.wait();
                    let r = act(&mut e);
                    both.wait();
                    Ok(r.map(|()| PEAK.load(Ordering::SeqCst) - base.load(Ordering::SeqCst)))
                })
                .unwrap();
            peaks[0].as_ref().map(|&p| p as u64).unwrap()
        };
    let save_peak = measured(3, &|e| e.save(&store, serde_json::json!(null)).map(|_| ()));
    let load_peak = measured(3, &|e| e.load(&store).map(|_| ()));
    // Stage 1, where every rank holds the whole weights: its load reads the other rank's
    // chunks of every unit's weights too, and must not hold them all.
    let store1 = DirStorage::new(dir.join("ckpt1")).unwrap();
    measured(1, &|e| e.save(&store1, serde_json::json!(null)).map(|_| ()));
    let load1_peak = measured(1, &|e| e.load(&store1).map(|_| ()));
    // The stage-3 checkpoint resharded into stage 1.
    let reshard_peak = measured(1, &|e| e.load_resharded(&store).map(|_| ()));
    drop(model);
    let (_, m) = read_manifest(&store, None).unwrap();
    let rank_file = m.files.iter().map(|f| f.bytes).max().unwrap();
    let largest = m.layout.params.iter().map(|p| p.numel() * 4).max().unwrap();
    assert!(
        rank_file > 16 << 20,
        "rank files of {rank_file} bytes are too small to tell"
    );
    println!(
        "save of 2 rank files of {rank_file} bytes, both ranks at once: peak {save_peak} bytes \
         allocated"
    );
    assert!(
        save_peak <= 2 * (rank_file + largest),
        "the save peaked at {save_peak} bytes, over a rank file + the largest tensor per rank"
    );
    assert!(
        save_peak < rank_file / 2,
        "the save peaked at {save_peak} bytes for both ranks, a rank file is {rank_file}: it \
         should stream"
    );
    // A load holds its own rank file (its shard) and, besides, one parameter at a time: its
    // values, its new model tensor and the checksum blocks around it, read again from another
    // rank's file; and 1 MiB of bookkeeping (manifest, tables, copy runs).
    let load_bound = |m: &zero_core::checkpoint::Manifest| {
        let block = m.files[0].block_size;
        m.files
            .iter()
            .map(|f| f.bytes + 2 * largest + 3 * block + (1 << 20))
            .sum::<u64>()
    };
    for (what, peak, store) in [
        ("stage 3", load_peak, &store),
        ("stage 1", load1_peak, &store1),
        ("stage 3 -> 1 reshard", reshard_peak, &store),
    ] {
        let (_, m) = read_manifest(store, None).unwrap();
        let bound = load_bound(&m);
        let file = m.files.iter().map(|f| f.bytes).max().unwrap();
        println!(
            "{what}: load of 2 rank files of {file} bytes into fresh engines, both ranks at \
             once: peak {peak} bytes allocated (bound: a rank file, a tensor twice, 3 blocks and \
             1 MiB per rank: {bound})"
        );
        assert!(
            peak <= bound,
            "the {what} load peaked at {peak} bytes, over {bound}: a rank file, the largest \
             tensor twice, 3 checksum blocks and 1 MiB per rank"
        );
    }

    let before = LIVE.load(Ordering::SeqCst);
    PEAK.store(before, Ordering::SeqCst);
    let r = export_safetensors(&store, None, &out, "model.safetensors", ExportDtype::F32).unwrap();
    let peak = (PEAK.load(Ordering::SeqCst) - before) as u64;
    println!(
        "export of {} bytes from 2 rank files of {rank_file} bytes (largest tensor {largest}): \
         peak {peak} bytes allocated",
        r.bytes
    );
    assert!(
        peak <= rank_file + largest,
        "the export peaked at {peak} bytes, over one rank file ({rank_file}) + the largest tensor \
         ({largest})"
    );
    assert!(
        peak < rank_file / 2,
        "the export peaked at {peak} bytes: it holds about a rank file ({rank_file}); it should \
         stream"
    );
    let written = std::fs::metadata(dir.join("out/model.safetensors"))
        .unwrap()
        .len();
    assert_eq!(written, r.bytes);
}
