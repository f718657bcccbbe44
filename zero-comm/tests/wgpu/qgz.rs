//! qgZ on wgpu buffers (`quantized::qgz_reduce_scatter_device` with the WGSL codecs) against the
//! host path (`quantized::qgz_reduce_scatter`) on the host loopback: results bit for bit, errors
//! word for word, and the same bytes in the sub-groups' traffic tables.

use zero_comm::quantized::{QuantGroups, qgz_reduce_scatter_device};
use zero_comm::wgpu_loopback::{WgpuBuffer, WgpuComm};
use zero_comm::{Communicator, Error};
use zero_quant::{Codec, Identity, Int4Block, Int8Block, WgpuQuantizer};

use crate::common::*;
use crate::device::{or_skip, wgpu_world};
use crate::quant_common::compare_qgz;

/// `(N, L)`: one rank; L = 2, M = 1; L = 1, M = 2; 2 nodes × 2; 3 × 1; 1 × 3; 2 nodes × 3.
const SHAPES: [(usize, usize); 7] = [(1, 1), (2, 2), (2, 1), (4, 2), (3, 3), (3, 1), (6, 3)];

fn codecs() -> [Codec; 3] {
    [
        Int4Block::default().into(),
        Int4Block::new(6).unwrap().into(),
        Int8Block::new(7).unwrap().into(),
    ]
}

fn quantizer() -> WgpuQuantizer {
    let device = or_skip().expect("checked by the caller");
    WgpuQuantizer::new(device.device().clone(), device.queue().clone()).unwrap()
}

/// Moves `x` into a buffer of its own at element offset `shift` (a view that does not start at
/// byte 0, as a tensor of a burn-wgpu pool is), or into a fresh buffer when `shift` is 0.
fn place(comm: &WgpuComm, x: &[f32], shift: usize) -> WgpuBuffer<f32> {
    if shift == 0 {
        return comm.upload(x).unwrap();
    }
    let (buffer, _, _) = comm.alloc::<f32>(x.len() + 2 * shift).unwrap().into_parts();
    let mut view = comm.wrap(buffer, 4 * shift as u64, x.len()).unwrap();
    comm.upload_into(x, &mut view).unwrap();
    view
}

/// Runs qgZ on both paths for a world of `n` ranks on nodes of `l`, every rank's input being
/// `input(rank)` of `n·c` elements placed at element `shift` of its buffer, compares every rank's
/// outcome and returns the host's.
fn compare(
    n: usize,
    l: usize,
    c: usize,
    codec: Codec,
    shift: usize,
    input: impl Fn(usize) -> Vec<f32> + Sync,
) -> Vec<Result<Vec<f32>, String>> {
    let at = |comm: &WgpuComm, x: &[f32]| place(comm, x, shift);
    compare_qgz(
        wgpu_world(topo(n, l)),
        &quantizer(),
        (l, c),
        codec,
        at,
        input,
    )
}

#[test]
fn qgz_on_wgpu_buffers_matches_the_host_path() {
    if or_skip().is_none() {
        return;
    }
    for (n, l) in SHAPES {
        for codec in codecs() {
            for c in [0, 1, 5, 100, 700] {
                let host = compare(n, l, c, codec, 0, |r| values::<f32>(r, n * c, c as u64));
                assert!(host.iter().all(Result::is_ok), "{host:?}");
            }
        }
        // Views that do not start at byte 0 of their buffers.
        compare(n, l, 33, Int4Block::new(8).unwrap().into(), 3, |r| {
            values::<f32>(r, n * 33, 5)
        });
    }
}

#[test]
fn qgz_on_wgpu_buffers_fails_like_the_host_path() {
    if or_skip().is_none() {
        return;
    }
    let codec: Codec = Int4Block::new(16).unwrap().into();
    let c = 40;
    for (n, l) in SHAPES {
        // A non-finite element on the last rank, in every destination's chunk in turn: every rank
        // fails naming it (with N = 1, that rank alone, as the host's finiteness check does).
        let bad = n - 1;
        for p in 0..n {
            for value in [f32::NAN, f32::INFINITY] {
                let host = compare(n, l, c, codec, 0, |r| {
                    let mut x = values::<f32>(r, n * c, 3);
                    if r == bad {
                        x[p * c + 17] = value;
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
        }
        // Sums that overflow f32: with L > 1 and M > 1 the node partials cannot be re-encoded
        // (every rank fails naming the first rank that saw it); otherwise each rank's final sum
        // overflows, which only the owner of the chunk sees.
        let host = compare(n, l, c, codec, 0, |r| {
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

#[test]
fn qgz_on_wgpu_buffers_validates_like_the_host_path() {
    if or_skip().is_none() {
        return;
    }
    let q = quantizer();
    let results = run_ranks(wgpu_world(topo(2, 1)), |mut world| {
        let mut groups = QuantGroups::new(&mut world).unwrap();
        let x = world.upload(&[1.0f32; 5]).unwrap();
        let mut out = world.alloc::<f32>(2).unwrap();
        let odd = qgz_reduce_scatter_device(&mut groups, &q, Int4Block::default(), &x, &mut out);
        let x = world.upload(&[1.0f32; 6]).unwrap();
        let short = qgz_reduce_scatter_device(&mut groups, &q, Int4Block::default(), &x, &mut out);
        let mut out = world.alloc::<f32>(3).unwrap();
        let identity = qgz_reduce_scatter_device(&mut groups, &q, Identity, &x, &mut out);
        // The groups are still usable.
        let ok = qgz_reduce_scatter_device(&mut groups, &q, Int4Block::default(), &x, &mut out);
        (odd, short, identity, ok, groups.traffic().calls())
    });
    for (odd, short, identity, ok, calls) in results {
        assert!(
            matches!(
                odd,
                Err(Error::LengthMismatch {
                    expected: 6,
                    got: 5,
                    ..
                })
            ),
            "{odd:?}"
        );
        assert!(
            matches!(
                short,
                Err(Error::LengthMismatch {
                    expected: 3,
                    got: 2,
                    ..
                })
            ),
            "{short:?}"
        );
        assert!(matches!(identity, Err(Error::Backend(_))), "{identity:?}");
        ok.unwrap();
        assert_eq!(calls, 1, "only the valid call moved anything");
    }
}
