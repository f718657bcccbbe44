//! Collecting a segment's parameter gradients from burn into the units' gradient buffers: in
//! host memory, or packed in the communicator's memory by a
//! [`DeviceTensors`](crate::device::DeviceTensors) hook.

use std::collections::HashMap;

use burn::optim::GradientsParams;
use zero_comm::Communicator;

use super::{Pending, ZeroEngine};
use crate::error::{Error, Result};
use crate::params;
use crate::segmented::Segmented;

impl<C: Communicator, M: Segmented> ZeroEngine<C, M> {
    /// Moves the gradients of segment `seg`'s trainable parameters in `gp` into their units'
    /// buffers in `pending` (created on first use), on the device where the unit is packed there.
    pub(super) fn collect_grads(
        &mut self,
        seg: usize,
        gp: &GradientsParams,
        pending: &mut [Option<Pending<C::Buffer<f32>>>],
    ) -> Result<()> {
        let plan = self.plan.clone();
        let mut want = HashMap::new();
        let mut slots = Vec::new();
        for (i, p) in self.params.iter().enumerate() {
            if self.layout.param_segment[i] == seg && p.trainable {
                want.insert(p.id, slots.len());
                slots.push(i);
            }
        }
        let device: Vec<bool> = (0..plan.units().len())
            .map(|u| self.packs_grads_on_device(u))
            .collect();
        let hook = self.device_tensors.as_deref();
        let mut failed = None;
        let mut packed = 0u64;
        params::for_each_grad_tensor(&self.model, gp, &want, |slot, g| {
            let Some((u, off)) = plan.locate(slots[slot]) else {
                return;
            };
            let (len, off) = (plan.units()[u].len as usize, off as usize);
            let r = match (hook, device[u]) {
                // Each parameter lives in one segment, so its slot is written once: a copy.
                (Some(hook), true) => (|| {
                    if pending[u].is_none() {
                        pending[u] = Some(Pending::Device(hook.zeros(len)?));
                    }
                    packed += 4 * g.shape().num_elements() as u64;
                    match &mut pending[u] {
                        Some(Pending::Device(buf)) => hook.copy_in(buf, off, &g),
                        _ => Ok(()),
                    }
                })(),
                _ => match g.into_data().try_into_vec_as::<f32>() {
                    Ok(g) => {
                        let p = pending[u].get_or_insert_with(|| Pending::Host(vec![0.0; len]));
                        if let Pending::Host(buf) = p {
                            write_once(&mut buf[off..off + g.len()], &g);
                        }
                        Ok(())
                    }
                    Err(e) => Err(Error::Tensor(format!("gradient: {e:?}"))),
                },
            };
            if let Err(e) = r {
                failed.get_or_insert(e);
            }
        });
        self.device_grad_bytes += packed;
        failed.map_or(Ok(()), Err)
    }
}

/// `dst = 0 + src`, bit for bit what adding `src` into a zeroed slot gives (`-0.0` becomes
/// `+0.0`), without reading `dst`: a fresh buffer's pages are the kernel's shared zero page until
/// written, and a read first makes every page fault twice, the second time with a TLB shootdown
/// on every core the rank's threads run on. Each parameter lives in one segment, so its slot of
/// a unit's gradient buffer is written once per micro-step.
fn write_once(dst: &mut [f32], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s + 0.0;
    }
}
