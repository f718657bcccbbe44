//! Every collective, world sizes 1 to 8, every dtype, lengths including 0 and odd ones.

use half::{bf16, f16};
use zero_comm::ReduceOp;
use zero_core::Topology;

use crate::bodies::collectives::{self as shared, COUNTS, LENS, OPS};
use crate::bodies::{host, stamp};
use crate::common::*;

fn for_worlds(f: impl Fn(Factory<zero_comm::host::HostComm>, Topology)) {
    for n in 1..=8 {
        f(host_world, Topology::single_node(n).unwrap());
    }
}

/// `check::<_, E>(args)` for each listed element type `E`.
macro_rules! each {
    ($check:ident $args:tt: $($e:ty),+) => {{ $( $check::<_, $e> $args; )+ }};
}

/// [`for_worlds`] with each reduction.
fn for_worlds_and_ops(f: impl Fn(Factory<zero_comm::host::HostComm>, Topology, ReduceOp)) {
    for_worlds(|w, t| OPS.into_iter().for_each(|op| f(w, t, op)));
}

#[test]
fn all_gather_every_dtype() {
    for_worlds(|w, t| each!(check_all_gather(w(t), COUNTS): f32, bf16, f16, u8));
}

#[test]
fn reduce_scatter_is_bit_exact() {
    for_worlds_and_ops(|w, t, op| each!(check_reduce_scatter(w(t), COUNTS, op): f32, bf16, f16));
}

#[test]
fn all_reduce_is_bit_exact() {
    for_worlds_and_ops(|w, t, op| each!(check_all_reduce(w(t), LENS, op): f32, bf16, f16));
}

#[test]
fn all_reduce_equals_reduce_scatter_then_all_gather() {
    for_worlds_and_ops(|w, t, op| {
        each!(check_all_reduce_is_rs_ag(w(t), COUNTS, op): f32, bf16, f16);
    });
}

#[test]
fn broadcast_from_every_root() {
    for_worlds(|w, t| each!(check_broadcast(w(t), LENS): f32, bf16, f16, u8));
}

#[test]
fn all_to_all_every_dtype() {
    for_worlds(|w, t| each!(check_all_to_all(w(t), COUNTS): f32, bf16, f16, u8));
}

#[test]
fn barrier_waits_for_everyone() {
    for_worlds(|w, t| check_barrier(w(t)));
}

/// The inputs are chosen so that the bit-exact checks above have teeth: another summation order,
/// or 16-bit accumulation, gives different bits.
#[test]
fn test_inputs_are_order_sensitive() {
    let n = 8;
    let inputs: Vec<Vec<f32>> = (0..n).map(|k| values::<f32>(k, 1000, 7)).collect();
    let forward = reference_reduce(&inputs, ReduceOp::Sum);
    let reversed: Vec<Vec<f32>> = inputs.iter().rev().cloned().collect();
    let backward = reference_reduce(&reversed, ReduceOp::Sum);
    assert!(
        forward
            .iter()
            .zip(&backward)
            .any(|(a, b)| a.to_bits() != b.to_bits())
    );

    let mean = reference_reduce(&inputs, ReduceOp::Mean);
    let times_inv: Vec<f32> = forward.iter().map(|s| s * (1.0 / n as f32)).collect();
    let mean_bits: Vec<u32> = mean.iter().map(|x| x.to_bits()).collect();
    let mul_bits: Vec<u32> = times_inv.iter().map(|x| x.to_bits()).collect();
    // n = 8 is a power of two, so division and multiplication agree; with n = 7 they must not.
    assert_eq!(mean_bits, mul_bits);
    let inputs7 = &inputs[..7];
    let mean7 = reference_reduce(inputs7, ReduceOp::Mean);
    let sum7 = reference_reduce(inputs7, ReduceOp::Sum);
    assert!(
        mean7
            .iter()
            .zip(&sum7)
            .any(|(m, s)| m.to_bits() != (s * (1.0 / 7.0)).to_bits())
    );

    let b: Vec<Vec<bf16>> = (0..n).map(|k| values::<bf16>(k, 1000, 7)).collect();
    let wide = reference_reduce(&b, ReduceOp::Sum);
    let narrow: Vec<bf16> = (0..1000)
        .map(|i| b[1..].iter().fold(b[0][i], |acc, x| acc + x[i]))
        .collect();
    assert!(
        wide.iter()
            .zip(&narrow)
            .any(|(a, b)| a.to_bits() != b.to_bits())
    );
}

stamp! { host, shared:
    upload_into_rewrites_existing_buffers();
}
