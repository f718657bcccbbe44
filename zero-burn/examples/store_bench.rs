//! The NVMe store's bandwidth against the disk's own: each round writes `MIB` MiB through the
//! store (4 MiB units, CRC-32C per block, direct IO where the file system allows it) and reads
//! it back, checksums and values checked, then has `dd` write and read a file of the same size
//! in the same folder, in the same blocks and with the same IO mode. It prints each round's
//! ratios (store ÷ dd, in bandwidth) and their medians.
//!
//! `cargo build --release -p zero-burn --example store_bench && $CARGO_TARGET_DIR/release/examples/store_bench [DIR [MIB [ROUNDS]]]`
//! (defaults: a temporary folder under /tmp, 1024 MiB, 3 rounds)

use std::path::Path;
use std::process::Command;
use std::time::Instant;

/// f32 values per unit (4 MiB).
const UNIT: usize = 1 << 20;

/// Seconds `dd` takes for `args`, which must succeed.
fn dd(args: &[String]) -> f64 {
    let t = Instant::now();
    let out = Command::new("dd").args(args).output().expect("dd runs");
    assert!(
        out.status.success(),
        "dd {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    t.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let tmp = tempfile::tempdir().expect("a temporary folder");
    let dir = args.first().map_or(tmp.path(), Path::new);
    let mib: usize = args
        .get(1)
        .map_or(1024, |a| a.parse().expect("MIB: a number"));
    let rounds: usize = args
        .get(2)
        .map_or(3, |a| a.parse().expect("ROUNDS: a number"));
    let units = mib / 4;
    let file = dir.join("dd.bin");
    let mut ratios = (Vec::new(), Vec::new());
    let mut direct = true;
    println!("round  store write / read MB/s   dd write / read MB/s   store/dd write / read");
    for round in 0..rounds {
        let s = zero_burn::time_store(dir, units, UNIT).expect("the store writes and reads");
        direct &= s.direct_io;
        // dd in the store's IO mode, in its blocks.
        let dd_args = |from: String, to: String, flag: &str| {
            let mut a = vec![from, to, "bs=4M".to_string(), format!("count={units}")];
            a.extend(s.direct_io.then(|| format!("{flag}=direct")));
            a
        };
        let path = file.display();
        let w = dd(&dd_args(
            "if=/dev/zero".into(),
            format!("of={path}"),
            "oflag",
        ));
        let r = dd(&dd_args(
            format!("if={path}"),
            "of=/dev/null".into(),
            "iflag",
        ));
        let _ = std::fs::remove_file(&file);
        let mbps = |secs: f64| s.bytes as f64 / secs / 1e6;
        let (ws, rs, wd, rd) = (mbps(s.write_secs), mbps(s.read_secs), mbps(w), mbps(r));
        println!(
            "{round:>5}  {ws:>8.0} / {rs:<8.0}       {wd:>8.0} / {rd:<8.0}      {:.2} / {:.2}",
            ws / wd,
            rs / rd
        );
        ratios.0.push(ws / wd);
        ratios.1.push(rs / rd);
    }
    println!(
        "median store / dd: write {:.2}, read {:.2} ({mib} MiB, {} IO)",
        median(ratios.0),
        median(ratios.1),
        if direct {
            "direct"
        } else {
            "buffered: the file system refuses direct IO"
        }
    );
}
