//! Codec throughput next to a single-thread memcpy of the same bytes.
//!
//! `cargo bench -p zero-quant --bench codecs`
//!
//! Every group processes a 16 MiB tensor (4 Mi f32 or 8 Mi bf16 elements);
//! throughput is reported in bytes of that *uncompressed* tensor per second,
//! for encode (its input) and decode (its output) alike, so each figure
//! compares directly with the `memcpy` line of its group.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use zero_quant::{BlockCodec, Codec, Element, Int4Block, Int8Block};

#[path = "../tests/common/mod.rs"]
mod common;

const TENSOR_BYTES: usize = 16 << 20;

fn codecs() -> [(&'static str, Codec); 2] {
    [
        ("int8", Codec::from(Int8Block::default())),
        ("int4", Codec::from(Int4Block::default())),
    ]
}

fn bench_dtype<E: Element>(c: &mut Criterion, name: &str) {
    let n = TENSOR_BYTES / E::DTYPE.size_bytes();
    let x: Vec<E> = common::gaussian(n, 7)
        .into_iter()
        .map(E::from_f32)
        .collect();
    let mut g = c.benchmark_group(format!("{name}_16MiB"));
    g.throughput(Throughput::Bytes(TENSOR_BYTES as u64));
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2));

    let mut copy = vec![E::default(); n];
    g.bench_function("memcpy", |b| b.iter(|| copy.copy_from_slice(black_box(&x))));
    black_box(&copy);

    for (cname, codec) in codecs() {
        bench_codec(&mut g, cname, &codec, &x);
    }
    g.finish();
}

fn bench_codec<E: Element>(
    g: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    codec: &Codec,
    x: &[E],
) {
    let n = x.len();
    let mut wire = vec![0u8; codec.encoded_len(n)];
    let mut y = vec![E::default(); n];
    let mut acc = vec![0f32; n];
    codec.encode(x, &mut wire).unwrap();
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());

    g.bench_function(format!("{name}_encode"), |b| {
        b.iter(|| codec.encode(black_box(x), &mut wire).unwrap())
    });
    g.bench_function(format!("{name}_decode"), |b| {
        b.iter(|| codec.decode(black_box(&wire), &mut y).unwrap())
    });
    if E::DTYPE == zero_quant::DType::F32 {
        g.bench_function(format!("{name}_decode_accumulate"), |b| {
            b.iter(|| codec.decode_accumulate(black_box(&wire), &mut acc).unwrap())
        });
    }
    if threads > 1 {
        g.bench_function(format!("{name}_encode_par{threads}"), |b| {
            b.iter(|| codec.encode_par(black_box(x), &mut wire, threads).unwrap())
        });
        g.bench_function(format!("{name}_decode_par{threads}"), |b| {
            b.iter(|| codec.decode_par(black_box(&wire), &mut y, threads).unwrap())
        });
    }
    black_box((&wire, &y, &acc));
}

fn benches(c: &mut Criterion) {
    bench_dtype::<f32>(c, "f32");
    bench_dtype::<bf16>(c, "bf16");
}

criterion_group!(codec_benches, benches);
criterion_main!(codec_benches);
