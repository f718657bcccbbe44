//! The device forms of qwZ and qgZ (`quantized::{qwz_all_gather_device,
//! qgz_reduce_scatter_device}`), written once over `DeviceCodec`, run with the host codecs
//! (`HostCodec`) on the host loopback against the host path: results bit for bit, errors word for
//! word and traffic byte for byte, for f32, bf16 and f16 and every codec. The wgpu loopback runs
//! the same bodies with its WGSL kernels (`tests/wgpu/{qwz,qgz}.rs`).

use half::{bf16, f16};
use zero_comm::Communicator;
use zero_comm::host::HostComm;
use zero_comm::quantized::{HostCodec, QuantElement};
use zero_quant::{Codec, Identity, Int4Block, Int8Block};

use crate::common::{Val, host_world, topo, values};
use crate::quant_common::{compare_qgz, compare_qwz};

/// `(N, L)`: one rank; L = 2, M = 1; L = 1, M = 2; 2 nodes × 2; 3 × 1; 1 × 3; 2 nodes × 3.
const SHAPES: [(usize, usize); 7] = [(1, 1), (2, 2), (2, 1), (4, 2), (3, 3), (3, 1), (6, 3)];

fn codecs() -> [Codec; 4] {
    [
        Int4Block::default().into(),
        Int4Block::new(6).unwrap().into(),
        Int8Block::new(7).unwrap().into(),
        Identity.into(),
    ]
}

fn place<E: Val>(comm: &HostComm, x: &[E]) -> zero_comm::host::HostBuffer<E> {
    comm.upload(x).unwrap()
}

fn qgz<E: Val + QuantElement>(
    (n, l, c): (usize, usize, usize),
    codec: Codec,
    input: impl Fn(usize) -> Vec<E> + Sync,
) -> Vec<Result<Vec<E>, String>> {
    compare_qgz(
        host_world(topo(n, l)),
        &HostCodec,
        (l, c),
        codec,
        place,
        input,
    )
}

#[test]
fn the_device_qgz_algorithm_matches_the_host_path() {
    for (n, l) in SHAPES {
        for codec in codecs() {
            for c in [0, 1, 5, 100] {
                let f = qgz((n, l, c), codec, |r| values::<f32>(r, n * c, c as u64));
                let b = qgz((n, l, c), codec, |r| values::<bf16>(r, n * c, 1));
                let h = qgz((n, l, c), codec, |r| values::<f16>(r, n * c, 2));
                assert!(f.iter().all(Result::is_ok), "{f:?}");
                assert!(b.iter().all(Result::is_ok) && h.iter().all(Result::is_ok));
            }
        }
    }
}

#[test]
fn the_device_qgz_algorithm_fails_like_the_host_path() {
    let c = 40;
    for (n, l) in SHAPES {
        for codec in codecs() {
            // A non-finite element on the last rank, in every destination's chunk in turn: every
            // rank fails naming it (with N = 1, that rank alone).
            let bad = n - 1;
            for p in 0..n {
                let host = qgz((n, l, c), codec, |r| {
                    let mut x = values::<f32>(r, n * c, 3);
                    if r == bad {
                        x[p * c + 17] = f32::NAN;
                    }
                    x
                });
                let named = format!("failed_rank: {bad},");
                assert!(
                    host.iter()
                        .all(|h| h.as_ref().is_err_and(|e| e.contains(&named))),
                    "N={n} L={l}: {host:?}"
                );
            }
            // Sums that overflow f32: every rank fails (with N = 1 nothing is summed).
            let host = qgz((n, l, c), codec, |r| {
                let mut x = values::<f32>(r, n * c, 4);
                for v in x.iter_mut().skip(5).step_by(7) {
                    *v = 3.0e38;
                }
                x
            });
            let failed = host.iter().filter(|h| h.is_err()).count();
            assert_eq!(failed, if n == 1 { 0 } else { n }, "N={n} L={l}: {host:?}");
        }
    }
}

#[test]
fn the_device_qwz_algorithm_matches_the_host_path() {
    for codec in codecs() {
        for n in [1, 2, 3] {
            let world = || host_world(topo(n, n));
            for c in [0, 1, 5, 100] {
                let f = compare_qwz(world(), &HostCodec, c, codec, place, |r| {
                    values::<f32>(r, c, c as u64)
                });
                assert!(f.iter().all(Result::is_ok), "{f:?}");
                compare_qwz(world(), &HostCodec, c, codec, place, |r| {
                    values::<bf16>(r, c, 5)
                });
            }
            // Rank 1's non-finite element: every rank fails naming rank 1, as on the host.
            if n > 1 {
                let host = compare_qwz(world(), &HostCodec, 100, codec, place, |r| {
                    let mut x = values::<f32>(r, 100, 6);
                    if r == 1 {
                        x[37] = f32::INFINITY;
                    }
                    x
                });
                assert!(
                    host.iter()
                        .all(|h| h.as_ref().is_err_and(|e| e.contains("failed_rank: 1,"))),
                    "{host:?}"
                );
            }
        }
    }
}
