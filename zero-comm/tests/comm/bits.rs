//! Adversarial inputs and a fixed script of collectives, run on a device loopback and on the host
//! loopback, compared bit for bit: random finite bit patterns (every exponent, subnormals
//! included), values near the subnormal and overflow ends, and sums that land exactly halfway
//! between two representable values (round-to-nearest-even ties). Shared by the wgpu and CUDA
//! loopbacks' tests.

use half::{bf16, f16};
use zero_comm::{Communicator, ReduceOp};
use zero_core::Topology;

use crate::common::*;

/// Element types with their raw bit patterns, for generating adversarial inputs.
pub(crate) trait Bits: Val {
    /// Mantissa bits (without the implicit one).
    const MANT: u32;
    /// Total bits.
    const WIDTH: u32;
    fn from_bits(bits: u32) -> Self;
}

impl Bits for f32 {
    const MANT: u32 = 23;
    const WIDTH: u32 = 32;
    fn from_bits(bits: u32) -> Self {
        f32::from_bits(bits)
    }
}

impl Bits for bf16 {
    const MANT: u32 = 7;
    const WIDTH: u32 = 16;
    fn from_bits(bits: u32) -> Self {
        bf16::from_bits(bits as u16)
    }
}

impl Bits for f16 {
    const MANT: u32 = 10;
    const WIDTH: u32 = 16;
    fn from_bits(bits: u32) -> Self {
        f16::from_bits(bits as u16)
    }
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Finite values of four kinds, chosen per element: random bit patterns; tiny (subnormal or
/// nearly); sums of `1 + k·2^-(MANT+1)` that hit rounding ties; the tests' usual mixed values.
pub(crate) fn nasty<E: Bits>(rank: usize, len: usize, salt: u64) -> Vec<E> {
    let exp_bits = E::WIDTH - 1 - E::MANT;
    let exp_mask = ((1u32 << exp_bits) - 1) << E::MANT;
    let usual = values::<E>(rank, len, salt);
    (0..len)
        .map(|i| {
            let h = mix(salt.wrapping_mul(31) ^ ((rank as u64) << 40) ^ i as u64);
            let sign = ((h >> 62) as u32 & 1) << (E::WIDTH - 1);
            let r = h as u32 & ((1u64 << E::WIDTH) - 1) as u32;
            match (h >> 56) % 4 {
                0 => {
                    // Random bits, but never infinity or NaN.
                    let bits = if r & exp_mask == exp_mask {
                        r & !(1 << E::MANT)
                    } else {
                        r
                    };
                    E::from_bits(bits)
                }
                1 => {
                    // Biased exponent 0..=2: subnormals and the smallest normals.
                    let e = ((h >> 40) % 3) as u32;
                    E::from_bits(sign | (e << E::MANT) | (r & ((1 << E::MANT) - 1)))
                }
                2 => {
                    let k = ((h >> 44) % 4) as f32;
                    let x = 1.0 + k * 2f32.powi(-(E::MANT as i32) - 1);
                    E::from_f32(if sign == 0 { x } else { -x / 2.0 })
                }
                _ => usual[i],
            }
        })
        .collect()
}

/// Runs a fixed script of collectives on `comm` and returns every output's bits.
pub(crate) fn script<C: Communicator, E: Bits>(
    comm: &mut C,
    counts: &[usize],
) -> Vec<(String, Vec<u32>)> {
    let (n, me) = (comm.world_size(), comm.rank());
    let mut out = Vec::new();
    let mut keep = |what: String, v: Vec<E>| out.push((what, v.iter().map(|x| x.bits()).collect()));
    for (t, &c) in counts.iter().enumerate() {
        let salt = 1000 + t as u64;
        for op in [ReduceOp::Sum, ReduceOp::Mean] {
            let x = nasty::<E>(me, n * c, salt);
            keep(
                format!("reduce_scatter {op} c={c}"),
                comm.reduce_scatter_host(&x, op).unwrap(),
            );
            let mut y = nasty::<E>(me, n * c + 1, salt + 1);
            comm.all_reduce_host(&mut y, op).unwrap();
            keep(format!("all_reduce {op} len={}", n * c + 1), y);
        }
        let x = nasty::<E>(me, c, salt + 2);
        keep(
            format!("all_gather c={c}"),
            comm.all_gather_host(&x).unwrap(),
        );
        let mut y = nasty::<E>(me, c + 1, salt + 3);
        comm.broadcast_host(&mut y, n - 1).unwrap();
        keep(format!("broadcast len={}", c + 1), y);
        let x = nasty::<E>(me, n * c, salt + 4);
        keep(
            format!("all_to_all c={c}"),
            comm.all_to_all_host(&x).unwrap(),
        );
    }
    out
}

/// Runs [`script`] on the host loopback and on `device`'s worlds (`name` in messages) and compares
/// every output of every rank.
pub(crate) fn same_bits<C: Communicator, E: Bits>(
    name: &str,
    device: impl Fn(Topology) -> Vec<C>,
    world: usize,
    counts: &[usize],
) {
    let t = Topology::single_node(world).unwrap();
    let host = run_ranks(host_world(t), |mut c| script::<_, E>(&mut c, counts));
    let dev = run_ranks(device(t), |mut c| script::<_, E>(&mut c, counts));
    for (rank, (h, w)) in host.iter().zip(&dev).enumerate() {
        assert_eq!(h.len(), w.len());
        for ((what, hb), (_, wb)) in h.iter().zip(w) {
            if let Some(i) = (0..hb.len()).find(|&i| hb[i] != wb[i]) {
                panic!(
                    "{} n={world} rank {rank} {what}: element {i} is {:#x} on {name}, {:#x} on host",
                    E::DTYPE,
                    wb[i],
                    hb[i]
                );
            }
            assert_eq!(hb.len(), wb.len(), "{what}");
        }
    }
}
