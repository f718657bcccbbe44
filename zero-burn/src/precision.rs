//! Mixed precision: 16-bit working weights and gradients, and fp16 loss scaling.
//!
//! With `Precision::Bf16` or `Precision::Fp16` each rank keeps, for its part of every trainable
//! unit, an fp32 **master** copy and the fp32 optimizer state. The **working** weights are the
//! master rounded to the 16-bit type (round to nearest, ties to even, by the `half` crate); they are what
//! the all-gathers move (as 16-bit elements, so measured bytes equal the plan's `2Ψ`-style
//! prediction) and what the model computes with. The backward's f32 gradients are rounded to
//! 16 bits before every reduction and reduced as 16-bit elements (the host loopback sums in f32
//! and rounds once); the gradient accumulator holds 16-bit values (the plan's 2 B/element); the
//! optimizer widens them to fp32, unscales and steps the fp32 master.
//!
//! **Compute is f32.** burn's flex (CPU) backend computes in f32, so the working weights are
//! loaded into the burn module widened to f32. The widening is exact, so the weights the model
//! sees are exactly the 16-bit values, and the gradients are really rounded to 16 bits; the
//! matmul precision, however, is f32's, not a 16-bit kernel's. The f32 tensors cost 2 B/element
//! beyond the 16-bit working copy the plan budgets; [`crate::MeasuredMemory::f32_compute_copies`]
//! reports that excess separately so the model-state categories stay comparable with the plan.
//!
//! **Loss scaling (fp16 only)** follows DeepSpeed's `DynamicLossScaler`: the
//! loss is multiplied by the scale before the backward; after the reduction every rank checks its
//! reduced gradient shard for inf/NaN; the flag travels in the 8-byte f64 sum-of-squares partial
//! the plan already schedules for the fp16 overflow check (a non-finite partial on any rank makes
//! every rank's total non-finite), so every rank skips the same step. A skipped step leaves the
//! master weights, the working weights and the optimizer state (including Adam's step count)
//! untouched, and [`crate::ZeroEngine::last_step`] reports it. bf16 runs unscaled and unchecked,
//! as in DeepSpeed.

use burn::tensor::{bf16, f16};
use serde::{Deserialize, Serialize};
use zero_comm::{Communicator, ReduceOp};
use zero_core::{LossScaleConfig, Precision};

use crate::error::Result;

/// A 16-bit working type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    /// bfloat16.
    Bf16,
    /// IEEE binary16.
    F16,
}

impl Half {
    /// The working type of `p`, or `None` for fp32.
    pub fn of(p: Precision) -> Option<Half> {
        match p {
            Precision::Fp32 => None,
            Precision::Bf16 => Some(Half::Bf16),
            Precision::Fp16 => Some(Half::F16),
        }
    }

    /// Rounds to the nearest 16-bit value (ties to even); the bits.
    pub fn round(self, x: f32) -> u16 {
        match self {
            Half::Bf16 => bf16::from_f32(x).to_bits(),
            Half::F16 => f16::from_f32(x).to_bits(),
        }
    }

    /// The exact f32 value of 16-bit bits.
    pub fn widen(self, b: u16) -> f32 {
        match self {
            Half::Bf16 => bf16::from_bits(b).to_f32(),
            Half::F16 => f16::from_bits(b).to_f32(),
        }
    }

    /// Rounds every element.
    pub fn round_all(self, xs: &[f32]) -> Vec<u16> {
        xs.iter().map(|&x| self.round(x)).collect()
    }

    /// Widens every element.
    pub fn widen_all(self, bs: &[u16]) -> Vec<f32> {
        bs.iter().map(|&b| self.widen(b)).collect()
    }

    /// `x` rounded to the 16-bit type and widened back: the value the working copy holds.
    pub fn quantize(self, x: f32) -> f32 {
        self.widen(self.round(x))
    }

    /// All-gather of 16-bit elements.
    pub fn all_gather<C: Communicator>(self, comm: &mut C, piece: &[u16]) -> Result<Vec<u16>> {
        Ok(match self {
            Half::Bf16 => bits(comm.all_gather_host(typed::<bf16>(piece))?),
            Half::F16 => bits(comm.all_gather_host(typed::<f16>(piece))?),
        })
    }

    /// Reduce-scatter of 16-bit elements (the loopback sums in f32 and rounds once).
    pub fn reduce_scatter<C: Communicator>(
        self,
        comm: &mut C,
        send: &[u16],
        op: ReduceOp,
    ) -> Result<Vec<u16>> {
        Ok(match self {
            Half::Bf16 => bits(comm.reduce_scatter_vec(typed::<bf16>(send).to_vec(), op)?),
            Half::F16 => bits(comm.reduce_scatter_vec(typed::<f16>(send).to_vec(), op)?),
        })
    }

    /// All-reduce of 16-bit elements, in place.
    pub fn all_reduce<C: Communicator>(
        self,
        comm: &mut C,
        data: &mut [u16],
        op: ReduceOp,
    ) -> Result<()> {
        let reduced = match self {
            Half::Bf16 => bits(comm.all_reduce_vec(typed::<bf16>(data).to_vec(), op)?),
            Half::F16 => bits(comm.all_reduce_vec(typed::<f16>(data).to_vec(), op)?),
        };
        data.copy_from_slice(&reduced);
        Ok(())
    }

    /// `acc[i] = round(widen(acc[i]) + widen(add[i]))`: a 16-bit accumulator added in f32.
    pub fn add_into(self, acc: &mut [u16], add: &[u16]) {
        for (a, &b) in acc.iter_mut().zip(add) {
            *a = self.round(self.widen(*a) + self.widen(b));
        }
    }

    /// `acc[i] = round(widen(acc[i]) + add[i])`.
    pub fn add_f32_into(self, acc: &mut [u16], add: &[f32]) {
        for (a, &b) in acc.iter_mut().zip(add) {
            *a = self.round(self.widen(*a) + b);
        }
    }
}

/// 16-bit words as the elements of a 16-bit type (the same bytes).
fn typed<T: zero_comm::Element>(words: &[u16]) -> &[T] {
    bytemuck::cast_slice(words)
}

/// A 16-bit type's elements as their words.
fn bits<T: zero_comm::Element>(v: Vec<T>) -> Vec<u16> {
    bytemuck::cast_slice(&v).to_vec()
}

/// What happened at one optimizer step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepInfo {
    /// The step was skipped (fp16 overflow): weights and optimizer state are unchanged.
    pub skipped: bool,
    /// The loss scale the step's backward used (1 in fp32 and bf16).
    pub loss_scale: f32,
    /// The global gradient norm before clipping, where the step computed it (gradient clipping
    /// on; the norm costs an 8-byte all-gather that the plan counts only then).
    pub grad_norm: Option<f32>,
}

/// fp16 gradients overflowed at the minimum loss scale: the run cannot make progress (see
/// [`LossScaler::update`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AtMinScale {
    /// The configured minimum loss scale.
    pub min_loss_scale: f64,
}

/// DeepSpeed's loss scaler: static, or dynamic with hysteresis and a window.
#[derive(Clone, Debug, PartialEq)]
pub struct LossScaler {
    cfg: LossScaleConfig,
    scale: f64,
    hysteresis: u32,
    iter: i64,
    last_overflow: i64,
}

impl LossScaler {
    /// A scaler at the configured initial scale.
    pub fn new(cfg: LossScaleConfig) -> Self {
        LossScaler {
            cfg,
            scale: cfg.initial_scale(),
            hysteresis: cfg.hysteresis,
            iter: 0,
            last_overflow: -1,
        }
    }

    /// The current scale.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// The mutable state (scale, hysteresis, iter, last overflow), for checkpoints.
    pub(crate) fn state(&self) -> (f64, u32, i64, i64) {
        (self.scale, self.hysteresis, self.iter, self.last_overflow)
    }

    /// Restores what [`Self::state`] returned.
    pub(crate) fn set_state(
        &mut self,
        (scale, hysteresis, iter, last_overflow): (f64, u32, i64, i64),
    ) {
        self.scale = scale;
        self.hysteresis = hysteresis;
        self.iter = iter;
        self.last_overflow = last_overflow;
    }

    /// Records one step's outcome (DeepSpeed's `update_scale`). An overflow at the minimum
    /// scale is an error: the run cannot make progress, and a silent skip forever would hide it.
    pub fn update(&mut self, overflow: bool) -> std::result::Result<(), AtMinScale> {
        if !self.cfg.dynamic() {
            self.iter += 1;
            return Ok(());
        }
        if overflow {
            if self.cfg.hysteresis == 1 || self.hysteresis == 1 {
                if self.scale <= self.cfg.min_loss_scale {
                    return Err(AtMinScale {
                        min_loss_scale: self.cfg.min_loss_scale,
                    });
                }
                self.scale = (self.scale / 2.0).max(self.cfg.min_loss_scale);
            } else {
                self.hysteresis -= 1;
            }
            self.last_overflow = self.iter;
        } else {
            if self.cfg.consecutive_hysteresis {
                self.hysteresis = self.cfg.hysteresis;
            }
            if (self.iter - self.last_overflow) % self.cfg.loss_scale_window as i64 == 0 {
                if !self.cfg.consecutive_hysteresis {
                    self.hysteresis = self.cfg.hysteresis;
                }
                self.scale *= 2.0;
            }
        }
        self.iter += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_nearest_even_and_widening_exact() {
        // 1 + 2^-8 is halfway between two bf16 values: ties to the even one (1.0).
        assert_eq!(Half::Bf16.quantize(1.0 + 2f32.powi(-8)), 1.0);
        assert_eq!(
            Half::Bf16.quantize(1.0 + 3.0 * 2f32.powi(-8)),
            1.0 + 2f32.powi(-6)
        );
        assert_eq!(Half::F16.quantize(70000.0), f32::INFINITY);
        for x in [0.1f32, -3.7, 1e-3, 12345.6] {
            for h in [Half::Bf16, Half::F16] {
                let q = h.quantize(x);
                assert_eq!(h.quantize(q), q, "{h:?} {x}");
            }
        }
    }

    #[test]
    fn dynamic_scaler_follows_deepspeed() {
        let cfg = LossScaleConfig {
            loss_scale_window: 3,
            hysteresis: 2,
            ..Default::default()
        };
        let mut s = LossScaler::new(cfg);
        assert_eq!(s.scale(), 65536.0);
        // Hysteresis 2: the first overflow only uses up the hysteresis.
        s.update(true).unwrap();
        assert_eq!(s.scale(), 65536.0);
        s.update(true).unwrap();
        assert_eq!(s.scale(), 32768.0);
        // Window 3: doubles on the third clean step after the last overflow.
        s.update(false).unwrap();
        s.update(false).unwrap();
        assert_eq!(s.scale(), 32768.0);
        s.update(false).unwrap();
        assert_eq!(s.scale(), 65536.0);
        let mut m = LossScaler::new(LossScaleConfig {
            initial_scale_power: 1,
            hysteresis: 1,
            ..Default::default()
        });
        m.update(true).unwrap();
        assert_eq!(m.scale(), 1.0);
        assert!(m.update(true).is_err());
        let mut fixed = LossScaler::new(LossScaleConfig {
            loss_scale: 8.0,
            ..Default::default()
        });
        fixed.update(true).unwrap();
        assert_eq!(fixed.scale(), 8.0);
    }
}
