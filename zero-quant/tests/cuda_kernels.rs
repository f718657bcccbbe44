//! The CUDA kernels (feature `cuda`) against the host codecs, bit for bit: wire bytes, decoded
//! values, accumulated values and errors, for f32, bf16 and f16 tensors.
//!
//! They need a GPU (compute capability 8.0+): they are compiled only with the `gpu-tests`
//! feature (so they never pass vacuously elsewhere) and run with `ZERO_GPU_TESTS=1` (what
//! `cargo xtask gpu-check` sets), where a missing device fails them; without it they record that
//! they did not run. Each test that passes appends its name to the gpu-check cookie
//! (`$ZERO_GPU_COOKIE`, else `<target dir>/.gpu_tests_ran`), which gpu-check reads as proof.
#![cfg(feature = "gpu-tests")]

mod common;

use std::sync::OnceLock;

use common::Rng;
use common::device::{self, DeviceCodec};
use half::{bf16, f16};
use zero_quant::cuda::CudaElement;
use zero_quant::{BlockCodec, Codec, CudaQuantizer, Error, Identity, Int4Block, Int8Block};
use zero_testkit::cookie::passed;

/// One quantizer on device 0, shared by every test of this binary. With `ZERO_GPU_TESTS=1` a
/// missing driver or device is a failure; without it the test records that it did not run.
fn gpu(test: &str) -> Option<&'static CudaQuantizer> {
    static Q: OnceLock<Result<CudaQuantizer, String>> = OnceLock::new();
    if !zero_testkit::cookie::gpu_tests() {
        zero_testkit::record_skip!(
            test,
            "ZERO_GPU_TESTS=1 is not set (cargo xtask gpu-check sets it)",
        );
        return None;
    }
    match Q.get_or_init(|| CudaQuantizer::on_device(0).map_err(|e| e.to_string())) {
        Ok(q) => Some(q),
        Err(e) => panic!("ZERO_GPU_TESTS=1 but CUDA device 0 cannot be used: {e}"),
    }
}

impl DeviceCodec for CudaQuantizer {
    fn encode(&self, c: Codec, x: &[f32]) -> zero_quant::Result<Vec<u8>> {
        self.encode_host(c, x)
    }
    fn decode(&self, c: Codec, wire: &[u8], n: usize) -> zero_quant::Result<Vec<f32>> {
        self.decode_host(c, wire, n)
    }
    fn accumulate(&self, c: Codec, wire: &[u8], acc: &mut [f32]) -> zero_quant::Result<()> {
        self.decode_accumulate_host(c, wire, acc)
    }
}

device::stamp!("cuda_", gpu, passed;
    encode_decode_accumulate_match_host_bit_for_bit,
    every_length_up_to_70_with_small_blocks,
    hand_computed_int4_wire,
    non_finite_input_reports_the_first_index,
    corrupt_wires_give_the_host_errors,
);

/// bf16 or f16 in and out: the same wire as the host from the same 16-bit tensor, and the same
/// 16-bit values (or the same overflow error) when decoding any wire into 16 bits.
fn half_case<E: CudaElement + PartialEq + std::fmt::Debug>(q: &CudaQuantizer, c: Codec, x: &[f32]) {
    let xe: Vec<E> = x.iter().map(|&v| E::from_f32(v)).collect();
    let ctx = format!("{c:?} {:?} n={}", E::DTYPE, x.len());
    let mut host = vec![0u8; c.encoded_len(x.len())];
    let h = c.encode(&xe, &mut host);
    let d = q.encode_host(c, &xe);
    match (d, h) {
        (Ok(d), Ok(())) => assert_eq!(d, host, "{ctx}: wire"),
        (Err(d), Err(h)) => return device::same_error(d, h),
        (d, h) => panic!("{ctx}: device {d:?}, host {h:?}"),
    }
    // Decode a wire made from the f32 tensor into 16 bits: values or overflow errors agree.
    let wire32 = device::host_encode(c, x).unwrap();
    for wire in [&host, &wire32] {
        let mut y = vec![E::from_f32(0.0); x.len()];
        let h = c.decode(wire, &mut y);
        let d = q.decode_host::<E>(c, wire, x.len());
        match (d, h) {
            (Ok(d), Ok(())) => {
                let same = d
                    .iter()
                    .zip(&y)
                    .all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits());
                assert!(same, "{ctx}: decoded values differ");
            }
            (Err(d), Err(h)) => device::same_error(d, h),
            (d, h) => panic!("{ctx}: decode device {d:?}, host {h:?}"),
        }
    }
}

#[test]
fn bf16_and_f16_tensors_match_host_bit_for_bit() {
    let Some(q) = gpu("cuda_bf16_and_f16_tensors_match_host_bit_for_bit") else {
        return;
    };
    let mut cases = 0;
    for (ci, c) in device::codecs().into_iter().enumerate() {
        for (di, dist) in device::DISTS.iter().enumerate() {
            let n = device::LENS[(ci * 5 + di * 3) % device::LENS.len()];
            let x = device::data(dist, n, (ci * 100 + di) as u64);
            half_case::<bf16>(q, c, &x);
            half_case::<f16>(q, c, &x);
            cases += 2;
        }
    }
    eprintln!("{cases} bf16/f16 cases");
    passed("cuda_bf16_and_f16_tensors_match_host_bit_for_bit");
}

#[test]
fn a_large_tensor_matches_the_host_and_reports_throughput() {
    let Some(q) = gpu("cuda_a_large_tensor_matches_the_host_and_reports_throughput") else {
        return;
    };
    let n = 64 << 20; // 256 MiB of f32
    let mut r = Rng::new(11);
    let x: Vec<f32> = (0..n).map(|_| r.normal() as f32).collect();
    for c in [
        Codec::from(Int8Block::default()),
        Codec::from(Int4Block::default()),
    ] {
        let s = q.stream();
        let src = s.clone_htod(&x).unwrap();
        let mut wire = s.alloc_zeros::<u8>(c.encoded_len(n)).unwrap();
        let mut y = s.alloc_zeros::<f32>(n).unwrap();
        q.encode(c, &src, &mut wire).unwrap();
        q.decode(c, &wire, &mut y).unwrap();
        let iters = 10;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            q.encode(c, &src, &mut wire).unwrap();
        }
        let enc = t.elapsed().as_secs_f64() / iters as f64;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            q.decode(c, &wire, &mut y).unwrap();
        }
        let dec = t.elapsed().as_secs_f64() / iters as f64;
        let gbps = |s: f64| (4 * n) as f64 / s / 1e9;
        let name = if matches!(c, Codec::Int8(_)) {
            "int8"
        } else {
            "int4"
        };
        println!(
            "ZERO_GPU_QUANT codec={name} n={n} encode_gbps={:.1} decode_gbps={:.1}",
            gbps(enc),
            gbps(dec)
        );
        let wire_d = s.clone_dtoh(&wire).unwrap();
        let host = device::host_encode(c, &x).unwrap();
        assert!(
            wire_d == host,
            "{c:?}: the 256 MiB wire differs from the host's"
        );
        let yd = s.clone_dtoh(&y).unwrap();
        let mut yh = vec![0f32; n];
        c.decode(&host, &mut yh).unwrap();
        assert!(
            device::bits(&yd) == device::bits(&yh),
            "{c:?}: decoded values differ"
        );
    }
    passed("cuda_a_large_tensor_matches_the_host_and_reports_throughput");
}

#[test]
fn buffers_and_codecs_are_checked() {
    let Some(q) = gpu("cuda_buffers_and_codecs_are_checked") else {
        return;
    };
    let c = Int8Block::new(8).unwrap();
    let s = q.stream();
    let x = s.alloc_zeros::<f32>(100).unwrap();
    let mut small = s.alloc_zeros::<u8>(16).unwrap();
    assert!(matches!(
        q.encode(c, &x, &mut small),
        Err(Error::BufferLen {
            expected: 152,
            got: 16,
            ..
        })
    ));
    let mut y = s.alloc_zeros::<f32>(100).unwrap();
    assert!(matches!(
        q.decode(c, &small, &mut y),
        Err(Error::BufferLen { .. })
    ));
    assert!(matches!(
        q.encode_host(Identity, &[1.0f32]),
        Err(Error::Cuda(_))
    ));
    assert_eq!(q.encode_host(c, &[] as &[f32]).unwrap(), Vec::<u8>::new());
    // A wire at an odd device address is refused, not misread.
    let mut big = s.alloc_zeros::<u8>(200).unwrap();
    let mut view = big.slice_mut(1..153);
    assert!(matches!(q.encode(c, &x, &mut view), Err(Error::Cuda(_))));
    passed("cuda_buffers_and_codecs_are_checked");
}
