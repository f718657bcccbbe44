//! The memory bounds of a save and an export (issue 11): both stream, so neither holds a whole
//! rank file. Measured with a counting global allocator around the save (both ranks at once) and
//! the export of a 2-rank stage-3 checkpoint of a GPT whose rank files are 20 MB: the peak of the
//! bytes allocated must stay within the bound (one rank file plus the largest tensor per
//! rank) and, streamed, well under it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Barrier;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use burn::tensor::Device;
use zero_burn::checkpoint::{DirStorage, ExportDtype, export_safetensors, read_manifest};
use zero_burn::demo::gpt::GptConfig;
use zero_burn::{Launch, ZeroEngine};
use zero_comm::Communicator;
use zero_core::{Topology, ZeroConfig};

/// Counts the bytes live on the heap and their high-water mark.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::SeqCst) + n;
    PEAK.fetch_max(now, Ordering::SeqCst);
}

// SAFETY: every call is forwarded to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Ordering::SeqCst);
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            LIVE.fetch_sub(l.size(), Ordering::SeqCst);
            grew(new);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

#[test]
fn save_and_export_never_hold_a_whole_rank_file() {
    let dir = std::env::temp_dir().join(format!("zero-export-mem-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
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
    let saved = Launch::new(Topology::single_node(2).unwrap())
        .timeout(Duration::from_secs(60))
        .run_with(&model, |comm, model| {
            let rank = comm.rank();
            let mut e = ZeroEngine::builder(comm, model)
                .config(ZeroConfig {
                    stage: 3,
                    ..Default::default()
                })
                .build()?;
            both.wait();
            if rank == 0 {
                base.store(LIVE.load(Ordering::SeqCst), Ordering::SeqCst);
                PEAK.store(LIVE.load(Ordering::SeqCst), Ordering::SeqCst);
            }
            both.wait();
            let r = e.save(&store, serde_json::json!(null));
            both.wait();
            Ok(r.map(|_| PEAK.load(Ordering::SeqCst) - base.load(Ordering::SeqCst)))
        })
        .unwrap();
    drop(model);
    let save_peak = *saved[0].as_ref().unwrap() as u64;
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
    std::fs::remove_dir_all(&dir).unwrap();
}
