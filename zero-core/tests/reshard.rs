//! Property tests of the checkpoint reshard map (`zero_core::checkpoint::copies`) and the
//! manifest's serde round trip.

mod common;

use std::collections::HashMap;

use proptest::prelude::*;
use zero_core::checkpoint::{
    CkptLayout, CopyRun, EngineScalars, FileRecord, LatestPointer, LossScalerState, Manifest,
    Saved, ShardHeader, TensorRecord, copies, fingerprint, loose_copies,
};
use zero_core::{CheckpointError, Error, ModelDesc, ParamDesc, Plan, Topology, ZeroConfig};

fn arb_model() -> impl Strategy<Value = ModelDesc> {
    common::arb_model(300, 20)
}

/// A topology and configuration: world sizes 1–16, ranks per node, stages 0–3, bucket sizes,
/// persistence thresholds and hpZ (stage 3).
fn arb_plan_inputs() -> impl Strategy<Value = (Topology, ZeroConfig)> {
    (
        1usize..=8,
        1usize..=2,
        0u8..=3,
        1u64..2000,
        0u64..300,
        0usize..3,
    )
        .prop_map(|(nodes, l, stage, bucket, persist, h)| {
            let topo = Topology::new(nodes * l, l).unwrap();
            let hpz = if stage == 3 && l > 1 && h > 0 { l } else { 1 };
            let cfg = ZeroConfig {
                stage,
                reduce_bucket_size: bucket,
                allgather_bucket_size: bucket,
                param_persistence_threshold: persist,
                hpz_partition_size: hpz,
                ..Default::default()
            };
            (topo, cfg)
        })
}

/// The identity of element `e` of parameter `p`: unique over the model.
fn ident(starts: &[u64], p: usize, e: u64) -> u64 {
    starts[p] + e
}

/// Every rank's saved tensors under `layout` (the real elements of its chunk of every unit, and
/// the loose parameters it holds), as element identities.
fn shards(layout: &CkptLayout, starts: &[u64]) -> Vec<HashMap<Saved, Vec<u64>>> {
    (0..layout.world_size)
        .map(|r| {
            let mut files: HashMap<Saved, Vec<u64>> = (0..layout.units.len())
                .map(|u| {
                    let c = layout.chunk_len(u);
                    let real = layout.real_in_chunk(u, r);
                    let mut out = vec![u64::MAX; real as usize];
                    for e in &layout.units[u].entries {
                        for k in 0..e.numel {
                            let o = e.offset + k;
                            if o >= r as u64 * c && o < r as u64 * c + real {
                                out[(o - r as u64 * c) as usize] = ident(starts, e.param, k);
                            }
                        }
                    }
                    (Saved::Unit(u), out)
                })
                .collect();
            for l in layout.loose.iter().filter(|l| l.rank == r) {
                let whole = (0..l.numel).map(|k| ident(starts, l.param, k)).collect();
                files.insert(Saved::Loose(l.param), whole);
            }
            files
        })
        .collect()
}

/// Every loose parameter of `dst`, whole, from `src`'s files through [`loose_copies`]; an
/// element written twice or never fails.
fn loose_values(
    src: &CkptLayout,
    dst: &CkptLayout,
    files: &[HashMap<Saved, Vec<u64>>],
) -> Result<HashMap<usize, Vec<u64>>, TestCaseError> {
    let mut out = HashMap::new();
    let copies = loose_copies(src, dst).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(copies.len(), dst.loose.len());
    for ((param, pieces), l) in copies.into_iter().zip(&dst.loose) {
        prop_assert_eq!(param, l.param);
        let mut got = vec![None; l.numel as usize];
        for p in pieces {
            let from = &files[p.src_rank][&p.src];
            for k in 0..p.len {
                let slot = &mut got[(p.elem + k) as usize];
                prop_assert!(slot.is_none(), "element written twice: {p:?}");
                *slot = Some(from[(p.src_off + k) as usize]);
            }
        }
        let whole: Option<Vec<u64>> = got.into_iter().collect();
        out.insert(
            param,
            whole.ok_or_else(|| TestCaseError::fail("element never written"))?,
        );
    }
    Ok(out)
}

fn starts(model: &ModelDesc) -> Vec<u64> {
    let mut acc = 0;
    model
        .params
        .iter()
        .map(|p| {
            let s = acc;
            acc += p.numel();
            s
        })
        .collect()
}

/// A model and the checkpoint layouts of two plans of it: the saving one and the loading one.
fn arb_reshard() -> impl Strategy<Value = (ModelDesc, CkptLayout, CkptLayout)> {
    (arb_model(), arb_plan_inputs(), arb_plan_inputs()).prop_map(|(model, (ta, ca), (tb, cb))| {
        let layout = |t, c: &ZeroConfig| CkptLayout::of(&Plan::new(&model, t, c).unwrap());
        let (a, b) = (layout(ta, &ca), layout(tb, &cb));
        (model, a, b)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Applying the map for every destination rank writes each real destination element exactly
    /// once, with the element the destination plan puts there; sources are real (never padding)
    /// and in bounds; A = A is one copy per non-empty chunk, from the rank's own file.
    #[test]
    fn every_element_is_copied_exactly_once_to_its_place((model, a, b) in arb_reshard()) {
        let st = starts(&model);
        let src = shards(&a, &st);
        let want = shards(&b, &st);
        for (s, want_s) in want.iter().enumerate() {
            let runs = copies(&a, &b, s).map_err(|e| TestCaseError::fail(e.to_string()))?;
            // In destination order without overlap (the loader's restore searches them so).
            prop_assert!(
                runs.windows(2).all(|w| (w[0].dst_unit, w[0].dst_off + w[0].len) <= (w[1].dst_unit, w[1].dst_off)),
                "runs out of destination order: {runs:?}"
            );
            let mut got: Vec<Vec<Option<u64>>> = (0..b.units.len())
                .map(|u| vec![None; want_s[&Saved::Unit(u)].len()])
                .collect();
            for c in &runs {
                prop_assert!(c.len > 0);
                let from = &src[c.src_rank][&c.src];
                prop_assert!(c.src_off + c.len <= from.len() as u64, "source out of bounds: {c:?}");
                for k in 0..c.len {
                    let slot = got[c.dst_unit]
                        .get_mut((c.dst_off + k) as usize)
                        .ok_or_else(|| TestCaseError::fail(format!("destination out of bounds: {c:?}")))?;
                    prop_assert!(slot.is_none(), "element written twice: {c:?}");
                    *slot = Some(from[(c.src_off + k) as usize]);
                }
            }
            for (u, g) in got.iter().enumerate() {
                for (k, (x, y)) in g.iter().zip(&want_s[&Saved::Unit(u)]).enumerate() {
                    prop_assert_eq!(*x, Some(*y), "unit {} element {} of rank {}", u, k, s);
                }
            }
            if a == b {
                let nonempty = (0..b.units.len()).filter(|&u| b.real_in_chunk(u, s) > 0).count();
                prop_assert_eq!(runs.len(), nonempty);
                prop_assert!(runs.iter().all(|c| c.src_rank == s && c.src == Saved::Unit(c.dst_unit) && c.src_off == 0 && c.dst_off == 0));
            }
        }
        // The destination's loose parameters, whole, each element once.
        for (param, v) in loose_values(&a, &b, &src)? {
            let whole: Vec<u64> = (0..model.params[param].numel()).map(|k| ident(&st, param, k)).collect();
            prop_assert_eq!(v, whole, "loose parameter {}", param);
        }
    }

    /// The loose parameters are exactly those in no unit, each saved by one rank, spread so
    /// that no rank holds more than the least-loaded one plus the largest loose parameter
    /// (greedy largest-first), and the table is the same whichever order it is asked in.
    #[test]
    fn loose_parameters_are_the_unsharded_ones_spread_over_the_ranks(
        model in arb_model(),
        (t, c) in arb_plan_inputs(),
    ) {
        let plan = Plan::new(&model, t, &c).unwrap();
        let l = CkptLayout::of(&plan);
        let unsharded: Vec<usize> = (0..model.params.len()).filter(|&p| plan.locate(p).is_none()).collect();
        prop_assert_eq!(l.loose.iter().map(|x| x.param).collect::<Vec<_>>(), unsharded);
        if l.stage == 3 {
            prop_assert!(l.loose.is_empty());
        }
        let mut held = vec![0u64; l.world_size];
        for x in &l.loose {
            prop_assert!(x.rank < l.world_size);
            prop_assert_eq!(x.numel, model.params[x.param].numel());
            prop_assert_eq!(l.saved_len(Saved::Loose(x.param), x.rank), x.numel);
            held[x.rank] += x.numel;
        }
        let largest = l.loose.iter().map(|x| x.numel).max().unwrap_or(0);
        let (lo, hi) = (held.iter().min().copied().unwrap_or(0), held.iter().max().copied().unwrap_or(0));
        prop_assert!(hi <= lo + largest, "held {held:?}, largest {largest}");
        prop_assert_eq!(&CkptLayout::of(&plan), &l);
        prop_assert_eq!(l.check(), Ok(()));
        // Every element is saved exactly once over the ranks.
        let saved: u64 = (0..l.world_size).map(|r| l.real_elements(r)).sum();
        prop_assert_eq!(saved, model.params.iter().map(|p| p.numel()).sum::<u64>());
    }

    /// A → B → A is the identity: composing the two maps sends every element home.
    #[test]
    fn resharding_there_and_back_is_the_identity((model, a, b) in arb_reshard()) {
        let st = starts(&model);
        let apply = |from: &CkptLayout, to: &CkptLayout, src: &[HashMap<Saved, Vec<u64>>]| -> Result<Vec<HashMap<Saved, Vec<u64>>>, TestCaseError> {
            let mut out = shards(to, &st);
            let loose = loose_values(from, to, src)?;
            for (s, shard) in out.iter_mut().enumerate() {
                shard.values_mut().for_each(|t| t.iter_mut().for_each(|x| *x = u64::MAX));
                for c in copies(from, to, s).map_err(|e| TestCaseError::fail(e.to_string()))? {
                    let dst = shard.get_mut(&Saved::Unit(c.dst_unit)).unwrap();
                    for k in 0..c.len {
                        dst[(c.dst_off + k) as usize] = src[c.src_rank][&c.src][(c.src_off + k) as usize];
                    }
                }
                for l in to.loose.iter().filter(|l| l.rank == s) {
                    shard.insert(Saved::Loose(l.param), loose[&l.param].clone());
                }
            }
            Ok(out)
        };
        let orig = shards(&a, &st);
        let mid = apply(&a, &b, &orig)?;
        let back = apply(&b, &a, &mid)?;
        prop_assert_eq!(back, orig);
    }
}

#[test]
fn manifest_round_trips_through_json() {
    let model = ModelDesc::new(vec![
        ParamDesc::new("a.weight", &[3, 5], "a"),
        ParamDesc::new("b.bias", &[7], "b").frozen(),
    ]);
    let plan = Plan::new(&model, Topology::new(4, 2).unwrap(), &ZeroConfig::default()).unwrap();
    let m = Manifest {
        format: zero_core::checkpoint::FORMAT.into(),
        format_version: zero_core::checkpoint::FORMAT_VERSION,
        tag: Manifest::tag_of(12),
        save_id: "abc".into(),
        plan_fingerprint: fingerprint(&plan),
        layout: CkptLayout::of(&plan),
        scalars: EngineScalars {
            step: 12,
            opt_steps: 11,
            skipped: 1,
            optimizer: serde_json::json!({"adamw": {"beta1": 0.9}}),
            optimizer_states: 2,
            reduction: "rank_ordered".into(),
            loss_scaler: Some(LossScalerState {
                scale_bits: 65536f64.to_bits(),
                scale: Some("65536".into()),
                hysteresis: 2,
                iter: 12,
                last_overflow: 7,
            }),
        },
        client_state: serde_json::json!({"epoch": 3, "next_sample": [1, 2]}),
        files: (0..4)
            .map(|r| FileRecord {
                path: Manifest::rank_file(r, 4),
                rank: r,
                bytes: 100 + r as u64,
                block_size: 64,
                block_crc32c: vec![1, 2, u32::MAX],
            })
            .collect(),
    };
    let back = Manifest::from_json(&m.to_json(), "MANIFEST.json").unwrap();
    assert_eq!(back, m);
    // A wrong version and a file list that does not match the world are refused, by name.
    let mut v: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
    v["format_version"] = 99.into();
    let e = Manifest::from_json(&serde_json::to_vec(&v).unwrap(), "X/MANIFEST.json").unwrap_err();
    assert!(
        matches!(&e, Error::Checkpoint(c) if matches!(&**c, CheckpointError::Version { file, .. } if file == "X/MANIFEST.json")),
        "{e}"
    );
    // An older manifest is named by its version even where its other fields no longer parse.
    let mut v1: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
    v1["format_version"] = 1.into();
    v1.as_object_mut().unwrap().remove("files");
    let e = Manifest::from_json(&serde_json::to_vec(&v1).unwrap(), "M").unwrap_err();
    assert!(
        matches!(&e, Error::Checkpoint(c) if matches!(&**c, CheckpointError::Version { found, .. } if found.ends_with("v1"))),
        "{e}"
    );
    // A layout its readers could not index is refused, saying what is wrong.
    let broken = |edit: &dyn Fn(&mut serde_json::Value), says: &str| {
        let mut v: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
        edit(&mut v);
        let e = Manifest::from_json(&serde_json::to_vec(&v).unwrap(), "M").unwrap_err();
        assert!(
            matches!(&e, Error::Checkpoint(c) if matches!(&**c, CheckpointError::Parse { message, .. } if message.contains(says))),
            "{says}: {e}"
        );
    };
    broken(
        &|v| {
            v["layout"]["world_size"] = 0.into();
            v["files"] = serde_json::json!([]);
        },
        "world size 0",
    );
    broken(
        &|v| v["layout"]["loose"] = serde_json::json!([{ "param": 0, "numel": 15, "rank": 0 }]),
        "saved 2 times",
    );
    broken(
        &|v| v["layout"]["loose"] = serde_json::json!([{ "param": 1, "numel": 7, "rank": 4 }]),
        "rank 4 of 4",
    );
    broken(
        &|v| v["layout"]["units"][0]["entries"][0]["param"] = 5.into(),
        "parameter 5 of 2",
    );
    broken(
        &|v| {
            v["layout"]["loose"] = serde_json::json!([
                { "param": 1, "numel": 7, "rank": 0 },
                { "param": 0, "numel": 15, "rank": 1 },
            ])
        },
        "out of parameter order",
    );
    let mut short = m.clone();
    short.files.pop();
    assert!(Manifest::from_json(&short.to_json(), "M").is_err());
    assert!(Manifest::from_json(b"{not json", "M").is_err());

    let h = ShardHeader {
        format_version: 1,
        save_id: "abc".into(),
        plan_fingerprint: "f".into(),
        rank: 3,
        world_size: 4,
        tensors: vec![TensorRecord {
            name: "w/u00000".into(),
            offset: 0,
            len: 9,
        }],
    };
    let mut bytes = h.encode();
    assert_eq!(bytes.len() % 8, 0);
    let data = bytes.len();
    bytes.extend_from_slice(&[0; 36]);
    assert_eq!(ShardHeader::decode(&bytes, "f").unwrap(), (h, data));
    assert!(ShardHeader::decode(&bytes[..10], "f").is_err());
    bytes[9] = 0xff; // header length beyond the file
    assert!(ShardHeader::decode(&bytes, "f").is_err());

    let p = LatestPointer {
        tag: "step-00000012".into(),
        manifest_crc32c: 0xdead_beef,
        manifest_bytes: 77,
    };
    assert_eq!(
        LatestPointer::parse(p.encode().as_bytes(), "LATEST").unwrap(),
        p
    );
    for bad in [
        "",
        "step-1 deadbeef 7",
        "step-1 deadbee 7\n",
        "../x deadbeef 7\n",
        "a b c d\n",
    ] {
        assert!(
            LatestPointer::parse(bad.as_bytes(), "LATEST").is_err(),
            "{bad:?}"
        );
    }
}

#[test]
fn the_map_splits_a_straddling_parameter_at_both_plans_boundaries() {
    // One parameter of 10 elements: 2 ranks (chunks of 6: 6 + 4) to 3 ranks (chunks of 4).
    let model = ModelDesc::new(vec![ParamDesc::new("w", &[10], "m")]);
    let cfg = ZeroConfig {
        stage: 1,
        ..Default::default()
    };
    let a = CkptLayout::of(&Plan::new(&model, Topology::single_node(2).unwrap(), &cfg).unwrap());
    let b = CkptLayout::of(&Plan::new(&model, Topology::single_node(3).unwrap(), &cfg).unwrap());
    assert_eq!((a.chunk_len(0), b.chunk_len(0)), (6, 4));
    let r1 = copies(&a, &b, 1).unwrap();
    assert_eq!(
        r1,
        vec![
            CopyRun {
                src_rank: 0,
                src: Saved::Unit(0),
                src_off: 4,
                dst_unit: 0,
                dst_off: 0,
                len: 2
            },
            CopyRun {
                src_rank: 1,
                src: Saved::Unit(0),
                src_off: 0,
                dst_unit: 0,
                dst_off: 2,
                len: 2
            },
        ]
    );
    let r2 = copies(&a, &b, 2).unwrap();
    assert_eq!(
        r2,
        vec![CopyRun {
            src_rank: 1,
            src: Saved::Unit(0),
            src_off: 2,
            dst_unit: 0,
            dst_off: 0,
            len: 2
        }]
    );
}
