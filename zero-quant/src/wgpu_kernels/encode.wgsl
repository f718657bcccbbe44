@group(0) @binding(1) var<storage, read> X: array<u32>;
@group(0) @binding(2) var<storage, read_write> W: array<u32>;
@group(0) @binding(3) var<storage, read_write> INV: array<u32>;
@group(0) @binding(4) var<storage, read_write> S: array<atomic<u32>>;

var<workgroup> wg_max: atomic<u32>;

// The stored scale for a block with largest magnitude bits `m` (finite):
// host `scale_for`.
fn scale_of(m: u32) -> u32 {
    if m == 0u {
        return 0u;
    }
    var s = div_rn(m, QMAX_BITS);
    if s == 0u {
        s = 1u;
    }
    if s > P.smax {
        s -= 1u;
    }
    return s;
}

// min(round_half_away(|v|), QMAX) from the bits of |v| (finite or not).
fn round_code(t: u32) -> u32 {
    let ex = t >> 23u;
    if ex < 126u {
        return 0u;
    }
    if ex >= 135u {
        return QMAX;
    }
    let m = (t & 0x7fffffu) | 0x800000u;
    let sh = 150u - ex;
    return min((m + (1u << (sh - 1u))) >> sh, QMAX);
}

// The code of element bits `xb` in a block with scale bits `s` and
// reciprocal bits `inv` (0 unless s is normal), as an i32.
fn quant(xb: u32, s: u32, inv: u32) -> i32 {
    let mag = xb & 0x7fffffffu;
    var t: u32;
    if s < TINY {
        if s == 0u {
            return 0;
        }
        // Subnormal scale: the host forms x / scale in f64, which rounds to
        // the correctly rounded f32 quotient here (proof in the Rust docs).
        t = div_rn(mag, s);
    } else if mag < TINY {
        // Zero or subnormal x: x * inv == f32(mant) * (inv * 2^-149); the
        // product only matters (>= 1/8) when inv * 2^-149 is normal.
        let b = bitcast<f32>(inv) * bitcast<f32>(P.p100) * bitcast<f32>(P.p49);
        t = bitcast<u32>(f32(mag) * b);
    } else {
        t = bitcast<u32>(bitcast<f32>(mag) * bitcast<f32>(inv));
    }
    let q = i32(round_code(t & 0x7fffffffu));
    if (xb >> 31u) != 0u {
        return -q;
    }
    return q;
}

// Pass 1: one workgroup per block. absmax, non-finite check, scale, 1/scale.
@compute @workgroup_size(WG)
fn enc_scales(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let b = wid.x + wid.y * P.grid_a;
    if b >= P.nb {
        return;
    }
    if lid == 0u {
        atomicStore(&wg_max, 0u);
    }
    workgroupBarrier();
    let start = b * P.bs;
    let end = min(start + P.bs, P.n);
    var m = 0u;
    for (var i = start + lid; i < end; i += WG) {
        let a = X[i] & 0x7fffffffu;
        if a >= 0x7f800000u {
            atomicMin(&S[0], i);
        }
        m = max(m, a);
    }
    atomicMax(&wg_max, m);
    workgroupBarrier();
    if lid == 0u {
        let am = atomicLoad(&wg_max);
        if am < 0x7f800000u {
            let s = scale_of(am);
            W[P.scale_word + b] = s;
            var inv = 0u;
            if s >= TINY {
                inv = div_rn(0x3f800000u, s);
            }
            INV[b] = inv;
        }
    }
}

// Pass 2: one invocation per u32 word of codes (PACK elements).
@compute @workgroup_size(WG)
fn enc_codes(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = (wid.x + wid.y * P.grid_b) * WG + lid;
    if w >= P.scale_word {
        return;
    }
    // The word's elements are consecutive: one division for the first
    // element's block, then a step whenever a block boundary is crossed.
    let i0 = w * PACK;
    var b = i0 / P.bs;
    var next = (b + 1u) * P.bs;
    var s = W[P.scale_word + b];
    var inv = INV[b];
    var word = 0u;
    for (var k = 0u; k < PACK; k++) {
        let i = i0 + k;
        if i < P.n {
            if i >= next {
                b += 1u;
                next += P.bs;
                s = W[P.scale_word + b];
                inv = INV[b];
            }
            let q = quant(X[i], s, inv);
            word |= (bitcast<u32>(q) & MASK) << (k * BITS);
        }
    }
    W[w] = word;
}

// After pass 1: the value of the first non-finite element, for the error.
@compute @workgroup_size(1)
fn enc_fix() {
    let i = atomicLoad(&S[0]);
    if i != 0xffffffffu {
        atomicStore(&S[1], X[i]);
    }
}
