// CUDA kernels of the block codecs (feature `cuda`), bit-identical to the
// host codecs in `src/kernels.rs`. Compiled to PTX offline by
// `cargo xtask ptx` (NVRTC, arch compute_80); the PTX is checked in as
// `kernels.ptx` and JIT-compiled by the driver at run time, so neither nvcc
// nor NVRTC is needed to build or run. A test checks that the PTX was made
// from this exact source (its FNV-1a hash is in the PTX's first line).
//
// Bit-exactness: every float operation that feeds a result is an explicit
// IEEE intrinsic (`__fdiv_rn`, `__fmul_rn`, `__fadd_rn`, `__dmul_rn`, ...),
// so no compiler flag can contract or approximate it, and PTX is compiled
// without flush-to-zero, so subnormals behave as on the host. The steps are
// the host's, one for one:
//   absmax (bits of |x|) -> scale = absmax / QMAX (with the host's zero,
//   underflow and overflow cases) -> q = clamp(trunc(x * (1/scale) +
//   copysign(0.5 - 2^-25, .)), +-QMAX) -> x^ = q * scale.
//
// Errors go through one 64-bit word that kernels lower with atomicMin, so the
// smallest key wins whatever the thread order, and that key is the first error
// the host codec would report:
//   encode: the index of the first non-finite input element;
//   decode/accumulate: padding errors (bit 63 clear, the wire offset) before
//   block errors (bit 63 set, then block << 32 | kind << 30 | index in block),
//   kind 0 = invalid scale, 1 = invalid code, 2 = overflow of bf16/f16.
// The word starts at ~0 (no error).

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define THREADS 256

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

struct F32 {
    typedef float T;
    static const bool NARROW = false;
    __device__ static __forceinline__ float load(float v) { return v; }
    __device__ static __forceinline__ float store(float v) { return v; }
    __device__ static __forceinline__ bool finite(float v) { return true; }
};
struct BF16 {
    typedef u16 T;
    static const bool NARROW = true;
    __device__ static __forceinline__ float load(u16 v) { return bf16_to_f32(v); }
    __device__ static __forceinline__ u16 store(float v) { return f32_to_bf16(v); }
    __device__ static __forceinline__ bool finite(u16 v) { return (v & 0x7f80u) != 0x7f80u; }
};
struct F16 {
    typedef u16 T;
    static const bool NARROW = true;
    __device__ static __forceinline__ float load(u16 v) { return f16_to_f32(v); }
    __device__ static __forceinline__ u16 store(float v) { return f32_to_f16(v); }
    __device__ static __forceinline__ bool finite(u16 v) { return (v & 0x7c00u) != 0x7c00u; }
};

// 0.5 - 2^-25: trunc(v + copysign(HALF_BELOW, v)) rounds half away from zero.
#define HALF_BELOW_BITS 0x3effffffu
#define NON_FINITE_BITS 0x7f800000u

__device__ __forceinline__ int quantize(float v, float qmax) {
    float r = __fadd_rn(v, copysignf(__uint_as_float(HALF_BELOW_BITS), v));
    r = fminf(fmaxf(r, -qmax), qmax);
    return __float2int_rz(r);
}

// The host's `scale_for`: absmax / QMAX with its three special cases.
__device__ __forceinline__ float scale_for(u32 m, float qmax) {
    if (m == 0u || m >= NON_FINITE_BITS) return 0.0f;
    float s = __fdiv_rn(__uint_as_float(m), qmax);
    if (s == 0.0f) s = __uint_as_float(1u);
    if (isinf(__fmul_rn(s, qmax))) s = __uint_as_float(__float_as_uint(s) - 1u);
    return s;
}

__device__ __forceinline__ bool scale_ok(float s, float qmax) {
    return s >= 0.0f && isfinite(__fmul_rn(s, qmax));
}

// Quantizes element x of a block whose scale is s (not zero).
__device__ __forceinline__ int quant_one(float x, float s, float inv, float qmax) {
    if (s >= 1.17549435e-38f) return quantize(__fmul_rn(x, inv), qmax);
    // Subnormal scale: 1/s overflows f32, so x / s is formed in f64.
    double inv64 = __ddiv_rn(1.0, (double)s);
    float t = __double2float_rn(__dmul_rn((double)x, inv64));
    return quantize(t, qmax);
}

__device__ __forceinline__ u32 block_max(u32 m, u32* red) {
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = m;
    __syncthreads();
    if (warp == 0) {
        m = lane < (int)(blockDim.x >> 5) ? red[lane] : 0u;
        for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) red[0] = m;
    }
    __syncthreads();
    m = red[0];
    __syncthreads();
    return m;
}

template <class E, int QMAX, bool I4>
__device__ __forceinline__ void encode(const typename E::T* __restrict__ x, u64 n, u64 bs,
                                       u8* __restrict__ codes, float* __restrict__ scales,
                                       u64* err) {
    __shared__ u32 red[32];
    const float qmax = (float)QMAX;
    u64 nb = (n + bs - 1) / bs;
    for (u64 b = blockIdx.x; b < nb; b += gridDim.x) {
        u64 lo = b * bs;
        u64 len = min(bs, n - lo);
        u32 m = 0u;
        for (u64 i = threadIdx.x; i < len; i += blockDim.x) {
            u32 a = __float_as_uint(E::load(x[lo + i])) & 0x7fffffffu;
            if (a >= NON_FINITE_BITS) atomicMin(err, lo + i);
            m = max(m, a);
        }
        m = block_max(m, red);
        float s = scale_for(m, qmax);
        if (threadIdx.x == 0) scales[b] = s;
        float inv = (s >= 1.17549435e-38f) ? __fdiv_rn(1.0f, s) : 0.0f;
        if (I4) {
            u64 pairs = (len + 1) / 2;
            for (u64 j = threadIdx.x; j < pairs; j += blockDim.x) {
                u64 i = lo + 2 * j;
                int q0 = s == 0.0f ? 0 : quant_one(E::load(x[i]), s, inv, qmax);
                int q1 = (s == 0.0f || 2 * j + 1 >= len) ? 0 : quant_one(E::load(x[i + 1]), s, inv, qmax);
                codes[lo / 2 + j] = (u8)((q0 & 0x0f) | ((q1 & 0x0f) << 4));
            }
        } else {
            for (u64 i = threadIdx.x; i < len; i += blockDim.x) {
                int q = s == 0.0f ? 0 : quant_one(E::load(x[lo + i]), s, inv, qmax);
                codes[lo + i] = (u8)(signed char)q;
            }
        }
    }
}

__device__ __forceinline__ u64 block_key(u64 b, u32 kind, u64 i) {
    return (1ull << 63) | (b << 32) | ((u64)kind << 30) | i;
}

// The code of element i (absolute), and whether it is the invalid pattern.
template <bool I4>
__device__ __forceinline__ int code_at(const u8* __restrict__ codes, u64 i, bool* bad) {
    if (I4) {
        u32 byte = codes[i / 2];
        u32 nib = (i & 1) ? (byte >> 4) : (byte & 0x0fu);
        *bad = nib == 0x8u;
        return ((int)(nib << 28)) >> 28;
    } else {
        u8 c = codes[i];
        *bad = c == 0x80u;
        return (int)(signed char)c;
    }
}

// ACC = false: y[i] = q * s rounded to E. ACC = true (E = F32): y[i] += q * s.
template <class E, int QMAX, bool I4, bool ACC>
__device__ __forceinline__ void decode(const u8* __restrict__ codes, const float* __restrict__ scales,
                                       u64 n, u64 bs, typename E::T* __restrict__ y, u64* err) {
    const float qmax = (float)QMAX;
    u64 nb = (n + bs - 1) / bs;
    for (u64 b = blockIdx.x; b < nb; b += gridDim.x) {
        float s = scales[b];
        if (!scale_ok(s, qmax)) {
            if (threadIdx.x == 0) atomicMin(err, block_key(b, 0, 0));
            continue;
        }
        u64 lo = b * bs;
        u64 len = min(bs, n - lo);
        for (u64 i = threadIdx.x; i < len; i += blockDim.x) {
            bool bad;
            int q = code_at<I4>(codes, lo + i, &bad);
            if (bad) {
                atomicMin(err, block_key(b, 1, i));
                continue;
            }
            float v = __fmul_rn((float)q, s);
            if (ACC) {
                y[lo + i] = __fadd_rn(E::load(y[lo + i]), v);
            } else {
                typename E::T o = E::store(v);
                if (E::NARROW && !E::finite(o)) atomicMin(err, block_key(b, 2, i));
                y[lo + i] = o;
            }
        }
    }
}

#define ENCODE(name, E, QMAX, I4)                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS)                                    \
        name(const E::T* x, u64 n, u64 bs, u8* codes, float* scales, u64* err) {             \
        encode<E, QMAX, I4>(x, n, bs, codes, scales, err);                                   \
    }
#define DECODE(name, E, QMAX, I4, ACC)                                                       \
    extern "C" __global__ void __launch_bounds__(THREADS)                                    \
        name(const u8* codes, const float* scales, u64 n, u64 bs, E::T* y, u64* err) {       \
        decode<E, QMAX, I4, ACC>(codes, scales, n, bs, y, err);                              \
    }

ENCODE(zq_encode_i8_f32, F32, 127, false)
ENCODE(zq_encode_i8_bf16, BF16, 127, false)
ENCODE(zq_encode_i8_f16, F16, 127, false)
ENCODE(zq_encode_i4_f32, F32, 7, true)
ENCODE(zq_encode_i4_bf16, BF16, 7, true)
ENCODE(zq_encode_i4_f16, F16, 7, true)

DECODE(zq_decode_i8_f32, F32, 127, false, false)
DECODE(zq_decode_i8_bf16, BF16, 127, false, false)
DECODE(zq_decode_i8_f16, F16, 127, false, false)
DECODE(zq_decode_i4_f32, F32, 7, true, false)
DECODE(zq_decode_i4_bf16, BF16, 7, true, false)
DECODE(zq_decode_i4_f16, F16, 7, true, false)
DECODE(zq_accumulate_i8, F32, 127, false, true)
DECODE(zq_accumulate_i4, F32, 7, true, true)

// Padding of a wire: the bytes between the codes and the scales, and the
// unused high nibble after an odd int4 tensor, must be zero. One thread.
extern "C" __global__ void zq_check_padding(const u8* wire, u64 codes_len, u64 scales_offset,
                                            u32 odd_int4, u64* err) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    if (odd_int4 && codes_len > 0 && (wire[codes_len - 1] & 0xf0u) != 0) {
        atomicMin(err, codes_len - 1);
        return;
    }
    for (u64 o = codes_len; o < scales_offset; ++o) {
        if (wire[o] != 0) {
            atomicMin(err, o);
            return;
        }
    }
}
