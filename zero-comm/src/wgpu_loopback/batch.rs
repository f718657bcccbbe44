//! [`Batch`]: the byte moves and reductions one rank records for one step of a collective,
//! turned into one command buffer of copies and kernel dispatches (see `kernels.rs`).

use crate::element::{DType, ReduceOp};

use super::buffer::REQUIRED_USAGES;
use super::core::{Core, scoped};
use super::kernels::{PARAMS_BYTES, SLOTS, Start, Variant, WORKGROUP, kind};

/// A location in device memory: a buffer and an absolute byte offset.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Loc<'a> {
    pub(crate) buffer: &'a wgpu::Buffer,
    pub(crate) byte: u64,
}

/// A buffer a command uses: a caller's, or the rank's scratch buffer.
#[derive(Clone, Debug)]
enum Res {
    User(wgpu::Buffer),
    Scratch,
}

/// A storage binding: `size` bytes of `res` from `offset` (a multiple of the storage alignment).
#[derive(Clone, Debug)]
struct Bind {
    res: Res,
    offset: u64,
    size: u64,
}

#[derive(Clone, Copy, Debug)]
enum Pipe {
    Move,
    Reduce(Variant),
}

#[derive(Debug)]
enum Cmd {
    Copy {
        src: Res,
        src_offset: u64,
        dst: Res,
        dst_offset: u64,
        size: u64,
    },
    Dispatch {
        pipe: Pipe,
        params: [u32; 8],
        /// Input slots in order, 1 to [`SLOTS`]; unused slots repeat the first.
        inputs: Vec<Bind>,
        dst: Bind,
        threads: u64,
    },
}

/// The commands one rank records for one step of a collective, submitted together.
#[derive(Debug)]
pub struct Batch<'c> {
    core: &'c Core,
    cmds: Vec<Cmd>,
    /// Bytes of scratch the commands need.
    scratch: u64,
}

/// One window of a reduction: `w` elements from element `start` on, of kind `k` (`es` bytes),
/// over a group of `n`.
#[derive(Clone, Copy, Debug)]
struct Reduction {
    k: usize,
    es: u64,
    start: u64,
    w: u64,
    n: u32,
}

impl Reduction {
    /// Binds the window of each of `xs` into the slots after `first`; returns the slots, the
    /// params with their element offsets, and the slot of the input that is exactly `out` (if
    /// `out` is given), which gets a placeholder binding.
    fn slots(
        &self,
        batch: &mut Batch<'_>,
        first: Option<&Bind>,
        xs: &[Loc<'_>],
        out: Option<Loc<'_>>,
    ) -> (Vec<Bind>, [u32; 8], Option<usize>) {
        let mut params = [0; 8];
        let mut slots: Vec<Bind> = first.into_iter().cloned().collect();
        let mut dst_term = None;
        for x in xs {
            if out.is_some_and(|o| o.buffer == x.buffer && o.byte == x.byte) {
                dst_term = Some(slots.len());
                slots.push(batch.bind(Res::Scratch, 0, 4).0);
                continue;
            }
            let at = x.byte + self.start * self.es;
            let (bind, rel) = batch.bind(Res::User(x.buffer.clone()), at, self.w * self.es);
            params[slots.len()] = (rel / self.es) as u32;
            slots.push(bind);
        }
        params[5] = self.w as u32;
        params[6] = self.n;
        (slots, params, dst_term)
    }

    /// A `reduce_acc` pass: adds `xs` (1 to [`SLOTS`]) to the accumulator `acc`, or starts it
    /// with them.
    fn acc(&self, batch: &mut Batch<'_>, xs: &[Loc<'_>], acc: &Bind, start: Start) {
        let (inputs, params, _) = self.slots(batch, None, xs, None);
        let variant = Variant {
            kind: self.k,
            out: false,
            start,
            nin: inputs.len(),
            mean: false,
            dst_term: None,
        };
        batch.cmds.push(Cmd::Dispatch {
            pipe: Pipe::Reduce(variant),
            params,
            inputs,
            dst: acc.clone(),
            threads: self.w,
        });
    }

    /// The `reduce_out` pass: the accumulator `acc` (if any) plus `xs`, rounded into `out`.
    fn out(
        &self,
        batch: &mut Batch<'_>,
        acc: Option<&Bind>,
        xs: &[Loc<'_>],
        out: Loc<'_>,
        mean: bool,
    ) {
        let (inputs, mut params, dst_term) = self.slots(batch, acc, xs, Some(out));
        let at = out.byte + self.start * self.es;
        let (dst, rel) = batch.bind(Res::User(out.buffer.clone()), at, self.w * self.es);
        let b = rel / self.es;
        params[4] = b as u32;
        let threads = if self.es == 4 {
            self.w
        } else {
            (b + self.w - 1) / 2 - b / 2 + 1
        };
        let variant = Variant {
            kind: self.k,
            out: true,
            start: if acc.is_some() {
                Start::AccIn
            } else {
                Start::Input
            },
            nin: inputs.len(),
            mean,
            dst_term,
        };
        batch.cmds.push(Cmd::Dispatch {
            pipe: Pipe::Reduce(variant),
            params,
            inputs,
            dst,
            threads,
        });
    }
}

impl<'c> Batch<'c> {
    pub(crate) fn new(core: &'c Core) -> Self {
        Batch {
            core,
            cmds: Vec::new(),
            scratch: 0,
        }
    }

    /// Binds `len > 0` bytes of `res` from byte `at`: the binding, and `at` relative to it.
    fn bind(&mut self, res: Res, at: u64, len: u64) -> (Bind, u64) {
        let offset = at / self.core.caps.storage_align * self.core.caps.storage_align;
        let size = (at + len).next_multiple_of(4) - offset;
        if let Res::Scratch = res {
            self.scratch = self.scratch.max(offset + size);
        }
        (Bind { res, offset, size }, at - offset)
    }

    /// Copies `len` bytes from `src` to `dst` (non-overlapping ranges; the buffers may be the same).
    pub(crate) fn copy(&mut self, src: Loc<'_>, dst: Loc<'_>, len: u64) {
        let window = self.core.caps.window;
        let mut done = 0;
        while done < len {
            let n = (len - done).min(window);
            let (s, d) = (src.byte + done, dst.byte + done);
            if src.buffer == dst.buffer {
                // WebGPU forbids copying a buffer to itself and binding it twice when one binding
                // is writable: bounce through scratch, keeping dst's alignment for the second hop.
                let mid = d % 4;
                self.copy_window(Res::User(src.buffer.clone()), s, Res::Scratch, mid, n);
                self.copy_window(Res::Scratch, mid, Res::User(dst.buffer.clone()), d, n);
            } else {
                self.copy_window(
                    Res::User(src.buffer.clone()),
                    s,
                    Res::User(dst.buffer.clone()),
                    d,
                    n,
                );
            }
            done += n;
        }
    }

    /// One window of [`copy`](Self::copy), between distinct buffers.
    fn copy_window(&mut self, src: Res, s: u64, dst: Res, d: u64, len: u64) {
        if s.is_multiple_of(4) && d.is_multiple_of(4) {
            let body = len / 4 * 4;
            if body > 0 {
                if let Res::Scratch = dst {
                    self.scratch = self.scratch.max(d + body);
                }
                self.cmds.push(Cmd::Copy {
                    src: src.clone(),
                    src_offset: s,
                    dst: dst.clone(),
                    dst_offset: d,
                    size: body,
                });
            }
            if body < len {
                self.move_kernel(src, s + body, dst, d + body, len - body);
            }
        } else {
            self.move_kernel(src, s, dst, d, len);
        }
    }

    fn move_kernel(&mut self, src: Res, s: u64, dst: Res, d: u64, len: u64) {
        let (src, s) = self.bind(src, s, len);
        let (dst, d) = self.bind(dst, d, len);
        let threads = (d + len - 1) / 4 - d / 4 + 1;
        let mut params = [0; 8];
        (params[0], params[4], params[5]) = (s as u32, d as u32, len as u32);
        self.cmds.push(Cmd::Dispatch {
            pipe: Pipe::Move,
            params,
            inputs: vec![src],
            dst,
            threads,
        });
    }

    /// `out[i] = op(inputs[0][i], inputs[1][i], …)` for `count` elements of `dtype`, in input
    /// order (see the module docs). `out` must not overlap any input except exactly (same
    /// location, as an all-reduce's own chunk).
    pub(crate) fn reduce(
        &mut self,
        inputs: &[Loc<'_>],
        out: Loc<'_>,
        count: u64,
        dtype: DType,
        op: ReduceOp,
    ) {
        let mean = op == ReduceOp::Mean;
        // Inputs that may share a dispatch with the output: WebGPU forbids binding a buffer
        // writable and read-only at once, so each must be another buffer, or exactly the output
        // (at most one, whose term is then read through the output binding).
        let fusable = |xs: &[Loc<'_>]| {
            let exact = |x: &&Loc<'_>| x.buffer == out.buffer && x.byte == out.byte;
            xs.iter().all(|x| x.buffer != out.buffer || exact(&x))
                && xs.iter().filter(exact).count() <= 1
        };
        let window = self.core.caps.window / 4;
        let mut start = 0;
        while start < count {
            let w = (count - start).min(window);
            let red = Reduction {
                k: kind(dtype),
                es: dtype.size_bytes() as u64,
                start,
                w,
                n: inputs.len() as u32,
            };
            if inputs.len() <= SLOTS && fusable(inputs) {
                red.out(self, None, inputs, out, mean);
            } else {
                let (acc, _) = self.bind(Res::Scratch, 0, w * 4);
                let mut done = inputs.len().min(SLOTS);
                red.acc(self, &inputs[..done], &acc, Start::Input);
                loop {
                    let rest = &inputs[done..];
                    if rest.len() < SLOTS && fusable(rest) {
                        red.out(self, Some(&acc), rest, out, mean);
                        break;
                    }
                    let take = rest.len().min(SLOTS);
                    red.acc(self, &rest[..take], &acc, Start::Dst);
                    done += take;
                }
            }
            start += w;
        }
    }

    /// Records every command into one command buffer and submits it. `scratch` is the rank's
    /// scratch buffer, grown here if the commands need more.
    pub(crate) fn submit(self, scratch: &mut Option<wgpu::Buffer>) -> Result<(), String> {
        if self.cmds.is_empty() {
            return Ok(());
        }
        let core = self.core;
        let device = &core.device;
        let result = scoped(device, || -> Result<(), String> {
            if self.scratch > scratch.as_ref().map_or(0, |b| b.size()) {
                let size = self
                    .scratch
                    .next_power_of_two()
                    .min(core.caps.window + 8)
                    .max(64);
                *scratch = Some(device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("zero-comm scratch"),
                    size: size.max(self.scratch),
                    usage: REQUIRED_USAGES,
                    mapped_at_creation: false,
                }));
            }
            let scratch = scratch.as_ref();
            let resolve = |r: &Res| -> Result<wgpu::Buffer, String> {
                match r {
                    Res::User(b) => Ok(b.clone()),
                    Res::Scratch => scratch
                        .cloned()
                        .ok_or_else(|| "wgpu loopback: no scratch buffer".to_string()),
                }
            };

            let stride = core.caps.uniform_stride;
            let dispatches: Vec<&[u32; 8]> = self
                .cmds
                .iter()
                .filter_map(|c| match c {
                    Cmd::Dispatch { params, .. } => Some(params),
                    Cmd::Copy { .. } => None,
                })
                .collect();
            let uniforms = (!dispatches.is_empty()).then(|| {
                device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("zero-comm params"),
                    size: dispatches.len() as u64 * stride,
                    usage: wgpu::BufferUsages::UNIFORM,
                    mapped_at_creation: true,
                })
            });
            if let Some(u) = &uniforms {
                let mut view = u
                    .get_mapped_range_mut(..)
                    .map_err(|e| format!("wgpu loopback: params: {e}"))?;
                for (i, params) in dispatches.iter().enumerate() {
                    let at = i * stride as usize;
                    view.slice(at..at + PARAMS_BYTES as usize)
                        .copy_from_slice(bytemuck::bytes_of(*params));
                }
                drop(view);
                u.unmap();
            }

            let mut enc = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("zero-comm collective"),
            });
            let (mut i, mut d) = (0, 0u64);
            while i < self.cmds.len() {
                if let Cmd::Copy {
                    src,
                    src_offset,
                    dst,
                    dst_offset,
                    size,
                } = &self.cmds[i]
                {
                    enc.copy_buffer_to_buffer(
                        &resolve(src)?,
                        *src_offset,
                        &resolve(dst)?,
                        *dst_offset,
                        *size,
                    );
                    i += 1;
                    continue;
                }
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("zero-comm collective"),
                    timestamp_writes: None,
                });
                while let Some(Cmd::Dispatch {
                    pipe,
                    inputs,
                    dst,
                    threads,
                    ..
                }) = self.cmds.get(i)
                {
                    let Some(u) = &uniforms else {
                        return Err("wgpu loopback: no params buffer".to_string());
                    };
                    let mut buffers = Vec::with_capacity(SLOTS + 1);
                    for slot in 0..SLOTS {
                        let b = inputs.get(slot).unwrap_or(&inputs[0]);
                        buffers.push((resolve(&b.res)?, b.offset, b.size));
                    }
                    buffers.push((resolve(&dst.res)?, dst.offset, dst.size));
                    let binding = |buffer, offset, size| {
                        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                            buffer,
                            offset,
                            size: wgpu::BufferSize::new(size),
                        })
                    };
                    let mut entries = vec![wgpu::BindGroupEntry {
                        binding: 0,
                        resource: binding(u, d * stride, PARAMS_BYTES),
                    }];
                    entries.extend(buffers.iter().enumerate().map(|(j, (b, offset, size))| {
                        wgpu::BindGroupEntry {
                            binding: j as u32 + 1,
                            resource: binding(b, *offset, *size),
                        }
                    }));
                    let group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: None,
                        layout: &core.kernels.layout,
                        entries: &entries,
                    });
                    let pipeline = match pipe {
                        Pipe::Move => core.kernels.moves.clone(),
                        Pipe::Reduce(v) => core.kernels.reduce_pipeline(device, *v),
                    };
                    // A balanced grid: an idle second row of workgroups costs lavapipe about as
                    // much as a busy one.
                    let groups = threads.div_ceil(WORKGROUP);
                    let y = groups.div_ceil(core.caps.max_groups);
                    let x = groups.div_ceil(y);
                    pass.set_pipeline(&pipeline);
                    pass.set_bind_group(0, &group, &[]);
                    pass.dispatch_workgroups(x as u32, y as u32, 1);
                    i += 1;
                    d += 1;
                }
            }
            core.queue.submit([enc.finish()]);
            Ok(())
        });
        result.and_then(|r| r)
    }
}
