//! The demo's GPT-style decoder, a [`Segmented`] model: the embeddings, each block, and the head
//! with the loss are its segments.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::attention::{
    MultiHeadAttention, MultiHeadAttentionConfig, generate_autoregressive_mask,
};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{
    Embedding, EmbeddingConfig, Gelu, LayerNorm, LayerNormConfig, Linear, LinearConfig,
};
use burn::tensor::activation::softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::demo::data::TokenBatch;
use crate::segmented::{SegmentOut, Segmented};

/// Size of the embedded GPT-style decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GptConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Context length.
    pub context: usize,
    /// Model width.
    pub d_model: usize,
    /// Attention heads.
    pub heads: usize,
    /// Decoder blocks.
    pub layers: usize,
}

impl GptConfig {
    /// Builds the model on `device` with deterministic weights from `seed` (normal(0, 0.02) for
    /// matrices, ones for norm scales, zeros for biases; independent of burn's global RNG).
    pub fn init(&self, device: &Device, seed: u64) -> Gpt {
        // burn's layers draw their initial values from the backend's generator (lazily, when
        // first read), which in-process ranks share: under the engine's lock, so no seeded
        // forward elsewhere sees its numbers move (see `crate::rng`).
        crate::rng::with_seed(device, seed, || {
            deterministic_init(self.layers_on(device), seed)
        })
    }

    /// The layers as burn initialises them.
    fn layers_on(&self, device: &Device) -> Gpt {
        let mha = MultiHeadAttentionConfig::new(self.d_model, self.heads).with_dropout(0.0);
        let blocks = (0..self.layers)
            .map(|_| Block {
                ln1: LayerNormConfig::new(self.d_model).init(device),
                attn: mha.init(device),
                ln2: LayerNormConfig::new(self.d_model).init(device),
                fc: LinearConfig::new(self.d_model, 4 * self.d_model).init(device),
                proj: LinearConfig::new(4 * self.d_model, self.d_model).init(device),
                act: Gelu::new(),
            })
            .collect();
        Gpt {
            wte: EmbeddingConfig::new(self.vocab, self.d_model).init(device),
            wpe: EmbeddingConfig::new(self.context, self.d_model).init(device),
            blocks,
            ln_f: LayerNormConfig::new(self.d_model).init(device),
            head: Some(LinearConfig::new(self.d_model, self.vocab).init(device)),
        }
    }

    /// [`Self::init`] with the output layer tied to the token embedding (`logits = ln_f(h)·wteᵀ`,
    /// GPT-2's weight tying): no head of its own; the last segment reads `wte` too.
    pub fn init_tied(&self, device: &Device, seed: u64) -> Gpt {
        let mut gpt = self.init(device, seed);
        gpt.head = None;
        gpt
    }
}

/// A GPT-style decoder: token and position embeddings, pre-norm blocks (causal self-attention and
/// a GELU MLP), a final norm and a head of its own or (tied, [`GptConfig::init_tied`]) the token
/// embedding transposed.
#[derive(Module, Debug)]
pub struct Gpt {
    /// Token embedding.
    pub wte: Embedding,
    /// Position embedding.
    pub wpe: Embedding,
    /// Decoder blocks.
    pub blocks: Vec<Block>,
    /// Final norm.
    pub ln_f: LayerNorm,
    /// Output head; `None`: tied to the token embedding.
    pub head: Option<Linear>,
}

/// One pre-norm decoder block.
#[derive(Module, Debug)]
pub struct Block {
    ln1: LayerNorm,
    attn: MultiHeadAttention,
    ln2: LayerNorm,
    fc: Linear,
    proj: Linear,
    act: Gelu,
}

impl Block {
    /// The block on `[b, t, d]`. Every linear layer runs on the `[b·t, d]` rows: one matmul per
    /// layer, and one for each weight's gradient, where burn would keep a batched matmul per
    /// sequence (its rows fill the tiles) and sum the weight's gradient over them.
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, t, d] = x.dims();
        let x = x.reshape([b * t, d]);
        let x = x.clone() + self.attend(self.ln1.forward(x), b, t);
        let m = self.proj.forward(
            self.act
                .forward(self.fc.forward(self.ln2.forward(x.clone()))),
        );
        (x + m).reshape([b, t, d])
    }

    /// Causal self-attention on `[b·t, d]` rows, with burn's `MultiHeadAttention`'s weights and
    /// arithmetic (scores scaled by `1/√d_k`, softmax; no dropout), masked to −∞ as PyTorch's
    /// causal attention is (burn's `min_float` gives the same zeros after the softmax, through
    /// `exp`'s slow underflow path).
    fn attend(&self, rows: Tensor<2>, b: usize, t: usize) -> Tensor<2> {
        let a = &self.attn;
        let (h, dk) = (a.n_heads, a.d_k);
        let heads = |l: &Linear| {
            l.forward(rows.clone())
                .reshape([b, t, h, dk])
                .swap_dims(1, 2)
        };
        let (q, k, v) = (heads(&a.query), heads(&a.key), heads(&a.value));
        let scores = q.matmul(k.transpose()).div_scalar((dk as f32).sqrt());
        let mask = generate_autoregressive_mask(b, t, &rows.device()).reshape([b, 1, t, t]);
        let weights = softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3);
        let context = weights.matmul(v).swap_dims(1, 2).reshape([b * t, h * dk]);
        a.output.forward(context)
    }
}

impl Segmented for Gpt {
    type Batch = TokenBatch;
    type Act = Tensor<3>;
    type Output = ();

    /// The embeddings, each block, and the head with the loss (which reads the token embedding
    /// too when tied).
    fn num_segments(&self) -> usize {
        self.blocks.len() + 2
    }

    fn visit_segment<V: ModuleVisitor>(&self, i: usize, visitor: &mut V) {
        match i {
            0 => {
                self.wte.visit(visitor);
                self.wpe.visit(visitor);
            }
            i if i <= self.blocks.len() => self.blocks[i - 1].visit(visitor),
            _ => {
                self.ln_f.visit(visitor);
                match &self.head {
                    Some(head) => head.visit(visitor),
                    None => self.wte.visit(visitor),
                }
            }
        }
    }

    fn forward_segment(
        &self,
        i: usize,
        batch: &TokenBatch,
        x: Option<Tensor<3>>,
    ) -> SegmentOut<Tensor<3>> {
        let device = self.wte.weight.val().device();
        if i == 0 {
            return SegmentOut::Next(self.embed(batch, &device));
        }
        let x = x.expect("the engine hands every segment after the first its input");
        if i <= self.blocks.len() {
            return SegmentOut::Next(self.blocks[i - 1].forward(x));
        }
        let [b, t, d] = x.dims();
        let h = self.ln_f.forward(x).reshape([b * t, d]);
        let logits = match &self.head {
            Some(head) => head.forward(h),
            None => h.matmul(self.wte.weight.val().transpose()),
        };
        let targets =
            Tensor::<1, Int>::from_data(TensorData::new(batch.targets.clone(), [b * t]), &device);
        let loss = CrossEntropyLossConfig::new()
            .init(&device)
            .forward(logits, targets);
        SegmentOut::Loss(loss)
    }
}

impl Gpt {
    fn embed(&self, batch: &TokenBatch, device: &Device) -> Tensor<3> {
        let tokens = Tensor::<2, Int>::from_data(
            TensorData::new(batch.inputs.clone(), [batch.batch, batch.seq]),
            device,
        );
        let pos: Vec<i64> = (0..batch.batch).flat_map(|_| 0..batch.seq as i64).collect();
        let pos =
            Tensor::<2, Int>::from_data(TensorData::new(pos, [batch.batch, batch.seq]), device);
        self.wte.forward(tokens) + self.wpe.forward(pos)
    }
}

struct DetInit {
    seed: u64,
    index: u64,
    path: Vec<String>,
}

impl ModuleMapper for DetInit {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, t, mapper) = p.consume();
        let dims = t.dims();
        let n: usize = dims.iter().product();
        let leaf = self.path.last().map(String::as_str).unwrap_or("");
        let mut rng = crate::demo::data::SplitMix::new(
            self.seed ^ (self.index.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        );
        self.index += 1;
        let values: Vec<f32> = match leaf {
            "gamma" => vec![1.0; n],
            "beta" | "bias" => vec![0.0; n],
            _ => (0..n).map(|_| 0.02 * rng.normal() as f32).collect(),
        };
        let require_grad = t.is_require_grad();
        let mut nt = Tensor::<D>::from_data(TensorData::new(values, dims), &t.device());
        if require_grad {
            nt = nt.require_grad();
        }
        Param::from_mapped_value(id, nt, mapper)
    }
}

/// Re-initializes every float parameter deterministically from `seed` and its visit index.
pub fn deterministic_init<M: Module>(model: M, seed: u64) -> M {
    model.map(&mut DetInit {
        seed,
        index: 0,
        path: Vec::new(),
    })
}
