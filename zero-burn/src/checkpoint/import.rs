//! Starting a model from a safetensors file (fine-tuning): the checkpoint export's format, or any
//! file that names burn's parameter paths.

use half::f16;
use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};
use crate::params::{self, NewValues};
use burn::module::Module;

/// Replaces every float parameter of `model` with the tensor of the same name (burn's dot path)
/// in the safetensors `bytes` (`file` names it in errors): f32, bf16 or f16, widened exactly to
/// the model's f32. Every parameter must be there with its shape, and every tensor must be a
/// parameter; otherwise an error names the first that is not, and the model is not touched.
pub fn init_from_safetensors<M: Module>(model: M, bytes: &[u8], file: &str) -> Result<M> {
    let bad = |detail: String| Error::Init {
        file: file.to_owned(),
        detail,
    };
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| bad(format!("not a readable safetensors file ({e})")))?;
    let params = params::describe(&model);
    let mut values = NewValues::new();
    for p in &params {
        let t = st
            .tensor(&p.path)
            .map_err(|_| bad(format!("no tensor for the model's parameter {}", p.path)))?;
        if t.shape() != p.shape.as_slice() {
            return Err(bad(format!(
                "tensor {} has shape {:?}; the model's parameter has {:?}",
                p.path,
                t.shape(),
                p.shape
            )));
        }
        let data = t.data();
        let v: Vec<f32> = match t.dtype() {
            Dtype::F32 => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            // bf16 is the top half of an f32: widening is exact.
            Dtype::BF16 => data
                .chunks_exact(2)
                .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
                .collect(),
            Dtype::F16 => data
                .chunks_exact(2)
                .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                .collect(),
            d => {
                return Err(bad(format!(
                    "tensor {} is {d:?}; expected F32, BF16 or F16",
                    p.path
                )));
            }
        };
        values.insert(p.id, (v, p.shape.clone(), p.trainable));
    }
    let mut names: Vec<String> = st.names().into_iter().map(str::to_owned).collect();
    names.sort();
    if let Some(extra) = names.iter().find(|n| !params.iter().any(|p| &p.path == *n)) {
        return Err(bad(format!(
            "tensor {extra} is not a parameter of the model ({} parameters, {} tensors)",
            params.len(),
            names.len()
        )));
    }
    Ok(params::write_values(model, values))
}
