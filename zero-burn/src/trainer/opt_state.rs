//! The optimizer's part of a rank's state, and where it lives.
//!
//! Per trainable unit (the whole unit at stage 0, the rank's chunk otherwise): the fp32 master
//! weights (bf16/fp16 only; in fp32 the weights are the master) and the optimizer's moments. They
//! live in host memory when the model runs on a CPU backend or `optimizer_placement = host`
//! (DeepSpeed's optimizer offload), and are stepped there by [`optim::step`]; otherwise they are
//! tensors on the model's device, stepped there by [`optim::step_tensors`] (the same operations,
//! so the same bits on the CPU). Only the gradients and, in fp32, the weights cross to the state,
//! and the new fp32 values come back. The loss scaler, the step count and the last step's outcome
//! live here too.

use std::ops::Range;

use burn::tensor::{Device, Tensor, TensorData};
use zero_core::Placement;

use crate::optim::{self, Optimizer};
use crate::precision::{LossScaler, StepInfo};

/// One part of a unit's optimizer state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Part {
    /// The fp32 master weights (bf16/fp16).
    Master,
    /// The first moment (Adam) or the momentum buffer (SGD).
    M,
    /// The second moment (Adam).
    V,
}

/// A flat fp32 buffer: in host memory, or a tensor on a device.
#[derive(Debug)]
enum Slab {
    Host(Vec<f32>),
    /// Boxed: a burn tensor handle is 640 bytes.
    Device(Box<Tensor<1>>),
}

impl Slab {
    fn new(values: Vec<f32>, device: Option<&Device>) -> Self {
        match device {
            None => Slab::Host(values),
            Some(d) => Slab::Device(Box::new(upload(&values, d))),
        }
    }

    fn read(&self, range: Range<usize>) -> Vec<f32> {
        match self {
            Slab::Host(v) => v[range].to_vec(),
            Slab::Device(t) => download(&t.clone().slice(range)),
        }
    }

    fn write(&mut self, at: usize, values: &[f32]) {
        match self {
            Slab::Host(v) => v[at..at + values.len()].copy_from_slice(values),
            Slab::Device(t) => {
                let new = upload(values, &t.device());
                **t = if at == 0 && values.len() == t.dims()[0] {
                    new
                } else {
                    t.clone().slice_assign(at..at + values.len(), new)
                };
            }
        }
    }

    fn tensor(self) -> Tensor<1> {
        match self {
            Slab::Device(t) => *t,
            Slab::Host(_) => unreachable!("a device slab"),
        }
    }
}

fn upload(values: &[f32], device: &Device) -> Tensor<1> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

fn download(t: &Tensor<1>) -> Vec<f32> {
    t.clone()
        .into_data()
        .try_into_vec_as::<f32>()
        .expect("the optimizer state is f32")
}

/// One trainable unit's state; a part is `None` when the run keeps none.
#[derive(Debug)]
struct UnitState {
    len: usize,
    master: Option<Slab>,
    m: Option<Slab>,
    v: Option<Slab>,
}

impl UnitState {
    fn part(&self, p: Part) -> Option<&Slab> {
        match p {
            Part::Master => self.master.as_ref(),
            Part::M => self.m.as_ref(),
            Part::V => self.v.as_ref(),
        }
    }

    fn part_mut(&mut self, p: Part) -> Option<&mut Slab> {
        match p {
            Part::Master => self.master.as_mut(),
            Part::M => self.m.as_mut(),
            Part::V => self.v.as_mut(),
        }
    }
}

/// The optimizer's state of one rank (see the module docs).
#[derive(Debug)]
pub(super) struct OptState {
    optimizer: Optimizer,
    /// The device holding the state; `None`: host memory.
    device: Option<Device>,
    /// Indexed like the plan's units; `None` for frozen units.
    units: Vec<Option<UnitState>>,
    /// fp16: the loss scaler.
    pub(super) scaler: Option<LossScaler>,
    /// Updates applied (a skipped step does not count: Adam's bias correction).
    pub(super) steps: u64,
    /// What happened at the last optimizer step.
    pub(super) last: StepInfo,
    /// Testing aid: poison this rank's reduced gradients at the next optimizer step.
    pub(super) inject_overflow: bool,
}

/// Where `placement` puts the state of a model on `model`: `None` for host memory (a CPU
/// backend's device is host memory too), else the model's device without autodiff.
pub(super) fn state_device(placement: Placement, model: &Device) -> Option<Device> {
    let inner = model.clone().inner();
    match placement {
        Placement::Device if inner != Device::flex() => Some(inner),
        _ => None,
    }
}

impl OptState {
    /// Zeroed moments for every trainable unit `u` of `lens[u]` elements, on `device` (`None`:
    /// host memory); no master yet (see [`Self::set_master`]).
    pub(super) fn new(
        optimizer: Optimizer,
        device: Option<Device>,
        lens: &[Option<usize>],
        scaler: Option<LossScaler>,
    ) -> Self {
        let k = optimizer.state_buffers();
        let zeros = |len: usize| Slab::new(vec![0.0; len], device.as_ref());
        let units = lens
            .iter()
            .map(|len| {
                len.map(|len| UnitState {
                    len,
                    master: None,
                    m: (k >= 1).then(|| zeros(len)),
                    v: (k >= 2).then(|| zeros(len)),
                })
            })
            .collect();
        OptState {
            optimizer,
            device,
            units,
            scaler,
            steps: 0,
            last: StepInfo::default(),
            inject_overflow: false,
        }
    }

    /// The device holding the state; `None`: host memory.
    pub(super) fn device(&self) -> Option<&Device> {
        self.device.as_ref()
    }

    /// Sets trainable unit `u`'s fp32 master weights (bf16/fp16).
    pub(super) fn set_master(&mut self, u: usize, values: &[f32]) {
        let slab = Slab::new(values.to_vec(), self.device.as_ref());
        if let Some(s) = self.units[u].as_mut() {
            debug_assert_eq!(s.len, values.len());
            s.master = Some(slab);
        }
    }

    /// Whether the run keeps `part` at all (every trainable unit keeps the same parts).
    pub(super) fn has(&self, part: Part) -> bool {
        self.units
            .iter()
            .flatten()
            .next()
            .is_some_and(|s| s.part(part).is_some())
    }

    /// Elements `range` of unit `u`'s `part`, in host memory (empty when the run keeps no such
    /// part, or `u` is frozen).
    pub(super) fn read(&self, u: usize, part: Part, range: Range<usize>) -> Vec<f32> {
        match self.units[u].as_ref().and_then(|s| s.part(part)) {
            Some(slab) => slab.read(range),
            None => Vec::new(),
        }
    }

    /// Writes `values` into unit `u`'s `part` from element `at` (nothing when the run keeps no
    /// such part).
    pub(super) fn write(&mut self, u: usize, part: Part, at: usize, values: &[f32]) {
        if let Some(slab) = self.units[u].as_mut().and_then(|s| s.part_mut(part)) {
            slab.write(at, values);
        }
    }

    /// Overwrites the whole of unit `u`'s `part` with what `fill` writes into a zeroed slice of
    /// its length: in place in host memory, else through one host buffer uploaded once. Nothing
    /// when the run keeps no such part.
    pub(super) fn fill<E>(
        &mut self,
        u: usize,
        part: Part,
        fill: impl FnOnce(&mut [f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        let Some(s) = self.units[u].as_mut() else {
            return Ok(());
        };
        let len = s.len;
        match s.part_mut(part) {
            None => Ok(()),
            Some(Slab::Host(v)) => {
                v.fill(0.0);
                fill(v)
            }
            Some(slab) => {
                let mut v = vec![0.0; len];
                fill(&mut v)?;
                slab.write(0, &v);
                Ok(())
            }
        }
    }

    /// Steps trainable unit `u` with its gradients `grads` at learning rate `lr` (the update
    /// count is [`Self::steps`]): the master where the run keeps one, else `weights`, the unit's
    /// fp32 values, in place. Hands the new fp32 values to `then`.
    pub(super) fn step<R>(
        &mut self,
        u: usize,
        lr: f32,
        grads: &[f32],
        weights: Option<&mut [f32]>,
        then: impl FnOnce(&[f32]) -> R,
    ) -> R {
        let (opt, n) = (self.optimizer, self.steps);
        let s = self.units[u]
            .as_mut()
            .expect("only trainable units are stepped");
        let Some(device) = self.device.clone() else {
            let (mut no_m, mut no_v) = (Vec::new(), Vec::new());
            let m = match &mut s.m {
                Some(Slab::Host(m)) => m,
                _ => &mut no_m,
            };
            let v = match &mut s.v {
                Some(Slab::Host(v)) => v,
                _ => &mut no_v,
            };
            let w: &mut [f32] = match (&mut s.master, weights) {
                (Some(Slab::Host(master)), _) => master,
                (_, Some(w)) => w,
                _ => unreachable!("fp32 steps hand over their weights"),
            };
            optim::step(&opt, lr, n, w, grads, m, v);
            return then(w);
        };
        let (master, keep) = match s.master.take() {
            Some(m) => (Some(m.tensor()), true),
            None => (None, false),
        };
        let w = match (master, &weights) {
            (Some(master), _) => master,
            (None, Some(w)) => upload(w, &device),
            (None, None) => unreachable!("fp32 steps hand over their weights"),
        };
        let (m, v) = (s.m.take().map(Slab::tensor), s.v.take().map(Slab::tensor));
        let (w, m, v) = optim::step_tensors(&opt, lr, n, w, upload(grads, &device), m, v);
        let device_slab = |t| Slab::Device(Box::new(t));
        (s.m, s.v) = (m.map(device_slab), v.map(device_slab));
        let out = download(&w);
        if keep {
            s.master = Some(device_slab(w));
        }
        match weights {
            Some(dst) => {
                dst.copy_from_slice(&out);
                then(dst)
            }
            None => then(&out),
        }
    }

    /// Bytes of the moments, or of the master (`master`), by elements.
    pub(super) fn bytes(&self, master: bool) -> u64 {
        let parts: &[Part] = if master {
            &[Part::Master]
        } else {
            &[Part::M, Part::V]
        };
        self.units
            .iter()
            .flatten()
            .map(|s| {
                let n = parts.iter().filter(|&&p| s.part(p).is_some()).count();
                n as u64 * 4 * s.len as u64
            })
            .sum()
    }

    /// `part` of every unit, flat at the units' offsets `offsets` in a buffer of `len` elements
    /// (empty when the run keeps no such part).
    pub(super) fn flat(&self, part: Part, offsets: &[Option<usize>], len: usize) -> Vec<f32> {
        if !self.has(part) {
            return Vec::new();
        }
        let mut out = vec![0.0; len];
        for (u, off) in offsets.iter().enumerate() {
            if let (Some(off), Some(s)) = (off, self.units[u].as_ref())
                && let Some(slab) = s.part(part)
            {
                out[*off..*off + s.len].copy_from_slice(&slab.read(0..s.len));
            }
        }
        out
    }
}
