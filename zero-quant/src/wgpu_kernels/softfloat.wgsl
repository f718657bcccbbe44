// Software f32 arithmetic on bits, shared by zero-quant's codec kernels and zero-comm's wgpu
// loopback (`zero_quant::wgpu_kernels::SOFTFLOAT_WGSL`): exact wherever a driver may flush
// subnormal inputs or results to zero (NVIDIA's Vulkan driver does). Needs no bindings.

// Correctly rounded (nearest, ties to even) f32 bits of (sig + r) * 2^e,
// where 0 < sig < 2^31 and 0 <= r < 1 with `sticky` = (r != 0). The result
// must not overflow. Handles subnormal and zero results.
fn round_pack(sig: u32, sticky: bool, e: i32) -> u32 {
    let top = i32(31u - countLeadingZeros(sig));
    let sub = top + e < -126;
    var shift = top - 23;
    if sub {
        shift = -149 - e;
    }
    var kept: u32;
    if shift <= 0 {
        kept = sig << u32(-shift);
    } else if shift >= 32 {
        return 0u;
    } else {
        let s = u32(shift);
        kept = sig >> s;
        let rem = sig & ((1u << s) - 1u);
        let half = 1u << (s - 1u);
        if rem > half || (rem == half && (sticky || (kept & 1u) == 1u)) {
            kept += 1u;
        }
    }
    if sub {
        return kept;
    }
    // kept is in [2^23, 2^24]; a carry to 2^24 bumps the exponent.
    return (u32(top + e + 127 - 1) << 23u) + kept;
}

// Exact a + b on f32 bits, subnormal inputs and outputs included, for finite
// operands. Guard, round and a jammed sticky bit (3 extra bits).
fn soft_add(a: u32, b: u32) -> u32 {
    var x = a;
    var y = b;
    if (y & 0x7fffffffu) > (x & 0x7fffffffu) {
        x = b;
        y = a;
    }
    let xm = x & 0x7fffffffu;
    let ym = y & 0x7fffffffu;
    if ym == 0u {
        if xm == 0u {
            return a & b;
        }
        return x;
    }
    let xe = xm >> 23u;
    let ye = ym >> 23u;
    var xs = xm & 0x7fffffu;
    var ys = ym & 0x7fffffu;
    var ex = -149;
    var ey = -149;
    if xe != 0u {
        xs |= 0x800000u;
        ex = i32(xe) - 150;
    }
    if ye != 0u {
        ys |= 0x800000u;
        ey = i32(ye) - 150;
    }
    let xx = xs << 3u;
    var yy = ys << 3u;
    let d = u32(ex - ey);
    if d >= 27u {
        yy = 1u;
    } else if d > 0u {
        let lost = yy & ((1u << d) - 1u);
        yy = (yy >> d) | select(0u, 1u, lost != 0u);
    }
    var sum: u32;
    if ((x ^ y) >> 31u) == 0u {
        sum = xx + yy;
    } else {
        sum = xx - yy;
    }
    if sum == 0u {
        return 0u;
    }
    return (x & 0x80000000u) | round_pack(sum, false, ex - 3);
}
