//! The host loopback is the oracle: the same calls on the same inputs give the same bits on both
//! backends. Inputs here are adversarial for the shaders' arithmetic: random finite bit patterns
//! (every exponent, subnormals included), values near the subnormal and overflow ends, and sums
//! that land exactly halfway between two representable values (round-to-nearest-even ties).

use half::{bf16, f16};
use zero_comm::{Communicator, ReduceOp};
use zero_core::Topology;

use crate::bits::{nasty, same_bits};
use crate::common::*;
use crate::device::{or_skip, wgpu_world};

const COUNTS: &[usize] = &[1, 2, 5, 300, 1027];

#[test]
fn f32_bits_equal_the_host_loopback() {
    if or_skip().is_none() {
        return;
    }
    for n in [1, 2, 3, 5, 6, 8] {
        same_bits::<_, f32>("wgpu", wgpu_world, n, COUNTS);
    }
}

#[test]
fn bf16_bits_equal_the_host_loopback() {
    if or_skip().is_none() {
        return;
    }
    for n in [1, 2, 3, 6, 7] {
        same_bits::<_, bf16>("wgpu", wgpu_world, n, COUNTS);
    }
}

#[test]
fn f16_bits_equal_the_host_loopback() {
    if or_skip().is_none() {
        return;
    }
    for n in [1, 2, 3, 5, 8] {
        same_bits::<_, f16>("wgpu", wgpu_world, n, COUNTS);
    }
}

/// The inputs reach what they are meant to: subnormals, ties, inexact means and overflow.
#[test]
fn adversarial_inputs_cover_the_edge_cases() {
    let x: Vec<Vec<bf16>> = (0..3).map(|k| nasty::<bf16>(k, 4000, 7)).collect();
    assert!(x[0].iter().any(|v| v.to_f32() != 0.0 && !v.is_normal()));
    let h: Vec<Vec<f16>> = (0..3).map(|k| nasty::<f16>(k, 4000, 7)).collect();
    let sum = reference_reduce(&h, ReduceOp::Sum);
    assert!(sum.iter().any(|v| v.is_infinite()), "no overflow");
    assert!(
        sum.iter().any(|v| v.to_f32() != 0.0 && !v.is_normal()),
        "no subnormal sums"
    );
    let ties = (0..4000)
        .filter(|&i| {
            let exact: f64 = x.iter().map(|r| f64::from(r[i].to_f32())).sum();
            let lo = f64::from(bf16::from_f64(exact).to_f32());
            (exact - lo).abs() * 2.0 == f64::from(bf16::EPSILON) * lo.abs()
        })
        .count();
    assert!(ties > 0, "no rounding ties");
    let f: Vec<Vec<f32>> = (0..3).map(|k| nasty::<f32>(k, 4000, 7)).collect();
    assert!(f[0].iter().any(|v| v.is_subnormal()));
    let mean = reference_reduce(&f, ReduceOp::Mean);
    assert!(mean.iter().any(|v| v.is_subnormal()), "no subnormal means");
}

/// Buffers larger than one 16 MiB window (4 Mi accumulators, 16 MiB of copies) are processed in
/// several dispatches; the seams must not show.
#[test]
fn large_buffers_cross_dispatch_windows() {
    if or_skip().is_none() {
        return;
    }
    let t = Topology::single_node(2).unwrap();
    let body = |mut comm: zero_comm::host::HostComm| big(&mut comm);
    let host = run_ranks(host_world(t), body);
    let wgpu = run_ranks(wgpu_world(t), |mut comm| big(&mut comm));
    assert!(host == wgpu, "large buffers differ between the backends");
}

fn big<C: Communicator>(comm: &mut C) -> Vec<Vec<u32>> {
    let me = comm.rank();
    let c = (4 << 20) + 3;
    let x = values::<bf16>(me, 2 * c + 1, 5);
    let mut y = x.clone();
    comm.all_reduce_host(&mut y, ReduceOp::Mean).unwrap();
    let rs = comm
        .reduce_scatter_host(&x[..2 * c], ReduceOp::Sum)
        .unwrap();
    let bytes = values::<u8>(me, (16 << 20) + 5, 6);
    let ag = comm.all_gather_host(&bytes).unwrap();
    vec![
        y.iter().map(|v| v.bits()).collect(),
        rs.iter().map(|v| v.bits()).collect(),
        ag.iter().map(|&v| u32::from(v)).collect(),
    ]
}
