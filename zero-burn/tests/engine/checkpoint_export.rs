//! Consolidated safetensors export of a sharded checkpoint: names and shapes are the
//! model's, the f32 export equals the gathered fp32 weights bit for bit, and a bf16 export
//! equals a bf16 run's working weights bit for bit. Parsed by the reference `safetensors` crate.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use safetensors::{Dtype, SafeTensors};
use zero_burn::checkpoint::{ExportDtype, MemStorage, Storage, export_safetensors};
use zero_burn::demo::run::{corpus_step, engine_builder};
use zero_burn::precision::Half;
use zero_burn::{Launch, plan_for};
use zero_core::{Plan, Precision, Topology, ZeroConfig};

/// Trains 2 steps on 2 ranks, saves, and returns the plan and the gathered weights.
fn trained(cfg: &ZeroConfig, store: &dyn Storage) -> (Arc<Plan>, Vec<Vec<f32>>) {
    let (model, corpus) = tiny();
    let plan = Arc::new(plan_for(&model, Topology::new(2, 2).unwrap(), cfg).unwrap());
    let mut out = Launch::new(*plan.topology())
        .timeout(Duration::from_secs(30))
        .run_with(&model, |comm, model| {
            let mut e = engine_builder(&plan, comm, model, options()).build()?;
            while e.steps() < 2 {
                corpus_step(&mut e, &corpus, &options())?;
            }
            e.save(store, serde_json::json!(null))?;
            e.gather_all_params()
        })
        .unwrap();
    (plan, out.swap_remove(0))
}

/// Every tensor of `file`, in the model's order: (name, dtype, shape, raw bytes).
fn read_back(out: &MemStorage, plan: &Plan) -> Vec<(Dtype, Vec<usize>, Vec<u8>)> {
    let bytes = out.read("model.safetensors").unwrap().expect("written");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), plan.model().params.len());
    plan.model()
        .params
        .iter()
        .map(|p| {
            let t = st
                .tensor(&p.name)
                .unwrap_or_else(|e| panic!("{}: {e}", p.name));
            (t.dtype(), t.shape().to_vec(), t.data().to_vec())
        })
        .collect()
}

#[test]
fn f32_export_equals_the_gathered_weights_at_every_stage() {
    for stage in [0u8, 2, 3] {
        let cfg = ZeroConfig {
            stage,
            param_persistence_threshold: 64,
            ..Default::default()
        };
        let store = MemStorage::new();
        let (plan, gathered) = trained(&cfg, &store);
        let out = MemStorage::new();
        let r =
            export_safetensors(&store, None, &out, "model.safetensors", ExportDtype::F32).unwrap();
        assert_eq!(
            (r.tag.as_str(), r.tensors),
            ("step-00000002", plan.model().params.len())
        );
        for ((dtype, shape, data), (p, want)) in read_back(&out, &plan)
            .into_iter()
            .zip(plan.model().params.iter().zip(&gathered))
        {
            assert_eq!((dtype, &shape), (Dtype::F32, &p.shape), "{}", p.name);
            let got: Vec<u32> = data
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let want: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
            assert!(got == want, "stage {stage}: {} differs", p.name);
        }
    }
}

#[test]
fn bf16_export_equals_the_working_weights() {
    let cfg = ZeroConfig {
        stage: 3,
        precision: Precision::Bf16,
        param_persistence_threshold: 64,
        ..Default::default()
    };
    let store = MemStorage::new();
    let (plan, gathered) = trained(&cfg, &store);
    let out = MemStorage::new();
    export_safetensors(&store, None, &out, "model.safetensors", ExportDtype::Bf16).unwrap();
    for ((dtype, _, data), (p, want)) in read_back(&out, &plan)
        .into_iter()
        .zip(plan.model().params.iter().zip(&gathered))
    {
        assert_eq!(dtype, Dtype::BF16, "{}", p.name);
        let got: Vec<u16> = data
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        let want: Vec<u16> = want.iter().map(|&x| Half::Bf16.round(x)).collect();
        assert!(got == want, "{} differs from the working weights", p.name);
    }
    // A corrupt rank file is refused by the export too.
    store
        .flip("step-00000002/rank-00001-of-00002.zrs", 200, 1)
        .unwrap();
    assert!(export_safetensors(&store, None, &out, "again.safetensors", ExportDtype::F32).is_err());
    assert!(!out.exists("again.safetensors").unwrap());
}

#[test]
fn offline_verify_checks_every_file() {
    let store = MemStorage::new();
    let (plan, _) = trained(
        &ZeroConfig {
            stage: 1,
            ..Default::default()
        },
        &store,
    );
    let r = zero_burn::checkpoint::verify(&store, None).unwrap();
    assert_eq!(
        (r.tag.as_str(), r.files),
        ("step-00000002", plan.world_size())
    );
    let (tag, m) = zero_burn::checkpoint::read_manifest(&store, None).unwrap();
    assert_eq!((tag.as_str(), m.scalars.step), ("step-00000002", 2));
    let n = store
        .size("step-00000002/rank-00001-of-00002.zrs")
        .unwrap()
        .unwrap() as usize;
    store
        .flip("step-00000002/rank-00001-of-00002.zrs", n - 1, 7)
        .unwrap();
    let e = zero_burn::checkpoint::verify(&store, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank-00001-of-00002.zrs") && e.contains("crc32c"),
        "{e}"
    );
}

/// A 2-rank stage-3 checkpoint of 2 steps saved into `store`; the gathered weights.
fn stage3_trained(store: &dyn Storage) -> Vec<Vec<f32>> {
    let cfg = ZeroConfig {
        stage: 3,
        param_persistence_threshold: 64,
        ..Default::default()
    };
    trained(&cfg, store).1
}

/// A fresh GPT of the tiny one's vocabulary and context, `layers` blocks of `d_model`.
fn gpt_layers(d_model: usize, layers: usize, seed: u64) -> zero_burn::demo::gpt::Gpt {
    zero_burn::demo::gpt::GptConfig {
        vocab: 16,
        context: 8,
        d_model,
        heads: 2,
        layers,
    }
    .init(&burn::tensor::Device::flex().autodiff(), seed)
}

/// Every parameter's values, in the model's order.
fn values_of(m: &zero_burn::demo::gpt::Gpt) -> Vec<Vec<f32>> {
    use zero_burn::params::{describe, read_values};
    let want = describe(m)
        .iter()
        .enumerate()
        .map(|(i, p)| (p.id, i))
        .collect();
    read_values(m, &want).unwrap()
}

/// `init_from_safetensors` (`cargo xtask train --init`): an f32 export loaded into a fresh model
/// of another seed gives every parameter the exported bits, a bf16 export the widened bf16 bits;
/// a model of another shape, a truncated file or a missing tensor is refused, naming it.
#[test]
fn an_export_initialises_a_fresh_model_with_identical_bits() {
    use zero_burn::checkpoint::init_from_safetensors;
    let store = MemStorage::new();
    let weights = stage3_trained(&store);
    let gpt = |d_model: usize, seed: u64| gpt_layers(d_model, 2, seed);
    for (dtype, round) in [
        (ExportDtype::F32, None),
        (ExportDtype::Bf16, Some(Half::Bf16)),
    ] {
        let out = MemStorage::new();
        export_safetensors(&store, None, &out, "m.safetensors", dtype).unwrap();
        let bytes = out.read("m.safetensors").unwrap().unwrap();
        let fresh = gpt(16, 7);
        assert_ne!(bits(&values_of(&fresh)), bits(&weights), "another seed");
        let got = values_of(&init_from_safetensors(fresh, &bytes, "m.safetensors").unwrap());
        let want: Vec<Vec<f32>> = weights
            .iter()
            .map(|w| match round {
                None => w.clone(),
                Some(h) => w.iter().map(|&x| h.widen(h.round(x))).collect(),
            })
            .collect();
        assert_eq!(bits(&got), bits(&want), "{dtype:?}");
        let e = init_from_safetensors(gpt(32, 7), &bytes, "m.safetensors")
            .unwrap_err()
            .to_string();
        assert!(e.contains("m.safetensors") && e.contains("shape"), "{e}");
        let e = init_from_safetensors(gpt(16, 7), &bytes[..bytes.len() / 2], "cut")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cut") && e.contains("not a readable"), "{e}");
        let e = init_from_safetensors(gpt_layers(16, 3, 7), &bytes, "m.safetensors")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no tensor for the model's parameter"), "{e}");
    }
}

/// burn's own loader takes the export: `SafetensorsStore` (burn-store) applied to a fresh model of
/// another seed through `ModuleSnapshot::load_from` finds every tensor by its path, leaves
/// nothing missing or unused, and gives every parameter the gathered fp32 bits.
#[test]
fn burn_store_loads_the_export_into_a_fresh_model() {
    use burn_store::{ModuleSnapshot, SafetensorsStore};
    let store = MemStorage::new();
    let weights = stage3_trained(&store);
    let out = MemStorage::new();
    export_safetensors(&store, None, &out, "m.safetensors", ExportDtype::F32).unwrap();
    let bytes = out.read("m.safetensors").unwrap().unwrap();
    let mut fresh = gpt_layers(16, 2, 7);
    assert_ne!(bits(&values_of(&fresh)), bits(&weights), "another seed");
    let mut st = SafetensorsStore::from_bytes(Some(bytes));
    let applied = fresh
        .load_from(&mut st)
        .expect("burn-store loads the export");
    assert!(
        applied.missing.is_empty() && applied.unused.is_empty() && applied.errors.is_empty(),
        "missing {:?}, unused {:?}, errors {:?}",
        applied.missing,
        applied.unused,
        applied.errors
    );
    assert_eq!(applied.applied.len(), weights.len());
    assert_eq!(bits(&values_of(&fresh)), bits(&weights));
}
