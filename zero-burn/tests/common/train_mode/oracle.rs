//! The plain-burn oracle: the same model trained by burn alone, replaying the engine's seeded
//! dropout masks, and the bounds the engine's runs are held to against it.

#[allow(clippy::wildcard_imports)]
use super::*;

/// The seeds of one micro-batch's forward: segment `i` draws from
/// `segment_seed(base, step, micro, i, rank)`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Seeds {
    pub(crate) base: u64,
    pub(crate) step: usize,
    pub(crate) micro: usize,
    pub(crate) rank: usize,
}

impl Seeds {
    pub(crate) fn of(&self, segment: usize) -> u64 {
        segment_seed(self.base, self.step as u64, self.micro, segment, self.rank)
    }
}

/// What plain burn computes.
#[derive(Debug)]
pub(crate) struct Want {
    /// `[rank][step][micro]` losses.
    pub(crate) losses: Vec<Vec<Vec<f32>>>,
    pub(crate) params: Named,
    pub(crate) buffers: Named,
}

/// Plain burn in one process: for every step, every (rank, micro-step) micro-batch forwarded on
/// its own through `forward` (which seeds each segment as the engine does), one backward of the
/// mean of the N·A losses, burn's SGD. Buffers: before each micro-batch's forward they are set to
/// the micro-step's starting buffers; after the micro-step they become rank 0's result
/// (`Broadcast`) or the mean over ranks (`Average`: summed in rank order, then divided by N).
pub(crate) fn plain_burn<M, T>(
    model: &M,
    n: usize,
    sync: BufferSync,
    base: u64,
    data: impl Fn(usize) -> T,
    forward: impl Fn(&M, &T, Seeds) -> Tensor<1>,
) -> Want
where
    M: Module,
{
    let average = matches!(sync, BufferSync::Average);
    let mut model = fresh(model);
    let mut optim = SgdConfig::new().init();
    let mut buf = buffers(&model);
    let mut losses = vec![vec![vec![0.0f32; A]; STEPS]; n];
    for s in 0..STEPS {
        let mut total: Option<Tensor<1>> = None;
        for m in 0..A {
            let mut next: Option<Named> = None;
            for (r, rank_losses) in losses.iter_mut().enumerate() {
                set_buffers(&model, &buf);
                let seeds = Seeds {
                    base,
                    step: s,
                    micro: m,
                    rank: r,
                };
                let loss = forward(&model, &data((s * A + m) * n + r), seeds);
                rank_losses[s][m] = loss
                    .clone()
                    .into_data()
                    .try_into_vec_as::<f32>()
                    .expect("f32")[0];
                total = Some(match total {
                    None => loss,
                    Some(t) => t + loss,
                });
                let after = buffers(&model);
                next = Some(match next {
                    None => after,
                    Some(mut acc) if average => {
                        for ((_, a), (_, b)) in acc.iter_mut().zip(&after) {
                            for (x, y) in a.iter_mut().zip(b) {
                                *x += y;
                            }
                        }
                        acc
                    }
                    Some(rank0) => rank0,
                });
            }
            buf = next.expect("at least one rank");
            if average {
                for (_, v) in &mut buf {
                    for x in v {
                        *x /= n as f32;
                    }
                }
            }
        }
        let loss = total
            .expect("micro-batches")
            .mul_scalar(1.0 / (n * A) as f32);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(f64::from(LR), model, grads);
    }
    set_buffers(&model, &buf);
    Want {
        losses,
        params: params_of(&model),
        buffers: buffers(&model),
    }
}

/// The CNN's forward as the engine runs it: segment 0 (features) and segment 1 (head and loss)
/// each under its own seed. The [`Whole`] CNN draws its masks in segment 0 too, and the head
/// draws nothing, so the same forward serves both.
pub(crate) fn cnn_forward(m: &Cnn, b: &Images, seeds: Seeds) -> Tensor<1> {
    let h = with_seed(&device(), seeds.of(0), || m.features(&b.x));
    with_seed(&device(), seeds.of(1), || m.head_loss(h, &b.y))
}

/// Bounds on the largest absolute gap to plain burn, per kind of value.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bounds {
    /// Any rank's micro-batch loss.
    pub(crate) losses: f32,
    /// Any element of a consolidated parameter.
    pub(crate) params: f32,
    /// Any element of a buffer.
    pub(crate) buffers: f32,
}

/// Every rank's micro-batch losses, the parameters and the buffers within [`TOL`] of plain
/// burn's.
pub(crate) fn assert_near_plain_burn(what: &str, seen: &[Seen], want: &Want) {
    let tol = Bounds {
        losses: TOL,
        params: TOL,
        buffers: TOL,
    };
    assert_within_of_plain_burn(what, seen, want, tol);
}

/// Every rank agrees ([`assert_ranks_agree`]), and every rank's micro-batch losses, the
/// parameters and the buffers lie within `bounds` of plain burn's. Returns the worst gaps found.
pub(crate) fn assert_within_of_plain_burn(
    what: &str,
    seen: &[Seen],
    want: &Want,
    bounds: Bounds,
) -> Bounds {
    assert_ranks_agree(what, seen);
    let mut losses = 0.0f32;
    for (r, s) in seen.iter().enumerate() {
        let got: Named = s
            .losses
            .iter()
            .enumerate()
            .map(|(step, l)| (format!("step {step}"), l.clone()))
            .collect();
        let wanted: Named = want.losses[r]
            .iter()
            .enumerate()
            .map(|(step, l)| (format!("step {step}"), l.clone()))
            .collect();
        losses = losses.max(assert_close(
            &format!("{what}: rank {r}'s micro-batch losses"),
            &got,
            &wanted,
            bounds.losses,
        ));
    }
    let params = assert_close(
        &format!("{what}: parameters"),
        &seen[0].params,
        &want.params,
        bounds.params,
    );
    let buffers = assert_close(
        &format!("{what}: buffers"),
        &seen[0].buffers,
        &want.buffers,
        bounds.buffers,
    );
    Bounds {
        losses,
        params,
        buffers,
    }
}
