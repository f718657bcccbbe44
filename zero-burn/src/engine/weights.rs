//! The weights: reading and writing units of the model, installing gathered units, releasing.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::ParamId;
use burn::tensor::{DType, Device, Tensor, TensorData};
use zero_comm::Communicator;
use zero_core::GatherOrder;

use super::sharded::Source;
use super::words::Words;
use super::{Core, UnitStatus, ZeroEngine};
use crate::comms::{Comms, Elems, Job, Out};
use crate::device::{DeviceTensors, WordBuffer};
use crate::error::{Error, Result};
use crate::params;
use crate::segmented::Segmented;

impl<C: Communicator, M: Segmented> ZeroEngine<C, M> {
    /// Testing aid (hidden from the docs; [`Self::consolidated_model`] is the public way):
    /// every parameter's current values, indexed like the plan's model (stage 3 gathers each
    /// unit with one all-gather; call it after reading [`Self::traffic`]).
    #[doc(hidden)]
    pub fn gather_all_params(&mut self) -> Result<Vec<Vec<f32>>> {
        let plan = self.core.plan.clone();
        let mut out = vec![Vec::new(); self.core.params.len()];
        if plan.stage() == 3 {
            for u in 0..plan.units().len() {
                let next = (u + 1 < plan.units().len()).then_some(u + 1);
                let world = &mut self.comms.world;
                let full = match self.core.sharded.source(u, false, next)? {
                    Source::F32(slab) => world.all_gather_host(&slab.read(0..slab.len()))?,
                    Source::Half(h, piece) => h.widen_all(&h.all_gather(world, &piece.bits(h))?),
                };
                for e in plan.unit_entries(u) {
                    out[e.param] = full[e.offset as usize..(e.offset + e.numel) as usize].to_vec();
                }
            }
            // The buffers are in no unit: every rank holds them (equal across ranks).
            let loose: Vec<usize> = (0..self.core.params.len())
                .filter(|&i| plan.locate(i).is_none())
                .collect();
            let want: HashMap<ParamId, usize> = loose
                .iter()
                .enumerate()
                .map(|(k, &i)| (self.core.params[i].id, k))
                .collect();
            for (&i, v) in loose
                .iter()
                .zip(params::read_values(&self.core.model, &want)?)
            {
                out[i] = v;
            }
        } else {
            let want: HashMap<ParamId, usize> = self
                .core
                .params
                .iter()
                .enumerate()
                .map(|(i, p)| (p.id, i))
                .collect();
            out = params::read_values(&self.core.model, &want)?;
        }
        Ok(out)
    }
}

impl<C: Communicator, M: Segmented> Core<C, M> {
    /// Unit `u`'s parameters: id → their slot in the unit's entries.
    fn unit_ids(&self, u: usize) -> HashMap<ParamId, usize> {
        self.plan
            .unit_entries(u)
            .iter()
            .enumerate()
            .map(|(k, e)| (self.params[e.param].id, k))
            .collect()
    }

    /// Reads unit `u`'s parameters from the model into a zero-padded flat buffer of its length.
    pub(super) fn read_unit(&self, u: usize) -> Result<Vec<f32>> {
        self.read_unit_range(u, 0..self.plan.units()[u].len as usize)
    }

    /// Elements `range` of unit `u`'s flat values, zero where it has no parameter, reading from
    /// the model only the parameters that overlap them (a rank's chunk at stages 1–2).
    pub(super) fn read_unit_range(&self, u: usize, range: Range<usize>) -> Result<Vec<f32>> {
        let parts = self.read_parts(u, range.clone())?;
        cut_range(parts.iter().map(|(at, d)| (*at, Some(d))), range)
            .ok_or_else(|| Error::Tensor("parameter values are not f32".into()))
    }

    /// Unit `u`'s parameters that overlap elements `range` of it (and any without elements),
    /// read from the model as flat `f32` data, in the unit's order, each with its offset.
    pub(super) fn read_parts(
        &self,
        u: usize,
        range: Range<usize>,
    ) -> Result<Vec<(usize, TensorData)>> {
        let (offsets, want) = self.parts_wanted(u, range);
        let data = params::read_data(&self.model, &want)?;
        Ok(offsets.into_iter().zip(data).collect())
    }

    /// The offsets of unit `u`'s parameters that overlap elements `range` of it (and of any
    /// without elements), in the unit's order, and their ids, each mapped to its place there.
    pub(super) fn parts_wanted(
        &self,
        u: usize,
        range: Range<usize>,
    ) -> (Vec<usize>, HashMap<ParamId, usize>) {
        let mut offsets = Vec::new();
        let mut want = HashMap::new();
        for e in self.plan.unit_entries(u) {
            let (at, n) = (e.offset as usize, e.numel as usize);
            if n == 0 || (at < range.end && at + n > range.start) {
                want.insert(self.params[e.param].id, offsets.len());
                offsets.push(at);
            }
        }
        (offsets, want)
    }

    /// Unit `u`'s parameters, as [`params::take_data`] takes the whole unit out of the model (a
    /// parameter that was not found stays as it is), made tensors of the model again (no copy
    /// on the CPU backend), for [`params::write_tensors`].
    pub(super) fn part_tensors(
        &self,
        u: usize,
        parts: Vec<Option<TensorData>>,
    ) -> params::NewTensors {
        let mut tensors = params::NewTensors::new();
        for (e, data) in self.plan.unit_entries(u).iter().zip(parts) {
            let Some(data) = data else { continue };
            let p = &self.params[e.param];
            let t = Tensor::<1>::from_data(data, &self.device);
            tensors.insert(p.id, (t, p.shape.clone(), p.trainable));
        }
        tensors
    }

    /// Unit `u`'s flat fp32 values as a tensor on `device` (the optimizer state's), cut and
    /// joined on the device from the model's parameter tensors (detached), with zeros where the
    /// unit has no parameter: [`Self::read_unit`] with no host round trip.
    pub(super) fn unit_tensor(&self, u: usize, device: &Device) -> Result<Tensor<1>> {
        let entries = self.plan.unit_entries(u);
        let want = self.unit_ids(u);
        let mut tensors = params::read_tensors(&self.model, &want);
        let len = self.plan.units()[u].len as usize;
        let mut parts = Vec::with_capacity(2 * entries.len() + 1);
        let mut at = 0;
        for e in entries {
            let o = e.offset as usize;
            if o > at {
                parts.push(Tensor::<1>::zeros([o - at], device));
            }
            let (t, _, _) = tensors
                .remove(&self.params[e.param].id)
                .ok_or_else(|| params::missing(&format!("unit {u}")))?;
            parts.push(t.inner().to_device(device));
            at = o + e.numel as usize;
        }
        if len > at {
            parts.push(Tensor::<1>::zeros([len - at], device));
        }
        Ok(Tensor::cat(parts, 0))
    }

    /// Adds unit `u`'s parameters, cut from `full` (its flat values on the optimizer state's
    /// device), to `tensors`, as tensors of the model.
    pub(super) fn unit_tensors(
        &self,
        u: usize,
        full: &Tensor<1>,
        tensors: &mut params::NewTensors,
    ) {
        for e in self.plan.unit_entries(u) {
            let p = &self.params[e.param];
            let o = e.offset as usize;
            let t = Tensor::from_inner(full.clone().slice(o..o + e.numel as usize));
            tensors.insert(p.id, (t, p.shape.clone(), p.trainable));
        }
    }

    pub(super) fn write_unit(&mut self, u: usize, full: &[f32]) {
        let mut values = HashMap::new();
        self.unit_values(u, full, &mut values);
        self.set_params(values);
    }

    /// Adds unit `u`'s parameters, from its flat values `full`, to `values` (one
    /// [`Self::set_params`] can then write many units in one pass over the model).
    pub(super) fn unit_values(&self, u: usize, full: &[f32], values: &mut params::NewValues) {
        for e in self.plan.unit_entries(u) {
            let p = &self.params[e.param];
            let o = e.offset as usize;
            values.insert(
                p.id,
                (
                    full[o..o + e.numel as usize].to_vec(),
                    p.shape.clone(),
                    p.trainable,
                ),
            );
        }
    }

    /// Replaces the values of the parameters in `values` (burn's mapper consumes the module, so
    /// it maps a clone, which shares every other tensor).
    pub(super) fn set_params(&mut self, values: params::NewValues) {
        let model = self.model.clone();
        self.model = params::write_values(model, values);
    }

    pub(super) fn release(&mut self, u: usize) {
        let mut values = HashMap::new();
        for e in self.plan.unit_entries(u) {
            let p = &self.params[e.param];
            values.insert(p.id, (Vec::new(), vec![0; p.rank], false));
        }
        self.set_params(values);
    }

    /// Installs a gathered unit in the model (in bf16/fp16 widened to f32); a forward gather
    /// keeps the hpZ secondary slice.
    pub(super) fn install(&mut self, u: usize, backward: bool, full: Out<C>) -> Result<()> {
        let plan = self.plan.clone();
        let len = plan.units()[u].len as usize;
        let slice = plan.hpz().filter(|_| !backward).map(|layout| {
            let s = len / layout.size;
            let g = self.rank % layout.size;
            g * s..(g + 1) * s
        });
        // The buffer the unit arrived in, as allocated (the device path's is sized by the hook).
        let bytes = match &full {
            Elems::F32(v) => v.capacity() as u64 * 4,
            Elems::U16(_, v) => v.capacity() as u64 * 2,
            Elems::Device(_) => len as u64 * 4,
            Elems::DeviceWords(_) => len as u64 * 2,
        };
        match full {
            Elems::Device(buf) => self.install_device(u, &buf, slice)?,
            Elems::DeviceWords(buf) => self.install_words(u, &buf, slice)?,
            Elems::F32(full) => {
                if let Some(r) = slice {
                    self.sharded.keep_f32(u, full[r].to_vec())?;
                }
                self.write_unit(u, &full);
            }
            Elems::U16(h, full) => {
                if let Some(r) = slice {
                    self.sharded.keep_half(u, full[r].to_vec())?;
                }
                self.write_unit(u, &h.widen_all(&full));
            }
        }
        self.status[u] = UnitStatus::Installed;
        self.meter.gathered_elems += plan.unit_entries(u).iter().map(|e| e.numel).sum::<u64>();
        self.meter.gathered_bytes += bytes;
        self.meter.unit_gathered_bytes[u] = bytes;
        Ok(())
    }

    /// [`Self::install`] from the communicator's memory through the [`DeviceTensors`] hook: each
    /// parameter becomes a tensor on the model's device, with no host round trip, and so does the
    /// hpZ secondary slice.
    pub(super) fn install_device(
        &mut self,
        u: usize,
        buf: &C::Buffer<f32>,
        slice: Option<std::ops::Range<usize>>,
    ) -> Result<()> {
        let hook = self.hook()?;
        if let Some(r) = slice {
            let sec = hook.tensor_at(buf, r.start, r.len())?;
            self.sharded.keep_tensor(u, sec)?;
        }
        self.install_tensors(u, buf)
    }

    pub(super) fn hook(&self) -> Result<&dyn DeviceTensors<C>> {
        self.device_tensors
            .as_deref()
            .ok_or_else(|| Error::Internal("a device gather without a device hook".into()))
    }

    /// Makes unit `u`'s parameters tensors of the model from `buf`, a gathered unit in the
    /// communicator's memory, through the [`DeviceTensors`] hook (one device copy each).
    pub(super) fn install_tensors(&mut self, u: usize, buf: &C::Buffer<f32>) -> Result<()> {
        let hook = self.hook()?;
        let mut tensors = params::NewTensors::new();
        for e in self.plan.unit_entries(u) {
            let p = &self.params[e.param];
            let t = hook.tensor_at(buf, e.offset as usize, e.numel as usize)?;
            tensors.insert(p.id, (t, p.shape.clone(), p.trainable));
        }
        let model = self.model.clone();
        self.model = params::write_tensors(model, tensors);
        self.meter.device_weight_bytes += 4 * self.plan.units()[u].len;
        Ok(())
    }

    /// Makes unit `u`'s parameters tensors of the model from `buf`, a gathered unit of 16-bit
    /// words in the communicator's memory, through the [`DeviceTensors`] hook: one device copy
    /// of the unit, widened per parameter on the device (exact). `slice`: the hpZ secondary
    /// slice to keep, a copy of its own.
    pub(super) fn install_words(
        &mut self,
        u: usize,
        buf: &WordBuffer<C>,
        slice: Option<std::ops::Range<usize>>,
    ) -> Result<()> {
        let len = self.plan.units()[u].len as usize;
        let hook = self.hook()?;
        if let Some(r) = slice {
            let sec = hook.tensor_of(buf, r.start, r.len())?;
            self.sharded.keep_words(u, Words::Device(Box::new(sec)))?;
        }
        let hook = self.hook()?;
        let full = hook.tensor_of(buf, 0, len)?;
        let mut tensors = params::NewTensors::new();
        for e in self.plan.unit_entries(u) {
            let p = &self.params[e.param];
            let at = e.offset as usize..(e.offset + e.numel) as usize;
            let t = full.clone().slice(at).cast(DType::F32);
            tensors.insert(p.id, (t, p.shape.clone(), p.trainable));
        }
        let model = self.model.clone();
        self.model = params::write_tensors(model, tensors);
        self.meter.device_weight_bytes += 2 * self.plan.units()[u].len;
        Ok(())
    }

    /// The all-gather of an updated chunk after the optimizer step (stages 1–2, stage-3
    /// persistent units): 16-bit words in host memory are gathered there; fp32 values (host
    /// values or a [`piece`] on the device) into the communicator's memory when a
    /// [`DeviceTensors`] hook installs weights from there, else into host memory; a piece already
    /// in the communicator's memory stays there.
    pub(super) fn post_step_gather(&self, comms: &mut Comms<C>, piece: Out<C>) -> Result<Out<C>> {
        comms.run(Job::Gather {
            piece,
            hpz: false,
            qwz: false,
            device: self.device_tensors.is_some(),
        })
    }

    /// Releases the gathered units segment `seg` needs for which `done(order, u)` holds (see
    /// [`zero_core::GatherOrder`]: after a forward, or after a backward).
    pub(super) fn release_where(&mut self, seg: usize, done: impl Fn(&GatherOrder, usize) -> bool) {
        for u in self.layout.order.needs[seg].clone() {
            if self.status[u] == UnitStatus::Installed && done(&self.layout.order, u) {
                self.release(u);
                self.status[u] = UnitStatus::Released;
                let real: u64 = self.plan.unit_entries(u).iter().map(|e| e.numel).sum();
                self.meter.gathered_elems -= real;
                self.meter.gathered_bytes -= std::mem::take(&mut self.meter.unit_gathered_bytes[u]);
            }
        }
    }
}

/// The piece a gather sends of a rank's chunk `source` (of a unit, or its hpZ secondary slice):
/// where it lives on a device and a `hook` is given, copied on the device into the
/// communicator's memory, so it never passes through host memory (16-bit words only when the
/// hook moves them, and not under `qwz`, which quantizes them widened in host memory); else its
/// values in host memory, which the communicator uploads where it gathers into its own memory.
pub(super) fn piece<C: Communicator>(
    hook: Option<&dyn DeviceTensors<C>>,
    source: Source<'_>,
    qwz: bool,
) -> Result<Out<C>> {
    Ok(match source {
        Source::F32(slab) => match (slab.device_slice(0..slab.len()), hook) {
            (Some(t), Some(hook)) => {
                let mut buf = hook.zeros(slab.len())?;
                hook.copy_in(&mut buf, 0, &t)?;
                Elems::Device(buf)
            }
            _ => Elems::F32(slab.read(0..slab.len())),
        },
        Source::Half(h, words) => match (words.tensor(), hook) {
            (Some(t), Some(hook)) if hook.moves_words() && !qwz => {
                Elems::DeviceWords(hook.words_of(t)?)
            }
            _ => Elems::U16(h, words.bits(h).into_owned()),
        },
    })
}

/// Elements `range` of a unit's flat values from its parameters' data, each at its offset in the
/// unit, zero where it has no parameter; `None` if a part is missing or not `f32` values.
pub(super) fn cut_range<'a>(
    parts: impl IntoIterator<Item = (usize, Option<&'a TensorData>)>,
    range: Range<usize>,
) -> Option<Vec<f32>> {
    let mut out = vec![0.0; range.len()];
    for (at, data) in parts {
        let v = data?.as_slice::<f32>().ok()?;
        // A parameter without elements may lie outside `range`: nothing to copy.
        let (from, to) = (at.max(range.start), (at + v.len()).min(range.end));
        if from < to {
            out[from - range.start..to - range.start].copy_from_slice(&v[from - at..to - at]);
        }
    }
    Some(out)
}

/// Overwrites each parameter's data in `parts` (at its offset in the unit) with its elements of
/// `full`, the unit's flat values; a part that is missing or not `f32` values is left as it is.
pub(super) fn fill_parts(offsets: &[usize], parts: &mut [Option<TensorData>], full: &[f32]) {
    for (&at, data) in offsets.iter().zip(parts) {
        if let Some(w) = data.as_mut().and_then(|d| d.as_mut_slice::<f32>().ok()) {
            w.copy_from_slice(&full[at..at + w.len()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A unit of 8 elements: a 3-element parameter at 0, one of no elements at 5, a 2-element
    /// one at 6 (elements 3–4 are padding). Cutting a chunk reads only what overlaps it, zero in
    /// the padding; writing a gathered unit back fills each parameter from its own offset.
    #[test]
    fn a_chunk_is_cut_from_parameters_and_a_unit_is_written_back_into_them() {
        let offsets = [0, 5, 6];
        let data = |v: &[f32]| Some(TensorData::new(v.to_vec(), [v.len()]));
        let mut parts = vec![data(&[1.0, 2.0, 3.0]), data(&[]), data(&[7.0, 8.0])];
        fn at<'a>(
            offsets: &[usize],
            parts: &'a [Option<TensorData>],
        ) -> Vec<(usize, Option<&'a TensorData>)> {
            let parts = parts.iter().map(Option::as_ref);
            offsets.iter().copied().zip(parts).collect()
        }
        assert_eq!(
            cut_range(at(&offsets, &parts), 2..6),
            Some(vec![3.0, 0.0, 0.0, 0.0])
        );
        assert_eq!(cut_range(at(&offsets, &parts), 6..8), Some(vec![7.0, 8.0]));

        let full: Vec<f32> = (10..18).map(|x| x as f32).collect();
        fill_parts(&offsets, &mut parts, &full);
        let values =
            |d: &Option<TensorData>| d.as_ref().unwrap().as_slice::<f32>().unwrap().to_vec();
        assert_eq!(values(&parts[0]), [10.0, 11.0, 12.0]);
        assert!(values(&parts[1]).is_empty());
        assert_eq!(values(&parts[2]), [16.0, 17.0]);

        parts[2] = Some(TensorData::new(vec![1i32, 2], [2]));
        assert_eq!(
            cut_range(at(&offsets, &parts), 0..8),
            None,
            "not f32 values"
        );
        parts[2] = None;
        assert_eq!(
            cut_range(at(&offsets, &parts), 0..8),
            None,
            "a missing parameter"
        );
    }
}
