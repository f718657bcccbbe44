//! Test bodies shared by the device-kernel tests (wgpu and CUDA): each takes a
//! [`DeviceCodec`] and checks it against the host codecs, bit for bit: wire
//! bytes, decoded values, accumulated values and errors.
#![allow(dead_code)]

use super::Rng;
use zero_quant::{BlockCodec, Codec, Error, Int4Block, Int8Block};

/// A device implementation of the codecs, driven from host memory.
pub(crate) trait DeviceCodec {
    /// Encodes `x` on the device and returns the wire.
    fn encode(&self, c: Codec, x: &[f32]) -> zero_quant::Result<Vec<u8>>;
    /// Decodes `n` elements of `wire` on the device.
    fn decode(&self, c: Codec, wire: &[u8], n: usize) -> zero_quant::Result<Vec<f32>>;
    /// `acc += decode(wire)` on the device.
    fn accumulate(&self, c: Codec, wire: &[u8], acc: &mut [f32]) -> zero_quant::Result<()>;
}

/// Value distributions, chosen to reach every kernel path.
pub(crate) const DISTS: &[&str] = &[
    "gaussian",
    "student_t",
    "zeros",
    "subnormal",
    "tiny",
    "wide",
    "huge",
    "halves",
];

pub(crate) fn data(dist: &str, n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n)
        .map(|i| match dist {
            "gaussian" => r.normal() as f32,
            "student_t" => r.student_t(3) as f32,
            // Mostly zero blocks, with an occasional signed zero or value.
            "zeros" => match r.next_u64() % 64 {
                0 => -0.0,
                1 => r.normal() as f32,
                _ => 0.0,
            },
            // Subnormal inputs only: subnormal scales (encode via the
            // integer quotient, decode via the integer product).
            "subnormal" => {
                let b = (r.next_u64() as u32) & 0x807f_ffff;
                f32::from_bits(b)
            }
            // Blocks around the subnormal-scale threshold (qmax * 2^-126),
            // mixing normal and subnormal x.
            "tiny" => {
                let e = -150.0 + 30.0 * r.uniform();
                let v = (2f64.powf(e) * (0.5 + r.uniform())) as f32;
                if r.next_u64().is_multiple_of(2) {
                    v
                } else {
                    -v
                }
            }
            // Any finite f32 bit pattern.
            "wide" => loop {
                let v = f32::from_bits(r.next_u64() as u32);
                if v.is_finite() {
                    break v;
                }
            },
            // Near f32::MAX: the scale is lowered by one ulp.
            "huge" => {
                let v = f32::MAX * (1.0 - r.uniform() as f32 * 1e-3);
                if i % 7 == 0 { -f32::MAX } else { v }
            }
            // Exact rounding ties: block absmax 127 (or 7), values k + 1/2.
            "halves" => match i % 3 {
                0 => 127.0,
                _ => (r.next_u64() % 254) as f32 - 126.5,
            },
            _ => unreachable!(),
        })
        .collect()
}

pub(crate) fn codecs() -> Vec<Codec> {
    let mut v: Vec<Codec> = [1, 2, 3, 6, 32, 250, 1024]
        .into_iter()
        .map(|b| Int8Block::new(b).unwrap().into())
        .collect();
    v.extend(
        [2, 6, 8, 64, 250, 512, 2048]
            .into_iter()
            .map(|b| Codec::from(Int4Block::new(b).unwrap())),
    );
    v
}

pub(crate) const LENS: &[usize] = &[
    1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 127, 255, 256, 513, 1000, 1025, 2047, 4097, 5000,
];

pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Asserts `dev == host` bit for bit, naming the first difference.
pub(crate) fn same_bits(dev: &[f32], host: &[f32], what: &str) {
    assert_eq!(dev.len(), host.len(), "{what}");
    if let Some(i) = (0..dev.len()).find(|&i| dev[i].to_bits() != host[i].to_bits()) {
        panic!(
            "{what}: element {i} of {}: device {:e} ({:#010x}), host {:e} ({:#010x})",
            dev.len(),
            dev[i],
            dev[i].to_bits(),
            host[i],
            host[i].to_bits()
        );
    }
}

pub(crate) fn host_encode(c: Codec, x: &[f32]) -> zero_quant::Result<Vec<u8>> {
    let mut w = vec![0u8; c.encoded_len(x.len())];
    c.encode(x, &mut w).map(|()| w)
}

/// Encode, decode and decode_accumulate of one tensor, all against the host.
pub(crate) fn check_case(q: &dyn DeviceCodec, c: Codec, x: &[f32], seed: u64) {
    let ctx = || format!("{c:?} n={} seed={seed}", x.len());
    let host = host_encode(c, x).unwrap();
    let dev = q.encode(c, x).unwrap();
    if dev != host {
        let i = dev.iter().zip(&host).position(|(a, b)| a != b).unwrap();
        panic!(
            "{}: wire differs at byte {i} of {} (device {:#04x}, host {:#04x})",
            ctx(),
            host.len(),
            dev[i],
            host[i]
        );
    }
    let mut y = vec![0f32; x.len()];
    c.decode(&host, &mut y).unwrap();
    let yd = q.decode(c, &host, x.len()).unwrap();
    same_bits(&yd, &y, &format!("{}: decode", ctx()));

    // Accumulators that reach the subnormal and cancellation paths: random
    // values, exact negatives of x̂ (sum +0), x̂ scaled by 2^-k, subnormals.
    let mut r = Rng::new(seed ^ 0xacc);
    let mut acc: Vec<f32> = y
        .iter()
        .map(|&v| match r.next_u64() % 5 {
            0 => -v,
            1 => v * 2f32.powi(-((r.next_u64() % 40) as i32)),
            2 => f32::from_bits((r.next_u64() as u32) & 0x807f_ffff),
            3 => -v * (1.0 + f32::EPSILON),
            _ => r.normal() as f32,
        })
        .collect();
    let mut acc_dev = acc.clone();
    let acc0 = acc.clone();
    c.decode_accumulate(&host, &mut acc).unwrap();
    q.accumulate(c, &host, &mut acc_dev).unwrap();
    let what = format!("{}: decode_accumulate", ctx());
    if let Some(i) = (0..acc.len()).find(|&i| acc[i].to_bits() != acc_dev[i].to_bits()) {
        panic!("{what}: acc {:e} + x̂ {:e} at {i}", acc0[i], y[i]);
    }
    same_bits(&acc_dev, &acc, &what);
}

pub(crate) fn encode_decode_accumulate_match_host_bit_for_bit(q: &dyn DeviceCodec) {
    let t = std::time::Instant::now();
    let mut cases = 0;
    for (ci, c) in codecs().into_iter().enumerate() {
        for (di, dist) in DISTS.iter().enumerate() {
            // Four lengths per (codec, distribution), rotating through LENS.
            for k in 0..4 {
                let n = LENS[(ci * 7 + di * 3 + k * 5) % LENS.len()];
                let seed = (ci * 1000 + di * 10 + k) as u64;
                check_case(q, c, &data(dist, n, seed), seed);
                cases += 1;
            }
        }
    }
    eprintln!("{cases} cases in {:.2?}", t.elapsed());
}

pub(crate) fn every_length_up_to_70_with_small_blocks(q: &dyn DeviceCodec) {
    let codecs: [Codec; 4] = [
        Int8Block::new(5).unwrap().into(),
        Int8Block::new(8).unwrap().into(),
        Int4Block::new(6).unwrap().into(),
        Int4Block::new(16).unwrap().into(),
    ];
    for c in codecs {
        for n in 1..=70 {
            let seed = n as u64;
            check_case(q, c, &data(DISTS[n % DISTS.len()], n, seed), seed);
        }
    }
}

pub(crate) fn hand_computed_int4_wire(q: &dyn DeviceCodec) {
    let c = Int4Block::new(4).unwrap();
    let wire = q.encode(c.into(), &[7.0, -7.0, 2.5, -0.4, 2.0]).unwrap();
    assert_eq!(
        wire,
        [
            0x97, 0x03, 0x07, 0x00, 0x00, 0x00, 0x80, 0x3f, 0x25, 0x49, 0x92, 0x3e
        ]
    );
}

pub(crate) fn same_error(dev: Error, host: Error) {
    match (&dev, &host) {
        (Error::NonFinite { index: a, value: u }, Error::NonFinite { index: b, value: v }) => {
            assert_eq!((a, u.to_bits()), (b, v.to_bits()), "{dev:?} vs {host:?}");
        }
        (
            Error::InvalidScale {
                block: a, value: u, ..
            },
            Error::InvalidScale {
                block: b, value: v, ..
            },
        ) => {
            assert_eq!((a, u.to_bits()), (b, v.to_bits()), "{dev:?} vs {host:?}");
        }
        _ => assert_eq!(dev, host),
    }
}

pub(crate) fn non_finite_input_reports_the_first_index(q: &dyn DeviceCodec) {
    let mut r = Rng::new(7);
    for c in codecs() {
        for &n in &[1usize, 9, 1000, 4097] {
            let mut x = data("gaussian", n, n as u64);
            // Up to three non-finite values; the first one must be reported.
            for _ in 0..=(r.next_u64() % 3) {
                let i = (r.next_u64() as usize) % n;
                x[i] = match r.next_u64() % 3 {
                    0 => f32::NAN,
                    1 => f32::INFINITY,
                    _ => f32::NEG_INFINITY,
                };
            }
            let host = host_encode(c, &x).unwrap_err();
            let dev = q.encode(c, &x).unwrap_err();
            same_error(dev, host);
        }
    }
}

pub(crate) fn corrupt_wires_give_the_host_errors(q: &dyn DeviceCodec) {
    let n = 1001;
    let x = data("gaussian", n, 3);
    for c in [
        Codec::from(Int8Block::new(100).unwrap()),
        Codec::from(Int4Block::new(100).unwrap()),
    ] {
        let good = host_encode(c, &x).unwrap();
        let l = c.layout(n);
        let int4 = matches!(c, Codec::Int4(_));
        let mut corruptions: Vec<Vec<u8>> = Vec::new();
        // Bad scales: negative, NaN, infinite, too large; in blocks 3 and 7.
        for (blk, v) in [
            (3, -1.0f32),
            (7, f32::NAN),
            (3, f32::INFINITY),
            (7, f32::MAX),
        ] {
            let mut w = good.clone();
            let o = l.scales_offset + 4 * blk;
            w[o..o + 4].copy_from_slice(&v.to_le_bytes());
            corruptions.push(w);
        }
        // Bad codes, alone and after a bad scale of a later block.
        for at in [17usize, 450] {
            let mut w = good.clone();
            if int4 {
                w[at] = (w[at] & 0x0f) | 0x80;
            } else {
                w[at] = 0x80;
            }
            corruptions.push(w.clone());
            let o = l.scales_offset + 4 * 8;
            w[o..o + 4].copy_from_slice(&(-2.0f32).to_le_bytes());
            corruptions.push(w);
        }
        // Padding (and the odd int4 high nibble), plus a bad code: padding wins.
        let mut w = good.clone();
        w[l.codes_len - 1] |= 0x70;
        w[5] = 0x80;
        corruptions.push(w);
        let mut w = good.clone();
        w[l.codes_len] = 1;
        corruptions.push(w);
        // Negative zero is a valid scale.
        let mut w = good.clone();
        let o = l.scales_offset + 4 * 2;
        w[o..o + 4].copy_from_slice(&(-0.0f32).to_le_bytes());
        corruptions.push(w);

        for w in corruptions {
            let mut y = vec![0f32; n];
            let host = c.decode(&w, &mut y);
            let dev = q.decode(c, &w, n);
            let mut acc = vec![1f32; n];
            let host_acc = c.decode_accumulate(&w, &mut acc);
            let mut acc_dev = vec![1f32; n];
            let dev_acc = q.accumulate(c, &w, &mut acc_dev);
            match (dev, host) {
                (Ok(d), Ok(())) => {
                    assert_eq!(bits(&d), bits(&y));
                    dev_acc.unwrap();
                    host_acc.unwrap();
                    assert_eq!(bits(&acc_dev), bits(&acc));
                }
                (Err(d), Err(h)) => {
                    same_error(d, h);
                    same_error(dev_acc.unwrap_err(), host_acc.unwrap_err());
                }
                (d, h) => panic!("{c:?}: device {d:?}, host {h:?}"),
            }
        }
    }
}

/// One `#[test]` per named case of this module, named as the case: `gate(prefix + name)` gives
/// the device (or records why there is none and the test returns), the case runs on it, and
/// `done(prefix + name)` records that it passed. (The benches share this file and stamp nothing.)
#[allow(unused_macros)]
macro_rules! stamp {
    ($prefix:literal, $gate:path, $done:path; $($name:ident),* $(,)?) => {$(
        #[test]
        fn $name() {
            let Some(q) = $gate(concat!($prefix, stringify!($name))) else { return };
            common::device::$name(q);
            $done(concat!($prefix, stringify!($name)));
        }
    )*};
}
#[allow(unused_imports)]
pub(crate) use stamp;
