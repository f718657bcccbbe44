//! Flat fp32 buffers that live where the state they hold lives: host memory, or a tensor on the
//! model's device. The optimizer's moments and masters ([`super::opt_state`]), stage 3's fp32
//! shard ([`Shard`]) and the fp32 gradient accumulator are made of them.

use std::borrow::Cow;
use std::ops::Range;

use burn::tensor::{Device, Tensor, TensorData};
use zero_core::Placement;

use crate::reduction::TreeBuffer;

/// Where one of the engine's buffers lives: host memory, or a tensor on a device. (State on NVMe
/// is paged through host memory by [`crate::offload`].)
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) enum Place {
    #[default]
    Host,
    Device(Device),
}

impl Place {
    /// Where the engine's state of `placement` lives for a model on `model`: host memory for
    /// `host` and `nvme` placement and on a CPU backend (whose device is host memory), else the
    /// model's device without autodiff.
    pub(super) fn of(placement: Placement, model: &Device) -> Place {
        let inner = model.clone().inner();
        match placement {
            Placement::Device if inner != Device::flex() => Place::Device(inner),
            _ => Place::Host,
        }
    }

    /// The device, unless the place is host memory.
    pub(super) fn device(&self) -> Option<&Device> {
        match self {
            Place::Host => None,
            Place::Device(d) => Some(d),
        }
    }
}

/// A flat buffer of `T`s: in host memory, or a tensor on a device. Its elements are fp32 values
/// ([`Slab`]) or a 16-bit type's words ([`super::words::Words`], a tensor of that type on a
/// device).
#[derive(Debug)]
pub(super) enum Buf<T> {
    Host(Vec<T>),
    /// Boxed: a burn tensor handle is 640 bytes.
    Device(Box<Tensor<1>>),
}

/// A flat fp32 buffer.
pub(super) type Slab = Buf<f32>;

impl<T> Buf<T> {
    /// Elements.
    pub(super) fn len(&self) -> usize {
        match self {
            Buf::Host(v) => v.len(),
            Buf::Device(t) => t.dims()[0],
        }
    }

    /// Bytes held: a host buffer as allocated, a tensor by its elements.
    pub(super) fn bytes(&self) -> u64 {
        let held = match self {
            Buf::Host(v) => v.capacity(),
            Buf::Device(t) => t.dims()[0],
        };
        (held * size_of::<T>()) as u64
    }

    /// The tensor of a device buffer; `None` in host memory.
    pub(super) fn tensor(&self) -> Option<&Tensor<1>> {
        match self {
            Buf::Device(t) => Some(t),
            Buf::Host(_) => None,
        }
    }

    /// Whether the buffer lives on a device.
    pub(super) fn on_device(&self) -> bool {
        matches!(self, Buf::Device(_))
    }
}

impl Slab {
    /// `values` at `place` (uploaded to a device).
    pub(super) fn new(values: Vec<f32>, place: &Place) -> Self {
        match place {
            Place::Host => Slab::Host(values),
            Place::Device(d) => Slab::Device(Box::new(upload(&values, d))),
        }
    }

    /// `len` zeros at `place`.
    pub(super) fn zeros(len: usize, place: &Place) -> Self {
        match place {
            Place::Host => Slab::Host(vec![0.0; len]),
            Place::Device(d) => Slab::Device(Box::new(Tensor::zeros([len], d))),
        }
    }

    /// Elements `range`, in host memory.
    pub(super) fn read(&self, range: Range<usize>) -> Vec<f32> {
        match self {
            Slab::Host(v) => v[range].to_vec(),
            Slab::Device(t) if range.start == 0 && range.end == t.dims()[0] => download(t),
            Slab::Device(t) => download(&t.clone().slice(range)),
        }
    }

    /// Every element in host memory: borrowed there, read from a device.
    pub(super) fn host(&self) -> Cow<'_, [f32]> {
        match self {
            Slab::Host(v) => Cow::Borrowed(v),
            Slab::Device(t) => Cow::Owned(download(t)),
        }
    }

    /// Writes `values` from element `at`.
    pub(super) fn write(&mut self, at: usize, values: &[f32]) {
        match self {
            Slab::Host(v) => v[at..at + values.len()].copy_from_slice(values),
            Slab::Device(t) if at == 0 && values.len() == t.dims()[0] => {
                **t = upload(values, &t.device());
            }
            Slab::Device(_) => self.map_tensor(|whole| {
                let new = upload(values, &whole.device());
                whole.slice_assign(at..at + values.len(), new)
            }),
        }
    }

    /// Adds `values` into the elements from `at`, one IEEE addition each, wherever it lives.
    pub(super) fn add(&mut self, at: usize, values: &[f32]) {
        match self {
            Slab::Host(v) => {
                for (d, s) in v[at..at + values.len()].iter_mut().zip(values) {
                    *d += s;
                }
            }
            Slab::Device(_) => self.map_tensor(|whole| {
                let range = at..at + values.len();
                let sum = whole.clone().slice(range.clone()) + upload(values, &whole.device());
                whole.slice_assign(range, sum)
            }),
        }
    }

    /// [`Self::add`] into elements known to be zero: in host memory written as `0 + v` (the same
    /// bits as the addition, `-0.0` becoming `+0.0`) without reading them first.
    pub(super) fn add_to_zeros(&mut self, at: usize, values: &[f32]) {
        match self {
            Slab::Host(v) => write_once(&mut v[at..at + values.len()], values),
            Slab::Device(_) => self.add(at, values),
        }
    }

    /// Divides every element by `d`, one IEEE division each, wherever it lives.
    pub(super) fn div(&mut self, d: f32) {
        match self {
            Slab::Host(v) => v.iter_mut().for_each(|g| *g /= d),
            Slab::Device(t) => **t = (**t).clone().div_scalar(d),
        }
    }

    /// Sets every element to zero (a device slab gets a zeroed tensor).
    pub(super) fn zero(&mut self) {
        match self {
            Slab::Host(v) => v.fill(0.0),
            Slab::Device(t) => **t = Tensor::zeros([t.dims()[0]], &t.device()),
        }
    }

    /// Elements `range` of a device slab, as a tensor there; `None` for a host slab.
    pub(super) fn device_slice(&self, range: Range<usize>) -> Option<Tensor<1>> {
        match self {
            Slab::Device(t) if range.start == 0 && range.end == t.dims()[0] => Some((**t).clone()),
            Slab::Device(t) => Some(t.clone().slice(range)),
            Slab::Host(_) => None,
        }
    }

    /// Overwrites the whole slab with what `fill` writes into a zeroed slice of its length: in
    /// place in host memory, else through one host buffer uploaded once.
    pub(super) fn fill<E>(
        &mut self,
        fill: impl FnOnce(&mut [f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        match self {
            Slab::Host(v) => {
                v.fill(0.0);
                fill(v)
            }
            Slab::Device(_) => {
                let mut v = vec![0.0; self.len()];
                fill(&mut v)?;
                self.write(0, &v);
                Ok(())
            }
        }
    }

    /// A device slab's tensor replaced by `f` of it, taken out first: owned, the tensor is the
    /// only handle to its memory, so burn may work in place. A host slab stays as it is.
    fn map_tensor(&mut self, f: impl FnOnce(Tensor<1>) -> Tensor<1>) {
        if let Some(t) = self.take_tensor() {
            *self = Slab::Device(Box::new(f(t)));
        }
    }

    /// The device tensor, leaving an empty host slab behind (put the new one back with
    /// [`Slab::Device`]); `None` for a host slab, which stays.
    pub(super) fn take_tensor(&mut self) -> Option<Tensor<1>> {
        match std::mem::replace(self, Slab::Host(Vec::new())) {
            Slab::Device(t) => Some(*t),
            host => {
                *self = host;
                None
            }
        }
    }
}

/// The canonical tree's levels where the fp32 accumulator lives: host slabs add as
/// `Vec<f32>` does, device slabs with burn's element-wise additions there (one IEEE addition per
/// element, the same operands in the same order).
impl TreeBuffer for Slab {
    fn len(&self) -> usize {
        Slab::len(self)
    }

    fn beside(&self, values: Vec<f32>) -> Self {
        match self {
            Slab::Host(_) => Slab::Host(values),
            Slab::Device(t) => Slab::Device(Box::new(upload(&values, &t.device()))),
        }
    }

    fn add_into(&self, off: usize, leaf: &mut Self) {
        let range = off..off + leaf.len();
        match (self, leaf) {
            (Slab::Host(v), Slab::Host(l)) => v.add_into(off, l),
            (Slab::Device(t), leaf @ Slab::Device(_)) => {
                leaf.map_tensor(|l| l + t.clone().slice(range));
            }
            // Never in one tree (its buffers live in one place); correct all the same.
            (this, leaf) => leaf.add(0, &this.read(range)),
        }
    }

    fn put(&mut self, off: usize, leaf: Self) {
        match (self, leaf) {
            (Slab::Host(v), Slab::Host(l)) => v.put(off, l),
            (this @ Slab::Device(_), Slab::Device(l)) => {
                let range = off..off + l.dims()[0];
                this.map_tensor(|whole| whole.slice_assign(range, *l));
            }
            (this, leaf) => this.write(off, &leaf.read(0..leaf.len())),
        }
    }

    fn add_all(&mut self, other: &Self) {
        match (self, other) {
            (Slab::Host(v), Slab::Host(r)) => v.add_all(r),
            (this @ Slab::Device(_), Slab::Device(r)) => this.map_tensor(|l| l + (**r).clone()),
            (this, other) => this.add(0, &other.read(0..other.len())),
        }
    }
}

/// Stage 3 in fp32: the rank's shard of every unit, one slab per unit, on the model's device
/// (host memory on a CPU backend). It is the fp32 master: the optimizer steps it in place, the
/// gathers read it. Empty at other stages and in bf16/fp16.
#[derive(Debug, Default)]
pub(super) struct Shard {
    units: Vec<Slab>,
    /// Where it lives.
    place: Place,
}

impl Shard {
    /// The shard of `chunks` (one per unit, in order) at `place`.
    pub(super) fn new(chunks: Vec<Vec<f32>>, place: Place) -> Self {
        Shard {
            units: chunks.into_iter().map(|c| Slab::new(c, &place)).collect(),
            place,
        }
    }

    /// A slab of `values` where the shard lives (the hpZ secondary shard's place).
    pub(super) fn slab(&self, values: Vec<f32>) -> Slab {
        Slab::new(values, &self.place)
    }

    /// Unit `u`'s slab.
    pub(super) fn unit(&self, u: usize) -> &Slab {
        &self.units[u]
    }

    /// Unit `u`'s slab, mutable.
    pub(super) fn unit_mut(&mut self, u: usize) -> &mut Slab {
        &mut self.units[u]
    }

    /// Every unit's slab, mutable (the NVMe store pages them in and out).
    pub(super) fn units_mut(&mut self) -> &mut [Slab] {
        &mut self.units
    }

    /// Bytes held by every unit's slab.
    pub(super) fn bytes(&self) -> u64 {
        self.units.iter().map(Slab::bytes).sum()
    }
}

/// `dst = 0 + src`, bit for bit what adding `src` into a zeroed slot gives (`-0.0` becomes
/// `+0.0`), without reading `dst`: a fresh buffer's pages are the kernel's shared zero page until
/// written, and a read first makes every page fault twice, the second time with a TLB shootdown
/// on every core the rank's threads run on; a reused one is read for nothing. Each parameter
/// lives in one segment, and each unit's slot is reduced once, so a slot is written once per
/// micro-step.
pub(super) fn write_once(dst: &mut [f32], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s + 0.0;
    }
}

pub(super) fn upload(values: &[f32], device: &Device) -> Tensor<1> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

pub(super) fn download(t: &Tensor<1>) -> Vec<f32> {
    t.clone()
        .into_data()
        .try_into_vec_as::<f32>()
        .expect("the engine's state is f32")
}
