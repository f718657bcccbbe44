//! Model descriptions: named parameter tensors in forward order, and presets.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE 754 binary32.
    #[default]
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE 754 binary16.
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }
}

fn yes() -> bool {
    true
}

/// One parameter tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamDesc {
    /// Unique dotted name, e.g. `h.0.attn.c_attn.weight`.
    pub name: String,
    /// Shape; the element count is the product.
    pub shape: Vec<usize>,
    /// Declared element type of the parameter as stored by the model (informational: the plan's
    /// working dtype comes from the configured precision).
    #[serde(default)]
    pub dtype: DType,
    /// Frozen parameters get no gradient and no optimizer state.
    #[serde(default = "yes")]
    pub trainable: bool,
    /// A buffer: module state that is not a parameter (BatchNorm's running mean and variance),
    /// updated by the forward pass, not by the optimizer. Never trainable; in no unit at any
    /// stage (replicated on every rank, never sharded or gathered), kept equal across ranks by
    /// the engine.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub buffer: bool,
    /// The module the parameter belongs to (its owner); stage 3 gathers per module.
    pub module: String,
    /// Other modules whose forward reads the parameter too (a tied weight: a GPT head that reads
    /// the token embedding). It is still one parameter: one unit, one gradient (the sum of every
    /// reader's), reduced once. Stage 3 gathers it at its first reader's forward and keeps it
    /// until the backward is done with it (see [`crate::GatherOrder`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub readers: Vec<String>,
}

impl ParamDesc {
    /// A trainable f32 parameter.
    pub fn new(name: impl Into<String>, shape: &[usize], module: impl Into<String>) -> Self {
        ParamDesc {
            name: name.into(),
            shape: shape.to_vec(),
            dtype: DType::F32,
            trainable: true,
            buffer: false,
            module: module.into(),
            readers: Vec::new(),
        }
    }

    /// Marks the parameter read by the forward of `modules` too (besides its own module's).
    pub fn read_by<S: Into<String>>(mut self, modules: impl IntoIterator<Item = S>) -> Self {
        self.readers.extend(modules.into_iter().map(Into::into));
        self
    }

    /// Marks the parameter frozen.
    pub fn frozen(mut self) -> Self {
        self.trainable = false;
        self
    }

    /// Marks the tensor a buffer (and so not trainable).
    pub fn buffer(mut self) -> Self {
        self.trainable = false;
        self.buffer = true;
        self
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

/// The most elements a model may have: 2^50 (about 1.1e15, hundreds of times today's largest
/// models). Every byte figure of a plan (16 bytes per parameter and more) then fits in a `u64`.
pub const MAX_MODEL_PARAMS: u64 = 1 << 50;

/// A model: its parameters in forward order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelDesc {
    /// Parameters in the order the forward pass first uses them.
    pub params: Vec<ParamDesc>,
    /// The modules in the order the forward runs them. Empty: the order in which the parameters
    /// first name them as their `module`. A module that owns no parameter and only reads
    /// another's (see [`ParamDesc::readers`]) needs this list.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub modules: Vec<String>,
}

impl ModelDesc {
    /// A model from a parameter list.
    pub fn new(params: Vec<ParamDesc>) -> Self {
        ModelDesc {
            params,
            modules: Vec::new(),
        }
    }

    /// The modules in the order the forward runs them: [`ModelDesc::modules`], or the order in
    /// which the parameters first name them.
    pub fn module_order(&self) -> Vec<&str> {
        if !self.modules.is_empty() {
            return self.modules.iter().map(String::as_str).collect();
        }
        let mut seen = HashSet::new();
        self.params
            .iter()
            .map(|p| p.module.as_str())
            .filter(|m| seen.insert(*m))
            .collect()
    }

    /// Parameters read by modules other than their own (tied weights), with their readers.
    pub fn shared(&self) -> impl Iterator<Item = &ParamDesc> {
        self.params.iter().filter(|p| !p.readers.is_empty())
    }

    /// Total elements.
    pub fn numel(&self) -> u64 {
        self.params.iter().map(ParamDesc::numel).sum()
    }

    /// Total trainable elements.
    pub fn trainable_numel(&self) -> u64 {
        self.params
            .iter()
            .filter(|p| p.trainable)
            .map(ParamDesc::numel)
            .sum()
    }

    /// Elements of the buffers (module state that is not a parameter; see [`ParamDesc::buffer`]).
    pub fn buffer_numel(&self) -> u64 {
        self.params
            .iter()
            .filter(|p| p.buffer)
            .map(ParamDesc::numel)
            .sum()
    }

    /// Checks that the model is usable: not empty, unique names, no zero-sized tensors, at most
    /// [`MAX_MODEL_PARAMS`] elements in all.
    pub fn validate(&self) -> Result<()> {
        if self.params.is_empty() {
            return Err(Error::Model(
                "the model has no parameters; expected at least one".into(),
            ));
        }
        let mut seen = HashSet::with_capacity(self.params.len());
        for (i, p) in self.params.iter().enumerate() {
            if p.name.is_empty() {
                return Err(Error::Model(format!("parameter #{i} has an empty name")));
            }
            if !seen.insert(p.name.as_str()) {
                return Err(Error::Model(format!(
                    "duplicate parameter name `{}` (parameter #{i}); names must be unique",
                    p.name
                )));
            }
            if p.buffer && p.trainable {
                return Err(Error::Model(format!(
                    "`{}` is marked both a buffer and trainable; a buffer is never trained",
                    p.name
                )));
            }
            if p.shape.is_empty() {
                return Err(Error::Model(format!(
                    "parameter `{}` has an empty shape; a scalar is written [1]",
                    p.name
                )));
            }
            if p.shape.contains(&0) {
                return Err(Error::Model(format!(
                    "parameter `{}` has shape {:?} with a zero dimension; every dimension must be ≥ 1",
                    p.name, p.shape
                )));
            }
            if p.shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
                .is_none()
            {
                return Err(Error::Model(format!(
                    "parameter `{}` has shape {:?} whose element count overflows u64",
                    p.name, p.shape
                )));
            }
        }
        self.validate_modules()?;
        let total = self
            .params
            .iter()
            .try_fold(0u64, |a, p| a.checked_add(p.numel()));
        if total.is_none_or(|t| t > MAX_MODEL_PARAMS) {
            return Err(Error::Model(format!(
                "the model has {} parameters; at most 2^50 ({MAX_MODEL_PARAMS}) are planned, so \
                 that every byte count fits in 64 bits",
                total.map_or_else(|| "over 2^64".to_string(), |t| t.to_string())
            )));
        }
        Ok(())
    }

    /// The module order names every module once, and every reader is a module of it.
    fn validate_modules(&self) -> Result<()> {
        let mut order = HashSet::new();
        for m in &self.modules {
            if !order.insert(m.as_str()) {
                return Err(Error::Model(format!(
                    "module `{m}` is listed twice in `modules`; each runs once"
                )));
            }
        }
        let order: HashSet<&str> = self.module_order().into_iter().collect();
        for p in &self.params {
            if !order.contains(p.module.as_str()) {
                return Err(Error::Model(format!(
                    "parameter `{}` belongs to module `{}`, which `modules` does not list",
                    p.name, p.module
                )));
            }
            let mut seen = HashSet::new();
            for r in &p.readers {
                if *r == p.module || !seen.insert(r.as_str()) {
                    return Err(Error::Model(format!(
                        "parameter `{}` lists reader `{r}` twice, or its own module as a reader",
                        p.name
                    )));
                }
                if !order.contains(r.as_str()) {
                    return Err(Error::Model(format!(
                        "parameter `{}` is read by module `{r}`, which owns no parameter; list \
                         the modules in the order the forward runs them (`modules`)",
                        p.name
                    )));
                }
            }
        }
        Ok(())
    }

    /// Parses a model description from JSON (`{"params": [{"name", "shape", "module", ...}]}`).
    pub fn from_json(text: &str) -> Result<Self> {
        serde_json::from_str(text).map_err(|e| Error::Parse {
            what: "model description (JSON)".into(),
            message: e.to_string(),
        })
    }

    /// Parses a model description from TOML (`[[params]]` tables).
    pub fn from_toml(text: &str) -> Result<Self> {
        toml::from_str(text).map_err(|e| Error::Parse {
            what: "model description (TOML)".into(),
            message: e.to_string(),
        })
    }

    /// A synthetic model of exactly `total` parameters spread over `modules` modules of one flat
    /// weight each (the last takes the remainder). Used by `--params N`.
    pub fn synthetic(total: u64, modules: usize) -> Result<Self> {
        if total == 0 {
            return Err(Error::invalid(
                "params",
                "0",
                "a parameter count of at least 1",
            ));
        }
        let modules = (modules as u64).clamp(1, total);
        let each = total / modules;
        let params = (0..modules)
            .map(|i| {
                let n = if i + 1 == modules {
                    total - each * (modules - 1)
                } else {
                    each
                };
                ParamDesc::new(
                    format!("layer.{i}.weight"),
                    &[n as usize],
                    format!("layer.{i}"),
                )
            })
            .collect();
        Ok(ModelDesc::new(params))
    }

    /// A named preset: `gpt2-small`, `gpt2-medium`, `llama-7b`, `llama-70b`.
    pub fn preset(name: &str) -> Result<Self> {
        match name {
            "gpt2-small" => Ok(gpt2(768, 12)),
            "gpt2-medium" => Ok(gpt2(1024, 24)),
            "llama-7b" => Ok(llama(4096, 32, 11008, 4096)),
            "llama-70b" => Ok(llama(8192, 80, 28672, 1024)),
            other => Err(Error::invalid(
                "preset",
                other,
                format!("one of {:?}", PRESETS),
            )),
        }
    }
}

/// The hidden size (width of the residual stream) of a [`ModelDesc::preset`], as Hugging Face
/// model configs state it (`hidden_size`); it resolves a DeepSpeed config's `"auto"` bucket sizes.
pub fn preset_hidden_size(name: &str) -> Option<u64> {
    match name {
        "gpt2-small" => Some(768),
        "gpt2-medium" => Some(1024),
        "llama-7b" => Some(4096),
        "llama-70b" => Some(8192),
        _ => None,
    }
}

/// Names accepted by [`ModelDesc::preset`].
pub const PRESETS: [&str; 4] = ["gpt2-small", "gpt2-medium", "llama-7b", "llama-70b"];

fn gpt2(d: usize, layers: usize) -> ModelDesc {
    let (vocab, ctx) = (50257, 1024);
    let mut p = vec![
        ParamDesc::new("wte.weight", &[vocab, d], "wte"),
        ParamDesc::new("wpe.weight", &[ctx, d], "wpe"),
    ];
    for l in 0..layers {
        let m = |s: &str| format!("h.{l}.{s}");
        let mut push = |sub: &str, leaf: &str, shape: &[usize]| {
            p.push(ParamDesc::new(format!("{}.{leaf}", m(sub)), shape, m(sub)));
        };
        push("ln_1", "weight", &[d]);
        push("ln_1", "bias", &[d]);
        push("attn.c_attn", "weight", &[d, 3 * d]);
        push("attn.c_attn", "bias", &[3 * d]);
        push("attn.c_proj", "weight", &[d, d]);
        push("attn.c_proj", "bias", &[d]);
        push("ln_2", "weight", &[d]);
        push("ln_2", "bias", &[d]);
        push("mlp.c_fc", "weight", &[d, 4 * d]);
        push("mlp.c_fc", "bias", &[4 * d]);
        push("mlp.c_proj", "weight", &[4 * d, d]);
        push("mlp.c_proj", "bias", &[d]);
    }
    p.push(ParamDesc::new("ln_f.weight", &[d], "ln_f"));
    p.push(ParamDesc::new("ln_f.bias", &[d], "ln_f"));
    ModelDesc::new(p)
}

fn llama(d: usize, layers: usize, ffn: usize, kv: usize) -> ModelDesc {
    let vocab = 32000;
    let mut p = vec![ParamDesc::new(
        "embed_tokens.weight",
        &[vocab, d],
        "embed_tokens",
    )];
    for l in 0..layers {
        let m = |s: &str| format!("layers.{l}.{s}");
        let mut push = |sub: &str, shape: &[usize]| {
            p.push(ParamDesc::new(format!("{}.weight", m(sub)), shape, m(sub)));
        };
        push("input_layernorm", &[d]);
        push("self_attn.q_proj", &[d, d]);
        push("self_attn.k_proj", &[kv, d]);
        push("self_attn.v_proj", &[kv, d]);
        push("self_attn.o_proj", &[d, d]);
        push("post_attention_layernorm", &[d]);
        push("mlp.gate_proj", &[ffn, d]);
        push("mlp.up_proj", &[ffn, d]);
        push("mlp.down_proj", &[d, ffn]);
    }
    p.push(ParamDesc::new("norm.weight", &[d], "norm"));
    p.push(ParamDesc::new("lm_head.weight", &[vocab, d], "lm_head"));
    ModelDesc::new(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_published_sizes() {
        let m = |n| ModelDesc::preset(n).unwrap().numel();
        assert_eq!(m("gpt2-small"), 124_439_808);
        assert_eq!(m("gpt2-medium"), 354_823_168);
        assert_eq!(m("llama-7b"), 6_738_415_616);
        assert_eq!(m("llama-70b"), 68_976_648_192);
        assert!(ModelDesc::preset("gpt5").is_err());
    }

    #[test]
    fn preset_hidden_sizes_are_the_embedding_widths() {
        for name in PRESETS {
            let embedding = &ModelDesc::preset(name).unwrap().params[0];
            assert_eq!(
                preset_hidden_size(name),
                Some(embedding.shape[1] as u64),
                "{name}"
            );
        }
        assert_eq!(preset_hidden_size("gpt5"), None);
    }

    #[test]
    fn synthetic_is_exact() {
        let m = ModelDesc::synthetic(7_500_000_000, 32).unwrap();
        assert_eq!(m.numel(), 7_500_000_000);
        assert_eq!(m.params.len(), 32);
        let m = ModelDesc::synthetic(5, 32).unwrap();
        assert_eq!(m.numel(), 5);
    }

    #[test]
    fn parses_json_and_toml() {
        let j = r#"{"params":[{"name":"a","shape":[2,3],"module":"m"},{"name":"b","shape":[3],"module":"m","trainable":false,"dtype":"bf16"}]}"#;
        let m = ModelDesc::from_json(j).unwrap();
        assert_eq!(m.numel(), 9);
        assert_eq!(m.trainable_numel(), 6);
        let t = "[[params]]\nname = \"a\"\nshape = [4]\nmodule = \"m\"\n";
        assert_eq!(ModelDesc::from_toml(t).unwrap().numel(), 4);
        let bad = r#"{"params":[{"name":"a","shape":[2],"module":"m","colour":1}]}"#;
        assert!(
            ModelDesc::from_json(bad)
                .unwrap_err()
                .to_string()
                .contains("colour")
        );
    }
}
