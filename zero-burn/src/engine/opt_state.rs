//! The optimizer's part of a rank's state, and where it lives.
//!
//! Per trainable unit (the whole unit at stage 0, the rank's chunk otherwise): the fp32 master
//! weights (bf16/fp16 only; in fp32 the weights are the master) and the optimizer's moments. They
//! live in host memory when the model runs on a CPU backend or `optimizer_placement = host`
//! (DeepSpeed's optimizer offload), and are stepped there by [`optim::step`]; otherwise they are
//! tensors on the model's device, stepped there by [`optim::step_tensors`] (the same operations,
//! so the same bits on the CPU). The gradients cross to the state; so do fp32 weights that live
//! apart from it (the model's at stages 0–2, stage 3's device shard under host placement), and
//! their new values come back. Stage 3's fp32 shard on the state's device is stepped where it is.
//! The loss scaler, the step count and the last step's outcome live here too.
//!
//! With `optimizer_placement = nvme` the state is stepped in host memory too, but lives in the
//! rank's NVMe store ([`crate::offload`]): a unit's parts are paged in when it is first touched
//! (the unit after it read ahead) and written back when the next unit is touched, or at
//! [`OptState::settle`], which every optimizer step and checkpoint load ends with.

use std::borrow::Cow;
use std::ops::Range;
use std::path::Path;

use burn::tensor::{Device, Tensor};

pub(super) use super::opt_unit::Part;
use super::opt_unit::{UnitState, host_moments, step_on_device};
use super::slab::{Place, Slab, download, upload};
use crate::offload::{Disk, IoReport, Ring};
use crate::optim::{self, Optimizer};
use crate::precision::{LossScaler, StepInfo};
use crate::{Error, Result};

/// A unit's gradients for the step: in host memory, or a tensor on the model's device (slices
/// of a device accumulator).
pub(super) enum Grads<'a> {
    Host(Cow<'a, [f32]>),
    /// Boxed: a burn tensor handle is 640 bytes.
    Device(Box<Tensor<1>>),
}

impl<'a> Grads<'a> {
    /// In host memory.
    pub(super) fn host(self) -> Cow<'a, [f32]> {
        match self {
            Grads::Host(g) => g,
            Grads::Device(t) => Cow::Owned(download(&t)),
        }
    }

    /// On `device`.
    fn tensor(self, device: &Device) -> Tensor<1> {
        match self {
            Grads::Host(g) => upload(&g, device),
            Grads::Device(t) => *t,
        }
    }
}

/// The units' state in the NVMe store, paged into host memory to be stepped (see the module
/// docs).
#[derive(Debug)]
struct Paged {
    ring: Ring,
    /// The parts every trainable unit keeps, in the order its file holds them.
    kept: Vec<Part>,
    /// The unit whose parts are in host memory.
    resident: Option<usize>,
}

impl Paged {
    /// Hands the paged-in unit's parts (taken out of `units`) to the ring to be written back.
    fn evict(&mut self, units: &mut [Option<UnitState>]) -> Result<()> {
        if let Some(r) = self.resident.take()
            && let Some(s) = units[r].as_mut()
        {
            self.ring.store(r, s.page_out(&self.kept))?;
        }
        Ok(())
    }
}

/// The optimizer's state of one rank (see the module docs).
#[derive(Debug)]
pub(super) struct OptState {
    optimizer: Optimizer,
    /// Where the state lives.
    place: Place,
    /// Indexed like the plan's units; `None` for frozen units.
    units: Vec<Option<UnitState>>,
    /// NVMe placement: the store, and which unit is paged in.
    paged: Option<Paged>,
    /// fp16: the loss scaler.
    pub(super) scaler: Option<LossScaler>,
    /// Updates applied (a skipped step does not count: Adam's bias correction).
    pub(super) steps: u64,
    /// What happened at the last optimizer step.
    pub(super) last: StepInfo,
    /// Testing aid: poison this rank's reduced gradients at the next optimizer step.
    pub(super) inject_overflow: bool,
}

impl OptState {
    /// Zeroed moments for every trainable unit `u` of `lens[u]` elements at `place`; no master
    /// yet (see [`Self::set_master`]).
    pub(super) fn new(
        optimizer: Optimizer,
        place: Place,
        lens: &[Option<usize>],
        scaler: Option<LossScaler>,
    ) -> Self {
        let k = optimizer.state_buffers();
        let zeros = |len: usize| Slab::new(vec![0.0; len], &place);
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
            place,
            units,
            paged: None,
            scaler,
            steps: 0,
            last: StepInfo::default(),
            inject_overflow: false,
        }
    }

    /// [`Self::new`] with the state in rank `rank`'s NVMe store under `root`, stepped in host
    /// memory through a ring of `buffers`; `master`: the units keep an fp32 master (bf16/fp16).
    /// Every trainable unit's zeroed state is written to the store now (with its master, by
    /// [`Self::set_master`]).
    pub(super) fn on_disk(
        optimizer: Optimizer,
        (root, rank, buffers): (&Path, usize, usize),
        lens: &[Option<usize>],
        scaler: Option<LossScaler>,
        master: bool,
    ) -> Result<Self> {
        let mut kept = Vec::new();
        if master {
            kept.push(Part::Master);
        }
        kept.extend([Part::M, Part::V].iter().take(optimizer.state_buffers()));
        let per_unit: Vec<_> = lens.iter().map(|l| l.map(|l| l * kept.len())).collect();
        let ring = Ring::new(Disk::create(root, rank, "unit", &per_unit)?, buffers);
        let mut s = Self::new(optimizer, Place::Host, &vec![None; lens.len()], scaler);
        s.units = lens
            .iter()
            .map(|len| {
                len.map(|len| UnitState {
                    len,
                    master: None,
                    m: None,
                    v: None,
                })
            })
            .collect();
        for (u, len) in lens.iter().enumerate() {
            if let Some(len) = len
                && !master
            {
                ring.disk().write(u, &vec![0.0; len * kept.len()])?;
            }
        }
        s.paged = Some(Paged {
            ring,
            kept,
            resident: None,
        });
        Ok(s)
    }

    /// Unit `u`'s state in memory: with NVMe placement, paged in (the unit paged in before it
    /// written back first, the next trainable unit read ahead).
    fn unit(&mut self, u: usize) -> Result<&mut UnitState> {
        if let Some(p) = self.paged.as_mut()
            && p.resident != Some(u)
        {
            p.evict(&mut self.units)?;
            let trainable = |k: &usize| self.units.get(*k).is_some_and(Option::is_some);
            let next = (u + 1..self.units.len()).find(trainable);
            if trainable(&u) {
                let flat = p.ring.load(u, next)?;
                if let Some(s) = self.units[u].as_mut() {
                    s.page_in(&p.kept, &flat);
                }
                p.resident = Some(u);
            }
        }
        self.units
            .get_mut(u)
            .and_then(Option::as_mut)
            .ok_or_else(|| {
                Error::Internal(format!("unit {u} is frozen: it has no optimizer state"))
            })
    }

    /// With NVMe placement, writes the paged-in unit back and waits for every write: the store
    /// then holds the whole state. Nothing otherwise.
    pub(super) fn settle(&mut self) -> Result<()> {
        let Some(p) = self.paged.as_mut() else {
            return Ok(());
        };
        p.evict(&mut self.units)?;
        p.ring.flush()
    }

    /// With NVMe placement, what the store moved so far.
    pub(super) fn io(&self) -> Option<IoReport> {
        self.paged.as_ref().map(|p| p.ring.report())
    }

    /// The device holding the state; `None`: host memory.
    pub(super) fn device(&self) -> Option<&Device> {
        self.place.device()
    }

    /// Where the state lives.
    pub(super) fn place(&self) -> &Place {
        &self.place
    }

    /// Sets trainable unit `u`'s fp32 master weights (bf16/fp16); with NVMe placement, writes
    /// the unit's whole state (the master, zeroed moments) to the store.
    pub(super) fn set_master(&mut self, u: usize, values: &[f32]) -> Result<()> {
        if let Some(p) = &self.paged {
            let mut flat = values.to_vec();
            flat.resize(values.len() * p.kept.len(), 0.0);
            return p.ring.disk().write(u, &flat);
        }
        let slab = Slab::new(values.to_vec(), &self.place);
        if let Some(s) = self.units[u].as_mut() {
            debug_assert_eq!(s.len, values.len());
            s.master = Some(slab);
        }
        Ok(())
    }

    /// Whether the run keeps `part` at all (every trainable unit keeps the same parts).
    pub(super) fn has(&self, part: Part) -> bool {
        if let Some(p) = &self.paged {
            return p.kept.contains(&part);
        }
        self.units
            .iter()
            .flatten()
            .next()
            .is_some_and(|s| s.part(part).is_some())
    }

    /// Elements `range` of unit `u`'s `part`, in host memory (empty when the run keeps no such
    /// part, or `u` is frozen). With NVMe placement, read from the store unless `u` is paged in
    /// (at a step boundary, after [`Self::settle`], the store holds every unit's last state).
    pub(super) fn read(&self, u: usize, part: Part, range: Range<usize>) -> Result<Vec<f32>> {
        let Some(s) = self.units[u].as_ref() else {
            return Ok(Vec::new());
        };
        match &self.paged {
            Some(p) if p.resident != Some(u) => {
                let Some(i) = p.kept.iter().position(|&k| k == part) else {
                    return Ok(Vec::new());
                };
                let flat = p.ring.disk().read(u)?;
                Ok(flat[i * s.len..(i + 1) * s.len][range].to_vec())
            }
            _ => Ok(s
                .part(part)
                .map(|slab| slab.read(range))
                .unwrap_or_default()),
        }
    }

    /// Writes `values` into unit `u`'s `part` from element `at` (nothing when the run keeps no
    /// such part, or `u` is frozen).
    pub(super) fn write(&mut self, u: usize, part: Part, at: usize, values: &[f32]) -> Result<()> {
        if self.units[u].is_some()
            && let Some(slab) = self.unit(u)?.part_mut(part)
        {
            slab.write(at, values);
        }
        Ok(())
    }

    /// Overwrites the whole of unit `u`'s `part` with what `fill` writes into a zeroed slice of
    /// its length: in place in host memory, else through one host buffer uploaded once. Nothing
    /// when the run keeps no such part, or `u` is frozen.
    pub(super) fn fill(
        &mut self,
        u: usize,
        part: Part,
        fill: impl FnOnce(&mut [f32]) -> Result<()>,
    ) -> Result<()> {
        if self.units[u].is_none() {
            return Ok(());
        }
        match self.unit(u)?.part_mut(part) {
            Some(slab) => slab.fill(fill),
            None => Ok(()),
        }
    }

    /// Steps trainable unit `u` in fp32 with its gradients `grads` at learning rate `lr` (the
    /// update count is [`Self::steps`]): `weights`, the unit's fp32 values and its master, in
    /// place. Where `weights` and the state live apart, the weights cross to the state and back.
    pub(super) fn step_weights(
        &mut self,
        u: usize,
        lr: f32,
        grads: Grads,
        weights: &mut Slab,
    ) -> Result<()> {
        let Some(device) = self.place.device().cloned() else {
            let grads = grads.host();
            return match weights {
                Slab::Host(w) => self.step_host_part(u, lr, 0, &grads, w),
                Slab::Device(_) => {
                    let mut w = weights.read(0..weights.len());
                    self.step_host_part(u, lr, 0, &grads, &mut w)?;
                    weights.write(0, &w);
                    Ok(())
                }
            };
        };
        let (opt, n) = (self.optimizer, self.steps);
        let s = self.unit(u)?;
        let on_device = matches!(weights, Slab::Device(_));
        let w = match weights {
            Slab::Host(w) => upload(w, &device),
            Slab::Device(_) => weights.take_tensor().expect("a device slab"),
        };
        let w = step_on_device(s, &opt, lr, n, w, grads.tensor(&device));
        match weights {
            Slab::Host(dst) if !on_device => dst.copy_from_slice(&download(&w)),
            _ => *weights = Slab::Device(Box::new(w)),
        }
        Ok(())
    }

    /// [`Self::step_weights`] for the elements `at..at + w.len()` of trainable unit `u` alone,
    /// with the weights `w` and their gradients `grads` in host memory, and the state too (the
    /// caller checks [`Self::device`]): the same elementwise arithmetic as over the whole unit.
    pub(super) fn step_host_part(
        &mut self,
        u: usize,
        lr: f32,
        at: usize,
        grads: &[f32],
        w: &mut [f32],
    ) -> Result<()> {
        let (opt, n) = (self.optimizer, self.steps);
        let (m, v) = host_moments(self.unit(u)?);
        let part = at..at + w.len();
        // An optimizer that keeps no moment has empty ones (`Optimizer::state_buffers`).
        let m = m.get_mut(part.clone()).unwrap_or_default();
        let v = v.get_mut(part).unwrap_or_default();
        optim::step(&opt, lr, n, w, grads, m, v);
        Ok(())
    }

    /// Steps trainable unit `u`'s fp32 master (bf16/fp16) with its gradients `grads` at
    /// learning rate `lr`, and hands the new master, where it lives, to `then`.
    pub(super) fn step_master<R>(
        &mut self,
        u: usize,
        lr: f32,
        grads: Grads,
        then: impl FnOnce(&Slab) -> R,
    ) -> Result<R> {
        let (opt, n) = (self.optimizer, self.steps);
        let device = self.place.device().cloned();
        let s = self.unit(u)?;
        let mut master = s.master.take().ok_or_else(|| {
            Error::Internal(format!(
                "unit {u}: bf16/fp16 steps a master, and it keeps none"
            ))
        })?;
        match (&device, &mut master) {
            (None, Slab::Host(w)) => {
                let (m, v) = host_moments(s);
                optim::step(&opt, lr, n, w, &grads.host(), m, v);
            }
            (Some(device), slab) => {
                let w = slab.take_tensor().expect("the master lives with the state");
                let w = step_on_device(s, &opt, lr, n, w, grads.tensor(device));
                *slab = Slab::Device(Box::new(w));
            }
            (None, Slab::Device(_)) => unreachable!("the master lives with the state"),
        }
        let out = then(&master);
        s.master = Some(master);
        Ok(out)
    }

    /// Bytes of the moments, or of the master (`master`), by elements (on NVMe, those in the
    /// store).
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
                // On NVMe, the state the store holds for the unit.
                let kept = |p: &Part| match &self.paged {
                    Some(paged) => paged.kept.contains(p),
                    None => s.part(*p).is_some(),
                };
                parts.iter().filter(|p| kept(p)).count() as u64 * 4 * s.len as u64
            })
            .sum()
    }

    /// `part` of every unit, flat at the units' offsets `offsets` in a buffer of `len` elements
    /// (empty when the run keeps no such part).
    pub(super) fn flat(
        &self,
        part: Part,
        offsets: &[Option<usize>],
        len: usize,
    ) -> Result<Vec<f32>> {
        if !self.has(part) {
            return Ok(Vec::new());
        }
        let mut out = vec![0.0; len];
        for (u, off) in offsets.iter().enumerate() {
            if let (Some(off), Some(s)) = (off, self.units[u].as_ref()) {
                out[*off..*off + s.len].copy_from_slice(&self.read(u, part, 0..s.len)?);
            }
        }
        Ok(out)
    }
}
