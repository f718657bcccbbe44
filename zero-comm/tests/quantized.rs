//! Tests of the quantized collectives (qwZ, qgZ) on the host loopback.
//!
//! Invariants I9/I10 of the design spec: error bounds, the mean (not `L ×` the mean), placement
//! (the swizzle composed with the two all-to-alls), exact equality with the unquantized
//! collectives under the identity codec, and byte accounting equal to zero-core's predictions.

use std::thread;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use zero_comm::host::{HostComm, HostLoopback};
use zero_comm::quantized::{
    ErrorFeedback, QuantElement, QuantGroups, QuantScratch, qgz_reduce_scatter,
    qgz_reduce_scatter_ef, qwz_all_gather,
};
use zero_comm::{Communicator, Error, ReduceOp};
use zero_core::quant_wire::{int4_wire_len, int8_wire_len};
use zero_core::{
    Collective, CollectiveTraffic, ModelDesc, Payload, Phase, Plan, Topology, TrafficTable,
    UnitKind, ZeroConfig,
};
use zero_quant::{BlockCodec, Identity, Int4Block, Int8Block};

const TIMEOUT: Duration = Duration::from_secs(20);

/// `(N, L)` combinations: N = 2, 4, 8 with 1, 2 and 4 ranks per node where they divide N.
const SHAPES: [(usize, usize); 8] = [
    (2, 1),
    (2, 2),
    (4, 1),
    (4, 2),
    (4, 4),
    (8, 1),
    (8, 2),
    (8, 4),
];

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// SplitMix64: deterministic, dependency-free.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1).
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn gauss(&mut self) -> f32 {
        let (u, v) = (self.unit(), self.unit());
        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
    }
    fn int(&mut self, lo: i64, hi: i64) -> f32 {
        (lo + (self.next_u64() % (hi - lo + 1) as u64) as i64) as f32
    }
}

/// Gaussian data whose scale changes every 37 elements (so blocks have different absmaxes).
fn gaussian(seed: u64, len: usize) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..len)
        .map(|i| r.gauss() * 10f32.powi((i / 37 % 5) as i32 - 2))
        .collect()
}

/// The same f32 values, bit for bit.
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn topo(n: usize, l: usize) -> Topology {
    Topology::new(n, l).unwrap()
}

/// Runs `f` on every rank; panics naming the ranks that panicked.
fn launch<R: Send>(t: Topology, f: impl Fn(HostComm) -> R + Sync) -> Vec<R> {
    HostLoopback::launch(t, TIMEOUT, f)
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|_| panic!("rank {r} panicked")))
        .collect()
}

/// zero-quant's per-element bound for one round trip through a block of absmax `a`.
fn beta(a: f32, qmax: f32) -> f32 {
    a / (2.0 * qmax) + 1e-6 * a + (qmax + 1.0) * 2f32.powi(-149)
}

/// Absmax of the block (of `block` elements, from element 0 of `x`) holding each element.
fn block_absmax(x: &[f32], block: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for b in x.chunks(block) {
        let a = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        out.extend(std::iter::repeat_n(a, b.len()));
    }
    out
}

fn delta(after: &TrafficTable, before: &TrafficTable, c: Collective) -> CollectiveTraffic {
    after
        .since(before)
        .by_collective
        .get(&c)
        .copied()
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// Wire sizes: the plan's formulas against the codecs
// ---------------------------------------------------------------------------------------------

#[test]
fn plan_wire_lengths_equal_codec_encoded_len() {
    let mut ns: Vec<usize> = (0..600).collect();
    ns.extend([
        1023, 1024, 1025, 4095, 4097, 65_535, 65_536, 1_000_003, 12_582_912,
    ]);
    for block in [
        2usize, 4, 6, 8, 32, 64, 100, 256, 512, 1000, 1024, 2048, 4096,
    ] {
        let i8c = Int8Block::new(block).unwrap();
        let i4c = Int4Block::new(block).unwrap();
        for &n in &ns {
            let (n64, b64) = (n as u64, block as u64);
            assert_eq!(
                int8_wire_len(n64, b64),
                i8c.encoded_len(n) as u64,
                "int8 n={n} block={block}"
            );
            assert_eq!(
                int4_wire_len(n64, b64),
                i4c.encoded_len(n) as u64,
                "int4 n={n} block={block}"
            );
        }
    }
    // Odd int8 block sizes too (int4 needs even ones).
    for block in [1usize, 3, 7, 999] {
        let i8c = Int8Block::new(block).unwrap();
        for n in 0..300 {
            assert_eq!(
                int8_wire_len(n as u64, block as u64),
                i8c.encoded_len(n) as u64
            );
        }
    }
}

#[test]
fn wire_bytes_are_half_and_quarter_of_fp16_plus_scales() {
    for block in [64u64, 256, 512, 1024, 2048] {
        for n in [4096u64, 1 << 20, 3 << 20] {
            let fp16 = 2 * n;
            let i8 = int8_wire_len(n, block);
            let i4 = int4_wire_len(n, block);
            let scales = 4 * n.div_ceil(block);
            // Exact decomposition: payload (padded to 4) + one f32 per block.
            assert_eq!(i8, n.next_multiple_of(4) + scales);
            assert_eq!(i4, n.div_ceil(2).next_multiple_of(4) + scales);
            let (r8, r4) = (i8 as f64 / fp16 as f64, i4 as f64 / fp16 as f64);
            let s = scales as f64 / fp16 as f64;
            assert!(
                (r8 - (0.5 + s)).abs() < 1e-9,
                "int8 ratio {r8} block {block}"
            );
            assert!(
                (r4 - (0.25 + s)).abs() < 1e-9,
                "int4 ratio {r4} block {block}"
            );
            assert!(s <= 2.0 / block as f64 + 1e-12);
        }
    }
    // The defaults: within 0.4% and 1.6% of ½ and ¼.
    let n = 1u64 << 24;
    let r8 = int8_wire_len(n, 1024) as f64 / (2 * n) as f64;
    let r4 = int4_wire_len(n, 512) as f64 / (2 * n) as f64;
    assert!(r8 > 0.5 && r8 < 0.5 * 1.004, "{r8}");
    assert!(r4 > 0.25 && r4 < 0.25 * 1.016, "{r4}");
}

// ---------------------------------------------------------------------------------------------
// qwZ
// ---------------------------------------------------------------------------------------------

const QWZ_CHUNKS: [usize; 6] = [1, 63, 64, 65, 200, 1000];

#[test]
fn qwz_matches_all_gather_within_bound_and_bytes() {
    let block = 64;
    let codec = Int8Block::new(block).unwrap();
    for (n, l) in SHAPES {
        let outs = launch(topo(n, l), |mut comm| {
            let me = comm.rank();
            let mut scratch = QuantScratch::new();
            let mut results = Vec::new();
            for &c in &QWZ_CHUNKS {
                let chunk = gaussian((me * 1000 + c) as u64, c);
                let exact = comm.all_gather_host(&chunk).unwrap();
                let before = comm.traffic().clone();
                let mut out = vec![f32::NAN; n * c];
                qwz_all_gather(&mut comm, &codec, &chunk, &mut out, &mut scratch).unwrap();
                // Bytes: exactly one all-gather of the plan's int8 wire length.
                let measured = delta(comm.traffic(), &before, Collective::AllGather);
                let planned = comm
                    .group_view()
                    .all_gather(int8_wire_len(c as u64, block as u64), 1);
                assert_eq!(measured, planned, "N={n} L={l} c={c}");
                assert_eq!(comm.traffic().since(&before).calls(), 1);
                // Error bound per element, from the owner's block absmax.
                for k in 0..n {
                    let x = &exact[k * c..(k + 1) * c];
                    let a = block_absmax(x, block);
                    for i in 0..c {
                        let err = (out[k * c + i] - x[i]).abs();
                        assert!(
                            err <= beta(a[i], 127.0),
                            "N={n} L={l} c={c} rank {k} elem {i}: |{} - {}| = {err} > {}",
                            out[k * c + i],
                            x[i],
                            beta(a[i], 127.0)
                        );
                    }
                }
                results.push(out);
            }
            results
        });
        // Every rank holds the same dequantized weights, bit for bit (the owner included).
        for r in 1..n {
            for (a, b) in outs[0].iter().zip(&outs[r]) {
                assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
            }
        }
    }
}

#[test]
fn qwz_identity_equals_all_gather_bitwise() {
    for (n, l) in [(4, 2), (8, 4)] {
        launch(topo(n, l), |mut comm| {
            let me = comm.rank();
            let mut scratch = QuantScratch::new();
            for c in [0usize, 1, 17, 300] {
                let chunk = gaussian(me as u64 + 7, c);
                let exact = comm.all_gather_host(&chunk).unwrap();
                let mut out = vec![0f32; n * c];
                qwz_all_gather(&mut comm, &Identity, &chunk, &mut out, &mut scratch).unwrap();
                assert!(same_bits(&out, &exact));
            }
        });
    }
}

#[test]
fn qwz_keeps_bf16_and_f16() {
    launch(topo(4, 2), |mut comm| {
        let src = gaussian(comm.rank() as u64 + 99, 101);
        // u: the type's unit roundoff; tiny: its smallest subnormal.
        qwz_half(
            &mut comm,
            &src,
            bf16::from_f32,
            2f32.powi(-8),
            2f32.powi(-133),
        );
        qwz_half(
            &mut comm,
            &src,
            f16::from_f32,
            2f32.powi(-11),
            2f32.powi(-24),
        );
    });
}

/// qwZ (int8, blocks of 32) of `src` rounded to `T` over `comm` stays within the int8 bound plus
/// `T`'s rounding of every exactly gathered element.
fn qwz_half<T: QuantElement + Default>(
    comm: &mut HostComm,
    src: &[f32],
    round: impl Fn(f32) -> T,
    u: f32,
    tiny: f32,
) {
    let (block, c) = (32, src.len());
    let codec = Int8Block::new(block).unwrap();
    let chunk: Vec<T> = src.iter().map(|&v| round(v)).collect();
    let exact = comm.all_gather_host(&chunk).unwrap();
    let mut out = vec![T::default(); comm.world_size() * c];
    qwz_all_gather(comm, &codec, &chunk, &mut out, &mut QuantScratch::new()).unwrap();
    for (x, y) in exact.chunks(c).zip(out.chunks(c)) {
        let x: Vec<f32> = x.iter().map(|&v| zero_quant::Element::to_f32(v)).collect();
        let a = block_absmax(&x, block);
        for i in 0..c {
            let y = zero_quant::Element::to_f32(y[i]);
            let bound = beta(a[i], 127.0) + u * y.abs() + tiny;
            assert!((y - x[i]).abs() <= bound, "{y} vs {} (bound {bound})", x[i]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// qgZ: structure, placement and scaling with the identity codec
// ---------------------------------------------------------------------------------------------

#[test]
fn qgz_identity_equals_reduce_scatter_mean_bitwise() {
    for (n, l) in SHAPES {
        launch(topo(n, l), |mut world| {
            let me = world.rank();
            let mut groups = QuantGroups::new(&mut world).unwrap();
            let mut scratch = QuantScratch::new();
            let mut rng = Rng::new(me as u64 * 31 + n as u64);
            for c in [1usize, 5, 64, 333] {
                // Integer-valued: every partial sum is exact, so any summation order is bit-exact.
                // Element i of chunk p carries p in its magnitude, so misplacement cannot hide.
                let input: Vec<f32> = (0..n * c)
                    .map(|j| (j / c * 10_000) as f32 + rng.int(-500, 500))
                    .collect();
                let exact = world.reduce_scatter_host(&input, ReduceOp::Mean).unwrap();
                let mut out = vec![f32::NAN; c];
                qgz_reduce_scatter(&mut groups, &Identity, &input, &mut out, &mut scratch).unwrap();
                assert!(
                    same_bits(&out, &exact),
                    "N={n} L={l} c={c} rank {me}: {:?} vs {:?}",
                    &out[..c.min(4)],
                    &exact[..c.min(4)]
                );
                // Placement, stated directly: rank `me` got chunk `me`.
                assert!(
                    out.iter()
                        .all(|&v| (v - (me * 10_000) as f32).abs() <= 500.0)
                );
            }
            // With one node or one rank per node the order is rank order: bit-exact on any data.
            if l == 1 || l == n {
                let input = gaussian(me as u64 + 5, n * 77);
                let exact = world.reduce_scatter_host(&input, ReduceOp::Mean).unwrap();
                let mut out = vec![0f32; 77];
                qgz_reduce_scatter(&mut groups, &Identity, &input, &mut out, &mut scratch).unwrap();
                assert!(same_bits(&out, &exact));
            }
        });
    }
}

#[test]
fn qgz_identity_bf16_equals_reduce_scatter() {
    launch(topo(8, 2), |mut world| {
        let me = world.rank();
        let mut groups = QuantGroups::new(&mut world).unwrap();
        let mut scratch = QuantScratch::new();
        let mut rng = Rng::new(me as u64 + 1);
        let input: Vec<bf16> = (0..8 * 40)
            .map(|_| bf16::from_f32(rng.int(-100, 100)))
            .collect();
        let exact = world.reduce_scatter_host(&input, ReduceOp::Mean).unwrap();
        let mut out = vec![bf16::ZERO; 40];
        qgz_reduce_scatter(&mut groups, &Identity, &input, &mut out, &mut scratch).unwrap();
        assert_eq!(out, exact);
    });
}

// ---------------------------------------------------------------------------------------------
// qgZ with int4
// ---------------------------------------------------------------------------------------------

/// The algorithm of the module docs, written out serially from every rank's input with zero-quant
/// directly: the output of rank `p`.
fn reference_qgz(inputs: &[Vec<f32>], n: usize, l: usize, codec: &Int4Block, p: usize) -> Vec<f32> {
    let m = n / l;
    let c = inputs[0].len() / n;
    let mut wire = vec![0u8; codec.encoded_len(c)];
    let round_trip = |x: &[f32], wire: &mut Vec<u8>, acc: &mut [f32], first: bool| {
        codec.encode(x, wire).unwrap();
        if first {
            codec.decode(wire, acc).unwrap();
        } else {
            codec.decode_accumulate(wire, acc).unwrap();
        }
    };
    let mut total = vec![0f32; c];
    for k in 0..m {
        // Node k's partial of chunk p, summed in local-rank order.
        let mut partial = vec![0f32; c];
        for j in 0..l {
            let x = &inputs[k * l + j][p * c..(p + 1) * c];
            if l > 1 {
                round_trip(x, &mut wire, &mut partial, j == 0);
            } else {
                partial.copy_from_slice(x);
            }
        }
        if m > 1 {
            round_trip(&partial, &mut wire, &mut total, k == 0);
        } else {
            total = partial;
        }
    }
    total.iter().map(|s| s / n as f32).collect()
}

/// Each rank's output of qgZ's int4 reduce-scatter over `topo(n, l)`, rank `r` sending
/// `inputs[r]` and receiving `c` elements.
fn qgz_int4<E: QuantElement + Default>(
    n: usize,
    l: usize,
    codec: &Int4Block,
    inputs: &[Vec<E>],
    c: usize,
) -> Vec<Vec<E>> {
    launch(topo(n, l), |mut world| {
        let me = world.rank();
        let mut groups = QuantGroups::new(&mut world).unwrap();
        let mut out = vec![E::default(); c];
        qgz_reduce_scatter(
            &mut groups,
            codec,
            &inputs[me],
            &mut out,
            &mut QuantScratch::new(),
        )
        .unwrap();
        out
    })
}

#[test]
fn qgz_int4_matches_the_reference_bitwise() {
    let codec = Int4Block::new(32).unwrap();
    for (n, l) in SHAPES {
        for c in [1usize, 31, 32, 100] {
            let inputs: Vec<Vec<f32>> = (0..n)
                .map(|r| gaussian(r as u64 * 13 + c as u64, n * c))
                .collect();
            let outs = qgz_int4(n, l, &codec, &inputs, c);
            for (p, out) in outs.iter().enumerate() {
                let want = reference_qgz(&inputs, n, l, &codec, p);
                assert!(same_bits(out, &want), "N={n} L={l} c={c} rank {p}");
            }
        }
    }
}

#[test]
fn qgz_int4_within_the_stated_bound_of_the_true_mean() {
    let block = 32;
    let codec = Int4Block::new(block).unwrap();
    for (n, l) in SHAPES {
        let m = n / l;
        let c = 250;
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| gaussian(r as u64 + 1000, n * c)).collect();
        let outs = qgz_int4(n, l, &codec, &inputs, c);
        for (p, out) in outs.iter().enumerate() {
            // Per rank, the absmax of the stage-1 block holding each element of chunk p.
            let a: Vec<Vec<f32>> = inputs
                .iter()
                .map(|x| block_absmax(&x[p * c..(p + 1) * c], block))
                .collect();
            for i in 0..c {
                let mean = inputs.iter().map(|x| x[p * c + i] as f64).sum::<f64>() / n as f64;
                let first: f32 = (0..n).map(|r| beta(a[r][i], 7.0)).sum();
                // Stage 2's block absmax A_k ≤ Σ_{r∈k} (a_r + β(a_r)): a bound from the inputs.
                let second: f32 = if l > 1 && m > 1 {
                    (0..m)
                        .map(|k| {
                            let ak: f32 = (k * l..(k + 1) * l)
                                .map(|r| a[r][i] + beta(a[r][i], 7.0))
                                .sum();
                            beta(ak, 7.0)
                        })
                        .sum()
                } else {
                    0.0
                };
                let sum_a: f32 = (0..n).map(|r| a[r][i]).sum();
                let bound = (first + second) / n as f32 + 1e-5 * sum_a / n as f32;
                let err = (out[i] as f64 - mean).abs();
                assert!(
                    err <= bound as f64,
                    "N={n} L={l} rank {p} elem {i}: {} vs mean {mean}: err {err} > {bound}",
                    out[i]
                );
            }
        }
    }
}

#[test]
fn qgz_is_the_mean_not_l_times_the_mean() {
    let codec = Int4Block::new(64).unwrap();
    for (n, l) in [(4, 2), (8, 2), (8, 4), (4, 4), (4, 1)] {
        let c = 96;
        // Every rank inputs the same vector with values in [1, 2]: the mean is that vector.
        let v: Vec<f32> = (0..n * c).map(|i| 1.0 + (i % 17) as f32 / 16.0).collect();
        let same: Vec<Vec<f32>> = vec![v.clone(); n];
        let outs = qgz_int4(n, l, &codec, &same, c);
        for (p, out) in outs.iter().enumerate() {
            for i in 0..c {
                let want = v[p * c + i];
                // Two int4 rounds on a block of absmax 2: at most 2·(2/14)·(1 + 1/14) + ε.
                assert!(
                    (out[i] - want).abs() <= 0.31,
                    "N={n} L={l} rank {p}: {} vs {want}",
                    out[i]
                );
            }
        }
    }
}

#[test]
fn qgz_bf16_output_stays_bf16_within_bound() {
    let codec = Int4Block::new(32).unwrap();
    let (n, l, c) = (8, 2, 64);
    let inputs: Vec<Vec<bf16>> = (0..n)
        .map(|r| {
            gaussian(r as u64 + 77, n * c)
                .into_iter()
                .map(bf16::from_f32)
                .collect()
        })
        .collect();
    let outs = qgz_int4(n, l, &codec, &inputs, c);
    for (p, out) in outs.iter().enumerate() {
        for i in 0..c {
            let xs: Vec<f32> = inputs.iter().map(|x| x[p * c + i].to_f32()).collect();
            let mean = xs.iter().sum::<f32>() / n as f32;
            let sum_a: f32 = inputs
                .iter()
                .map(|x| {
                    block_absmax(
                        &x[p * c..(p + 1) * c]
                            .iter()
                            .map(|v| v.to_f32())
                            .collect::<Vec<_>>(),
                        32,
                    )[i]
                })
                .sum();
            // Loose form of the bound: two rounds of absmax/14 (+ growth) plus bf16 rounding.
            let bound = sum_a * (2.0 + 1.0 / 7.0) / 14.0 / n as f32 + mean.abs() / 256.0 + 1e-6;
            assert!((out[i].to_f32() - mean).abs() <= bound);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Accounting
// ---------------------------------------------------------------------------------------------

#[test]
fn qgz_bytes_equal_the_formula() {
    let block = 32u64;
    let codec = Int4Block::new(block as usize).unwrap();
    for (n, l) in SHAPES {
        let m = n / l;
        launch(topo(n, l), |mut world| {
            let me = world.rank();
            let mut groups = QuantGroups::new(&mut world).unwrap();
            assert_eq!(groups.intra().is_some(), l > 1);
            assert_eq!(groups.cross().is_some(), m > 1);
            let world_before = world.traffic().clone();
            let mut scratch = QuantScratch::new();
            for c in [0usize, 1, 7, 64, 129] {
                let input = gaussian(me as u64, n * c);
                let before_i = groups
                    .intra()
                    .map(|g| g.traffic().clone())
                    .unwrap_or_default();
                let before_c = groups
                    .cross()
                    .map(|g| g.traffic().clone())
                    .unwrap_or_default();
                let mut out = vec![0f32; c];
                qgz_reduce_scatter(&mut groups, &codec, &input, &mut out, &mut scratch).unwrap();
                let e = int4_wire_len(c as u64, block);
                if let Some(g) = groups.intra() {
                    assert_eq!(
                        g.members(),
                        (me / l * l..(me / l + 1) * l).collect::<Vec<_>>()
                    );
                    let t = g.traffic().since(&before_i);
                    assert_eq!(t.calls(), 1);
                    assert_eq!(
                        t.by_collective[&Collective::AllToAll],
                        g.group_view().all_to_all((l * m) as u64 * e, 1),
                        "intra N={n} L={l} c={c}"
                    );
                    assert_eq!(t.sent().inter_node, 0);
                }
                if let Some(g) = groups.cross() {
                    assert_eq!(
                        g.members(),
                        (0..m).map(|k| k * l + me % l).collect::<Vec<_>>()
                    );
                    let t = g.traffic().since(&before_c);
                    assert_eq!(t.calls(), 1);
                    assert_eq!(
                        t.by_collective[&Collective::AllToAll],
                        g.group_view().all_to_all(m as u64 * e, 1),
                        "cross N={n} L={l} c={c}"
                    );
                    // Cross-node bytes: (M−1)·e sent, ≈ ¼ of the fp16 chunks plus scales.
                    assert_eq!(t.sent().inter_node, (m as u64 - 1) * e);
                    assert_eq!(t.sent().intra_node, 0);
                }
            }
            // Nothing ran on the world communicator.
            assert_eq!(world.traffic(), &world_before);
        });
    }
}

/// Runs, on every rank, the qwZ forward gathers and qgZ reductions that a ZeRO++ plan schedules
/// and compares the measured bytes with the plan's own predictions for those ops, with `==`.
#[test]
fn measured_bytes_equal_the_plan() {
    for (n, l) in [(4, 2), (8, 2), (8, 4), (4, 1), (4, 4)] {
        let cfg = ZeroConfig {
            stage: 3,
            quantized_weights: true,
            quantized_gradients: true,
            qwz_block_size: 64,
            qgz_block_size: 32,
            param_persistence_threshold: 10,
            ..Default::default()
        };
        let model = ModelDesc::synthetic(5_001, 3).unwrap();
        let plan = Plan::new(&model, topo(n, l), &cfg).unwrap();
        let schedule = plan.schedule();
        launch(topo(n, l), |mut world| {
            let me = world.rank();
            let mut groups = QuantGroups::new(&mut world).unwrap();
            let mut scratch = QuantScratch::new();
            let int8 = Int8Block::new(cfg.qwz_block_size).unwrap();
            let int4 = Int4Block::new(cfg.qgz_block_size).unwrap();
            let mut ran_qgz = 0;
            for u in plan.units().iter().filter(|u| u.kind == UnitKind::Gather) {
                let len = u.len as usize;
                let chunk = gaussian(me as u64, len / n);
                let mut full = vec![0f32; len];
                qwz_all_gather(&mut world, &int8, &chunk, &mut full, &mut scratch).unwrap();
                if u.trainable {
                    let mut g = vec![0f32; len / n];
                    qgz_reduce_scatter(&mut groups, &int4, &full, &mut g, &mut scratch).unwrap();
                    ran_qgz += 1;
                }
            }
            assert!(ran_qgz > 0);
            let mut want_world = TrafficTable::new();
            let mut want_groups = TrafficTable::new();
            for op in &schedule {
                if op.phase == Phase::Forward && op.payload == Payload::Int8 {
                    want_world.record(op.collective, plan.op_traffic(op, me));
                }
                if op.payload == Payload::Int4 {
                    want_groups.record(op.collective, plan.op_traffic(op, me));
                }
            }
            assert_eq!(world.traffic(), &want_world, "qwZ N={n} L={l} rank {me}");
            assert_eq!(groups.traffic(), want_groups, "qgZ N={n} L={l} rank {me}");
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Errors and failures
// ---------------------------------------------------------------------------------------------

#[test]
fn bad_lengths_are_rejected_before_anything_moves() {
    launch(topo(4, 2), |mut world| {
        let mut groups = QuantGroups::new(&mut world).unwrap();
        let mut s = QuantScratch::new();
        let mut out = vec![0f32; 3];
        let e =
            qgz_reduce_scatter(&mut groups, &Identity, &[0f32; 13], &mut out, &mut s).unwrap_err();
        assert!(
            matches!(
                e,
                Error::LengthMismatch {
                    expected: 16,
                    got: 13,
                    ..
                }
            ),
            "{e}"
        );
        let e =
            qgz_reduce_scatter(&mut groups, &Identity, &[0f32; 16], &mut out, &mut s).unwrap_err();
        assert!(
            matches!(
                e,
                Error::LengthMismatch {
                    expected: 4,
                    got: 3,
                    ..
                }
            ),
            "{e}"
        );
        let e = qwz_all_gather(&mut world, &Identity, &[0f32; 3], &mut out, &mut s).unwrap_err();
        assert!(
            matches!(
                e,
                Error::LengthMismatch {
                    expected: 12,
                    got: 3,
                    ..
                }
            ),
            "{e}"
        );
        // Nothing moved, and the groups still work.
        assert_eq!(groups.traffic().calls(), 0);
        assert_eq!(world.traffic().calls(), 0);
        let mut out = vec![0f32; 4];
        qgz_reduce_scatter(&mut groups, &Identity, &[1f32; 16], &mut out, &mut s).unwrap();
        assert_eq!(out, [1.0; 4]);
        // A group that is not the whole world in order cannot host qgZ.
        let mut half = world.split(world.rank() % 2, 0).unwrap();
        let e = QuantGroups::new(&mut half).unwrap_err();
        assert!(matches!(e, Error::Topology(_)), "{e}");
    });
}

#[test]
fn single_rank_is_a_copy() {
    launch(topo(1, 1), |mut world| {
        let mut groups = QuantGroups::new(&mut world).unwrap();
        let x = gaussian(3, 50);
        let mut out = vec![0f32; 50];
        qgz_reduce_scatter(
            &mut groups,
            &Int4Block::default(),
            &x,
            &mut out,
            &mut QuantScratch::new(),
        )
        .unwrap();
        assert_eq!(out, x);
        assert_eq!(groups.traffic().calls(), 0);
        let mut bad = x.clone();
        bad[7] = f32::INFINITY;
        let e = qgz_reduce_scatter(
            &mut groups,
            &Identity,
            &bad,
            &mut out,
            &mut QuantScratch::new(),
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Quant {
                    failed_rank: 0,
                    source: Some(_),
                    ..
                }
            ),
            "{e}"
        );
    });
}

/// A non-finite input on one rank: every rank returns `Error::Quant` naming it (none hangs, no NaN
/// reaches an output), and the next call works.
#[test]
fn non_finite_input_names_the_rank_everywhere() {
    let codec = Int4Block::new(16).unwrap();
    for (n, l, bad) in [(8, 2, 5usize), (4, 1, 2), (4, 4, 1), (8, 4, 6)] {
        let c = 40;
        let t0 = Instant::now();
        launch(topo(n, l), |mut world| {
            let me = world.rank();
            let mut groups = QuantGroups::new(&mut world).unwrap();
            let mut s = QuantScratch::new();
            let mut x = gaussian(me as u64, n * c);
            if me == bad {
                x[3 * c + 11] = f32::NAN;
            }
            let mut out = vec![0f32; c];
            let e = qgz_reduce_scatter(&mut groups, &codec, &x, &mut out, &mut s).unwrap_err();
            match e {
                Error::Quant {
                    failed_rank,
                    rank,
                    ref source,
                    ..
                } => {
                    assert_eq!(failed_rank, bad, "{e}");
                    assert_eq!(rank, me);
                    if me == bad {
                        assert!(
                            matches!(source, Some(zero_quant::Error::NonFinite { .. })),
                            "{e}"
                        );
                        // The codec's error is the source, reported once by chain walkers.
                        let src = std::error::Error::source(&e).map(|s| s.to_string());
                        assert!(src.is_some_and(|s| s.contains("non-finite")), "{e}");
                    } else {
                        assert!(source.is_none());
                    }
                }
                e => panic!("rank {me}: unexpected {e}"),
            }
            // qwZ: the same, over the world.
            let mut full = vec![0f32; n * c];
            let chunk = &x[me * c..(me + 1) * c];
            let mut chunk = chunk.to_vec();
            if me == bad {
                chunk[0] = f32::NEG_INFINITY;
            }
            let e = qwz_all_gather(
                &mut world,
                &Int8Block::new(16).unwrap(),
                &chunk,
                &mut full,
                &mut s,
            )
            .unwrap_err();
            assert!(
                matches!(e, Error::Quant { failed_rank, .. } if failed_rank == bad),
                "{e}"
            );
            // Everybody made the same calls: the groups are still usable.
            x[3 * c + 11] = 0.5;
            qgz_reduce_scatter(&mut groups, &codec, &x, &mut out, &mut s).unwrap();
            assert!(out.iter().all(|v| v.is_finite()));
        });
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "took {:?}",
            t0.elapsed()
        );
    }
}

/// A rank that panics while its peers wait in a quantized collective makes them fail fast with
/// `PeerFailed` naming it, well before the timeout.
#[test]
fn panicking_rank_fails_peers_fast() {
    for which in ["qgz", "qwz"] {
        let (n, l, victim) = (8, 2, 5);
        let t0 = Instant::now();
        let results = HostLoopback::launch(topo(n, l), Duration::from_secs(60), |mut world| {
            let me = world.rank();
            let mut groups = QuantGroups::new(&mut world).unwrap();
            if me == victim {
                thread::sleep(Duration::from_millis(200));
                panic!("rank {me} fails on purpose");
            }
            let x = gaussian(me as u64, n * 16);
            let mut out = vec![0f32; n * 16];
            let mut s = QuantScratch::new();
            if which == "qgz" {
                qgz_reduce_scatter(
                    &mut groups,
                    &Int4Block::default(),
                    &x,
                    &mut out[..16],
                    &mut s,
                )
            } else {
                qwz_all_gather(
                    &mut world,
                    &Int8Block::default(),
                    &x[..16],
                    &mut out,
                    &mut s,
                )
            }
        });
        let elapsed = t0.elapsed();
        assert!(
            elapsed < Duration::from_secs(10),
            "{which}: took {elapsed:?}"
        );
        for (r, res) in results.into_iter().enumerate() {
            if r == victim {
                assert!(res.is_err(), "the victim panicked");
                continue;
            }
            let res = res.unwrap_or_else(|_| panic!("rank {r} panicked"));
            match res {
                // Ranks waiting for the victim (directly, or for a peer that failed on it).
                Err(Error::PeerFailed { failed_rank, .. }) => assert_eq!(failed_rank, victim),
                other => panic!("{which}: rank {r}: expected PeerFailed, got {other:?}"),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Error feedback
// ---------------------------------------------------------------------------------------------

#[test]
fn error_feedback_removes_the_accumulated_bias() {
    let codec = Int4Block::new(32).unwrap();
    for (n, l) in [(8, 2), (4, 1), (4, 4)] {
        let c = 128;
        let steps = 40;
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| gaussian(r as u64 + 555, n * c)).collect();
        let outs = launch(topo(n, l), |mut world| {
            let me = world.rank();
            let mut groups = QuantGroups::new(&mut world).unwrap();
            let mut s = QuantScratch::new();
            let mut fb = ErrorFeedback::new();
            let (mut plain, mut ef) = (vec![0f64; c], vec![0f64; c]);
            let mut out = vec![0f32; c];
            let mut first = None;
            for _ in 0..steps {
                qgz_reduce_scatter(&mut groups, &codec, &inputs[me], &mut out, &mut s).unwrap();
                // Without feedback the same input gives the same output every time.
                assert_eq!(*first.get_or_insert_with(|| out.clone()), out);
                plain
                    .iter_mut()
                    .zip(&out)
                    .for_each(|(a, &v)| *a += v as f64);
                qgz_reduce_scatter_ef(&mut groups, &codec, &inputs[me], &mut out, &mut s, &mut fb)
                    .unwrap();
                ef.iter_mut().zip(&out).for_each(|(a, &v)| *a += v as f64);
            }
            // Another length with the same state is an error.
            let e = qgz_reduce_scatter_ef(
                &mut groups,
                &codec,
                &inputs[me][..n],
                &mut out[..1],
                &mut s,
                &mut fb,
            )
            .unwrap_err();
            assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
            (plain, ef)
        });
        let (mut err_plain, mut err_ef) = (0f64, 0f64);
        for (p, (plain, ef)) in outs.iter().enumerate() {
            for i in 0..c {
                let mean = inputs.iter().map(|x| x[p * c + i] as f64).sum::<f64>() / n as f64;
                err_plain = err_plain.max((plain[i] / steps as f64 - mean).abs());
                err_ef = err_ef.max((ef[i] / steps as f64 - mean).abs());
            }
        }
        assert!(
            err_ef * 4.0 < err_plain,
            "N={n} L={l}: time-averaged error with feedback {err_ef}, without {err_plain}"
        );
    }
}
