//! A parameter that no gradient reaches in a step, on some ranks or on all of them: the engine
//! counts its gradient as zeros (DeepSpeed's convention), so AdamW still decays its moments and
//! applies weight decay. The oracle is plain burn with the same zeros made explicit: each
//! micro-batch that leaves the parameter out adds `0 · Σ p` to its loss (a zero gradient and a
//! zero loss term), so burn's optimizer steps it instead of skipping it.

use burn::data::dataloader::batcher::Batcher;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use zero_burn::Whole;
use zero_burn::demo::gpt::deterministic_init;
use zero_core::{Topology, ZeroConfig};

use crate::common::points::{
    B, CLASSES, FEATURES, PointBatch, PointBatcher, adamw_pair, assert_near_burn, cross_entropy,
    points, values,
};

/// A body and two heads; `aux` joins the logits only for micro-batches whose first label is 0.
#[derive(Module, Debug)]
struct TwoHeads {
    body: Linear,
    main: Linear,
    aux: Linear,
}

impl TwoHeads {
    fn new(device: &Device) -> Self {
        deterministic_init(
            TwoHeads {
                body: LinearConfig::new(FEATURES, 16).init(device),
                main: LinearConfig::new(16, CLASSES).init(device),
                aux: LinearConfig::new(16, CLASSES).init(device),
            },
            5,
        )
    }

    /// The loss of one micro-batch, and whether `aux` took part in it.
    fn loss(&self, b: &PointBatch) -> (Tensor<1>, bool) {
        let h = relu(self.body.forward(b.x.clone()));
        let uses_aux = uses_aux(b);
        let mut logits = self.main.forward(h.clone());
        if uses_aux {
            logits = logits + self.aux.forward(h);
        }
        (cross_entropy(logits, b.y.clone()), uses_aux)
    }

    /// `0 · Σ p` over `aux`'s parameters: what burn needs to see a zero gradient there.
    fn aux_zeros(&self) -> Tensor<1> {
        let w = self.aux.weight.val().sum() * 0.0;
        match &self.aux.bias {
            Some(b) => w + b.val().sum() * 0.0,
            None => w,
        }
    }
}

fn uses_aux(b: &PointBatch) -> bool {
    b.y.clone().into_data().iter::<i64>().next() == Some(0)
}

const STEPS: usize = 12;
const A: usize = 2;

#[test]
fn a_parameter_without_a_gradient_counts_as_zeros_like_plain_burn_given_zeros() {
    let device = Device::flex().autodiff();
    let model = TwoHeads::new(&device);
    let topo = Topology::new(2, 1).unwrap();
    let n = topo.world_size();
    let per_step = n * A;
    let (ours, burns) = adamw_pair(0.01);
    let items = points(STEPS * per_step * B);
    let batches: Vec<PointBatch> = items
        .chunks_exact(B)
        .map(|c| PointBatcher.batch(c.to_vec(), &Device::flex()))
        .collect();

    // Plain burn: each step's mean over its N·A micro-batches; `aux` gets explicit zeros from
    // every micro-batch that leaves it out.
    let mut plain = model.clone();
    let mut optim = burns;
    let mut want_losses = Vec::new();
    let (mut none, mut some) = (0, 0);
    for s in 0..STEPS {
        let mut total: Option<Tensor<1>> = None;
        let mut used = 0;
        for b in &batches[s * per_step..(s + 1) * per_step] {
            let (loss, uses) = plain.loss(b);
            used += usize::from(uses);
            let term = if uses { loss } else { loss + plain.aux_zeros() };
            total = Some(match total {
                None => term,
                Some(t) => t + term,
            });
        }
        match used {
            0 => none += 1,
            u if u < per_step => some += 1,
            _ => {}
        }
        let mean = total.expect("micro-batches") / per_step as f32;
        want_losses.push(
            mean.clone()
                .into_data()
                .try_into_vec_as::<f32>()
                .expect("f32")[0],
        );
        let grads = GradientsParams::from_grads(mean.backward(), &plain);
        plain = optim.step(1e-2, plain, grads);
    }
    // The data must exercise both cases, or the test proves nothing.
    assert!(
        none > 0 && some > 0,
        "steps where no micro-batch used aux: {none}; where some did: {some}"
    );
    let want_params = values(&plain);

    let whole = Whole::new(model, |m: &TwoHeads, b: &PointBatch| m.loss(b).0);
    for stage in 0..=3u8 {
        let cfg = ZeroConfig {
            stage,
            gradient_accumulation_steps: A as u32,
            ..Default::default()
        };
        let seen = super::train(&whole, topo, &cfg, ours, 1e-2, STEPS);
        let losses: Vec<f32> = (0..STEPS)
            .map(|s| seen.iter().map(|r| r.losses[s]).sum::<f32>() / n as f32)
            .collect();
        assert_near_burn(
            &format!("unused aux, stage {stage}"),
            (&losses, &seen[0].params),
            (&want_losses, &want_params),
            1e-4,
        );
    }
}
