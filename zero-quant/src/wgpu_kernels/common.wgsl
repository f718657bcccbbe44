// Shared by the encode and decode modules. The host prepends:
//   const QMAX: u32;  const QMAX_BITS: u32 (bits of f32(QMAX));
//   const PACK: u32 (codes per u32 word); const BITS: u32 (bits per code);
//   const MASK: u32; const BAD: u32 (the one code pattern never written);
//   const WG: u32 (workgroup size).
//
// Bit-exactness rules followed below (see the Rust module docs):
// - no float division (Vulkan allows 2.5 ulp): quotients are formed by
//   integer long division and rounded to nearest-even in integers;
// - no float operation whose inputs or result may be subnormal (a driver
//   may flush them): those cases take integer paths;
// - no `a * b + c` a compiler could fuse into an FMA: rounding to an integer
//   code is done on the bits of the product, and a product that feeds an
//   add is passed through `^ P.zero` (a uniform the compiler cannot see).

struct Params {
    n: u32,           // elements
    bs: u32,          // block size (clamped to n)
    nb: u32,          // blocks
    scale_word: u32,  // first scale word of the wire (= code words)
    grid_a: u32,      // workgroups along x, block dispatch
    grid_b: u32,      // workgroups along x, word dispatch
    smax: u32,        // bits of the largest scale s with s * QMAX finite
    zero: u32,        // always 0
    p100: u32,        // bits of 2^-100
    p49: u32,         // bits of 2^-49
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<uniform> P: Params;

const TINY: u32 = 0x00800000u;  // bits of f32::MIN_POSITIVE

// |f| bits (non-zero, finite) as (m, e) with m in [2^23, 2^24), |f| = m 2^e.
fn unpack_norm(b: u32) -> vec2<i32> {
    let ex = b >> 23u;
    var m = b & 0x7fffffu;
    if ex == 0u {
        let sh = countLeadingZeros(m) - 8u;
        return vec2<i32>(i32(m << sh), -149 - i32(sh));
    }
    return vec2<i32>(i32(m | 0x800000u), i32(ex) - 150);
}

// Correctly rounded a / b for finite a >= 0, b > 0 (bits, sign bit clear).
fn div_rn(a: u32, b: u32) -> u32 {
    if a == 0u {
        return 0u;
    }
    let ua = unpack_norm(a);
    let ub = unpack_norm(b);
    var r = u32(ua.x);
    let d = u32(ub.x);
    var e = ua.y - ub.y;
    if r < d {
        r = r << 1u;
        e -= 1;
    }
    var q = 0u;
    // `+ P.zero` keeps the loop a loop: unrolled, its 26 steps would run
    // (masked) in every SIMD lane of a CPU driver even when no lane needs it.
    for (var i = 0u; i < 26u + P.zero; i++) {
        q = q << 1u;
        if r >= d {
            r -= d;
            q |= 1u;
        }
        r = r << 1u;
    }
    return round_pack(q, r != 0u, e - 25);
}
