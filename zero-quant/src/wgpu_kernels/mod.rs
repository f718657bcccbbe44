//! WGSL device kernels for [`Int8Block`](crate::Int8Block) and [`Int4Block`](crate::Int4Block) (feature `wgpu`),
//! **bit-identical** to the host codecs for `f32` tensors.
//!
//! # Use
//!
//! ```no_run
//! # fn main() -> zero_quant::Result<()> {
//! use zero_quant::{BlockCodec, Int4Block, WgpuQuantizer};
//!
//! // On a shared device: `WgpuQuantizer::new(device.clone(), queue.clone())`.
//! let q = WgpuQuantizer::new_default()?;
//! let codec = Int4Block::default();
//! let x: Vec<f32> = (0..5000).map(|i| (i as f32).sin()).collect();
//! let wire = q.encode_host_via_gpu(codec, &x)?; // == host encode bytes
//! let mut host = vec![0u8; codec.encoded_len(x.len())];
//! codec.encode(&x, &mut host)?;
//! assert_eq!(wire, host);
//! # Ok(())
//! # }
//! ```
//!
//! The device methods take `wgpu::Buffer`s the caller owns, bound from
//! offset 0 (sub-ranges are not supported yet):
//!
//! | method | reads | writes |
//! |---|---|---|
//! | [`encode`](WgpuQuantizer::encode) | `input`: `n` f32, `4 n` bytes | `output`: [`encoded_len(n)`](crate::BlockCodec::encoded_len) wire bytes |
//! | [`decode`](WgpuQuantizer::decode) | `wire` | `output`: `n` f32 |
//! | [`decode_accumulate`](WgpuQuantizer::decode_accumulate) | `wire`, `acc` | `acc += x̂` (f32, qgZ's reduction step) |
//!
//! Buffers need `STORAGE` usage and at least the stated size (larger is
//! fine; only the prefix is touched). Every call records its dispatches,
//! submits them and **waits** for a 16-byte status read-back, so that it can
//! return the same [`Error`] as the host codec (first non-finite input, first
//! invalid scale or code, padding); afterwards the results are in the
//! buffers and any later submission on the same queue sees them.
//!
//! # Device layout
//!
//! The wire buffer holds exactly the host wire bytes: the codes region is
//! padded to 4 bytes, so the whole wire is an `array<u32>` in the shader.
//! Word `w` of the codes holds elements `4w..4w+4` (int8, byte `k` = bits
//! `8k..8k+8`) or `8w..8w+8` (int4, nibble `k` = bits `4k..4k+4`), i.e. the
//! little-endian bytes of the word are the host's code bytes (element `2i`
//! in the low nibble of byte `i`). The scales follow as one f32 bit pattern
//! per word. Inputs and outputs are f32 arrays read and written as `u32`
//! bit patterns (no NaN canonicalisation on the way in).
//!
//! Encode runs two dispatches: one workgroup per block (absmax by a
//! workgroup `atomicMax` on the magnitude bits, the non-finite check by an
//! `atomicMin` of the index into the status buffer, then the scale and its
//! reciprocal into a scratch buffer), then one invocation per code word.
//! Decode is one invocation per code word. Any block size the host accepts
//! works, including blocks that do not start on a word (e.g. int8 with
//! block size 6): each element looks up its own block's scale.
//!
//! # Bit-exactness
//!
//! Tested against the host codecs on Mesa lavapipe
//! (`tests/wgpu_kernels.rs`); it holds on any conforming Vulkan/Metal/DX12
//! device because the kernels rely only on what the Vulkan precision rules
//! guarantee:
//!
//! - f32 `*` and `+` are correctly rounded (required by Vulkan); no float
//!   division is used (Vulkan allows 2.5 ulp for `/`): `absmax / qmax`,
//!   `1 / scale` and the subnormal-scale quotient are computed by integer
//!   long division with round-to-nearest-even done on the integers;
//! - rounding to a code (`round_half_away`, clamp) is done on the bits of
//!   the product `x * inv`, so no FMA contraction is possible; in
//!   `decode_accumulate` the product `q * scale` reaches the add through an
//!   integer `xor` with a uniform zero, so it cannot be fused either;
//! - drivers may flush subnormals (the Vulkan rules leave denormal handling to the driver), so every
//!   operation that could see a subnormal input or produce a subnormal
//!   result takes an integer path: subnormal `x` in encode, blocks with a
//!   subnormal scale (`absmax < qmax * 2^-126`) in encode and decode, and
//!   adds whose operands or result are subnormal in `decode_accumulate`.
//!
//! The host quantizes subnormal-scale blocks as `f32(f64(x) * (1 / f64(scale)))`;
//! the device uses the correctly rounded f32 quotient `x / scale`. They are
//! equal: `x / scale = N / S` with integers `N` and `S < 2^23`, so it is
//! either an exact f32 rounding midpoint (impossible: `x` would need 25
//! significant bits) or at least `2^(j-47)` away from every midpoint of
//! `[2^j, 2^(j+1))`, while the f64 path errs by less than `2^(j-50)`.
//!
//! Conditions: `f32` elements only (bf16 input is not implemented), `n`
//! below `2^31`, and each bound range within the device's
//! `max_storage_buffer_binding_size` (128 MiB on lavapipe: 32 Mi elements).
//!
//! # Sharing a device
//!
//! [`WgpuQuantizer::new`] takes a `wgpu::Device` and `wgpu::Queue` (both are
//! cheap reference-counted handles), so a caller that already has a device
//! passes clones of its own: zero-comm's wgpu loopback from the device its
//! communicators use, burn-wgpu from the device and queue of its wgpu
//! runtime. The quantizer compiles its eight pipelines once, at
//! construction, and is `Send + Sync`. A qgZ step on such a device is
//! `encode` into a send buffer, the all-to-all on the wire buffers, then
//! `decode_accumulate` of each received wire into one f32 accumulator.

/// The wgpu crate these kernels are built against (use it to create
/// buffers of the matching type).
pub use wgpu;

use std::num::NonZeroU64;
use std::sync::mpsc;

use wgpu::util::DeviceExt;

use crate::codec::{BlockCodec, Codec, WireLayout, sealed::Raw};
use crate::error::{Error, Result};
use crate::kernels::{I4, I8, QFormat};

mod dispatch;
mod host;

const COMMON_WGSL: &str = include_str!("common.wgsl");
/// `round_pack` and `soft_add`: f32 rounding and addition on bits, exact with subnormals on
/// drivers that flush them (zero-comm's wgpu loopback reduces with them too).
pub const SOFTFLOAT_WGSL: &str = include_str!("softfloat.wgsl");
const ENCODE_WGSL: &str = include_str!("encode.wgsl");
const DECODE_WGSL: &str = include_str!("decode.wgsl");

/// Invocations per workgroup.
const WG: u32 = 128;
/// Status words: error key or index (`u32::MAX` = none), then the last
/// code word (decode) or the offending value (encode), then the offending
/// scale (decode), then padding.
const STATUS_WORDS: u64 = 4;

/// Pipelines of one code format (int8 or int4).
#[derive(Debug)]
struct Format {
    enc_scales: wgpu::ComputePipeline,
    enc_codes: wgpu::ComputePipeline,
    enc_fix: wgpu::ComputePipeline,
    dec: wgpu::ComputePipeline,
    dec_acc: wgpu::ComputePipeline,
    dec_fix: wgpu::ComputePipeline,
    /// Bits of the largest scale `s` with `s * qmax` finite.
    smax: u32,
    name: &'static str,
    bad_code: u8,
}

/// Uniform block of the kernels (`Params` in `common.wgsl`).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,
    bs: u32,
    nb: u32,
    scale_word: u32,
    grid_a: u32,
    grid_b: u32,
    smax: u32,
    zero: u32,
    p100: u32,
    p49: u32,
    pad: [u32; 2],
}

/// WGSL encode / decode / decode-accumulate kernels for the int8 and int4
/// block codecs on one wgpu device. See the [module docs](self) for the
/// layout and the bit-exactness guarantee.
#[derive(Debug)]
pub struct WgpuQuantizer {
    device: wgpu::Device,
    queue: wgpu::Queue,
    enc_layout: wgpu::BindGroupLayout,
    dec_layout: wgpu::BindGroupLayout,
    int8: Format,
    int4: Format,
    max_groups: u32,
    max_binding: u64,
}

fn dev_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Device(format!("{what}: {}", one_line(&e.to_string())))
}

/// wgpu's multi-line error report ("Validation Error\n\nCaused by:\n  In …") as one line.
fn one_line(report: &str) -> String {
    report
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && *l != "Caused by:")
        .collect::<Vec<_>>()
        .join(": ")
        .trim_end_matches('.')
        .to_string()
}

/// Runs `f` inside validation and out-of-memory error scopes of this thread, returning the first
/// error either caught as one line. zero-comm's wgpu loopback runs its work in these scopes too.
pub fn error_scope<T>(
    device: &wgpu::Device,
    f: impl FnOnce() -> T,
) -> std::result::Result<T, String> {
    let validation = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let oom = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
    let out = f();
    let oom = pollster::block_on(oom.pop());
    let validation = pollster::block_on(validation.pop());
    match oom.or(validation) {
        Some(e) => Err(one_line(&e.to_string())),
        None => Ok(out),
    }
}

/// [`error_scope`] with a failure as [`Error::Device`] saying `what` failed.
fn scoped<T>(device: &wgpu::Device, what: &str, f: impl FnOnce() -> T) -> Result<T> {
    error_scope(device, f).map_err(|e| Error::Device(format!("{what}: {e}")))
}

/// The largest `s` with `s * qmax` finite, as bits (computed with the host's
/// own f32 multiply).
fn smax_bits(qmax: f32) -> u32 {
    let mut b = f32::MAX.to_bits();
    while !(f32::from_bits(b) * qmax).is_finite() {
        b -= 1;
    }
    b
}

impl WgpuQuantizer {
    /// Compiles the kernels on an existing device (e.g. clones of the device
    /// and queue of zero-comm's wgpu loopback or of burn-wgpu). Needs no
    /// optional feature and only default limits.
    pub fn new(device: wgpu::Device, queue: wgpu::Queue) -> Result<Self> {
        let entry = |binding, ty| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty,
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let ro = wgpu::BufferBindingType::Storage { read_only: true };
        let rw = wgpu::BufferBindingType::Storage { read_only: false };
        let uni = wgpu::BufferBindingType::Uniform;
        let built = scoped(&device, "compiling the zero-quant kernels", || {
            let enc_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some("zero-quant encode"),
                entries: &[
                    entry(0, uni),
                    entry(1, ro),
                    entry(2, rw),
                    entry(3, rw),
                    entry(4, rw),
                ],
            });
            let dec_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some("zero-quant decode"),
                entries: &[entry(0, uni), entry(1, ro), entry(2, rw), entry(3, rw)],
            });
            let int8 = Self::format::<I8>(&device, &enc_layout, &dec_layout, 4, 0x80);
            let int4 = Self::format::<I4>(&device, &enc_layout, &dec_layout, 8, 0x08);
            (enc_layout, dec_layout, int8, int4)
        })?;
        let (enc_layout, dec_layout, int8, int4) = built;
        let limits = device.limits();
        Ok(Self {
            max_groups: limits.max_compute_workgroups_per_dimension.max(1),
            max_binding: limits.max_storage_buffer_binding_size,
            device,
            queue,
            enc_layout,
            dec_layout,
            int8,
            int4,
        })
    }

    /// Requests the default adapter (honouring `WGPU_BACKEND` and friends;
    /// on a machine without a GPU, Mesa's lavapipe is a Vulkan adapter that
    /// works) and opens a device with its limits. Returns
    /// [`Error::Device`] when there is no adapter; never panics.
    pub fn new_default() -> Result<Self> {
        let instance =
            wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            ..Default::default()
        }))
        .map_err(|e| dev_err("no adapter", e))?;
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("zero-quant"),
            required_limits: adapter.limits(),
            ..Default::default()
        }))
        .map_err(|e| dev_err("request_device", e))?;
        Self::new(device, queue)
    }

    /// The device the kernels run on.
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    /// The queue the kernels are submitted to.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    fn format<F: QFormat>(
        device: &wgpu::Device,
        enc_layout: &wgpu::BindGroupLayout,
        dec_layout: &wgpu::BindGroupLayout,
        pack: u32,
        bad: u8,
    ) -> Format {
        let qmax = F::QMAX as u32;
        let bits = 32 / pack;
        let header = format!(
            "const QMAX: u32 = {qmax}u;\nconst QMAX_BITS: u32 = {:#x}u;\nconst PACK: u32 = {pack}u;\n\
             const BITS: u32 = {bits}u;\nconst MASK: u32 = {:#x}u;\nconst BAD: u32 = {bad:#x}u;\n\
             const WG: u32 = {WG}u;\n",
            (qmax as f32).to_bits(),
            (1u32 << bits) - 1,
        );
        let module = |body: &str| {
            device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(F::NAME),
                source: wgpu::ShaderSource::Wgsl(
                    format!("{header}{COMMON_WGSL}{SOFTFLOAT_WGSL}{body}").into(),
                ),
            })
        };
        let pipeline = |layout: &wgpu::BindGroupLayout, module: &wgpu::ShaderModule, entry| {
            let pl = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(entry),
                bind_group_layouts: &[Some(layout)],
                immediate_size: 0,
            });
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: Some(&pl),
                module,
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            })
        };
        let enc = module(ENCODE_WGSL);
        let dec = module(DECODE_WGSL);
        Format {
            enc_scales: pipeline(enc_layout, &enc, "enc_scales"),
            enc_codes: pipeline(enc_layout, &enc, "enc_codes"),
            enc_fix: pipeline(enc_layout, &enc, "enc_fix"),
            dec: pipeline(dec_layout, &dec, "dec"),
            dec_acc: pipeline(dec_layout, &dec, "dec_acc"),
            dec_fix: pipeline(dec_layout, &dec, "dec_fix"),
            smax: smax_bits(F::QMAX as f32),
            name: F::NAME,
            bad_code: bad,
        }
    }

    fn pick(&self, codec: Codec) -> Result<(&Format, Codec)> {
        match codec {
            Codec::Int8(_) => Ok((&self.int8, codec)),
            Codec::Int4(_) => Ok((&self.int4, codec)),
            Codec::Identity(_) => Err(Error::Device(
                "the identity codec has no device kernel (copy the buffer instead)".into(),
            )),
        }
    }

    /// Encodes `n` f32 values from `input` (at least `4 n` bytes) into the
    /// wire bytes of `codec` in `output` (at least
    /// [`encoded_len(n)`](crate::BlockCodec::encoded_len) bytes): the same
    /// bytes as the host [`encode`](crate::BlockCodec::encode), or the same
    /// [`Error::NonFinite`] (first index, its value). Waits for completion.
    pub fn encode(
        &self,
        codec: impl Into<Codec>,
        input: &wgpu::Buffer,
        n: usize,
        output: &wgpu::Buffer,
    ) -> Result<()> {
        let (f, codec) = self.pick(codec.into())?;
        if n == 0 {
            return Ok(());
        }
        let p = self.params(f, codec, n)?;
        let wire = codec.encoded_len(n) as u64;
        self.check_buffer(f.name, "gpu encode input bytes", input, 4 * n as u64)?;
        self.check_buffer(f.name, "gpu encode output bytes", output, wire)?;
        let uniform = self.uniform(&p);
        let scratch = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("zero-quant 1/scale"),
            size: 4 * u64::from(p.nb),
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let status = self.status_buffer();
        let resources = vec![
            uniform.as_entire_binding(),
            Self::binding(input, 4 * n as u64),
            Self::binding(output, wire),
            scratch.as_entire_binding(),
            status.as_entire_binding(),
        ];
        let s = self.run(
            "zero-quant encode",
            &self.enc_layout,
            resources,
            &status,
            &[
                (&f.enc_scales, self.grid(p.nb)),
                (&f.enc_fix, (1, 1)),
                (&f.enc_codes, self.grid(p.scale_word.div_ceil(WG))),
            ],
        )?;
        if s[0] != u32::MAX {
            return Err(Error::NonFinite {
                index: s[0] as usize,
                value: f32::from_bits(s[1]),
            });
        }
        Ok(())
    }

    /// Decodes the `codec` wire of `n` elements in `wire` into `n` f32 in
    /// `output`: the same values, bit for bit, as the host
    /// [`decode`](crate::BlockCodec::decode) into `f32`, and the same errors
    /// for corrupt wires. Waits for completion.
    pub fn decode(
        &self,
        codec: impl Into<Codec>,
        wire: &wgpu::Buffer,
        n: usize,
        output: &wgpu::Buffer,
    ) -> Result<()> {
        self.decode_impl(codec.into(), wire, n, output, false)
    }

    /// `acc += decode(wire)` for `n` f32 in `acc`, each product rounded to
    /// f32 before the add: bit for bit the host
    /// [`decode_accumulate`](crate::BlockCodec::decode_accumulate) (qgZ's
    /// reduction step). Waits for completion.
    pub fn decode_accumulate(
        &self,
        codec: impl Into<Codec>,
        wire: &wgpu::Buffer,
        n: usize,
        acc: &wgpu::Buffer,
    ) -> Result<()> {
        self.decode_impl(codec.into(), wire, n, acc, true)
    }

    fn uniform(&self, p: &Params) -> wgpu::Buffer {
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("zero-quant params"),
                contents: bytemuck::bytes_of(p),
                usage: wgpu::BufferUsages::UNIFORM,
            })
    }

    fn decode_impl(
        &self,
        codec: Codec,
        wire: &wgpu::Buffer,
        n: usize,
        output: &wgpu::Buffer,
        accumulate: bool,
    ) -> Result<()> {
        let (f, codec) = self.pick(codec)?;
        if n == 0 {
            return Ok(());
        }
        let p = self.params(f, codec, n)?;
        let l = codec.layout(n);
        let (wire_what, out_what) = if accumulate {
            (
                "gpu decode_accumulate src bytes",
                "gpu decode_accumulate acc bytes",
            )
        } else {
            ("gpu decode src bytes", "gpu decode dst bytes")
        };
        self.check_buffer(f.name, wire_what, wire, l.total_len as u64)?;
        self.check_buffer(f.name, out_what, output, 4 * n as u64)?;
        let uniform = self.uniform(&p);
        let status = self.status_buffer();
        let resources = vec![
            uniform.as_entire_binding(),
            Self::binding(wire, l.total_len as u64),
            Self::binding(output, 4 * n as u64),
            status.as_entire_binding(),
        ];
        let main = if accumulate { &f.dec_acc } else { &f.dec };
        let s = self.run(
            "zero-quant decode",
            &self.dec_layout,
            resources,
            &status,
            &[
                (main, self.grid(p.scale_word.div_ceil(WG))),
                (&f.dec_fix, (1, 1)),
            ],
        )?;
        // Host order: padding first, then blocks in order (scale, codes).
        check_padding(f.name, codec.packs_pairs(), n, &l, s[1])?;
        if s[0] != u32::MAX {
            let key = s[0] as usize;
            return Err(if key.is_multiple_of(2) {
                Error::InvalidScale {
                    codec: f.name,
                    block: key / 2 / codec.block_size().min(n),
                    value: f32::from_bits(s[2]),
                }
            } else {
                Error::InvalidCode {
                    codec: f.name,
                    index: key / 2,
                    code: f.bad_code,
                }
            });
        }
        Ok(())
    }
}

/// The host's padding check (`split_wire`), on the last code word as read
/// by the device: the unused high nibble after an odd int4 tensor, then the
/// zero bytes that pad the codes to 4 bytes.
fn check_padding(
    codec: &'static str,
    pairs: bool,
    n: usize,
    l: &WireLayout,
    last_word: u32,
) -> Result<()> {
    let bytes = last_word.to_le_bytes();
    let base = l.scales_offset - 4;
    if pairs && !n.is_multiple_of(2) {
        let b = bytes[l.codes_len - 1 - base];
        if b & 0xf0 != 0 {
            return Err(Error::Padding {
                codec,
                offset: l.codes_len - 1,
                byte: b,
            });
        }
    }
    for off in l.codes_len..l.scales_offset {
        let b = bytes[off - base];
        if b != 0 {
            return Err(Error::Padding {
                codec,
                offset: off,
                byte: b,
            });
        }
    }
    Ok(())
}

// The quantizer is shared across threads (wgpu handles are Send + Sync).
const _: fn() = || {
    fn assert<T: Send + Sync>() {}
    assert::<WgpuQuantizer>();
};
