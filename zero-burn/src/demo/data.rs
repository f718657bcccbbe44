//! Training data: a deterministic synthetic language with a known entropy rate, and byte-level
//! text. Any rank can produce any sequence from its global index alone, so no data moves between
//! ranks and every world size sees the same global batch.

use crate::error::{Error, Result};

/// SplitMix64: a tiny deterministic PRNG (no dependency, identical everywhere).
#[derive(Clone, Debug)]
pub struct SplitMix(u64);

impl SplitMix {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        SplitMix(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(f64::MIN_POSITIVE);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// A batch of token sequences: `inputs[b][t]` predicts `targets[b][t]` (= `inputs[b][t+1]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenBatch {
    /// Row-major `[batch, seq]` input tokens.
    pub inputs: Vec<i64>,
    /// Row-major `[batch, seq]` next tokens.
    pub targets: Vec<i64>,
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
}

/// The global index of the first sequence of `rank`'s micro-batch `micro` at optimizer step
/// `step`, with `n` ranks, `a` micro-steps per step and `b` sequences per micro-batch: step-major,
/// then micro-step, then rank, then row. The canonical-tree reduction numbers micro-batches the
/// same way (`micro · n + rank`), which makes runs at different world sizes comparable.
pub fn global_index(step: u64, micro: u64, rank: u64, n: u64, a: u64, b: u64) -> u64 {
    ((step * a + micro) * n + rank) * b
}

/// Where sequences come from.
pub trait Corpus: Send + Sync {
    /// Vocabulary size.
    fn vocab(&self) -> usize;
    /// Sequence number `index` (of `seq + 1` tokens), deterministic in `index`.
    fn sequence(&self, index: u64, seq: usize) -> Vec<i64>;
    /// The entropy rate in nats per token if known (the loss floor).
    fn entropy_floor(&self) -> Option<f64>;

    /// The batch of sequences `first..first + batch`.
    fn batch(&self, first: u64, batch: usize, seq: usize) -> TokenBatch {
        let mut inputs = Vec::with_capacity(batch * seq);
        let mut targets = Vec::with_capacity(batch * seq);
        for b in 0..batch {
            let s = self.sequence(first + b as u64, seq);
            inputs.extend_from_slice(&s[..seq]);
            targets.extend_from_slice(&s[1..]);
        }
        TokenBatch {
            inputs,
            targets,
            batch,
            seq,
        }
    }

    /// The micro-batches a rank draws at an optimizer step (numbered by [`global_index`]).
    fn rank_batches(&self, d: Draw) -> Vec<TokenBatch> {
        let (n, a, b) = (d.ranks as u64, u64::from(d.micro_steps), d.micro_batch);
        (0..a)
            .map(|m| {
                self.batch(
                    global_index(d.step, m, d.rank as u64, n, a, b as u64),
                    b,
                    d.seq,
                )
            })
            .collect()
    }
}

/// Which micro-batches a rank draws at an optimizer step ([`Corpus::rank_batches`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Draw {
    /// The optimizer step.
    pub step: u64,
    /// The rank that draws.
    pub rank: usize,
    /// Ranks in the world.
    pub ranks: usize,
    /// Micro-batches per optimizer step (the gradient accumulation steps).
    pub micro_steps: u32,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
}

/// A first-order Markov language: each token has `K` possible successors with fixed probabilities.
/// Its entropy rate is exactly the entropy of those probabilities, so the loss has a known floor.
#[derive(Clone, Debug)]
pub struct MarkovLanguage {
    vocab: usize,
    successors: Vec<Vec<i64>>,
    cumulative: Vec<f64>,
    entropy: f64,
    seed: u64,
}

impl MarkovLanguage {
    /// Successor probabilities of every token.
    pub const PROBS: [f64; 4] = [0.5, 0.25, 0.15, 0.1];

    /// A language over `vocab` tokens whose transition table comes from `seed`.
    pub fn new(vocab: usize, seed: u64) -> Result<Self> {
        if vocab < Self::PROBS.len() {
            return Err(Error::Data(format!(
                "vocabulary {vocab} is too small: at least {}",
                Self::PROBS.len()
            )));
        }
        let mut rng = SplitMix::new(seed ^ 0x5EED_1A46);
        let successors = (0..vocab)
            .map(|_| {
                let mut s: Vec<i64> = Vec::new();
                while s.len() < Self::PROBS.len() {
                    let t = rng.below(vocab as u64) as i64;
                    if !s.contains(&t) {
                        s.push(t);
                    }
                }
                s
            })
            .collect();
        let cumulative = Self::PROBS
            .iter()
            .scan(0.0, |a, p| {
                *a += p;
                Some(*a)
            })
            .collect();
        let entropy = -Self::PROBS.iter().map(|p| p * p.ln()).sum::<f64>();
        Ok(MarkovLanguage {
            vocab,
            successors,
            cumulative,
            entropy,
            seed,
        })
    }
}

impl Corpus for MarkovLanguage {
    fn vocab(&self) -> usize {
        self.vocab
    }

    fn sequence(&self, index: u64, seq: usize) -> Vec<i64> {
        let mut rng = SplitMix::new(
            self.seed
                .wrapping_mul(31)
                .wrapping_add(index.wrapping_mul(0xD1B5_4A32_D192_ED03)),
        );
        let mut t = rng.below(self.vocab as u64) as i64;
        let mut out = Vec::with_capacity(seq + 1);
        out.push(t);
        for _ in 0..seq {
            let u = rng.uniform();
            let k = self
                .cumulative
                .iter()
                .position(|&c| u < c)
                .unwrap_or(self.cumulative.len() - 1);
            t = self.successors[t as usize][k];
            out.push(t);
        }
        out
    }

    fn entropy_floor(&self) -> Option<f64> {
        Some(self.entropy)
    }
}

/// Byte-level text: sequence `i` is a window of the file at a position drawn from `i`.
#[derive(Clone, Debug)]
pub struct ByteText {
    bytes: Vec<u8>,
    seed: u64,
}

impl ByteText {
    /// Text from raw bytes.
    pub fn new(bytes: Vec<u8>, seed: u64) -> Result<Self> {
        if bytes.len() < 2 {
            return Err(Error::Data(format!(
                "the text has {} bytes; need at least 2",
                bytes.len()
            )));
        }
        Ok(ByteText { bytes, seed })
    }
}

impl Corpus for ByteText {
    fn vocab(&self) -> usize {
        256
    }

    fn sequence(&self, index: u64, seq: usize) -> Vec<i64> {
        let mut rng = SplitMix::new(self.seed ^ index.wrapping_mul(0xA24B_AED4_963E_E407));
        let span = self.bytes.len().saturating_sub(seq + 1).max(1) as u64;
        let start = rng.below(span) as usize;
        (0..=seq)
            .map(|k| i64::from(self.bytes[(start + k) % self.bytes.len()]))
            .collect()
    }

    fn entropy_floor(&self) -> Option<f64> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markov_is_deterministic_and_follows_its_table() {
        let m = MarkovLanguage::new(16, 7).unwrap();
        assert_eq!(m.sequence(3, 20), m.sequence(3, 20));
        assert_ne!(m.sequence(3, 20), m.sequence(4, 20));
        let s = m.sequence(9, 200);
        for w in s.windows(2) {
            assert!(m.successors[w[0] as usize].contains(&w[1]));
        }
        assert!((m.entropy_floor().unwrap() - 1.2080).abs() < 1e-3);
        let b = m.batch(0, 2, 5);
        assert_eq!(&b.inputs[1..5], &b.targets[0..4]);
    }

    #[test]
    fn empirical_entropy_matches_the_floor() {
        // The empirical conditional entropy of a long sample is close to the stated floor.
        let m = MarkovLanguage::new(8, 1).unwrap();
        let s = m.sequence(0, 200_000);
        let mut counts = vec![vec![0f64; 8]; 8];
        for w in s.windows(2) {
            counts[w[0] as usize][w[1] as usize] += 1.0;
        }
        let total: f64 = counts.iter().flatten().sum();
        let mut h = 0.0;
        for row in &counts {
            let r: f64 = row.iter().sum();
            for &c in row {
                if c > 0.0 {
                    h -= c / total * (c / r).ln();
                }
            }
        }
        assert!((h - m.entropy_floor().unwrap()).abs() < 0.01, "{h}");
    }
}
