//! What the engine refuses or repairs before training starts, and what a failed launch reports:
//! buffers told apart from frozen parameters, deep copies that share no buffer, tied weights
//! refused naming both paths, a model without autodiff named as such, and a failing rank that is
//! not rank 0 reported as the root cause.

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

/// One `Param` reachable from two fields: a tied weight.
#[derive(Module, Debug)]
struct Tied {
    a: Linear,
    b: Linear,
}

#[test]
fn tied_weights_are_refused_naming_both_paths() {
    let device = Device::flex().autodiff();
    let a = LinearConfig::new(3, 3).init(&device);
    let mut b = LinearConfig::new(3, 3).init(&device);
    b.weight = a.weight.clone();
    let model = Whole::new(Tied { a, b }, |m: &Tied, x: &Tensor<2>| {
        m.b.forward(m.a.forward(x.clone())).mean()
    });
    let err = Launch::new(Topology::single_node(2).unwrap())
        .run_with(&model, |comm, m| {
            ZeroEngine::builder(comm, m).build()?;
            Ok(())
        })
        .unwrap_err();
    match err.root_cause() {
        Error::TiedParameter { path, again } => {
            assert_eq!((path.as_str(), again.as_str()), ("a.weight", "b.weight"));
        }
        e => panic!("expected a tied-parameter error, got {e}"),
    }
    assert!(err.to_string().contains("tied weights"), "{err}");
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
