//! The wgpu loopback's WGSL kernels and their pipelines ([`Kernels`]); `batch.rs` records them
//! into command buffers, `core.rs` holds them with the device.
//!
//! # Data layout
//!
//! Every buffer is an `array<u32>` to the shaders: WGSL has no `bf16` (and `f16` needs a feature
//! lavapipe may lack), so 16-bit elements travel as packed pairs (element `2w` in the low half of
//! word `w`) and bytes as packed quads, little-endian, exactly as the host lays them out.
//!
//! # Kernels
//!
//! - `move_bytes`: copies a byte range to another buffer at any alignment, one thread per
//!   destination word, keeping the bytes of partly covered words. Used where
//!   `copy_buffer_to_buffer` cannot be (offsets or sizes that are not multiples of 4).
//! - `reduce_out` and `reduce_acc` read up to [`SLOTS`] inputs each and add them in group-rank
//!   order, one IEEE `f32` addition per input as on the host: `((x₀ + x₁) + x₂) + …`. `reduce_out`
//!   then divides by `n` for `Mean`, rounds once to the element type and writes the output words
//!   (keeping the other half of a partly covered 16-bit word); `reduce_acc` keeps the running sum
//!   in an `f32` scratch buffer instead, for groups larger than [`SLOTS`].
//!
//! WebGPU forbids binding one buffer writable and read-only in the same dispatch (read-only
//! bindings of one buffer may repeat). An input that is *exactly* the output (an in-place
//! all-reduce's own chunk, NCCL's in-place reduce-scatter) is therefore read through the output
//! binding, by the thread that then overwrites it; only inputs that share the output's buffer
//! elsewhere (views of one pool) need the scratch path. So a reduce-scatter or all-reduce of up to
//! 4 ranks is a single pass over the data.
//!
//! Every choice a pass makes (element type, where the sum starts, how many inputs, which input is
//! the output, `Mean`) is a constant of its pipeline ([`Variant`], compiled on first use), never a
//! flag in the uniform block: a CPU adapter such as lavapipe runs both sides of a branch on a
//! uniform value under a mask, which made the first version 3 × slower.
//!
//! Only the additions use the GPU's float unit. The 16-bit conversions are ports of `half`'s
//! integer code (round to nearest, ties to even, subnormals, infinities; NaN payloads as `half`),
//! and `Mean`'s division is an exact integer long division rounded to nearest even, because WGSL
//! allows 2.5 ulp for `x / y` and leaves the rounding of `pack2x16float` to the implementation.
//! So the results equal the host loopback's bit for bit wherever the device adds `f32` with IEEE
//! rounding and keeps subnormals, which Vulkan requires of the rounding (lavapipe keeps
//! subnormals; the tests check both). One exception: a sum that involves a NaN is a NaN on both
//! backends, but which NaN (its payload bits) is up to each float unit.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use crate::element::DType;

/// Threads per workgroup of every kernel.
pub(super) const WORKGROUP: u64 = 64;

/// Bytes of the kernels' uniform `Params` block.
pub(super) const PARAMS_BYTES: u64 = 32;

/// Upper bound of one window (bytes moved, or `f32` accumulators × 4) per dispatch.
pub(super) const MAX_WINDOW_BYTES: u64 = 16 << 20;

/// Input slots of a reduction dispatch (read-only storage bindings 1 to 4).
pub(super) const SLOTS: usize = 4;

/// Shared by every kernel: one uniform block, [`SLOTS`] read-only sources, a read-write
/// destination.
use zero_quant::wgpu_kernels::SOFTFLOAT_WGSL;

const COMMON_WGSL: &str = r#"
struct Params {
    a0: u32,
    a1: u32,
    a2: u32,
    a3: u32,
    b: u32,
    count: u32,
    n: u32,
    pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> in0: array<u32>;
@group(0) @binding(2) var<storage, read> in1: array<u32>;
@group(0) @binding(3) var<storage, read> in2: array<u32>;
@group(0) @binding(4) var<storage, read> in3: array<u32>;
@group(0) @binding(5) var<storage, read_write> dst: array<u32>;

fn flat_id(gid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return gid.x + gid.y * nwg.x * WG;
}
"#;

/// Byte moves. `p.a0`: first source byte, `p.b`: first destination byte (both relative to the
/// bindings), `p.count`: bytes. One thread per destination word.
const MOVE_WGSL: &str = r#"
fn src_byte(i: u32) -> u32 {
    return (in0[i >> 2u] >> ((i & 3u) * 8u)) & 0xffu;
}

@compute @workgroup_size(WG)
fn move_bytes(@builtin(global_invocation_id) gid: vec3<u32>,
              @builtin(num_workgroups) nwg: vec3<u32>) {
    let start = p.b;
    let end = p.b + p.count;
    let w = (start >> 2u) + flat_id(gid, nwg);
    if (w > ((end - 1u) >> 2u)) {
        return;
    }
    let lo = w * 4u;
    var word = 0u;
    if (lo < start || lo + 4u > end) {
        word = dst[w];
    }
    for (var k = 0u; k < 4u; k++) {
        let i = lo + k;
        if (i >= start && i < end) {
            let sh = k * 8u;
            word = (word & ~(0xffu << sh)) | (src_byte(i - start + p.a0) << sh);
        }
    }
    dst[w] = word;
}
"#;

/// Reductions, for the constants of a [`Variant`] prepended to the source (see
/// [`Variant::source`]).
const REDUCE_WGSL: &str = r#"
// half::bf16::to_f32, as f32 bits.
fn bf16_to_f32(h: u32) -> u32 {
    if ((h & 0x7fffu) > 0x7f80u) {
        return (h | 0x40u) << 16u;
    }
    return h << 16u;
}

// half::f16::to_f32 (the portable fallback, same results as F16C), as f32 bits.
fn f16_to_f32(h: u32) -> u32 {
    if ((h & 0x7fffu) == 0u) {
        return h << 16u;
    }
    let sgn = (h & 0x8000u) << 16u;
    let hexp = h & 0x7c00u;
    let hman = h & 0x3ffu;
    if (hexp == 0x7c00u) {
        if (hman == 0u) {
            return sgn | 0x7f800000u;
        }
        return sgn | 0x7fc00000u | (hman << 13u);
    }
    if (hexp == 0u) {
        let e = countLeadingZeros(hman) - 22u;
        let ebits = (112u - e) << 23u;
        let man = (hman << (14u + e)) & 0x7fffffu;
        return sgn | ebits | man;
    }
    return sgn | (((hexp >> 10u) + 112u) << 23u) | (hman << 13u);
}

// half::bf16::from_f32 of f32 bits: round to nearest, ties to even.
fn f32_to_bf16(x: u32) -> u32 {
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (x >> 16u) | 0x40u;
    }
    let round_bit = 0x8000u;
    if ((x & round_bit) != 0u && (x & (3u * round_bit - 1u)) != 0u) {
        return (x >> 16u) + 1u;
    }
    return x >> 16u;
}

// half::f16::from_f32 of f32 bits (the portable fallback; F16C rounds the same way).
fn f32_to_f16(x: u32) -> u32 {
    let sgn = x & 0x80000000u;
    let ebits = x & 0x7f800000u;
    let man = x & 0x7fffffu;
    if (ebits == 0x7f800000u) {
        var nan_bit = 0u;
        if (man != 0u) {
            nan_bit = 0x200u;
        }
        return (sgn >> 16u) | 0x7c00u | nan_bit | (man >> 13u);
    }
    let half_sign = sgn >> 16u;
    let half_exp = i32(ebits >> 23u) - 112;
    if (half_exp >= 31) {
        return half_sign | 0x7c00u;
    }
    if (half_exp <= 0) {
        if (14 - half_exp > 24) {
            return half_sign;
        }
        let m = man | 0x800000u;
        var half_man = m >> u32(14 - half_exp);
        let round_bit = 1u << u32(13 - half_exp);
        if ((m & round_bit) != 0u && (m & (3u * round_bit - 1u)) != 0u) {
            half_man += 1u;
        }
        return half_sign | half_man;
    }
    let h = half_sign | (u32(half_exp) << 10u) | (man >> 13u);
    let round_bit = 0x1000u;
    if ((man & round_bit) != 0u && (man & (3u * round_bit - 1u)) != 0u) {
        return h + 1u;
    }
    return h;
}

// IEEE f32 division of the f32 with bits `xb` by the integer `n` (>= 1), rounded to nearest even,
// by integer long division: the bits of `x / f32(n)` on any IEEE machine.
fn div_rne(xb: u32, n: u32) -> u32 {
    let sgn = xb & 0x80000000u;
    let ex = (xb >> 23u) & 0xffu;
    let fr = xb & 0x7fffffu;
    if (ex == 0xffu) {
        if (fr != 0u) {
            return xb | 0x400000u;
        }
        return xb;
    }
    if ((ex == 0u && fr == 0u) || n == 1u) {
        return xb;
    }
    // |x| = m * 2^e with m in [2^23, 2^24).
    var m = fr | 0x800000u;
    var e = i32(ex) - 150;
    if (ex == 0u) {
        let s = countLeadingZeros(fr) - 8u;
        m = fr << s;
        e = -149 - i32(s);
    }
    // Quotient bits until q has 25 (24 + a guard bit); r is the exact remainder (r < n).
    var q = m / n;
    var r = m % n;
    loop {
        if (q >= 0x1000000u) {
            break;
        }
        r = r << 1u;
        q = q << 1u;
        if (r >= n) {
            r -= n;
            q |= 1u;
        }
        e -= 1;
    }
    // |x| / n = (q + r / n) * 2^e; the leading bit of q has biased exponent e + 151.
    let biased = e + 151;
    var sh = 1;
    if (biased < 1) {
        sh = min(2 - biased, 26);
    }
    let shu = u32(sh);
    let mant = q >> shu;
    let rem = q & ((1u << shu) - 1u);
    let halfway = 1u << (shu - 1u);
    var res = mant;
    if (rem > halfway || (rem == halfway && (r != 0u || (mant & 1u) == 1u))) {
        res += 1u;
    }
    // A carry out of the mantissa moves into the exponent field, as it should.
    return sgn | ((u32(max(biased, 1) - 1) << 23u) + res);
}

// A 16-bit element as f32 bits.
fn widen(h: u32) -> u32 {
    if (KIND == 1u) {
        return bf16_to_f32(h);
    }
    return f16_to_f32(h);
}

// a + b on f32 bits, rounded like the host. The hardware add serves when neither input is
// subnormal and the result is normal or non-finite; otherwise a driver may have flushed a
// subnormal to zero (NVIDIA's Vulkan driver does), so the exact integer `soft_add` redoes it.
fn is_sub(x: u32) -> bool {
    return (x & 0x7f800000u) == 0u && (x & 0x7fffffu) != 0u;
}

fn add(a: u32, b: u32) -> u32 {
    let r = bitcast<u32>(bitcast<f32>(a) + bitcast<f32>(b));
    let finite = (a & 0x7f800000u) != 0x7f800000u && (b & 0x7f800000u) != 0x7f800000u;
    if (finite && (is_sub(a) || is_sub(b) || (r & 0x7f800000u) == 0u)) {
        return soft_add(a, b);
    }
    return r;
}

// Element i of `dst` (relative to the binding) as f32 bits: the term of an input that is exactly
// the output (an all-reduce's own chunk), read by the thread that then overwrites it.
fn load_dst(i: u32) -> u32 {
    if (KIND == 0u) {
        return dst[i];
    }
    return widen((dst[i >> 1u] >> ((i & 1u) * 16u)) & 0xffffu);
}

// The sum for element e of the window, as f32 bits: the start (term 0, the accumulator in `dst`
// plus term 0, or the accumulator in slot 0) plus the other terms, in order. START, NIN and
// DST_TERM are constants of the pipeline, so the compiler drops the branches not taken.
fn value(e: u32) -> u32 {
    var s = 0u;
    if (START == START_ACC_IN) {
        s = in0[e];
    } else if (START == START_INPUT) {
        s = term0(e);
    } else {
        s = add(dst[e], term0(e));
    }
    if (NIN > 1u) {
        s = add(s, term1(e));
    }
    if (NIN > 2u) {
        s = add(s, term2(e));
    }
    if (NIN > 3u) {
        s = add(s, term3(e));
    }
    return s;
}

// `dst` is the f32 accumulator; one thread per element.
@compute @workgroup_size(WG)
fn reduce_acc(@builtin(global_invocation_id) gid: vec3<u32>,
              @builtin(num_workgroups) nwg: vec3<u32>) {
    let e = flat_id(gid, nwg);
    if (e < p.count) {
        dst[e] = value(e);
    }
}

// Element e of the window, divided by n for Mean, rounded to the element type.
fn reduced(e: u32) -> u32 {
    var b = value(e);
    if (MEAN) {
        b = div_rne(b, p.n);
    }
    if (KIND == 0u) {
        return b;
    }
    if (KIND == 1u) {
        return f32_to_bf16(b);
    }
    return f32_to_f16(b);
}

// `dst` is the output, from element `p.b` on; one thread per output word.
@compute @workgroup_size(WG)
fn reduce_out(@builtin(global_invocation_id) gid: vec3<u32>,
              @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = flat_id(gid, nwg);
    if (KIND == 0u) {
        if (t < p.count) {
            dst[p.b + t] = reduced(t);
        }
        return;
    }
    let start = p.b;
    let end = p.b + p.count;
    let w = (start >> 1u) + t;
    if (w > ((end - 1u) >> 1u)) {
        return;
    }
    var word = 0u;
    if (w * 2u < start || w * 2u + 2u > end) {
        word = dst[w];
    }
    for (var h = 0u; h < 2u; h++) {
        let q = w * 2u + h;
        if (q >= start && q < end) {
            let sh = h * 16u;
            word = (word & ~(0xffffu << sh)) | (reduced(q - start) << sh);
        }
    }
    dst[w] = word;
}
"#;

/// The pipelines of one device.
#[derive(Debug)]
pub(crate) struct Kernels {
    pub(super) layout: wgpu::BindGroupLayout,
    pipeline_layout: wgpu::PipelineLayout,
    pub(super) moves: wgpu::ComputePipeline,
    /// Reduction pipelines, compiled on first use.
    reduce: Mutex<HashMap<Variant, wgpu::ComputePipeline>>,
}

/// Where a reduction pass's sum starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Start {
    /// Input slot 0 (the first input of the group).
    Input,
    /// The `f32` accumulator in `dst`, plus input slot 0 (a later `reduce_acc` pass).
    Dst,
    /// The `f32` accumulator in input slot 0 (a `reduce_out` pass after `reduce_acc` passes).
    AccIn,
}

/// A specialisation of the reduction kernels: every choice a pass makes is a constant of its
/// pipeline, so the shader compiler removes the branches (a CPU adapter would otherwise run every
/// branch under a mask).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Variant {
    /// [`kind`] of the element type.
    pub(super) kind: usize,
    /// `reduce_out` (round into the output) rather than `reduce_acc`.
    pub(super) out: bool,
    pub(super) start: Start,
    /// Input slots read, 1 to [`SLOTS`].
    pub(super) nin: usize,
    /// Divide by `n` (`Mean`; `reduce_out` only).
    pub(super) mean: bool,
    /// The slot whose input is exactly the output, read from `dst` (`reduce_out` only); its
    /// binding is a placeholder.
    pub(super) dst_term: Option<usize>,
}

impl Variant {
    fn source(&self) -> String {
        let start = match self.start {
            Start::Input => 0,
            Start::Dst => 1,
            Start::AccIn => 2,
        };
        // One typed load and one term per input slot (WGSL cannot index bindings).
        let loads: String = (0..SLOTS)
            .map(|k| {
                format!(
                    "fn load{k}(i: u32) -> u32 {{\n    if (KIND == 0u) {{\n        \
                     return in{k}[i];\n    }}\n    \
                     return widen((in{k}[i >> 1u] >> ((i & 1u) * 16u)) & 0xffffu);\n}}\n\
                     fn term{k}(e: u32) -> u32 {{\n    if (DST_TERM == {k}u) {{\n        \
                     return load_dst(p.b + e);\n    }}\n    return load{k}(p.a{k} + e);\n}}\n"
                )
            })
            .collect();
        format!(
            "const WG: u32 = {WORKGROUP}u;\nconst KIND: u32 = {}u;\nconst NIN: u32 = {}u;\n\
             const START_INPUT: u32 = 0u;\nconst START_DST: u32 = 1u;\n\
             const START_ACC_IN: u32 = 2u;\nconst START: u32 = {start}u;\n\
             const MEAN: bool = {};\nconst DST_TERM: u32 = {}u;\n\
             {COMMON_WGSL}{SOFTFLOAT_WGSL}{loads}{REDUCE_WGSL}",
            self.kind,
            self.nin,
            self.mean,
            self.dst_term.unwrap_or(SLOTS)
        )
    }
}

/// Index of a reducible dtype in the per-type pipeline arrays.
pub(super) fn kind(dtype: DType) -> usize {
    match dtype {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
        // Rejected before anything moves (`Error::UnsupportedReduce`).
        DType::U8 => 0,
    }
}

impl Kernels {
    pub(super) fn new(device: &wgpu::Device) -> Kernels {
        let entry = |binding, read_only| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: match read_only {
                    None => wgpu::BufferBindingType::Uniform,
                    Some(read_only) => wgpu::BufferBindingType::Storage { read_only },
                },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("zero-comm kernels"),
            entries: &[
                entry(0, None),
                entry(1, Some(true)),
                entry(2, Some(true)),
                entry(3, Some(true)),
                entry(4, Some(true)),
                entry(5, Some(false)),
            ],
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("zero-comm kernels"),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let source = format!("const WG: u32 = {WORKGROUP}u;\n{COMMON_WGSL}{MOVE_WGSL}");
        let moves = Self::pipeline(device, &pipeline_layout, source, "move_bytes");
        let kernels = Kernels {
            layout,
            pipeline_layout,
            moves,
            reduce: Mutex::new(HashMap::new()),
        };
        // Compile one reduction now (every variant shares the source), so that a shader the
        // device rejects fails the device, not a collective.
        kernels.reduce_pipeline(
            device,
            Variant {
                kind: 1,
                out: true,
                start: Start::AccIn,
                nin: SLOTS,
                mean: true,
                dst_term: Some(1),
            },
        );
        kernels
    }

    fn pipeline(
        device: &wgpu::Device,
        layout: &wgpu::PipelineLayout,
        source: String,
        entry: &str,
    ) -> wgpu::ComputePipeline {
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("zero-comm kernels"),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        });
        device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(entry),
            layout: Some(layout),
            module: &module,
            entry_point: Some(entry),
            compilation_options: Default::default(),
            cache: None,
        })
    }

    /// The pipeline of `v`, compiled on first use (once per device: ranks wait for each other).
    pub(super) fn reduce_pipeline(
        &self,
        device: &wgpu::Device,
        v: Variant,
    ) -> wgpu::ComputePipeline {
        let mut cache = self.reduce.lock().unwrap_or_else(PoisonError::into_inner);
        cache
            .entry(v)
            .or_insert_with(|| {
                let entry = if v.out { "reduce_out" } else { "reduce_acc" };
                Self::pipeline(device, &self.pipeline_layout, v.source(), entry)
            })
            .clone()
    }
}
