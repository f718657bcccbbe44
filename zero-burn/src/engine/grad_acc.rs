//! The rank's gradient accumulator: where reduced gradients add up between optimizer steps, in
//! the precision the plan asks for and where it asks for it (with the optimizer's state). One
//! type owns it, its variant fixed by the plan when the engine is built. A reduction whose
//! elements do not fit that variant (16-bit gradients in an fp32 run) is a bug the plan
//! cannot cause: `GradAcc::apply` returns `Error::Internal` for it rather than guess.

use std::borrow::Cow;
use std::ops::Range;

use burn::tensor::Device;
use zero_core::Plan;

use super::opt_state::Grads;
use super::slab::{Place, Slab};
use super::words::{Words, words_place};
use crate::comms::{Elems, Wire};
use crate::error::{Error, Result};
use crate::precision::Half;
use crate::reduction::{Reduction, TreeAccumulator};

/// Reduced gradients of this rank: stage 0's full units (and stage 1's with
/// `accumulate_before_reduce`), otherwise its chunks of the trainable units, at the layout's
/// offsets.
#[derive(Debug)]
pub(super) enum GradAcc {
    /// fp32, summed in rank order: where the optimizer's state lives (only ever added into,
    /// written and read whole, so a device holds it as well as host memory).
    F32(Slab),
    /// fp32 over [`Reduction::CanonicalTree`]: level 0 of the tree, the pending subtrees in
    /// `tree`, all where the optimizer's state lives.
    Tree {
        acc: Slab,
        tree: TreeAccumulator<Slab>,
    },
    /// bf16/fp16: 16-bit words, added in f32 and rounded, where the optimizer's state lives if
    /// its device supports the type (else in host memory).
    Half { half: Half, acc: Words },
    /// bf16/fp16 with `grad_accum_dtype = fp32`: the reduced 16-bit gradients widened into f32,
    /// where the optimizer's state lives.
    HalfIntoF32 { half: Half, acc: Slab },
}

impl GradAcc {
    /// `len` zeros for `plan` with `half` (the 16-bit type, if any) and `reduction`, the fp32
    /// ones on the optimizer state's device (the model's `device`, unless offloaded).
    pub(super) fn new(
        plan: &Plan,
        half: Option<Half>,
        reduction: Reduction,
        len: usize,
        device: &Device,
    ) -> GradAcc {
        let c = plan.config();
        let on = Place::of(c.optimizer_placement, device);
        match (half, c.grad_accum_dtype) {
            (Some(half), Some(zero_core::Precision::Fp32)) => GradAcc::HalfIntoF32 {
                half,
                acc: Slab::zeros(len, &on),
            },
            (Some(half), _) => GradAcc::Half {
                half,
                acc: Words::zeros(half, len, &words_place(half, on.clone())),
            },
            (None, _) if reduction == Reduction::CanonicalTree => GradAcc::Tree {
                acc: Slab::zeros(len, &on),
                tree: TreeAccumulator::with(c.gradient_accumulation_steps, || {
                    Slab::zeros(len, &on)
                }),
            },
            (None, _) => GradAcc::F32(Slab::zeros(len, &on)),
        }
    }

    /// Bytes held: buffers as allocated (a device tensor by its elements), the canonical tree's
    /// pending subtrees included (gradient accumulators too, not in the plan).
    pub(super) fn bytes(&self) -> u64 {
        match self {
            GradAcc::F32(s) => s.bytes(),
            GradAcc::Tree { acc, tree } => acc.bytes() + tree.len() as u64 * 4,
            GradAcc::Half { acc, .. } => acc.bytes(),
            GradAcc::HalfIntoF32 { acc, .. } => acc.bytes(),
        }
    }

    /// Adds this rank's own fp32 gradients `g` at `off`, unreduced (`accumulate_before_reduce`:
    /// the sum is reduced once, after the last micro-step).
    pub(super) fn add_local(&mut self, off: usize, g: &[f32]) {
        match self {
            GradAcc::F32(s)
            | GradAcc::Tree { acc: s, .. }
            | GradAcc::HalfIntoF32 { acc: s, .. } => s.add(off, g),
            GradAcc::Half { half, acc } => acc.add_f32(*half, off, g),
        }
    }

    /// Elements `off..off + len` as the wire carries them: f32, or rounded to 16 bits.
    pub(super) fn wire(&self, range: Range<usize>) -> Wire {
        match self {
            GradAcc::F32(s) | GradAcc::Tree { acc: s, .. } => Wire::F32(s.read(range)),
            GradAcc::Half { half, acc } => Wire::U16(*half, acc.bits_of(*half, range).into_owned()),
            GradAcc::HalfIntoF32 { half, acc } => {
                Wire::U16(*half, half.round_all(&acc.read(range)))
            }
        }
    }

    /// Applies reduced gradients for the elements from `off`: written over them (`overwrite`:
    /// `accumulate_before_reduce`'s one reduction), or added (the canonical tree: pushed as leaf
    /// `micro`). 16-bit words add in f32 and round, or widen into an fp32 accumulator.
    pub(super) fn apply<B, Y>(
        &mut self,
        off: usize,
        words: Elems<B, Y>,
        overwrite: bool,
        micro: u32,
    ) -> Result<()> {
        match (self, words) {
            (GradAcc::F32(s), Elems::F32(r)) if overwrite => s.write(off, &r),
            // The first micro-step's sums land on the zeros `end_step` left.
            (GradAcc::F32(s), Elems::F32(r)) if micro == 0 => s.add_to_zeros(off, &r),
            (GradAcc::F32(s), Elems::F32(r)) => s.add(off, &r),
            (GradAcc::Tree { acc, .. }, Elems::F32(r)) if overwrite => acc.write(off, &r),
            (GradAcc::Tree { acc, tree }, Elems::F32(r)) => tree.push(acc, micro, off, r),
            (GradAcc::Half { half, acc }, Elems::U16(h, r)) if h == *half => match overwrite {
                true => acc.write_bits(h, off, &r),
                false => acc.add_bits(h, off, &r),
            },
            (GradAcc::HalfIntoF32 { half, acc }, Elems::U16(h, r)) if h == *half => match overwrite
            {
                true => acc.write(off, &h.widen_all(&r)),
                false => acc.add(off, &h.widen_all(&r)),
            },
            (acc, words) => {
                let got = match words {
                    Elems::F32(_) => "f32 elements",
                    Elems::U16(Half::Bf16, _) => "16-bit elements (bf16)",
                    Elems::U16(Half::F16, _) => "16-bit elements (fp16)",
                    Elems::Device(_) | Elems::DeviceWords(_) => {
                        "elements in the communicator's memory"
                    }
                };
                return Err(Error::Internal(format!(
                    "a reduction returned {got} for the {} gradient accumulator",
                    acc.kind()
                )));
            }
        }
        Ok(())
    }

    fn kind(&self) -> &'static str {
        match self {
            GradAcc::F32(_) => "fp32",
            GradAcc::Tree { .. } => "canonical-tree fp32",
            GradAcc::Half { .. } => "16-bit",
            GradAcc::HalfIntoF32 { .. } => "fp32 (of 16-bit gradients)",
        }
    }

    /// Makes the first element infinite, as an fp16 overflow would (a test hook).
    pub(super) fn poison(&mut self) {
        match self {
            GradAcc::F32(s)
            | GradAcc::Tree { acc: s, .. }
            | GradAcc::HalfIntoF32 { acc: s, .. }
                if s.len() > 0 =>
            {
                s.write(0, &[f32::INFINITY])
            }
            GradAcc::F32(_) | GradAcc::Tree { .. } | GradAcc::HalfIntoF32 { .. } => {}
            GradAcc::Half { half, acc } if acc.len() > 0 => acc.write(*half, 0, &[f32::INFINITY]),
            GradAcc::Half { .. } => {}
        }
    }

    /// After the last micro-step of a step over `world` ranks and `a` micro-steps: the canonical
    /// tree's root, divided once by `world · a` (the reductions summed). Nothing to do otherwise
    /// (they took the mean).
    pub(super) fn finish(&mut self, world: usize, a: u32) {
        if let GradAcc::Tree { acc, tree } = self {
            tree.finish(acc, a);
            acc.div((world as u64 * u64::from(a)) as f32);
        }
    }

    /// The gradients as the optimizer reads them, unscaled by `inv`: in host memory, read from a
    /// device (whole, once) only when `host` is asked for (clipping's norm, fp16's overflow
    /// check), else left where they are. 16-bit words on a device give the step its slices from
    /// there either way (widened, unscaled and clipped on the device).
    pub(super) fn view(&self, host: bool, inv: f32) -> GradView<'_> {
        let data = match self {
            GradAcc::Half { half, acc } if acc.on_device() && !host => {
                Data::Half(*half, Cow::Borrowed(&[]), Some(acc))
            }
            GradAcc::Half { half, acc } => Data::Half(*half, acc.bits(*half), Some(acc)),
            GradAcc::F32(s)
            | GradAcc::Tree { acc: s, .. }
            | GradAcc::HalfIntoF32 { acc: s, .. } => match s {
                Slab::Host(v) => Data::F32(Cow::Borrowed(v)),
                s if host => Data::F32(Cow::Owned(s.read(0..s.len()))),
                s => Data::Device(s),
            },
        };
        GradView { data, inv }
    }

    /// Zeros every element, for the next step.
    pub(super) fn zero(&mut self) {
        match self {
            GradAcc::F32(s)
            | GradAcc::Tree { acc: s, .. }
            | GradAcc::HalfIntoF32 { acc: s, .. } => s.zero(),
            GradAcc::Half { half, acc } => acc.zero(*half),
        }
    }
}

/// Where [`GradView`]'s elements are.
enum Data<'a> {
    F32(Cow<'a, [f32]>),
    /// 16-bit words in host memory (read from a device only when asked for; else empty), and
    /// the buffer itself.
    Half(Half, Cow<'a, [u16]>, Option<&'a Words>),
    /// On the optimizer state's device, not read into host memory.
    Device(&'a Slab),
}

/// The accumulated gradients as the optimizer sees them: fp32 elements, or 16-bit ones widened,
/// times `inv` (the inverse loss scale; 1 outside fp16, where the product is exact).
pub(super) struct GradView<'a> {
    data: Data<'a>,
    inv: f32,
}

impl GradView<'_> {
    /// Element `i`, unscaled. A view left on the device has no host elements: NaN, which a
    /// gradient norm reports as diverged (ask [`GradAcc::view`] for host memory to read them).
    pub(super) fn at(&self, i: usize) -> f32 {
        match &self.data {
            Data::F32(v) => v[i] * self.inv,
            Data::Half(h, v, _) => v.get(i).map_or(f32::NAN, |&b| h.widen(b) * self.inv),
            Data::Device(_) => f32::NAN,
        }
    }

    /// `len` elements from `off`, unscaled and clipped by `coef`: borrowed where nothing changes
    /// them (fp32 without clipping or loss scale), else computed; a tensor on the device where
    /// the accumulator lives there (fp32: never scaled or clipped, see [`GradAcc::view`]; 16-bit:
    /// widened, then times `inv` and `coef`, the host's operations in its order).
    pub(super) fn slice(&self, off: usize, len: usize, coef: f32) -> Grads<'_> {
        if let Data::Half(_, _, Some(words)) = &self.data
            && let Some(mut g) = words.widened(off..off + len)
        {
            // x · 1 is x: the host multiplies by `inv` always, by `coef` when it is not 1.
            if self.inv != 1.0 {
                g = g.mul_scalar(self.inv);
            }
            if coef != 1.0 {
                g = g.mul_scalar(coef);
            }
            return Grads::Device(Box::new(g));
        }
        match &self.data {
            Data::Device(s) => Grads::Device(Box::new(
                s.device_slice(off..off + len)
                    .expect("a device view holds a device slab"),
            )),
            Data::F32(v) if self.inv == 1.0 && coef == 1.0 => {
                Grads::Host(Cow::Borrowed(&v[off..off + len]))
            }
            _ => Grads::Host(Cow::Owned(
                (off..off + len)
                    .map(|i| {
                        let g = self.at(i);
                        if coef != 1.0 { g * coef } else { g }
                    })
                    .collect(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zero_core::Precision;

    type Reduced = Elems<(), ()>;

    /// Two micro-steps' reduced values, `a` then `b`, from element 1 of a 4-element accumulator,
    /// each as the accumulator's own arithmetic says: exact f32 sums of the widened 16-bit words
    /// (`grad_accum_dtype = fp32`), a rounding after each 16-bit addition, plain f32 additions;
    /// an overwrite replaces; the wrong kind of words is an error naming both.
    #[test]
    fn reduced_gradients_add_in_the_accumulator_s_own_arithmetic() {
        let h = Half::of(Precision::Bf16).expect("bf16 is 16-bit");
        let (a, b) = ([1.0f32, 0.5, -3.0], [0.25f32, 1e-3, 7.0]);
        let (wa, wb) = (h.round_all(&a), h.round_all(&b));
        let add = |acc: &mut GradAcc, words: fn(&[f32], &[u16]) -> Reduced| {
            acc.apply(1, words(&a, &wa), false, 0).unwrap();
            acc.apply(1, words(&b, &wb), false, 1).unwrap();
        };
        let sixteen: fn(&[f32], &[u16]) -> Reduced = |_, w| Elems::U16(Half::Bf16, w.to_vec());
        let thirty_two: fn(&[f32], &[u16]) -> Reduced = |v, _| Elems::F32(v.to_vec());

        let mut wide = GradAcc::HalfIntoF32 {
            half: h,
            acc: Slab::Host(vec![0.0; 4]),
        };
        add(&mut wide, sixteen);
        let sums: Vec<f32> = (0..3).map(|i| h.widen(wa[i]) + h.widen(wb[i])).collect();
        let GradAcc::HalfIntoF32 {
            acc: Slab::Host(acc),
            ..
        } = &wide
        else {
            unreachable!()
        };
        assert_eq!(acc[1..], sums[..]);
        assert_eq!(acc[0], 0.0, "outside the range nothing moves");
        let Wire::U16(Half::Bf16, wire) = wide.wire(1..4) else {
            panic!("16-bit training sends 16-bit words")
        };
        assert_eq!(wire, h.round_all(&sums));
        wide.apply(1, Reduced::U16(h, wb.clone()), true, 0).unwrap();
        let GradAcc::HalfIntoF32 {
            acc: Slab::Host(acc),
            ..
        } = &wide
        else {
            unreachable!()
        };
        assert_eq!(acc[1..], h.widen_all(&wb)[..], "an overwrite replaces");

        let mut narrow = GradAcc::Half {
            half: h,
            acc: Words::Host(vec![0; 4]),
        };
        add(&mut narrow, sixteen);
        let GradAcc::Half {
            acc: Words::Host(acc),
            ..
        } = &narrow
        else {
            unreachable!()
        };
        let rounded: Vec<u16> = (0..3).map(|i| h.round(sums[i])).collect();
        assert_eq!(acc[1..], rounded[..]);

        let mut f32s = GradAcc::F32(Slab::Host(vec![0.0; 4]));
        add(&mut f32s, thirty_two);
        let Wire::F32(got) = f32s.wire(0..4) else {
            panic!("fp32 training sends f32")
        };
        assert_eq!(got, [0.0, a[0] + b[0], a[1] + b[1], a[2] + b[2]]);

        // The canonical tree: two leaves summed once, divided by world · A = 2 · 2 at the end.
        let mut tree = GradAcc::Tree {
            acc: Slab::Host(vec![0.0; 4]),
            tree: TreeAccumulator::with(2, || Slab::Host(vec![0.0; 4])),
        };
        add(&mut tree, thirty_two);
        tree.finish(2, 2);
        let GradAcc::Tree {
            acc: Slab::Host(acc),
            ..
        } = &tree
        else {
            unreachable!()
        };
        let means: Vec<f32> = (0..3).map(|i| (a[i] + b[i]) / 4.0).collect();
        assert_eq!(acc[1..], means[..]);

        let err = f32s
            .apply(0, Elems::<(), ()>::U16(h, wa.clone()), false, 0)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("16-bit elements") && err.contains("fp32"),
            "{err}"
        );
    }

    /// The first micro-step writes its sums over the zeroed fp32 accumulator and later ones add:
    /// bit for bit what adding every micro-step into zeros gives, `-0.0` included (`0 + -0 = +0`).
    #[test]
    fn the_first_micro_step_writes_what_adding_into_zeros_gives() {
        let steps = [[-0.0f32, 1.5, f32::MIN_POSITIVE], [-0.0, -1.5, 3.0]];
        let mut acc = GradAcc::F32(Slab::Host(vec![0.0; 4]));
        let mut oracle = [0.0f32; 4];
        for (micro, r) in steps.iter().enumerate() {
            acc.apply(1, Elems::<(), ()>::F32(r.to_vec()), false, micro as u32)
                .unwrap();
            for (o, v) in oracle[1..].iter_mut().zip(r) {
                *o += v;
            }
            let Wire::F32(got) = acc.wire(0..4) else {
                panic!("fp32 training sends f32")
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&oracle), "after micro-step {micro}");
        }
    }
}
