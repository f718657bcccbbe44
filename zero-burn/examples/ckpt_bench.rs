//! Checkpoint throughput: a 2-rank stage-3 save and load (a resume: a fresh engine) of a GPT
//! (fp32 weights, AdamW m and v) through `DirStorage`, against a plain `std::fs` write (+ fsync)
//! and read of the same number of bytes by the same two threads, in the same directory. Loads
//! and plain reads twice: from the page cache (just written), and from the disk (the files
//! evicted with `posix_fadvise(DONTNEED)` first). Also the crc32c cost alone.
//!
//! `cargo run -p zero-burn --example ckpt_bench --features zero-comm/wgpu,zero-quant/wgpu,zero-burn/wgpu -- [DIR [keep]]`
//! (`keep` leaves the checkpoint in `DIR/ckpt`, e.g. for `cargo xtask ckpt`)

use std::io::Write;
use std::sync::Barrier;
use std::time::Instant;

use burn::tensor::Device;
use zero_burn::checkpoint::DirStorage;
use zero_burn::demo::gpt::GptConfig;
use zero_burn::{Launch, ZeroEngine};
use zero_comm::Communicator;
use zero_core::{Topology, ZeroConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .map_or_else(|| std::env::temp_dir().join("zero-ckpt-bench"), Into::into);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let cfg = GptConfig {
        vocab: 256,
        context: 64,
        d_model: 512,
        heads: 8,
        layers: 4,
    };
    let model = cfg.init(&Device::flex().autodiff(), 1);
    let n = 2;
    let barrier = Barrier::new(n);
    let store = DirStorage::new(dir.join("ckpt"))?;
    let zero = ZeroConfig {
        stage: 3,
        ..Default::default()
    };
    let launch = || Topology::single_node(n).map(Launch::new);
    let saves = launch()?.run_with(&model, |comm, model| {
        let mut e = ZeroEngine::builder(comm, model)
            .config(zero.clone())
            .build()?;
        e.save(&store, serde_json::json!(null))
    })?;
    // A resume: a fresh engine loads, from the page cache (the files were just written), then
    // another fresh engine after the files are evicted from it (from the disk).
    let load = |cold: bool| {
        launch()?.run_with(&model, |comm, model| {
            let rank = comm.rank();
            let mut e = ZeroEngine::builder(comm, model)
                .config(zero.clone())
                .build()?;
            if cold && rank == 0 {
                evict_dir(&dir.join("ckpt"))?;
            }
            barrier.wait();
            let t = Instant::now();
            let loaded = e.load(&store)?;
            assert_eq!(loaded.step, 0);
            Ok(t.elapsed().as_secs_f64())
        })
    };
    let warm = load(false)?;
    let cold = load(true)?;
    let rows = launch()?.run(|comm| {
        let rank = comm.rank();
        let bytes = vec![0x5au8; saves[rank].bytes as usize];
        // The same bytes, plainly.
        let path = dir.join(format!("plain-{rank}"));
        let io = |e: std::io::Error| zero_burn::Error::Data(format!("{}: {e}", path.display()));
        barrier.wait();
        let t = Instant::now();
        let mut f = std::fs::File::create(&path).map_err(io)?;
        f.write_all(&bytes)
            .and_then(|()| f.sync_all())
            .map_err(io)?;
        let plain_w = t.elapsed().as_secs_f64();
        barrier.wait();
        let t = Instant::now();
        let back = std::fs::read(&path).map_err(io)?;
        let plain_r = t.elapsed().as_secs_f64();
        drop(back);
        evict(&path).map_err(io)?;
        barrier.wait();
        let t = Instant::now();
        let back = std::fs::read(&path).map_err(io)?;
        let plain_cold = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let crc = crc32c::crc32c(&back);
        let crc_s = t.elapsed().as_secs_f64();
        Ok((plain_w, plain_r, plain_cold, crc_s, crc))
    })?;
    let mb = |b: u64, s: f64| b as f64 / 1e6 / s;
    println!(
        "rank  MB     save MB/s  plain write  ratio  load (cache)  plain read  ratio  load (disk)  plain read  ratio  crc32c GB/s"
    );
    for (rank, (pw, pr, pc, crc, _)) in rows.into_iter().enumerate() {
        let (bytes, save) = (saves[rank].bytes, saves[rank].seconds);
        let (lw, lc) = (warm[rank], cold[rank]);
        println!(
            "{rank:<5} {:<6.1} {:<10.0} {:<12.0} {:<6.2} {:<13.0} {:<11.0} {:<6.2} {:<12.0} {:<11.0} {:<6.2} {:.1}",
            bytes as f64 / 1e6,
            mb(bytes, save),
            mb(bytes, pw),
            pw / save,
            mb(bytes, lw),
            mb(bytes, pr),
            pr / lw,
            mb(bytes, lc),
            mb(bytes, pc),
            pc / lc,
            mb(bytes, crc) / 1e3,
        );
    }
    if std::env::args().nth(2).as_deref() == Some("keep") {
        for r in 0..n {
            std::fs::remove_file(dir.join(format!("plain-{r}")))?;
        }
    } else {
        std::fs::remove_dir_all(&dir)?;
    }
    Ok(())
}

/// Drops `path`'s pages from the page cache (it is synced first, so they are clean), so the next
/// read comes from the disk.
fn evict(path: &std::path::Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path)?;
    f.sync_all()?;
    // SAFETY: a plain syscall on an open descriptor; it reads no memory of ours.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::from_raw_os_error(r))
    }
}

/// [`evict`] for every file under `dir`.
fn evict_dir(dir: &std::path::Path) -> zero_burn::Result<()> {
    let io = |e: std::io::Error| zero_burn::Error::Data(format!("{}: {e}", dir.display()));
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.is_dir() {
            evict_dir(&path)?;
        } else {
            evict(&path).map_err(io)?;
        }
    }
    Ok(())
}
