//! Checkpoint throughput: a 2-rank stage-3 save and load (a resume: a fresh engine) of a GPT
//! (fp32 weights, AdamW m and v) through `DirStorage`, against a plain `std::fs` write (+ fsync)
//! and read of the same number of bytes by the same two threads, in the same directory. Loads
//! and plain reads twice: from the page cache (just written), and from the disk (the files
//! evicted with `posix_fadvise(DONTNEED)` first). Also the crc32c cost alone. The disk of a VM
//! is noisy, so the run is `ROUNDS` rounds (default 5), each a save into a fresh directory and
//! every measurement once, alternating with its plain yardstick; it prints every round's ratios
//! and, per column, the median and the worst over rounds and ranks.
//!
//! `cargo build --release -p zero-burn --example ckpt_bench && $CARGO_TARGET_DIR/release/examples/ckpt_bench [DIR [ROUNDS [keep]]]`
//! (`keep` leaves the last round's checkpoint in `DIR/ckpt-<round>`, e.g. for `cargo xtask ckpt`)

use std::io::Write;
use std::path::Path;
use std::sync::Barrier;
use std::time::Instant;

use burn::tensor::Device;
use zero_burn::checkpoint::DirStorage;
use zero_burn::demo::gpt::{Gpt, GptConfig};
use zero_burn::{Launch, ZeroEngine};
use zero_comm::Communicator;
use zero_core::{Topology, ZeroConfig};

/// Ranks.
const N: usize = 2;

/// A ratio of two of a [`Row`]'s figures.
type Ratio = fn(&Row) -> f64;

/// One rank's figures of one round, in seconds (and the bytes).
#[derive(Clone, Copy)]
struct Row {
    bytes: u64,
    save: f64,
    plain_write: f64,
    load_cache: f64,
    plain_cache: f64,
    load_disk: f64,
    plain_disk: f64,
    crc: f64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arg = |k: usize| std::env::args().nth(k);
    let dir = arg(1).map_or_else(|| std::env::temp_dir().join("zero-ckpt-bench"), Into::into);
    let rounds: usize = arg(2).map_or(Ok(5), |r| r.parse())?;
    let keep = arg(3).as_deref() == Some("keep");
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
    println!(
        "round rank MB     save MB/s  plain write  ratio  load (cache)  plain read  ratio  load (disk)  plain read  ratio  crc32c GB/s"
    );
    let mut all = Vec::new();
    for round in 0..rounds {
        let ckpt = dir.join(format!("ckpt-{round}"));
        let rows = one_round(&model, &dir, &ckpt)?;
        for (rank, r) in rows.iter().enumerate() {
            print_row(round, rank, r);
        }
        all.extend(rows);
        if !(keep && round + 1 == rounds) {
            std::fs::remove_dir_all(&ckpt)?;
        }
    }
    let ratio = |f: Ratio| {
        let mut v: Vec<f64> = all.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[0])
    };
    let columns: [(&str, Ratio); 3] = [
        ("save / plain write", |r| r.plain_write / r.save),
        ("load / plain read, cache", |r| r.plain_cache / r.load_cache),
        ("load / plain read, disk", |r| r.plain_disk / r.load_disk),
    ];
    for (name, f) in columns {
        let (median, worst) = ratio(f);
        println!(
            "{name}: median {median:.2}, worst {worst:.2} over {} rank-rounds",
            all.len()
        );
    }
    for r in 0..N {
        let _ = std::fs::remove_file(dir.join(format!("plain-{r}")));
    }
    if !keep {
        std::fs::remove_dir_all(&dir)?;
    }
    Ok(())
}

fn print_row(round: usize, rank: usize, r: &Row) {
    let mb = |s: f64| r.bytes as f64 / 1e6 / s;
    println!(
        "{round:<5} {rank:<4} {:<6.1} {:<10.0} {:<12.0} {:<6.2} {:<13.0} {:<11.0} {:<6.2} {:<12.0} {:<11.0} {:<6.2} {:.1}",
        r.bytes as f64 / 1e6,
        mb(r.save),
        mb(r.plain_write),
        r.plain_write / r.save,
        mb(r.load_cache),
        mb(r.plain_cache),
        r.plain_cache / r.load_cache,
        mb(r.load_disk),
        mb(r.plain_disk),
        r.plain_disk / r.load_disk,
        mb(r.crc) / 1e3,
    );
}

/// A save into `ckpt`, a plain write of the same bytes, a load and a plain read from the page
/// cache, then both again from the disk.
fn one_round(model: &Gpt, dir: &Path, ckpt: &Path) -> Result<Vec<Row>, Box<dyn std::error::Error>> {
    let barrier = Barrier::new(N);
    let store = DirStorage::new(ckpt)?;
    let zero = ZeroConfig {
        stage: 3,
        ..Default::default()
    };
    let launch = || Topology::single_node(N).map(Launch::new);
    let saves = launch()?.run_with(model, |comm, model| {
        let mut e = ZeroEngine::builder(comm, model)
            .config(zero.clone())
            .build()?;
        e.save(&store, serde_json::json!(null))
    })?;
    let plain = |rank: usize| dir.join(format!("plain-{rank}"));
    let io = |p: &Path, e: std::io::Error| zero_burn::Error::Data(format!("{}: {e}", p.display()));
    // The same bytes, plainly written.
    let writes = launch()?.run(|comm| {
        let path = plain(comm.rank());
        let bytes = vec![0x5au8; saves[comm.rank()].bytes as usize];
        barrier.wait();
        let t = Instant::now();
        let mut f = std::fs::File::create(&path).map_err(|e| io(&path, e))?;
        f.write_all(&bytes)
            .and_then(|()| f.sync_all())
            .map_err(|e| io(&path, e))?;
        Ok(t.elapsed().as_secs_f64())
    })?;
    // A resume: a fresh engine loads; `cold` evicts the checkpoint first.
    let load = |cold: bool| {
        launch()?.run_with(model, |comm, model| {
            let rank = comm.rank();
            let mut e = ZeroEngine::builder(comm, model)
                .config(zero.clone())
                .build()?;
            if cold && rank == 0 {
                evict_dir(ckpt)?;
            }
            barrier.wait();
            let t = Instant::now();
            let loaded = e.load(&store)?;
            assert_eq!(loaded.step, 0);
            Ok(t.elapsed().as_secs_f64())
        })
    };
    // A plain read of the plain file; `cold` evicts it first.
    let read = |cold: bool| {
        launch()?.run(|comm| {
            let path = plain(comm.rank());
            if cold {
                evict(&path).map_err(|e| io(&path, e))?;
            } else {
                // Into the cache first, as a just-written checkpoint is.
                std::fs::read(&path).map_err(|e| io(&path, e))?;
            }
            barrier.wait();
            let t = Instant::now();
            let back = std::fs::read(&path).map_err(|e| io(&path, e))?;
            let secs = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let crc = crc32c::crc32c(&back);
            Ok((secs, t.elapsed().as_secs_f64(), crc))
        })
    };
    let load_cache = load(false)?;
    let plain_cache = read(false)?;
    let load_disk = load(true)?;
    let plain_disk = read(true)?;
    Ok((0..N)
        .map(|r| Row {
            bytes: saves[r].bytes,
            save: saves[r].seconds,
            plain_write: writes[r],
            load_cache: load_cache[r],
            plain_cache: plain_cache[r].0,
            load_disk: load_disk[r],
            plain_disk: plain_disk[r].0,
            crc: plain_disk[r].1,
        })
        .collect())
}

/// Drops `path`'s pages from the page cache (it is synced first, so they are clean), so the next
/// read comes from the disk.
fn evict(path: &Path) -> std::io::Result<()> {
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
fn evict_dir(dir: &Path) -> zero_burn::Result<()> {
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
