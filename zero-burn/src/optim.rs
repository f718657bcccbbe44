//! Optimizers over flat `f32` buffers: each rank steps only its shard, element by element, so the
//! result does not depend on how the flat buffer is sharded. One algorithm in two forms with the
//! same bits (tested): [`step`], one fused loop over host slices, for state in host memory (on a
//! CPU backend, or offloaded), and [`step_tensors`], the same operations as burn tensor
//! operations, for state on a device. The loop is the CPU's form because the tensor form makes a
//! pass over memory per operation: about 5× slower on flex (5.25M elements: 16 ms against 88 ms).

use burn::tensor::Tensor;
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

/// One step over `params` with `grads`, in host memory; `step` counts from 1. `m` and `v` are
/// the moments ([`Optimizer::state_buffers`] of them hold `params.len()` elements; the others
/// may be empty).
///
/// On an x86-64 CPU with AVX2 the loop runs compiled for it (found at run time): wider vectors,
/// the same IEEE operations per element (Rust never fuses a multiply and an add), so the same bits.
pub fn step(
    opt: &Optimizer,
    lr: f32,
    step: u64,
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    let s = Slices {
        params,
        grads,
        m,
        v,
    };
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: this CPU has AVX2 (checked just above).
        unsafe { step_avx2(opt, lr, step, s) };
        return;
    }
    step_loop(opt, lr, step, s);
}

/// [`step`]'s buffers.
struct Slices<'a> {
    params: &'a mut [f32],
    grads: &'a [f32],
    m: &'a mut [f32],
    v: &'a mut [f32],
}

/// [`step_loop`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn step_avx2(opt: &Optimizer, lr: f32, step: u64, s: Slices<'_>) {
    step_loop(opt, lr, step, s);
}

/// [`step`]'s loop, inlined into each form it is compiled in.
#[inline(always)]
fn step_loop(opt: &Optimizer, lr: f32, step: u64, s: Slices<'_>) {
    let Slices {
        params,
        grads,
        m,
        v,
    } = s;
    let n = params.len();
    match *opt {
        Optimizer::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
        } => {
            let (bc1, bc2) = bias_corrections(beta1, beta2, step);
            // Iterators over slices of one length: no bounds checks, so the loop vectorises
            // (the same IEEE operations per element, so the same bits).
            let moments = m[..n].iter_mut().zip(&mut v[..n]);
            for ((p, &g), (m, v)) in params.iter_mut().zip(&grads[..n]).zip(moments) {
                *m = beta1 * *m + (1.0 - beta1) * g;
                *v = beta2 * *v + (1.0 - beta2) * g * g;
                let mhat = *m / bc1;
                let vhat = *v / bc2;
                *p -= lr * (mhat / (vhat.sqrt() + eps) + weight_decay * *p);
            }
        }
        Optimizer::Sgd { momentum } => {
            if momentum == 0.0 {
                for (p, &g) in params.iter_mut().zip(&grads[..n]) {
                    *p -= lr * g;
                }
            } else {
                for ((p, &g), m) in params.iter_mut().zip(&grads[..n]).zip(&mut m[..n]) {
                    *m = momentum * *m + g;
                    *p -= lr * *m;
                }
            }
        }
    }
}

/// Adam's bias corrections `1 − β^t`.
fn bias_corrections(beta1: f32, beta2: f32, step: u64) -> (f32, f32) {
    (1.0 - beta1.powi(step as i32), 1.0 - beta2.powi(step as i32))
}

/// [`step`] as burn tensor operations on the tensors' own device: the same IEEE operations in
/// the same order, element by element, so on the CPU backend the bits equal [`step`]'s (tested),
/// and on a GPU they differ at most by the device's `sqrt` and division rounding. Returns the new
/// weights and moments; `m` and `v` are `Some` exactly when the optimizer keeps them.
pub fn step_tensors(
    opt: &Optimizer,
    lr: f32,
    step: u64,
    params: Tensor<1>,
    grads: Tensor<1>,
    m: Option<Tensor<1>>,
    v: Option<Tensor<1>>,
) -> (Tensor<1>, Option<Tensor<1>>, Option<Tensor<1>>) {
    match (*opt, m, v) {
        (
            Optimizer::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            },
            Some(m),
            Some(v),
        ) => {
            let (bc1, bc2) = bias_corrections(beta1, beta2, step);
            let m = m.mul_scalar(beta1) + grads.clone().mul_scalar(1.0 - beta1);
            let v = v.mul_scalar(beta2) + grads.clone().mul_scalar(1.0 - beta2) * grads;
            let mhat = m.clone().div_scalar(bc1);
            let vhat = v.clone().div_scalar(bc2);
            let update =
                mhat / vhat.sqrt().add_scalar(eps) + params.clone().mul_scalar(weight_decay);
            (params - update.mul_scalar(lr), Some(m), Some(v))
        }
        (Optimizer::Sgd { momentum }, m, _) if momentum != 0.0 => {
            let m = m.expect("momentum SGD keeps a momentum buffer");
            let m = m.mul_scalar(momentum) + grads;
            (params - m.clone().mul_scalar(lr), Some(m), None)
        }
        (Optimizer::Sgd { .. }, _, _) => (params - grads.mul_scalar(lr), None, None),
        (Optimizer::AdamW { .. }, _, _) => {
            unreachable!("AdamW keeps both moments (Optimizer::state_buffers)")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    fn tensor(x: &[f32]) -> Tensor<1> {
        Tensor::from_data(TensorData::new(x.to_vec(), [x.len()]), &Device::flex())
    }

    /// Every optimizer, weight decay on in one.
    fn optimizers() -> [Optimizer; 4] {
        [
            Optimizer::default(),
            Optimizer::AdamW {
                beta1: 0.8,
                beta2: 0.95,
                eps: 1e-6,
                weight_decay: 0.1,
            },
            Optimizer::Sgd { momentum: 0.9 },
            Optimizer::Sgd { momentum: 0.0 },
        ]
    }

    fn host(t: &Tensor<1>) -> Vec<u32> {
        t.clone()
            .into_data()
            .try_into_vec_as::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }

    /// On the CPU backend the tensor step gives the host step's bits, step after step, for every
    /// optimizer (weight decay on, and the awkward values: zeros, signed zeros, tiny and huge).
    #[test]
    fn the_tensor_step_equals_the_host_step_bit_for_bit() {
        let n = 1000;
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let mut w0: Vec<f32> = (0..n).map(|_| next()).collect();
        w0[..4].copy_from_slice(&[0.0, -0.0, 1e-30, -3e30]);
        for opt in optimizers() {
            let k = opt.state_buffers();
            let mut w = w0.clone();
            let (mut m, mut v) = (
                vec![0.0; n * usize::from(k >= 1)],
                vec![0.0; n * usize::from(k >= 2)],
            );
            let mut tw = tensor(&w);
            let mut tm = (k >= 1).then(|| tensor(&m));
            let mut tv = (k >= 2).then(|| tensor(&v));
            for t in 1..=5u64 {
                let mut g: Vec<f32> = (0..n).map(|_| next() * 1e-2).collect();
                g[..3].copy_from_slice(&[0.0, -0.0, 1e-38]);
                step(&opt, 1e-3, t, &mut w, &g, &mut m, &mut v);
                (tw, tm, tv) = step_tensors(&opt, 1e-3, t, tw, tensor(&g), tm, tv);
                let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(host(&tw), bits(&w), "{opt:?} step {t}: weights");
                if let Some(tm) = &tm {
                    assert_eq!(host(tm), bits(&m), "{opt:?} step {t}: m");
                }
                if let Some(tv) = &tv {
                    assert_eq!(host(tv), bits(&v), "{opt:?} step {t}: v");
                }
            }
        }
    }

    /// The AVX2 form of the host step gives the portable loop's bits (the two compiled forms of
    /// one loop), for every optimizer; on a CPU without AVX2 there is one form, and the test says
    /// so.
    #[test]
    fn the_avx2_step_equals_the_portable_loop_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        let avx2 = std::arch::is_x86_feature_detected!("avx2");
        #[cfg(not(target_arch = "x86_64"))]
        let avx2 = false;
        if !avx2 {
            eprintln!("not run: this CPU has no AVX2, so the host step has one form");
            return;
        }
        let n = 1037;
        let g: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37).sin() * 1e-2).collect();
        let w0: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.11).cos()).collect();
        for opt in optimizers() {
            let (mut a, mut b) = (w0.clone(), w0.clone());
            let (mut ma, mut va) = (vec![0.0; n], vec![0.0; n]);
            let (mut mb, mut vb) = (vec![0.0; n], vec![0.0; n]);
            for t in 1..=3u64 {
                step(&opt, 1e-3, t, &mut a, &g, &mut ma, &mut va);
                let s = Slices {
                    params: &mut b,
                    grads: &g,
                    m: &mut mb,
                    v: &mut vb,
                };
                step_loop(&opt, 1e-3, t, s);
                let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "{opt:?} step {t}: weights");
                assert_eq!(bits(&ma), bits(&mb), "{opt:?} step {t}: m");
                assert_eq!(bits(&va), bits(&vb), "{opt:?} step {t}: v");
            }
        }
    }
}
