//! Reading a module's gradients from burn's container by parameter, each parameter once.

use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

/// Where a visit finds gradients: read (burn's container keeps its handle) or taken out of it
/// (the only handle left, so burn hands over the memory without a copy).
pub(crate) enum GradSource<'a> {
    Read(&'a GradientsParams),
    Take(&'a mut GradientsParams),
}

struct ReadGrads<'a, F> {
    grads: GradSource<'a>,
    want: &'a HashMap<ParamId, usize>,
    sink: F,
    seen: HashSet<ParamId>,
}

impl<F: FnMut(usize, Tensor<1>)> ModuleVisitor for ReadGrads<'_, F> {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
        let Some(&slot) = self.want.get(&p.id) else {
            return;
        };
        if !self.seen.insert(p.id) {
            return;
        }
        let g = match &mut self.grads {
            GradSource::Read(g) => g.get::<D>(p.id),
            GradSource::Take(g) => g.remove::<D>(p.id),
        };
        if let Some(g) = g {
            let n = g.shape().num_elements();
            (self.sink)(slot, g.reshape([n]));
        }
    }
}

/// Hands the gradient of every parameter in `want` that has one to `sink(slot, values)`, one
/// parameter at a time (no more than one gradient is copied out at once).
pub fn for_each_grad<M: Module>(
    model: &M,
    grads: &GradientsParams,
    want: &HashMap<ParamId, usize>,
    mut sink: impl FnMut(usize, Vec<f32>),
) {
    for_each_grad_tensor(model, grads, want, |slot, g| {
        if let Ok(v) = g.into_data().try_into_vec_as::<f32>() {
            sink(slot, v);
        }
    });
}

/// [`for_each_grad`] with each gradient as a flat burn tensor where it lives (on a GPU backend:
/// in device memory, for the zero-copy bridge).
pub fn for_each_grad_tensor<M: Module>(
    model: &M,
    grads: &GradientsParams,
    want: &HashMap<ParamId, usize>,
    sink: impl FnMut(usize, Tensor<1>),
) {
    visit_grads(model, GradSource::Read(grads), want, sink);
}

/// [`for_each_grad_tensor`] from gradients read or taken out of burn's container.
pub(crate) fn visit_grads<M: Module>(
    model: &M,
    grads: GradSource<'_>,
    want: &HashMap<ParamId, usize>,
    sink: impl FnMut(usize, Tensor<1>),
) {
    model.visit(&mut ReadGrads {
        grads,
        want,
        sink,
        seen: HashSet::new(),
    });
}
