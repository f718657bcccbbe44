@group(0) @binding(1) var<storage, read> W: array<u32>;
@group(0) @binding(2) var<storage, read_write> Y: array<u32>;
@group(0) @binding(3) var<storage, read_write> S: array<atomic<u32>>;

// q * scale as f32 bits (host: f32::from(q) * scale).
fn dequant(q: i32, s: u32) -> u32 {
    if s != 0u && s < TINY {
        // Positive subnormal scale: |q| * mant is exact in u32, then rounded.
        if q == 0 {
            return 0u;
        }
        let r = round_pack(u32(abs(q)) * s, false, -149);
        if q < 0 {
            return r | 0x80000000u;
        }
        return r;
    }
    return bitcast<u32>(f32(q) * bitcast<f32>(s));
}


// a + b like the host's f32 add: hardware when nothing is subnormal.
fn add_exact(a: u32, b: u32) -> u32 {
    let r = bitcast<u32>(bitcast<f32>(a) + bitcast<f32>(b));
    let am = a & 0x7fffffffu;
    let bm = b & 0x7fffffffu;
    if (am != 0u && am < TINY) || (bm != 0u && bm < TINY) || (r & 0x7fffffffu) < TINY {
        return soft_add(a, b);
    }
    return r;
}

// The scale of block b, validated. Errors are ranked like the host's:
// block b's scale (key 2 b bs) before its codes (key 2 i + 1), earlier
// blocks first.
fn block_scale(b: u32) -> u32 {
    let s = W[P.scale_word + b];
    if s > P.smax && s != 0x80000000u {
        atomicMin(&S[0], 2u * (b * P.bs));
    }
    return s;
}

// Validates and dequantizes code field k of `word` (element i) with scale s.
fn decode_elem(i: u32, word: u32, k: u32, s: u32) -> u32 {
    let c = (word >> (k * BITS)) & MASK;
    if c == BAD {
        atomicMin(&S[0], 2u * i + 1u);
    }
    let q = bitcast<i32>(c << (32u - BITS)) >> (32u - BITS);
    return dequant(q, s);
}

// One invocation per code word; `acc` selects y = x̂ or y += x̂.
fn decode_word(w: u32, acc: bool) {
    let word = W[w];
    if w + 1u == P.scale_word {
        atomicStore(&S[1], word);
    }
    // Consecutive elements: one division, then a step per block boundary.
    let i0 = w * PACK;
    var b = i0 / P.bs;
    var next = (b + 1u) * P.bs;
    var s = block_scale(b);
    for (var k = 0u; k < PACK; k++) {
        let i = i0 + k;
        if i < P.n {
            if i >= next {
                b += 1u;
                next += P.bs;
                s = block_scale(b);
            }
            let v = decode_elem(i, word, k, s);
            if acc {
                Y[i] = add_exact(Y[i], v ^ P.zero);
            } else {
                Y[i] = v;
            }
        }
    }
}

@compute @workgroup_size(WG)
fn dec(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = (wid.x + wid.y * P.grid_b) * WG + lid;
    if w < P.scale_word {
        decode_word(w, false);
    }
}

@compute @workgroup_size(WG)
fn dec_acc(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = (wid.x + wid.y * P.grid_b) * WG + lid;
    if w < P.scale_word {
        decode_word(w, true);
    }
}

// After the main pass: the raw scale of the block named by an error key.
@compute @workgroup_size(1)
fn dec_fix() {
    let key = atomicLoad(&S[0]);
    if key != 0xffffffffu && (key & 1u) == 0u {
        atomicStore(&S[2], W[P.scale_word + (key / 2u) / P.bs]);
    }
}
