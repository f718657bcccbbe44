//! Checkpoint throughput: a 2-rank stage-3 save and load of a GPT (fp32 weights, AdamW m and v)
//! through `DirStorage`, against a plain `std::fs` write (+ fsync) and read of the same number
//! of bytes by the same two threads, in the same directory. Also the crc32c cost alone.
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
    let rows = Launch::new(Topology::single_node(n)?).run_with(&model, |comm, model| {
        let rank = comm.rank();
        let mut e = ZeroEngine::builder(comm, model)
            .config(ZeroConfig {
                stage: 3,
                ..Default::default()
            })
            .build()?;
        let save = e.save(&store, serde_json::json!(null))?;
        let t = Instant::now();
        let loaded = e.load(&store)?;
        let load_s = t.elapsed().as_secs_f64();
        assert_eq!(loaded.step, 0);
        // The same bytes, plainly.
        let bytes = vec![0x5au8; save.bytes as usize];
        let path = dir.join(format!("plain-{rank}"));
        barrier.wait();
        let t = Instant::now();
        let mut f =
            std::fs::File::create(&path).map_err(|_| zero_burn::Error::Data("create".into()))?;
        f.write_all(&bytes)
            .and_then(|()| f.sync_all())
            .map_err(|_| zero_burn::Error::Data("write".into()))?;
        let plain_w = t.elapsed().as_secs_f64();
        barrier.wait();
        let t = Instant::now();
        let back = std::fs::read(&path).map_err(|_| zero_burn::Error::Data("read".into()))?;
        let plain_r = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let crc = crc32c::crc32c(&back);
        let crc_s = t.elapsed().as_secs_f64();
        Ok((
            rank,
            save.bytes,
            save.seconds,
            load_s,
            plain_w,
            plain_r,
            crc_s,
            crc,
        ))
    })?;
    let mb = |b: u64, s: f64| b as f64 / 1e6 / s;
    println!(
        "rank  MB     save MB/s  plain write MB/s  ratio  load MB/s  plain read MB/s  ratio  crc32c GB/s"
    );
    for (rank, bytes, save, load, pw, pr, crc, _) in rows {
        println!(
            "{rank:<5} {:<6.1} {:<10.0} {:<17.0} {:<6.2} {:<10.0} {:<16.0} {:<6.2} {:.1}",
            bytes as f64 / 1e6,
            mb(bytes, save),
            mb(bytes, pw),
            pw / save,
            mb(bytes, load),
            mb(bytes, pr),
            pr / load,
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
