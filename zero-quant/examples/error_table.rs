//! Relative RMS error and single-thread speed of the codecs per block size,
//! on Gaussian and heavy-tailed data: the measurements behind
//! `DEFAULT_INT8_BLOCK` and `DEFAULT_INT4_BLOCK`.
//!
//! `cargo run -p zero-quant --release --example error_table`
//!
//! Columns: relative RMS error `rms(x - x̂) / rms(x)` of the codec; the same
//! for an asymmetric (min/max, zero-point) reference quantizer with the same
//! bit width, computed here only for comparison (it is not a codec of this
//! crate); wire bytes per element including scales; and encode / decode
//! throughput in GiB/s of f32 tensor bytes (one thread, best of 5).

use std::hint::black_box;
use std::time::Instant;

use zero_quant::{BlockCodec, Codec, Int4Block, Int8Block};

#[path = "../tests/common/mod.rs"]
mod common;

const N: usize = 1 << 22; // 4 Mi elements, 16 MiB of f32

/// Asymmetric min/max quantization with `levels + 1` codes per block,
/// `x̂ = min + q * (max - min) / levels`, for comparison only.
fn asym_rel_rms(x: &[f32], bs: usize, levels: f32) -> f64 {
    let mut y = vec![0f32; x.len()];
    for (xb, yb) in x.chunks(bs).zip(y.chunks_mut(bs)) {
        let lo = xb.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = xb.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let scale = (hi - lo) / levels;
        for (o, &v) in yb.iter_mut().zip(xb) {
            *o = if scale > 0.0 {
                lo + ((v - lo) / scale).round().clamp(0.0, levels) * scale
            } else {
                v
            };
        }
    }
    common::rel_rms(x, &y)
}

fn gbps(mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    (N * 4) as f64 / best / (1u64 << 30) as f64
}

fn main() {
    let data: [(&str, Vec<f32>); 2] = [
        ("gaussian", common::gaussian(N, 1)),
        ("student-t3", common::student_t(N, 3, 2)),
    ];
    println!(
        "| codec | block | data | rel RMS | asym rel RMS | wire B/elem | encode GiB/s | decode GiB/s |"
    );
    println!("|---|---:|---|---:|---:|---:|---:|---:|");
    for (name, levels) in [("int8", 255.0f32), ("int4", 15.0)] {
        for bs in [32usize, 64, 128, 256, 512, 1024, 2048, 4096, 8192] {
            let codec = match name {
                "int8" => Codec::from(Int8Block::new(bs).unwrap()),
                _ => Codec::from(Int4Block::new(bs).unwrap()),
            };
            for (dname, x) in &data {
                let mut w = vec![0u8; codec.encoded_len(N)];
                let mut y = vec![0f32; N];
                codec.encode(x, &mut w).unwrap();
                codec.decode(&w, &mut y).unwrap();
                let err = common::rel_rms(x, &y);
                let asym = asym_rel_rms(x, bs, levels);
                // Speed does not depend on the data; time the Gaussian rows.
                let speed = if *dname == "gaussian" {
                    let enc = gbps(|| codec.encode(black_box(x), &mut w).unwrap());
                    let dec = gbps(|| codec.decode(black_box(&w), &mut y).unwrap());
                    format!("{enc:.1} | {dec:.1}")
                } else {
                    "- | -".to_string()
                };
                println!(
                    "| {name} | {bs} | {dname} | {err:.5} | {asym:.5} | {:.4} | {speed} |",
                    w.len() as f64 / N as f64
                );
            }
        }
    }
}
