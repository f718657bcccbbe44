//! Golden wire layouts: hand-computed bytes for tiny inputs, and insta
//! snapshots of a ramp through every codec.

mod common;

use std::fmt::Write as _;

use half::{bf16, f16};
use zero_quant::{BlockCodec, Codec, Error, Identity, Int4Block, Int8Block};

/// The ramp every snapshot encodes: 19 elements (an odd count, so the last
/// block is partial and int4 has a spare nibble), `(i - 9) * 0.25` except
/// element 4, which is `-3.0` so that blocks have different scales.
fn ramp() -> Vec<f32> {
    (0..19)
        .map(|i| {
            if i == 4 {
                -3.0
            } else {
                (i as f32 - 9.0) * 0.25
            }
        })
        .collect()
}

/// Layout header, hex dump, scales, and the decoded values.
fn describe(codec: &Codec, x: &[f32]) -> String {
    let l = codec.layout(x.len());
    let mut wire = vec![0u8; l.total_len];
    codec.encode(x, &mut wire).unwrap();
    let mut y = vec![0f32; x.len()];
    codec.decode(&wire, &mut y).unwrap();
    let mut s = String::new();
    writeln!(s, "codec: {codec:?}").unwrap();
    writeln!(s, "input: {x:?}").unwrap();
    writeln!(
        s,
        "layout: codes 0..{}, padding {}..{}, scales {}..{} ({} blocks)",
        l.codes_len, l.codes_len, l.scales_offset, l.scales_offset, l.total_len, l.num_blocks
    )
    .unwrap();
    s.push_str(&common::hex_dump(&wire));
    let scales: Vec<f32> = wire[l.scales_offset..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    writeln!(s, "scales: {scales:?}").unwrap();
    writeln!(s, "decoded: {y:?}").unwrap();
    s
}

#[test]
fn ramp_int8_block8() {
    let c = Codec::from(Int8Block::new(8).unwrap());
    insta::assert_snapshot!(describe(&c, &ramp()));
}

#[test]
fn ramp_int4_block8() {
    let c = Codec::from(Int4Block::new(8).unwrap());
    insta::assert_snapshot!(describe(&c, &ramp()));
}

#[test]
fn ramp_identity() {
    insta::assert_snapshot!(describe(&Codec::from(Identity), &ramp()));
}

/// The ramp is exact in bf16 and f16, so those encode to the same bytes.
#[test]
fn ramp_bytes_do_not_depend_on_input_dtype() {
    let x = ramp();
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
    for codec in [
        Codec::from(Int8Block::new(8).unwrap()),
        Codec::from(Int4Block::new(8).unwrap()),
        Codec::from(Identity),
    ] {
        let n = codec.encoded_len(x.len());
        let (mut a, mut b, mut h) = (vec![0u8; n], vec![0u8; n], vec![0u8; n]);
        codec.encode(&x, &mut a).unwrap();
        codec.encode(&xb, &mut b).unwrap();
        codec.encode(&xh, &mut h).unwrap();
        assert_eq!(a, b, "{codec:?}");
        assert_eq!(a, h, "{codec:?}");
    }
}

/// Bytes worked out by hand from the documented layout (no snapshot
/// involved), so a layout change cannot slip through as a snapshot update.
#[test]
fn hand_computed_int8() {
    let c = Int8Block::new(4).unwrap();
    // Block 0: absmax 127 -> scale 1.0; 0.5 and -0.5 round away from zero.
    // Block 1 (partial, 1 element): 0 -> scale 0, code 0.
    let x = [127.0f32, -127.0, 0.5, -0.5, 0.0];
    let mut w = vec![0u8; c.encoded_len(x.len())];
    c.encode(&x, &mut w).unwrap();
    #[rustfmt::skip]
    let want = [
        0x7f, 0x81, 0x01, 0xff, 0x00, // codes: 127, -127, 1, -1, 0
        0x00, 0x00, 0x00,             // padding to 8
        0x00, 0x00, 0x80, 0x3f,       // scale 1.0
        0x00, 0x00, 0x00, 0x00,       // scale 0.0
    ];
    assert_eq!(w, want);
    let mut y = [1.0f32; 5];
    c.decode(&w, &mut y).unwrap();
    assert_eq!(y, [127.0, -127.0, 1.0, -1.0, 0.0]);
}

#[test]
fn hand_computed_int4() {
    let c = Int4Block::new(4).unwrap();
    // One block: absmax 7 -> scale 1.0. Element 2i low nibble, 2i+1 high.
    // Element 4 starts block 1 alone: scale 2/7, code 7, high nibble 0.
    let x = [7.0f32, -7.0, 2.5, -0.4, 2.0];
    let mut w = vec![0u8; c.encoded_len(x.len())];
    c.encode(&x, &mut w).unwrap();
    let s1 = (2.0f32 / 7.0).to_le_bytes();
    #[rustfmt::skip]
    let want = [
        0x97,       // lo 7 (0x7), hi -7 (0x9)
        0x03,       // lo 3 (2.5 rounds away), hi 0 (-0.4 rounds to 0)
        0x07,       // lo 7, hi unused (0)
        0x00,       // padding to 4
        0x00, 0x00, 0x80, 0x3f, // scale 1.0
        s1[0], s1[1], s1[2], s1[3],
    ];
    assert_eq!(w, want);
}

#[test]
fn hand_computed_identity() {
    let x = [1.0f32, -2.5];
    let mut w = vec![0u8; Identity.encoded_len(2)];
    Identity.encode(&x, &mut w).unwrap();
    assert_eq!(w, [0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x20, 0xc0]);
}

/// Every error message, for review; none ends with a full stop.
#[test]
fn error_messages() {
    let errors = [
        Error::NonFinite {
            index: 7,
            value: f32::NAN,
        },
        Error::BufferLen {
            codec: "int8",
            what: "encode dst bytes",
            expected: 12,
            got: 11,
        },
        Error::BlockSize {
            codec: "int4",
            multiple_of: 2,
            got: 3,
        },
        Error::InvalidScale {
            codec: "int8",
            block: 2,
            value: -1.0,
        },
        Error::InvalidCode {
            codec: "int4",
            index: 5,
            code: 0x08,
        },
        Error::Overflow {
            index: 3,
            value: 70000.0,
            dtype: zero_quant::DType::F16,
        },
        Error::Padding {
            codec: "int8",
            offset: 6,
            byte: 0xab,
        },
    ];
    let text: String = errors.iter().map(|e| format!("{e}\n")).collect();
    for line in text.lines() {
        assert!(!line.ends_with('.'), "{line}");
    }
    insta::assert_snapshot!(text);
}
