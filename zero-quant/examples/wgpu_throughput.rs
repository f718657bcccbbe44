//! Throughput of the WGSL kernels on the default wgpu adapter (lavapipe on a
//! CPU-only machine), on a 16 MiB f32 tensor (4 Mi Gaussian values) with the
//! default block sizes.
//!
//! Buffers stay on the device: each figure is one `encode` / `decode` /
//! `decode_accumulate` call, which records the dispatches, submits and waits
//! for its 16-byte status read-back; the tensor itself is not uploaded or
//! read back. The first call of each op is a warm-up; the median of 7 is
//! printed, as tensor bytes (the f32 side) per second.
//!
//! `cargo run -p zero-quant --features wgpu --example wgpu_throughput`

use std::time::Instant;

use zero_quant::wgpu_kernels::wgpu::{self, util::DeviceExt};
use zero_quant::{BlockCodec, Codec, Int4Block, Int8Block, WgpuQuantizer};

fn main() -> zero_quant::Result<()> {
    let q = WgpuQuantizer::new_default()?;
    let n = 4 << 20;
    let x: Vec<f32> = (0..n)
        .map(|i| ((i as f32) * 0.618).sin() * (1.0 + (i % 97) as f32 * 0.05))
        .collect();
    let dev = q.device();
    let storage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC;
    let input = dev.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: None,
        contents: bytemuck::cast_slice(&x),
        usage: storage,
    });
    let out = dev.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 4 * n as u64,
        usage: storage,
        mapped_at_creation: false,
    });
    let bytes = (4 * n) as f64;
    for (name, codec) in [
        ("int8", Codec::from(Int8Block::default())),
        ("int4", Codec::from(Int4Block::default())),
    ] {
        let wire = dev.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: codec.encoded_len(n) as u64,
            usage: storage,
            mapped_at_creation: false,
        });
        let report = |op: &str, f: &mut dyn FnMut() -> zero_quant::Result<()>| {
            f()?;
            let mut t: Vec<f64> = (0..7)
                .map(|_| {
                    let s = Instant::now();
                    f().map(|()| s.elapsed().as_secs_f64())
                })
                .collect::<zero_quant::Result<_>>()?;
            t.sort_by(f64::total_cmp);
            let m = t[3];
            println!(
                "{:<5} block {:>4} {op:<18} {:8.2} ms {:6.2} GiB/s",
                name,
                codec.block_size(),
                m * 1e3,
                bytes / m / f64::from(1u32 << 30)
            );
            Ok::<(), zero_quant::Error>(())
        };
        report("encode", &mut || q.encode(codec, &input, n, &wire))?;
        report("decode", &mut || q.decode(codec, &wire, n, &out))?;
        report("decode_accumulate", &mut || {
            q.decode_accumulate(codec, &wire, n, &out)
        })?;
    }
    Ok(())
}
