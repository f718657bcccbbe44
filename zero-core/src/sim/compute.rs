//! Compute: FLOPs of a dense transformer step, their time, the optimizer step, activations.
//!
//! Per token, with `Ψ_t` trainable and `Ψ_f` frozen parameters, `l` layers, hidden `h` and
//! sequence length `s` (attention as in Megatron's formula: `4·s·h` per layer forward, the
//! full `s×s` score matrix, no causal halving):
//! - forward: `2Ψ + 4·l·s·h`;
//! - backward: `4Ψ_t + 2Ψ_f + 8·l·s·h` (weight and input gradients; frozen weights need only
//!   the input gradient);
//! - recompute (activation checkpointing, as the trainer does per segment): one more forward.
//!
//! `model FLOPs = 6Ψ + 12·l·s·h` per token (frozen parts counted as trainable: the usual MFU
//! convention); `hardware FLOPs` add the recompute, which is Megatron's TFLOPs formula
//! `96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))` when `Ψ = 12·l·h² + V·h`, except that the trainer
//! also recomputes the head. Time is FLOPs over `peak · compute_efficiency`.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::model::{ModelDesc, ParamDesc};

/// What attention FLOPs and activations need beyond the parameter list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelShape {
    /// Transformer layers.
    pub layers: u64,
    /// Hidden size.
    pub hidden: u64,
    /// Sequence length.
    pub seq_len: u64,
}

impl ModelShape {
    /// The shape of a `zero_core::model` preset (sequence length: the model's context).
    pub fn of_preset(name: &str) -> Option<ModelShape> {
        let s = |layers, hidden, seq_len| ModelShape {
            layers,
            hidden,
            seq_len,
        };
        match name {
            "gpt2-small" => Some(s(12, 768, 1024)),
            "gpt2-medium" => Some(s(24, 1024, 1024)),
            "llama-7b" => Some(s(32, 4096, 4096)),
            "llama-70b" => Some(s(80, 8192, 4096)),
            _ => None,
        }
    }
}

/// The most layers [`gpt`] builds (one parameter list entry per tensor, 12 per layer).
pub const MAX_LAYERS: usize = 100_000;

/// A GPT-2-style decoder of `layers` blocks of width `hidden` (vocabulary 50,257, learned
/// positions for `seq_len`, biases, MLP 4h): `12·l·h² + 13·l·h + (V + s + 2)·h` parameters,
/// one module per linear layer and layer norm, as stage 3 gathers them.
pub fn gpt(layers: usize, hidden: usize, seq_len: usize) -> Result<(ModelDesc, ModelShape)> {
    if layers == 0 || hidden == 0 || seq_len == 0 {
        return Err(Error::invalid(
            "gpt",
            format!("{layers} layers, hidden {hidden}, sequence {seq_len}"),
            "layers, hidden size and sequence length of at least 1",
        ));
    }
    let (d, v) = (hidden, 50257);
    // Checked before a parameter list is built (in f64, which cannot overflow here).
    let (lf, df, sf) = (layers as f64, d as f64, seq_len as f64);
    let total = v as f64 * df + sf * df + lf * (12.0 * df * df + 13.0 * df) + 2.0 * df;
    if layers > MAX_LAYERS || total > crate::MAX_MODEL_PARAMS as f64 {
        return Err(Error::invalid(
            "gpt",
            format!(
                "{layers} layers, hidden {hidden}, sequence {seq_len} ({total:.3e} parameters)"
            ),
            format!(
                "at most {MAX_LAYERS} layers and 2^50 ({:.3e}) parameters",
                crate::MAX_MODEL_PARAMS as f64
            ),
        ));
    }
    let mut p = vec![
        ParamDesc::new("wte.weight", &[v, d], "wte"),
        ParamDesc::new("wpe.weight", &[seq_len, d], "wpe"),
    ];
    for l in 0..layers {
        for (m, shape) in [
            ("ln_1", vec![d]),
            ("attn.c_attn", vec![d, 3 * d]),
            ("attn.c_proj", vec![d, d]),
            ("ln_2", vec![d]),
            ("mlp.c_fc", vec![d, 4 * d]),
            ("mlp.c_proj", vec![4 * d, d]),
        ] {
            let module = format!("h.{l}.{m}");
            let bias = if m.starts_with("ln") { d } else { shape[1] };
            p.push(ParamDesc::new(format!("{module}.weight"), &shape, &module));
            p.push(ParamDesc::new(format!("{module}.bias"), &[bias], &module));
        }
    }
    p.push(ParamDesc::new("ln_f.weight", &[d], "ln_f"));
    p.push(ParamDesc::new("ln_f.bias", &[d], "ln_f"));
    let shape = ModelShape {
        layers: layers as u64,
        hidden: hidden as u64,
        seq_len: seq_len as u64,
    };
    Ok((ModelDesc::new(p), shape))
}

/// FLOPs of one micro-step on one GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct StepFlops {
    /// Forward.
    pub forward: f64,
    /// Backward (weight and input gradients).
    pub backward: f64,
    /// Recomputed forward.
    pub recompute: f64,
    /// `6Ψ + 12·l·s·h` per token: the model FLOPs (no recompute).
    pub model: f64,
}

impl StepFlops {
    /// Forward, backward and recompute.
    pub fn hardware(&self) -> f64 {
        self.forward + self.backward + self.recompute
    }
}

/// FLOPs of `tokens` tokens through `model`.
pub fn flops(
    model: &ModelDesc,
    shape: Option<ModelShape>,
    tokens: u64,
    recompute: bool,
) -> StepFlops {
    let t = tokens as f64;
    let psi_t = model.trainable_numel() as f64;
    let psi = model.numel() as f64;
    let attn = shape.map_or(0.0, |s| 4.0 * (s.layers * s.seq_len * s.hidden) as f64);
    let forward = t * (2.0 * psi + attn);
    StepFlops {
        forward,
        backward: t * (4.0 * psi_t + 2.0 * (psi - psi_t) + 2.0 * attn),
        recompute: if recompute { forward } else { 0.0 },
        model: t * (6.0 * psi + 3.0 * attn),
    }
}

/// Activation bytes one GPU holds at its peak for `tokens` tokens per micro-step, with
/// `w`-byte activations: with recompute, each layer's input (`tokens·h·w`) plus one layer's
/// working set; without, every layer's working set. A layer's working set is Korthikanti et
/// al.'s `34·tokens·h` bytes at 16 bits (attention scores not stored: flash attention), scaled
/// by `w/2`. Logits and the loss are not counted.
pub fn activation_bytes(shape: ModelShape, tokens: u64, w: u64, recompute: bool) -> u64 {
    let per_layer = 34 * tokens * shape.hidden * w / 2;
    if recompute {
        shape.layers * tokens * shape.hidden * w + per_layer
    } else {
        shape.layers * per_layer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt_has_the_closed_form_size() {
        let (m, s) = gpt(40, 6144, 512).unwrap();
        let (l, h, v) = (40u64, 6144u64, 50257u64);
        assert_eq!(m.numel(), 12 * l * h * h + 13 * l * h + (v + 512 + 2) * h);
        assert_eq!(s.layers, 40);
        assert!(gpt(0, 8, 8).is_err());
    }

    #[test]
    fn flops_match_megatrons_formula() {
        // Ψ = 12·l·h² + V·h exactly (a model of one flat tensor of that size): hardware FLOPs
        // with recompute equal 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) plus the head recompute
        // 2·B·s·V·h, which Megatron does not do.
        let (l, h, s, v) = (24u64, 1024u64, 2048u64, 50000u64);
        let psi = 12 * l * h * h + v * h;
        let m = ModelDesc::synthetic(psi, 1).unwrap();
        let shape = ModelShape {
            layers: l,
            hidden: h,
            seq_len: s,
        };
        let b = 4u64;
        let f = flops(&m, Some(shape), b * s, true);
        let (bf, sf, lf, hf, vf) = (b as f64, s as f64, l as f64, h as f64, v as f64);
        let megatron =
            96.0 * bf * sf * lf * hf * hf * (1.0 + sf / (6.0 * hf) + vf / (16.0 * lf * hf));
        let head_recompute = 2.0 * bf * sf * vf * hf;
        let got = f.hardware();
        assert!(
            (got - megatron - head_recompute).abs() / got < 1e-12,
            "{got} {megatron}"
        );
        assert_eq!(
            f.model,
            6.0 * psi as f64 * (b * s) as f64 + 12.0 * (l * s * h * b * s) as f64
        );
        assert_eq!(flops(&m, None, 10, false).hardware(), 60.0 * psi as f64);
    }

    #[test]
    fn frozen_weights_skip_their_weight_gradient() {
        let m = ModelDesc::new(vec![
            ParamDesc::new("a", &[100], "a"),
            ParamDesc::new("b", &[50], "b").frozen(),
        ]);
        let f = flops(&m, None, 1, false);
        assert_eq!(f.forward, 300.0);
        assert_eq!(f.backward, 400.0 + 100.0);
    }

    #[test]
    fn activations_with_and_without_recompute() {
        let s = ModelShape {
            layers: 10,
            hidden: 100,
            seq_len: 10,
        };
        assert_eq!(
            activation_bytes(s, 10, 2, true),
            10 * 10 * 100 * 2 + 34 * 10 * 100
        );
        assert_eq!(activation_bytes(s, 10, 2, false), 10 * 34 * 10 * 100);
    }
}
