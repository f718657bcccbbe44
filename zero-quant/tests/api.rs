//! API contract tests: lengths, constructor checks, wire validation,
//! parallel = serial, dtype tags, and reference error levels.

mod common;

use half::{bf16, f16};
use zero_quant::{
    BlockCodec, Codec, DEFAULT_INT4_BLOCK, DEFAULT_INT8_BLOCK, DType, Element, Error, Identity,
    Int4Block, Int8Block, WireLayout,
};

fn codecs() -> [Codec; 3] {
    [
        Codec::from(Int8Block::new(64).unwrap()),
        Codec::from(Int4Block::new(64).unwrap()),
        Codec::from(Identity),
    ]
}

#[test]
fn block_size_is_validated() {
    assert_eq!(
        Int8Block::new(0),
        Err(Error::BlockSize {
            codec: "int8",
            multiple_of: 1,
            got: 0
        })
    );
    for bad in [0, 1, 3, 4097] {
        assert_eq!(
            Int4Block::new(bad),
            Err(Error::BlockSize {
                codec: "int4",
                multiple_of: 2,
                got: bad
            })
        );
    }
    assert!(Int8Block::new(1).is_ok());
    assert!(Int4Block::new(2).is_ok());
    assert_eq!(Int8Block::default().block_size(), DEFAULT_INT8_BLOCK);
    assert_eq!(Int4Block::default().block_size(), DEFAULT_INT4_BLOCK);
    assert_eq!(DEFAULT_INT4_BLOCK % 2, 0);
}

#[test]
fn layouts() {
    let c = Int8Block::new(4).unwrap();
    assert_eq!(
        c.layout(9),
        WireLayout {
            n_elems: 9,
            num_blocks: 3,
            codes_len: 9,
            scales_offset: 12,
            total_len: 24
        }
    );
    let c = Int4Block::new(4).unwrap();
    assert_eq!(
        c.layout(9),
        WireLayout {
            n_elems: 9,
            num_blocks: 3,
            codes_len: 5,
            scales_offset: 8,
            total_len: 20
        }
    );
    assert_eq!(
        Identity.layout(9),
        WireLayout {
            n_elems: 9,
            num_blocks: 0,
            codes_len: 36,
            scales_offset: 36,
            total_len: 36
        }
    );
    for c in codecs() {
        assert_eq!(c.encoded_len(0), 0);
        assert_eq!(c.num_blocks(0), 0);
        // Empty tensors are fine.
        c.encode::<f32>(&[], &mut []).unwrap();
        c.decode::<f32>(&[], &mut []).unwrap();
        c.decode_accumulate(&[], &mut []).unwrap();
        for n in [1, 63, 64, 65, 1000] {
            let l = c.layout(n);
            assert_eq!(l.scales_offset % 4, 0);
            assert_eq!(l.total_len, c.encoded_len(n));
            assert_eq!(l.num_blocks, c.num_blocks(n));
        }
    }
}

#[test]
fn length_mismatches_are_errors() {
    let x = common::gaussian(100, 1);
    for c in codecs() {
        let n = c.encoded_len(100);
        for bad in [n - 1, n + 1, 0] {
            let mut w = vec![0u8; bad];
            assert_eq!(
                c.encode(&x, &mut w),
                Err(Error::BufferLen {
                    codec: c.name_for_test(),
                    what: "encode dst bytes",
                    expected: n,
                    got: bad
                }),
                "{c:?}"
            );
            let mut y = vec![0f32; 100];
            assert_eq!(
                c.decode(&w, &mut y),
                Err(Error::BufferLen {
                    codec: c.name_for_test(),
                    what: "decode src bytes",
                    expected: n,
                    got: bad
                })
            );
            assert_eq!(
                c.decode_accumulate(&w, &mut y),
                Err(Error::BufferLen {
                    codec: c.name_for_test(),
                    what: "decode_accumulate src bytes",
                    expected: n,
                    got: bad
                })
            );
        }
        // A wire for 100 elements does not decode into 99 or 101.
        let mut w = vec![0u8; n];
        c.encode(&x, &mut w).unwrap();
        for m in [99, 101] {
            let mut y = vec![0f32; m];
            let r = c.decode(&w, &mut y);
            if c.encoded_len(m) != n {
                assert!(
                    matches!(r, Err(Error::BufferLen { .. })),
                    "{c:?} {m}: {r:?}"
                );
            }
        }
    }
}

trait NameForTest {
    fn name_for_test(&self) -> &'static str;
}

impl NameForTest for Codec {
    fn name_for_test(&self) -> &'static str {
        match self {
            Codec::Identity(_) => "identity",
            Codec::Int8(_) => "int8",
            Codec::Int4(_) => "int4",
        }
    }
}

fn wire(c: &Codec, x: &[f32]) -> Vec<u8> {
    let mut w = vec![0u8; c.encoded_len(x.len())];
    c.encode(x, &mut w).unwrap();
    w
}

#[test]
fn corrupt_scales_are_rejected() {
    let x = common::gaussian(130, 2); // 3 blocks of 64
    for c in &codecs()[..2] {
        let l = c.layout(130);
        for bad in [f32::NAN, f32::INFINITY, -1.0, f32::MAX] {
            let mut w = wire(c, &x);
            w[l.scales_offset + 4..][..4].copy_from_slice(&bad.to_le_bytes());
            let mut y = vec![0f32; 130];
            let r = c.decode(&w, &mut y);
            assert!(
                matches!(r, Err(Error::InvalidScale { block: 1, value, .. }) if value.to_bits() == bad.to_bits()),
                "{c:?} {bad}: {r:?}"
            );
            let r = c.decode_accumulate(&w, &mut y);
            assert!(
                matches!(r, Err(Error::InvalidScale { block: 1, .. })),
                "{r:?}"
            );
        }
    }
}

#[test]
fn corrupt_codes_are_rejected() {
    let x = common::gaussian(130, 3);
    let int8 = Codec::from(Int8Block::new(64).unwrap());
    let mut w = wire(&int8, &x);
    w[70] = 0x80;
    w[100] = 0x80;
    let mut y = vec![0f32; 130];
    assert_eq!(
        int8.decode(&w, &mut y),
        Err(Error::InvalidCode {
            codec: "int8",
            index: 70,
            code: 0x80
        })
    );
    let int4 = Codec::from(Int4Block::new(64).unwrap());
    for (byte, value, index) in [(35, 0x08, 70), (35, 0x80, 71)] {
        let mut w = wire(&int4, &x);
        w[byte] = value;
        assert_eq!(
            int4.decode(&w, &mut y),
            Err(Error::InvalidCode {
                codec: "int4",
                index,
                code: 0x08
            })
        );
        assert!(matches!(
            int4.decode_accumulate(&w, &mut y),
            Err(Error::InvalidCode { index: i, .. }) if i == index
        ));
    }
    // Identity: a NaN on the wire is reported like a NaN input.
    let id = Codec::from(Identity);
    let mut w = wire(&id, &x);
    w[4 * 9..4 * 10].copy_from_slice(&f32::NAN.to_le_bytes());
    assert!(matches!(
        id.decode(&w, &mut y),
        Err(Error::NonFinite { index: 9, .. })
    ));
    let mut acc = vec![0f32; 130];
    assert!(matches!(
        id.decode_accumulate(&w, &mut acc),
        Err(Error::NonFinite { index: 9, .. })
    ));
}

#[test]
fn non_zero_padding_is_rejected() {
    let x = common::gaussian(129, 4);
    let int8 = Codec::from(Int8Block::new(64).unwrap());
    let mut w = wire(&int8, &x);
    w[130] = 1; // codes 0..129, padding 129..132
    let mut y = vec![0f32; 129];
    assert_eq!(
        int8.decode(&w, &mut y),
        Err(Error::Padding {
            codec: "int8",
            offset: 130,
            byte: 1
        })
    );
    // int4, odd count: the high nibble of the last code byte is padding.
    let int4 = Codec::from(Int4Block::new(64).unwrap());
    let mut w = wire(&int4, &x);
    assert_eq!(w[64] & 0xf0, 0);
    w[64] |= 0x10;
    let b = w[64];
    assert_eq!(
        int4.decode(&w, &mut y),
        Err(Error::Padding {
            codec: "int4",
            offset: 64,
            byte: b
        })
    );
}

/// A wire encoded from f32 values beyond f16's range does not decode into
/// f16 silently as infinity.
#[test]
fn overflow_of_narrow_destination_is_an_error() {
    let mut x = vec![1.0f32; 100];
    x[70] = 1e5; // > f16::MAX = 65504
    for c in codecs() {
        let w = wire(&c, &x);
        let mut y = vec![f16::ZERO; 100];
        let r = c.decode(&w, &mut y);
        assert!(
            matches!(r, Err(Error::Overflow { index: 70, value, dtype: DType::F16 }) if (value - 1e5).abs() < 1e3),
            "{c:?}: {r:?}"
        );
        // bf16 has f32's range: fine.
        let mut yb = vec![bf16::ZERO; 100];
        c.decode(&w, &mut yb).unwrap();
    }
    // bf16 overflows only right at the top of f32's range.
    let x = [f32::MAX, 1.0];
    for c in codecs() {
        let w = wire(&c, &x);
        let mut y = [bf16::ZERO; 2];
        assert!(
            matches!(
                c.decode(&w, &mut y),
                Err(Error::Overflow {
                    index: 0,
                    dtype: DType::BF16,
                    ..
                })
            ),
            "{c:?}"
        );
    }
}

/// Parallel runs produce the same bytes, values and errors as serial ones.
#[test]
fn parallel_equals_serial() {
    let n = 300_001; // 4+ pieces of >= 65536 elements, partial last block
    let x = common::student_t(n, 3, 5);
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    for c in [
        Codec::from(Int8Block::default()),
        Codec::from(Int4Block::default()),
        Codec::from(Int8Block::new(1000).unwrap()),
        Codec::from(Identity),
    ] {
        let len = c.encoded_len(n);
        let mut serial = vec![0u8; len];
        c.encode(&x, &mut serial).unwrap();
        let mut serial_b = vec![0u8; len];
        c.encode(&xb, &mut serial_b).unwrap();
        let mut y_serial = vec![bf16::ZERO; n];
        c.decode(&serial_b, &mut y_serial).unwrap();
        for threads in [2, 3, 4, 16] {
            let mut par = vec![0xaau8; len];
            c.encode_par(&x, &mut par, threads).unwrap();
            assert!(par == serial, "{c:?} threads={threads}");
            let mut y = vec![bf16::ZERO; n];
            c.decode_par(&serial_b, &mut y, threads).unwrap();
            assert!(y == y_serial, "{c:?} threads={threads}");
            let mut acc = x.clone();
            let mut acc_par = x.clone();
            c.decode_accumulate(&serial, &mut acc).unwrap();
            c.decode_accumulate_par(&serial, &mut acc_par, threads)
                .unwrap();
            assert!(acc == acc_par, "{c:?} threads={threads}");
        }
        // The error a serial run reports (the first) wins, wherever it is.
        let mut bad = x.clone();
        bad[250_000] = f32::INFINITY;
        bad[200_000] = f32::NAN;
        let mut w = vec![0u8; len];
        for threads in [1, 4] {
            assert!(matches!(
                c.encode_par(&bad, &mut w, threads),
                Err(Error::NonFinite { index: 200_000, .. })
            ));
        }
        if !matches!(c, Codec::Identity(_)) {
            let l = c.layout(n);
            let mut w = serial.clone();
            let last = l.num_blocks - 1;
            w[l.scales_offset + 4 * last..][..4].copy_from_slice(&(-1f32).to_le_bytes());
            w[l.scales_offset + 4 * 100..][..4].copy_from_slice(&f32::NAN.to_le_bytes());
            let mut y = vec![0f32; n];
            for threads in [1, 4] {
                assert!(matches!(
                    c.decode_par(&w, &mut y, threads),
                    Err(Error::InvalidScale { block: 100, .. })
                ));
            }
        }
    }
}

#[test]
fn dtype_tags() {
    assert_eq!(<f32 as Element>::DTYPE, DType::F32);
    assert_eq!(<bf16 as Element>::DTYPE, DType::BF16);
    assert_eq!(<f16 as Element>::DTYPE, DType::F16);
    assert_eq!(DType::F32.size_bytes(), 4);
    assert_eq!(DType::BF16.size_bytes(), 2);
    assert_eq!(DType::F16.size_bytes(), 2);
    assert_eq!(bf16::from_f32(1.5).to_f32(), 1.5);
    assert_eq!(<f16 as Element>::from_f32(-2.0), f16::from_f32(-2.0));
}

/// Reference error levels on fixed vectors (4096 Gaussian / Student-t(3)
/// values, seed 42): relative RMS error must not regress past these (about
/// 10% above what the codecs achieve today).
#[test]
fn reference_rms_error() {
    let cases: [(Codec, &str, f64); 4] = [
        (Codec::from(Int8Block::new(256).unwrap()), "gauss", 0.0075), // today 0.00678
        (Codec::from(Int4Block::new(256).unwrap()), "gauss", 0.135),  // today 0.12214
        (Codec::from(Int8Block::new(256).unwrap()), "t3", 0.0155),    // today 0.01396
        (Codec::from(Int4Block::new(256).unwrap()), "t3", 0.275),     // today 0.25014
    ];
    for (c, data, limit) in cases {
        let x = match data {
            "gauss" => common::gaussian(4096, 42),
            _ => common::student_t(4096, 3, 42),
        };
        let w = wire(&c, &x);
        let mut y = vec![0f32; x.len()];
        c.decode(&w, &mut y).unwrap();
        let e = common::rel_rms(&x, &y);
        println!("{c:?} {data}: rel rms {e:.5}");
        assert!(e <= limit, "{c:?} {data}: {e} > {limit}");
    }
}
