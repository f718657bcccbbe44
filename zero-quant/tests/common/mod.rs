//! Helpers shared by the tests, the bench and the example: a tiny
//! deterministic PRNG (splitmix64 + Box–Muller) and small utilities.
#![allow(dead_code)]

pub(crate) mod device;

use std::fmt::Write as _;

/// splitmix64: small, fast, deterministic; good enough for test data.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub(crate) fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal (Box–Muller; one of the pair is discarded).
    pub(crate) fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // (0, 1]
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Student-t with `nu` (integer) degrees of freedom: heavy tailed.
    pub(crate) fn student_t(&mut self, nu: u32) -> f64 {
        let z = self.normal();
        let chi2: f64 = (0..nu).map(|_| self.normal().powi(2)).sum();
        z / (chi2 / f64::from(nu)).sqrt()
    }
}

pub(crate) fn gaussian(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.normal() as f32).collect()
}

pub(crate) fn student_t(n: usize, nu: u32, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.student_t(nu) as f32).collect()
}

/// rms(x - y) / rms(x), in f64.
pub(crate) fn rel_rms(x: &[f32], y: &[f32]) -> f64 {
    assert_eq!(x.len(), y.len());
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&a, &b) in x.iter().zip(y) {
        num += (f64::from(a) - f64::from(b)).powi(2);
        den += f64::from(a).powi(2);
    }
    (num / den).sqrt()
}

/// `offset: 16 hex bytes` per line.
pub(crate) fn hex_dump(bytes: &[u8]) -> String {
    let mut s = String::new();
    for (i, line) in bytes.chunks(16).enumerate() {
        write!(s, "{:04x}:", i * 16).unwrap();
        for b in line {
            write!(s, " {b:02x}").unwrap();
        }
        s.push('\n');
    }
    s
}
