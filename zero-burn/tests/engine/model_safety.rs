//! What the engine refuses or repairs before training starts, and what a failed launch reports:
//! buffers told apart from frozen parameters, deep copies that share no buffer (the consolidated
//! model's included), a parameter held by two fields trained as one, a recompute that does not
//! reproduce its forward failing the step, a model without autodiff named as such, and a failing
//! rank that is not rank 0 reported as the root cause.

use burn::module::{Module, Param};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::tensor::{Device, Tensor, TensorData};
use zero_burn::params::{buffers, describe};
use zero_burn::{Error, Launch, Whole, ZeroEngine, deep_copy};
use zero_core::{Topology, ZeroConfig};

/// A linear layer, a BatchNorm over its 4 outputs, and a frozen bias of its own.
#[derive(Module, Debug)]
struct Net {
    lin: Linear,
    bn: BatchNorm,
    frozen: Param<Tensor<1>>,
}

fn net(device: &Device) -> Net {
    Net {
        lin: LinearConfig::new(3, 4).init(device),
        bn: BatchNormConfig::new(4).init(device),
        frozen: Param::from_tensor(Tensor::from_data(
            TensorData::new(vec![0.5f32; 4], [4]),
            device,
        ))
        .set_require_grad(false),
    }
}

impl Net {
    fn loss(&self, x: &Tensor<2>) -> Tensor<1> {
        let h = self.lin.forward(x.clone());
        // BatchNorm1d on [batch, channels, length]: length 1.
        let h: Tensor<3> = self.bn.forward(h.unsqueeze_dim(2));
        (h.squeeze_dim::<2>(2) + self.frozen.val().unsqueeze_dim(0))
            .powf_scalar(2.0)
            .mean()
    }
}

fn batch(seed: f32) -> Tensor<2> {
    let v: Vec<f32> = (0..12).map(|i| ((i as f32 + seed) * 0.37).sin()).collect();
    Tensor::from_data(TensorData::new(v, [4, 3]), &Device::flex().autodiff())
}

type Loss = fn(&Net, &Tensor<2>) -> Tensor<1>;

fn whole(device: &Device) -> Whole<Net, Tensor<2>, Loss> {
    Whole::new(net(device), Net::loss as Loss)
}

#[test]
fn running_statistics_are_buffers_and_a_frozen_parameter_is_not() {
    let m = net(&Device::flex().autodiff());
    let kinds: Vec<(String, bool, bool)> = describe(&m)
        .into_iter()
        .map(|p| (p.path, p.trainable, p.buffer))
        .collect();
    let find = |path: &str| {
        kinds
            .iter()
            .find(|k| k.0 == path)
            .unwrap_or_else(|| panic!("{path} not in {kinds:?}"))
            .clone()
    };
    assert_eq!(find("lin.weight"), ("lin.weight".into(), true, false));
    assert_eq!(find("bn.gamma"), ("bn.gamma".into(), true, false));
    assert_eq!(
        find("bn.running_mean"),
        ("bn.running_mean".into(), false, true)
    );
    assert_eq!(
        find("bn.running_var"),
        ("bn.running_var".into(), false, true)
    );
    assert_eq!(find("frozen"), ("frozen".into(), false, false));
    // The plan keeps the buffers out of every unit at stage 3, and counts them.
    let plan = zero_burn::plan_for(
        &whole(&Device::flex().autodiff()),
        Topology::single_node(2).unwrap(),
        &ZeroConfig {
            stage: 3,
            param_persistence_threshold: 0,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(plan.model().buffer_numel(), 8);
    for (i, p) in plan.model().params.iter().enumerate() {
        assert_eq!(plan.locate(i).is_none(), p.buffer, "{}", p.name);
    }
    let report = plan.report(0).to_string();
    assert!(report.contains("buffers: 8 elements"), "{report}");
}

#[test]
fn a_deep_copy_shares_no_buffer_where_a_clone_does() {
    let device = Device::flex().autodiff();
    let m = net(&device);
    let before = buffers(&m);
    // A training forward of a plain clone moves the original's statistics: the hazard.
    let clone = m.clone();
    drop(clone.loss(&batch(1.0)));
    let after_clone = buffers(&m);
    assert_ne!(before, after_clone, "burn's clone no longer shares buffers");
    // A deep copy's forward does not.
    let copy = deep_copy(&m);
    drop(copy.loss(&batch(2.0)));
    assert_eq!(buffers(&m), after_clone);
    assert_ne!(buffers(&copy), after_clone);
    // The copy keeps every parameter's training state.
    let flags = |m: &Net| {
        describe(m)
            .into_iter()
            .map(|p| (p.trainable, p.buffer))
            .collect::<Vec<_>>()
    };
    assert_eq!(flags(&copy), flags(&m));
}

#[test]
fn launch_gives_every_rank_its_own_buffers() {
    let model = whole(&Device::flex().autodiff());
    let stats = Launch::new(Topology::single_node(2).unwrap())
        .run_with(&model, |_comm, m| {
            let rank = zero_comm::Communicator::rank(&_comm);
            drop(m.module.loss(&batch(rank as f32 * 10.0)));
            Ok(buffers(&m.module))
        })
        .unwrap();
    assert_ne!(
        stats[0], stats[1],
        "the ranks' forwards wrote one shared buffer"
    );
    // And the caller's model kept its initial statistics.
    let initial = buffers(&whole(&Device::flex().autodiff()).module);
    assert_eq!(buffers(&model.module), initial);
}

/// One `Param` held by two fields: a tied weight.
#[derive(Module, Debug)]
struct Tied {
    a: Linear,
    b: Linear,
}

impl Tied {
    fn loss(&self, x: &Tensor<2>) -> Tensor<1> {
        self.b
            .forward(self.a.forward(x.clone()).tanh())
            .powf_scalar(2.0)
            .mean()
    }
}

/// A `Param` held by two fields is one parameter: listed once, saved, sharded and stepped once,
/// and both fields hold its values. The oracle is plain burn's own backward (one autodiff leaf
/// for both uses sums their gradients) and its SGD, which steps the first field; the oracle then
/// ties the second to it again, as the engine keeps it.
#[test]
fn a_parameter_held_by_two_fields_is_one_parameter() {
    let device = Device::flex().autodiff();
    let a = LinearConfig::new(3, 3).init(&device);
    let mut b = LinearConfig::new(3, 3).init(&device);
    b.weight = a.weight.clone();
    let tied = Tied { a, b };
    let paths: Vec<String> = describe(&tied).into_iter().map(|p| p.path).collect();
    assert_eq!(paths, ["a.weight", "a.bias", "b.bias"]);
    let (n, a, steps, lr) = (2usize, 2usize, 3usize, 0.2f32);
    let micro = |k: usize| batch(k as f32 * 0.7);
    // Plain burn on the global batch of each step: the mean of its micro-batch losses.
    let mut oracle = Tied {
        a: tied.a.clone(),
        b: tied.b.clone(),
    };
    let mut sgd = burn::optim::SgdConfig::new().init();
    for s in 0..steps {
        let loss = (0..n * a)
            .map(|k| oracle.loss(&micro(s * n * a + k)))
            .reduce(|x, y| x + y)
            .unwrap()
            .div_scalar((n * a) as f32);
        let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &oracle);
        oracle = sgd.step(f64::from(lr), oracle, grads);
        oracle.b.weight = oracle.a.weight.clone();
    }
    let want = values_of(&oracle);
    let model = Whole::new(tied, |m: &Tied, x: &Tensor<2>| m.loss(x));
    for (stage, threshold) in [(0u8, 0u64), (2, 0), (3, 0), (3, 100_000)] {
        let got = Launch::new(Topology::single_node(n).unwrap())
            .run_with(&model, |comm, m| {
                let rank = zero_comm::Communicator::rank(&comm);
                let mut e = ZeroEngine::builder(comm, m)
                    .config(ZeroConfig {
                        stage,
                        param_persistence_threshold: threshold,
                        gradient_accumulation_steps: a as u32,
                        ..Default::default()
                    })
                    .optimizer(zero_burn::Optimizer::Sgd { momentum: 0.0 })
                    .build()?;
                for s in 0..steps {
                    let batches: Vec<Tensor<2>> =
                        (0..a).map(|m| micro(s * n * a + m * n + rank)).collect();
                    e.step(lr, &batches)?;
                }
                Ok(values_of(&e.consolidated_model()?.module))
            })
            .unwrap();
        for (path, v) in &got[0] {
            let w = &want.iter().find(|(p, _)| p == path).unwrap().1;
            let gap = v
                .iter()
                .zip(w)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            assert!(gap < 1e-6, "stage {stage}: {path} is {gap} from plain burn");
        }
        let field = |p: &str| &got[0].iter().find(|(q, _)| q == p).unwrap().1;
        assert_eq!(
            field("a.weight"),
            field("b.weight"),
            "stage {stage}: both fields tied"
        );
        assert_ne!(
            field("a.weight"),
            &values_of(&model.module)[0].1,
            "stage {stage}: trained"
        );
    }
}

/// Every float tensor of `m` by the path of the field that holds it (a tied weight under each).
fn values_of<M: Module>(m: &M) -> Vec<(String, Vec<f32>)> {
    struct All(Vec<String>, Vec<(String, Vec<f32>)>);
    impl burn::module::ModuleVisitor for All {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name.into());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let v = p.val().into_data().try_to_vec::<f32>().unwrap();
            self.1.push((self.0.join("."), v));
        }
    }
    let mut all = All(Vec::new(), Vec::new());
    m.visit(&mut all);
    all.1
}

/// `consolidated_model()` hands out a deep copy: a training forward of it (which moves its
/// BatchNorm statistics) leaves the engine's model and buffers alone, where a forward of a plain
/// clone moves them.
#[test]
fn the_consolidated_model_shares_nothing_with_the_engine() {
    let model = whole(&Device::flex().autodiff());
    for stage in [0u8, 3] {
        Launch::new(Topology::single_node(2).unwrap())
            .run_with(&model, |comm, m| {
                let mut e = ZeroEngine::builder(comm, m)
                    .config(ZeroConfig {
                        stage,
                        param_persistence_threshold: 0,
                        ..Default::default()
                    })
                    .build()?;
                e.step(0.1, &[batch(1.0)])?;
                // The hazard, shown on a plain clone of the engine's model (at stage 0: at stage
                // 3 its weights are released between steps).
                let stats = buffers(&e.model().module);
                if stage == 0 {
                    drop(e.model().clone().module.loss(&batch(9.0)));
                    assert_ne!(
                        buffers(&e.model().module),
                        stats,
                        "a clone's forward moves them"
                    );
                }
                let moved = buffers(&e.model().module);
                let params = values_of(&e.model().module);
                let copy = e.consolidated_model()?;
                drop(copy.module.loss(&batch(5.0)));
                assert_ne!(buffers(&copy.module), moved, "the copy's statistics moved");
                assert_eq!(buffers(&e.model().module), moved, "stage {stage}: buffers");
                assert_eq!(
                    values_of(&e.model().module),
                    params,
                    "stage {stage}: parameters"
                );
                Ok(())
            })
            .unwrap();
    }
}

/// A middle segment whose output differs at every call (a counter the engine cannot replay):
/// the recompute of segment 1 does not reproduce its forward, and the step fails naming it,
/// though the last segment's loss recomputes exactly from the saved activation.
#[test]
fn a_middle_segment_that_does_not_recompute_fails_the_step_naming_it() {
    use std::sync::atomic::{AtomicU32, Ordering};
    static CALLS: AtomicU32 = AtomicU32::new(0);
    #[derive(Module, Debug)]
    struct Drift {
        a: Linear,
        b: Linear,
        c: Linear,
    }
    impl zero_burn::Segmented for Drift {
        type Batch = Tensor<2>;
        type Act = Tensor<2>;
        type Output = ();
        fn num_segments(&self) -> usize {
            3
        }
        fn visit_segment<V: burn::module::ModuleVisitor>(&self, i: usize, v: &mut V) {
            [&self.a, &self.b, &self.c][i].visit(v);
        }
        fn forward_segment(
            &self,
            i: usize,
            x: &Tensor<2>,
            h: Option<Tensor<2>>,
        ) -> zero_burn::SegmentOut<Tensor<2>> {
            use zero_burn::SegmentOut;
            match (i, h) {
                (0, None) => SegmentOut::Next(self.a.forward(x.clone())),
                (1, Some(h)) => {
                    let k = CALLS.fetch_add(1, Ordering::Relaxed) as f32;
                    SegmentOut::Next(self.b.forward(h).add_scalar(k * 1e-3))
                }
                (_, Some(h)) => SegmentOut::Loss(self.c.forward(h).powf_scalar(2.0).mean()),
                _ => unreachable!("segment 0 alone has no input"),
            }
        }
    }
    let device = Device::flex().autodiff();
    let model = Drift {
        a: LinearConfig::new(3, 3).init(&device),
        b: LinearConfig::new(3, 3).init(&device),
        c: LinearConfig::new(3, 2).init(&device),
    };
    // One step of the model on one rank at `stage`, checkpointing as `ckpt` says.
    let one_step = |stage, ckpt| {
        Launch::new(Topology::single_node(1).unwrap()).run_with(&model, |comm, m| {
            let config = ZeroConfig {
                stage,
                checkpoint_activations: Some(ckpt),
                ..Default::default()
            };
            let mut e = ZeroEngine::builder(comm, m).config(config).build()?;
            e.step(0.1, &[batch(1.0)])?;
            Ok(())
        })
    };
    for stage in [1u8, 3] {
        let err = one_step(stage, true).unwrap_err();
        match err.root_cause() {
            Error::RecomputeMismatch { segment, step, .. } => {
                assert_eq!((*segment, *step), (1, 1), "{err}");
            }
            e => panic!("stage {stage}: expected a recompute mismatch, got {e}"),
        }
        assert!(err.to_string().contains("recompute of segment 1"), "{err}");
    }
    // Without checkpointing nothing is recomputed: the same model trains.
    one_step(3, false).unwrap();
}

#[test]
fn a_model_without_autodiff_is_named_as_such() {
    let model = whole(&Device::flex());
    let err = Launch::new(Topology::single_node(1).unwrap())
        .run_with(&model, |comm, m| {
            ZeroEngine::builder(comm, m).build()?;
            Ok(())
        })
        .unwrap_err();
    assert!(
        matches!(err.root_cause(), Error::NotAutodiff { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("autodiff()"), "{err}");
}

#[test]
fn the_root_cause_is_the_failing_rank_not_rank_0() {
    let model = whole(&Device::flex().autodiff());
    let err = Launch::new(Topology::single_node(3).unwrap())
        .run_with(&model, |comm, m| {
            let rank = zero_comm::Communicator::rank(&comm);
            let mut engine = ZeroEngine::builder(comm, m)
                .config(ZeroConfig {
                    stage: 2,
                    ..Default::default()
                })
                .build()?;
            // Rank 1 passes two micro-batches where the plan takes one.
            let n = if rank == 1 { 2 } else { 1 };
            let batches: Vec<Tensor<2>> = (0..n).map(|k| batch(k as f32)).collect();
            engine.step(0.1, &batches)?;
            Ok(())
        })
        .unwrap_err();
    let Error::RankFailed {
        rank,
        source,
        consequences,
    } = &err
    else {
        panic!("expected RankFailed, got {err}");
    };
    assert_eq!(*rank, 1, "{err}");
    assert!(
        matches!(
            **source,
            Error::Invalid {
                field: "batches",
                ..
            }
        ),
        "{err}"
    );
    // Ranks 0 and 2 failed only because rank 1 left; they follow, naming it.
    let others: Vec<usize> = consequences.iter().map(|(r, _)| *r).collect();
    assert_eq!(others, [0, 2], "{err}");
    assert!(
        consequences.iter().all(|(_, m)| m.contains("rank 1")),
        "{err}"
    );
    let text = err.to_string();
    assert!(text.starts_with("rank 1 failed: invalid batches"), "{text}");
}
