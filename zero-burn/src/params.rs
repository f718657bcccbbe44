//! Bridging burn modules and flat parameter buffers: describe a module's parameters, read their
//! values and gradients into flat `f32` slices, and write values back.
//!
//! burn's `GradientsParams::get::<D>` panics on a wrong rank `D`, so every read happens inside a
//! visitor where `D` is the parameter's own rank.

use std::any::Any;
use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId, ParamMapper};
use burn::tensor::{DType, Tensor, TensorData};
use zero_core::{ModelDesc, ParamDesc};

use crate::error::{Error, Result};

mod grads;
pub(crate) use grads::{GradSource, visit_grads};
pub use grads::{for_each_grad, for_each_grad_tensor};

/// One parameter of a burn module.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    /// burn's id.
    pub id: ParamId,
    /// Dotted path, e.g. `blocks.0.attn.query.weight`.
    pub path: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Rank (number of dimensions) — the `D` to read its gradient with.
    pub rank: usize,
    /// Whether it requires a gradient.
    pub trainable: bool,
    /// Whether it is a buffer: module state that is not a parameter (burn's `RunningState`, e.g.
    /// BatchNorm's running mean and variance), updated by the forward pass. Never trainable.
    pub buffer: bool,
}

impl ParamInfo {
    /// Element count.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

#[derive(Default)]
struct Describe {
    path: Vec<String>,
    out: Vec<ParamInfo>,
    seen: HashSet<ParamId>,
}

impl ModuleVisitor for Describe {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
        // A parameter held by two fields (a tied weight) is one parameter, named by the first.
        if !self.seen.insert(p.id) {
            return;
        }
        let t = p.val();
        self.out.push(ParamInfo {
            id: p.id,
            path: self.path.join("."),
            shape: t.dims().to_vec(),
            rank: D,
            trainable: t.is_require_grad(),
            buffer: false,
        });
    }
}

/// Makes every float tensor require a gradient: burn's `RunningState` (a buffer) refuses, so
/// what still requires none afterwards is a buffer.
struct RequireGrad;

impl ModuleMapper for RequireGrad {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, t, mapper) = p.consume();
        Param::from_mapped_value(id, t.require_grad(), mapper)
    }
}

/// The module's float parameters (and buffers) in visit order, each once: a parameter held by
/// two fields (a tied weight: the same [`ParamId`]) is one parameter, with the first field's
/// path.
///
/// burn visits a buffer (`RunningState`) like a parameter that needs no gradient; it differs from
/// a frozen parameter in that it cannot be made to need one. On an autodiff device every float
/// tensor is probed that way on a copy of the model (a buffer's value is written back unchanged);
/// without autodiff nothing can be trained and nothing is classified as a buffer.
pub fn describe<M: Module>(model: &M) -> Vec<ParamInfo> {
    let mut d = Describe::default();
    model.visit(&mut d);
    let mut out = d.out;
    if model
        .devices()
        .iter()
        .any(burn::tensor::Device::is_autodiff)
    {
        let mut probe = Describe::default();
        model.clone().map(&mut RequireGrad).visit(&mut probe);
        for (p, q) in out.iter_mut().zip(&probe.out) {
            p.buffer = !q.trainable;
        }
    }
    out
}

/// A zero-core model description. `group_of(i)` names the unit parameter `i` is gathered with at
/// stage 3 (e.g. its segment).
pub fn model_desc(params: &[ParamInfo], group_of: impl Fn(usize) -> String) -> Result<ModelDesc> {
    let descs = params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut d = ParamDesc::new(p.path.clone(), &p.shape, group_of(i));
            d.trainable = p.trainable;
            if p.buffer {
                d = d.buffer();
            }
            d
        })
        .collect();
    let m = ModelDesc::new(descs);
    m.validate()?;
    Ok(m)
}

struct ValuesCrc(u32, HashSet<ParamId>);

impl ModuleVisitor for ValuesCrc {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
        if self.1.insert(p.id) {
            let data = p.val().into_data();
            self.0 = crc32c::crc32c_append(self.0, data.as_bytes());
        }
    }
}

/// A crc32c of every float parameter's bytes in visit order (a host read of each, once): equal
/// models, equal values.
pub fn values_crc<M: Module>(model: &M) -> u64 {
    let mut v = ValuesCrc(0, HashSet::new());
    model.visit(&mut v);
    u64::from(v.0)
}

struct ReadValues<'a> {
    want: &'a HashMap<ParamId, usize>,
    out: Vec<Option<TensorData>>,
}

impl ModuleVisitor for ReadValues<'_> {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
        if let Some(&slot) = self.want.get(&p.id)
            && self.out[slot].is_none()
        {
            let t = p.val();
            let n = t.shape().num_elements();
            self.out[slot] = t.reshape([n]).into_data().try_cast_as::<f32>().ok();
        }
    }
}

/// Reads the values of the parameters in `want` (id → output slot).
pub fn read_values<M: Module>(model: &M, want: &HashMap<ParamId, usize>) -> Result<Vec<Vec<f32>>> {
    read_data(model, want)?
        .into_iter()
        .map(|d| {
            d.try_into_vec_as::<f32>()
                .map_err(|e| Error::Tensor(format!("parameter values: {e:?}")))
        })
        .collect()
}

/// A parameter of the plan at `place` that the engine's model does not hold as `f32` values:
/// the model and its plan disagree (a bug in zero-burn).
pub(crate) fn missing(place: &str) -> Error {
    Error::Internal(format!(
        "{place}: a parameter is not in the module, or not f32 values"
    ))
}

/// [`read_values`] as burn's flat `f32` data, without the copy into a `Vec`.
pub(crate) fn read_data<M: Module>(
    model: &M,
    want: &HashMap<ParamId, usize>,
) -> Result<Vec<TensorData>> {
    let mut r = ReadValues {
        want,
        out: vec![None; want.len()],
    };
    model.visit(&mut r);
    r.out
        .into_iter()
        .enumerate()
        .map(|(i, v)| v.ok_or_else(|| missing(&format!("parameter slot {i}"))))
        .collect()
}

/// The tensors a mapper has written, by parameter: a parameter held by two fields (a tied
/// weight) gets the same tensor in both, so burn's autodiff sees one leaf and sums its gradient.
#[derive(Default)]
struct Written(HashMap<ParamId, Box<dyn Any>>);

impl Written {
    /// The tensor written for `p` earlier in this map, put in this field too.
    fn again<const D: usize>(
        &self,
        p: Param<Tensor<D>>,
    ) -> std::result::Result<Param<Tensor<D>>, Param<Tensor<D>>> {
        match self
            .0
            .get(&p.id)
            .and_then(|t| t.downcast_ref::<Tensor<D>>())
        {
            Some(t) => {
                let (id, _, mapper) = p.consume();
                Ok(Param::from_mapped_value(id, t.clone(), mapper))
            }
            None => Err(p),
        }
    }

    fn put<const D: usize>(
        &mut self,
        id: ParamId,
        t: Tensor<D>,
        mapper: ParamMapper<Tensor<D>>,
    ) -> Param<Tensor<D>> {
        self.0.insert(id, Box::new(t.clone()));
        Param::from_mapped_value(id, t, mapper)
    }
}

struct WriteValues<'a> {
    values: &'a mut NewValues,
    written: Written,
}

impl ModuleMapper for WriteValues<'_> {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let p = match self.written.again(p) {
            Ok(p) => return p,
            Err(p) => p,
        };
        let Some((v, shape, require_grad)) = self.values.remove(&p.id) else {
            return p;
        };
        let (id, t, mapper) = p.consume();
        let device = t.device();
        let mut nt = Tensor::<D>::from_data(TensorData::new(v, shape), &device);
        if require_grad {
            nt = nt.require_grad();
        }
        self.written.put(id, nt, mapper)
    }
}

struct WriteTensors<'a> {
    values: &'a mut NewTensors,
    written: Written,
}

impl ModuleMapper for WriteTensors<'_> {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let p = match self.written.again(p) {
            Ok(p) => return p,
            Err(p) => p,
        };
        let Some((t, shape, require_grad)) = self.values.remove(&p.id) else {
            return p;
        };
        let Ok(dims) = <[usize; D]>::try_from(shape) else {
            return p;
        };
        let (id, _, mapper) = p.consume();
        let mut nt = t.reshape(dims);
        if require_grad {
            nt = nt.require_grad();
        }
        self.written.put(id, nt, mapper)
    }
}

/// New values of parameters as flat tensors already on the model's device: id → (tensor, shape,
/// whether it requires a gradient).
pub type NewTensors = HashMap<ParamId, (Tensor<1>, Vec<usize>, bool)>;

/// Replaces parameter values with tensors (reshaped; no host round trip).
pub fn write_tensors<M: Module>(model: M, mut values: NewTensors) -> M {
    model.map(&mut WriteTensors {
        values: &mut values,
        written: Written::default(),
    })
}

/// New values of parameters: id → (flat values, shape, whether it requires a gradient).
pub type NewValues = HashMap<ParamId, (Vec<f32>, Vec<usize>, bool)>;

/// Replaces parameter values. A shape with a zero dimension (and no gradient, so no autodiff
/// node) releases the parameter's storage (stage 3).
pub fn write_values<M: Module>(model: M, mut values: NewValues) -> M {
    model.map(&mut WriteValues {
        values: &mut values,
        written: Written::default(),
    })
}

/// Settles burn's pending buffer updates: a training forward records a `RunningState`'s new value
/// per thread, and it reaches the value read by a visit only when the state is next synced
/// (making the module `valid()` syncs every one).
pub(crate) fn settle_buffers<M: Module>(model: &M) {
    drop(model.valid());
}

/// Every buffer of the module (see [`ParamInfo::buffer`]), as `(path, values)` in visit order,
/// after settling burn's pending updates of them.
pub fn buffers<M: Module>(model: &M) -> Vec<(String, Vec<f32>)> {
    settle_buffers(model);
    let infos: Vec<ParamInfo> = describe(model).into_iter().filter(|p| p.buffer).collect();
    let want: HashMap<ParamId, usize> = infos.iter().enumerate().map(|(i, p)| (p.id, i)).collect();
    let mut r = ReadValues {
        want: &want,
        out: vec![None; want.len()],
    };
    model.visit(&mut r);
    infos
        .into_iter()
        .zip(r.out)
        .map(|(p, v)| {
            let v = v.and_then(|d| d.try_into_vec_as::<f32>().ok());
            (p.path, v.unwrap_or_default())
        })
        .collect()
}

struct ReadTensors<'a> {
    want: &'a HashMap<ParamId, usize>,
    out: NewTensors,
}

impl ModuleVisitor for ReadTensors<'_> {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
        if self.want.contains_key(&p.id) && !self.out.contains_key(&p.id) {
            let t = p.val();
            let shape = t.dims().to_vec();
            let n: usize = shape.iter().product();
            self.out.insert(p.id, (t.reshape([n]), shape, false));
        }
    }
}

/// The current tensors of the parameters in `want`, where they live (no copy): a snapshot that
/// [`write_tensors`] puts back.
pub(crate) fn read_tensors<M: Module>(model: &M, want: &HashMap<ParamId, usize>) -> NewTensors {
    let mut r = ReadTensors {
        want,
        out: HashMap::with_capacity(want.len()),
    };
    model.visit(&mut r);
    r.out
}

struct TakeTensors<'a> {
    want: &'a HashMap<ParamId, usize>,
    out: Vec<Option<Tensor<1>>>,
}

impl ModuleMapper for TakeTensors<'_> {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(&slot) = self.want.get(&p.id) else {
            return p;
        };
        let (id, t, mapper) = p.consume();
        let device = t.device();
        let n = t.shape().num_elements();
        // A second field of a tied weight holds the same tensor: its placeholder too.
        if self.out[slot].is_none() {
            self.out[slot] = Some(t.detach().reshape([n]));
        }
        Param::from_mapped_value(id, Tensor::empty([0; D], &device), mapper)
    }
}

/// Takes the parameters in `want` (id → output slot) out of `model`, each as flat data, leaving
/// tensors of no elements in their place until [`write_tensors`] puts values back. With the
/// model's handle gone a parameter's memory is handed over, not copied, as [`read_data`] must.
/// A slot not found in the module is `None`; values that do not cast to `f32` come back as they
/// are (and go back so).
pub(crate) fn take_data<M: Module>(
    model: &mut M,
    want: &HashMap<ParamId, usize>,
) -> Vec<Option<TensorData>> {
    let mut t = TakeTensors {
        want,
        out: vec![None; want.len()],
    };
    // The clone shares every tensor; replacing the model drops its handles.
    *model = model.clone().map(&mut t);
    t.out
        .into_iter()
        .map(|t| {
            t.map(|t| match t.into_data() {
                d if d.dtype() == DType::F32 => d,
                d => d.clone().try_cast_as::<f32>().unwrap_or(d),
            })
        })
        .collect()
}

struct CountResident {
    elems: u64,
    seen: HashSet<ParamId>,
}

impl ModuleVisitor for CountResident {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
        if self.seen.insert(p.id) {
            self.elems += p.val().shape().num_elements() as u64;
        }
    }
}

/// Elements of parameter storage the module currently holds (released parameters count 0).
pub fn resident_elems<M: Module>(model: &M) -> u64 {
    let mut c = CountResident {
        elems: 0,
        seen: HashSet::new(),
    };
    model.visit(&mut c);
    c.elems
}

/// The ids of the float parameters a visit reaches, in order, each once.
#[derive(Default)]
pub(crate) struct Ids(pub(crate) Vec<ParamId>);

impl ModuleVisitor for Ids {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
        if !self.0.contains(&p.id) {
            self.0.push(p.id);
        }
    }
}
