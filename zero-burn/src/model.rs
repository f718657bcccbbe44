//! A model as the planner sees it: its parameters, its [`ModelDesc`], a plan for it.

use zero_core::{ModelDesc, Plan, Topology, ZeroConfig};

use crate::error::Result;
use crate::params;
use crate::segmented::{self, Segmented};

/// Every parameter and buffer of `model`, in visit order: its path (`blocks.0.attn.query.weight`,
/// the name the plan, its report and errors use), shape, and whether it is trainable or a buffer.
pub fn parameters<M: burn::module::Module>(model: &M) -> Vec<params::ParamInfo> {
    params::describe(model)
}

/// The zero-core description of a segmented model: parameters in visit order, grouped for stage-3
/// gathers by segment (`segment.K`, the first segment that visits the parameter), with the other
/// segments that read it (tied weights) as its readers, and the segments in order as the modules.
pub fn describe_model<M: Segmented>(model: &M) -> Result<ModelDesc> {
    let params = params::describe(model);
    let readers = segmented::param_readers(model, &params)?;
    let name = |s: usize| format!("segment.{s}");
    let mut desc = params::model_desc(&params, |i| name(readers[i][0]))?;
    for (d, r) in desc.params.iter_mut().zip(&readers) {
        // A buffer is in no unit: every rank holds it whole, whoever reads it.
        if !d.buffer {
            d.readers = r[1..].iter().map(|&s| name(s)).collect();
        }
    }
    desc.modules = (0..model.num_segments()).map(name).collect();
    desc.validate()?;
    Ok(desc)
}

/// A checked plan for `model`.
pub fn plan_for<M: Segmented>(model: &M, topology: Topology, config: &ZeroConfig) -> Result<Plan> {
    Ok(Plan::new(&describe_model(model)?, topology, config)?)
}
