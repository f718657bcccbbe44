//! Optimizers over flat `f32` slices: each rank steps only its shard, element by element, so the
//! result does not depend on how the flat buffer is sharded.

use serde::{Deserialize, Serialize};

/// The optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Optimizer {
    /// AdamW (decoupled weight decay).
    AdamW {
        /// β1.
        beta1: f32,
        /// β2.
        beta2: f32,
        /// ε.
        eps: f32,
        /// Decoupled weight decay.
        weight_decay: f32,
    },
    /// SGD with optional momentum.
    Sgd {
        /// Momentum (0 = plain SGD).
        momentum: f32,
    },
}

impl Default for Optimizer {
    fn default() -> Self {
        Optimizer::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

impl Optimizer {
    /// State buffers per element (Adam: 2, momentum SGD: 1, SGD: 0).
    pub fn state_buffers(&self) -> usize {
        match self {
            Optimizer::AdamW { .. } => 2,
            Optimizer::Sgd { momentum } if *momentum != 0.0 => 1,
            Optimizer::Sgd { .. } => 0,
        }
    }

    /// The zero-core optimizer kind (for the memory model).
    pub fn kind(&self) -> zero_core::OptimizerKind {
        match self.state_buffers() {
            2 => zero_core::OptimizerKind::Adam,
            1 => zero_core::OptimizerKind::SgdMomentum,
            _ => zero_core::OptimizerKind::Sgd,
        }
    }
}

/// Optimizer state of one flat slice.
#[derive(Clone, Debug, Default)]
pub struct OptimState {
    /// First moment (Adam) or momentum buffer (SGD).
    pub m: Vec<f32>,
    /// Second moment (Adam).
    pub v: Vec<f32>,
}

impl OptimState {
    /// Zeroed state for `len` elements.
    pub fn new(opt: &Optimizer, len: usize) -> Self {
        let n = opt.state_buffers();
        OptimState {
            m: if n >= 1 { vec![0.0; len] } else { Vec::new() },
            v: if n >= 2 { vec![0.0; len] } else { Vec::new() },
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        4 * (self.m.capacity() + self.v.capacity()) as u64
    }
}

/// One step over `params[range]` with `grads[range]`; `step` counts from 1.
pub fn step(
    opt: &Optimizer,
    lr: f32,
    step: u64,
    params: &mut [f32],
    grads: &[f32],
    st: &mut OptimState,
    offset: usize,
) {
    let n = params.len();
    match *opt {
        Optimizer::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
        } => {
            let bc1 = 1.0 - beta1.powi(step as i32);
            let bc2 = 1.0 - beta2.powi(step as i32);
            let m = &mut st.m[offset..offset + n];
            let v = &mut st.v[offset..offset + n];
            for i in 0..n {
                let g = grads[i];
                m[i] = beta1 * m[i] + (1.0 - beta1) * g;
                v[i] = beta2 * v[i] + (1.0 - beta2) * g * g;
                let mhat = m[i] / bc1;
                let vhat = v[i] / bc2;
                params[i] -= lr * (mhat / (vhat.sqrt() + eps) + weight_decay * params[i]);
            }
        }
        Optimizer::Sgd { momentum } => {
            if momentum == 0.0 {
                for i in 0..n {
                    params[i] -= lr * grads[i];
                }
            } else {
                let m = &mut st.m[offset..offset + n];
                for i in 0..n {
                    m[i] = momentum * m[i] + grads[i];
                    params[i] -= lr * m[i];
                }
            }
        }
    }
}
