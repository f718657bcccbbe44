//! One trainable unit's optimizer state: its parts, where each lives ([`Slab`]), its flat layout
//! in the NVMe store, and one step of its moments on the state's device. The rank's state of
//! every unit is [`super::opt_state`]'s.

use burn::tensor::Tensor;

use super::slab::Slab;
use crate::optim::{self, Optimizer};

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

/// The host moments of a unit whose state is in host memory (empty for an optimizer without).
pub(super) fn host_moments(s: &mut UnitState) -> (&mut [f32], &mut [f32]) {
    let m = match &mut s.m {
        Some(Slab::Host(m)) => &mut m[..],
        _ => &mut [],
    };
    let v = match &mut s.v {
        Some(Slab::Host(v)) => &mut v[..],
        _ => &mut [],
    };
    (m, v)
}

/// One step of `w` on the state's device with `grads`: the moments are taken from `s` and put
/// back; returns the new weights.
pub(super) fn step_on_device(
    s: &mut UnitState,
    opt: &Optimizer,
    lr: f32,
    n: u64,
    w: Tensor<1>,
    grads: Tensor<1>,
) -> Tensor<1> {
    let take = |p: &mut Option<Slab>| p.as_mut().map(|s| s.take_tensor().expect("on the device"));
    let (m, v) = (take(&mut s.m), take(&mut s.v));
    let (w, m, v) = optim::step_tensors(opt, lr, n, w, grads, m, v);
    let device_slab = |t| Slab::Device(Box::new(t));
    (s.m, s.v) = (m.map(device_slab), v.map(device_slab));
    w
}

/// One trainable unit's state; a part is `None` when the run keeps none.
#[derive(Debug)]
pub(super) struct UnitState {
    /// Elements of each part.
    pub(super) len: usize,
    pub(super) master: Option<Slab>,
    pub(super) m: Option<Slab>,
    pub(super) v: Option<Slab>,
}

impl UnitState {
    pub(super) fn part(&self, p: Part) -> Option<&Slab> {
        match p {
            Part::Master => self.master.as_ref(),
            Part::M => self.m.as_ref(),
            Part::V => self.v.as_ref(),
        }
    }

    pub(super) fn part_mut(&mut self, p: Part) -> Option<&mut Slab> {
        match p {
            Part::Master => self.master.as_mut(),
            Part::M => self.m.as_mut(),
            Part::V => self.v.as_mut(),
        }
    }

    fn slot(&mut self, p: Part) -> &mut Option<Slab> {
        match p {
            Part::Master => &mut self.master,
            Part::M => &mut self.m,
            Part::V => &mut self.v,
        }
    }

    /// Takes the `kept` parts out, one after another in one buffer (as the store holds them).
    pub(super) fn page_out(&mut self, kept: &[Part]) -> Vec<f32> {
        let mut flat = Vec::with_capacity(self.len * kept.len());
        for &p in kept {
            match self.slot(p).take() {
                Some(slab) => flat.extend_from_slice(&slab.host()),
                None => flat.resize(flat.len() + self.len, 0.0),
            }
        }
        flat
    }

    /// Puts the `kept` parts back from one buffer laid out as [`Self::page_out`] writes it.
    pub(super) fn page_in(&mut self, kept: &[Part], flat: &[f32]) {
        let len = self.len;
        for (&p, values) in kept.iter().zip(flat.chunks(len.max(1))) {
            *self.slot(p) = Some(Slab::Host(values.to_vec()));
        }
    }
}
