//! Property tests of the partition invariants I2 and I3 (ARCHITECTURE.md, "Invariants").

mod common;

use proptest::prelude::*;
use zero_core::{ModelDesc, Plan, Topology, UnitKind, ZeroConfig};

fn arb_model() -> impl Strategy<Value = ModelDesc> {
    common::arb_model(400, 24)
}

fn arb_setup() -> impl Strategy<Value = (ModelDesc, Topology, ZeroConfig)> {
    (
        arb_model(),
        1usize..=9,
        1usize..=3,
        0u8..=3,
        1u64..2000,
        0u64..300,
    )
        .prop_map(|(m, nodes_or_n, l, stage, bucket, persist)| {
            let n = nodes_or_n * l;
            let topo = Topology::new(n, l).unwrap();
            let cfg = ZeroConfig {
                stage,
                reduce_bucket_size: bucket,
                allgather_bucket_size: bucket,
                param_persistence_threshold: persist,
                ..Default::default()
            };
            (m, topo, cfg)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// I2: the union of every rank's fragments covers every element of every partitioned
    /// parameter exactly once; padding is never part of a fragment; units are multiples of 2N.
    #[test]
    fn every_element_is_owned_exactly_once((model, topo, cfg) in arb_setup()) {
        let plan = Plan::new(&model, topo, &cfg).unwrap();
        let n = topo.world_size();
        let mut owned: Vec<Vec<u32>> =
            model.params.iter().map(|p| vec![0; p.numel() as usize]).collect();
        let mut real = 0u64;
        for r in 0..n {
            let mut shard_cursor = 0u64;
            for f in plan.fragments(r) {
                prop_assert!(f.shard_offset >= shard_cursor, "fragments overlap in the shard");
                shard_cursor = f.shard_offset + (f.param_range.end - f.param_range.start);
                prop_assert!(shard_cursor <= plan.shard_len());
                for e in f.param_range.clone() {
                    owned[f.param][e as usize] += 1;
                }
                real += f.param_range.end - f.param_range.start;
            }
        }
        for (i, p) in model.params.iter().enumerate() {
            let expect = if plan.locate(i).is_some() { 1 } else { 0 };
            prop_assert!(owned[i].iter().all(|&c| c == expect), "param {} owned {:?}", p.name, owned[i]);
            if cfg.stage == 3 {
                prop_assert!(plan.locate(i).is_some(), "stage 3 partitions every parameter");
            } else {
                prop_assert_eq!(plan.locate(i).is_some(), p.trainable);
            }
        }
        let numel: u64 = plan.units().iter().map(|u| u.numel).sum();
        prop_assert_eq!(real, numel, "padding is never counted");
        for (u, unit) in plan.units().iter().enumerate() {
            prop_assert_eq!(unit.len % (2 * n as u64), 0);
            prop_assert!(unit.len - unit.numel < 2 * n as u64, "padding below one alignment step");
            let per_rank: u64 = (0..n).map(|r| plan.real_in_chunk(u, r)).sum();
            prop_assert_eq!(per_rank, unit.numel);
            if cfg.stage <= 2 {
                prop_assert!(unit.numel <= cfg.reduce_bucket_size || plan.unit_entries(u).len() == 1);
            }
        }
        prop_assert_eq!(plan.shard_len(), plan.flat_len() / n as u64);
    }

    /// I3: a parameter that crosses a chunk boundary is split exactly at the boundary, and its
    /// pieces reassemble it in order, with the chunk offsets the all-gather uses.
    #[test]
    fn straddling_parameters_split_exactly((model, topo, cfg) in arb_setup()) {
        let plan = Plan::new(&model, topo, &cfg).unwrap();
        let n = topo.world_size() as u64;
        for (u, unit) in plan.units().iter().enumerate() {
            let c = unit.len / n;
            for e in plan.unit_entries(u) {
                let mut pieces = Vec::new();
                for r in 0..n {
                    for f in plan.unit_fragments(u, r as usize) {
                        if f.param == e.param {
                            // The piece sits where the all-gather of chunk r puts it.
                            let flat = r * c + (f.shard_offset - unit.shard_offset);
                            prop_assert_eq!(flat, e.offset + f.param_range.start);
                            pieces.push(f.param_range.clone());
                        }
                    }
                }
                prop_assert_eq!(pieces.first().map(|p| p.start), Some(0));
                for w in pieces.windows(2) {
                    prop_assert_eq!(w[0].end, w[1].start, "pieces are contiguous");
                    prop_assert_eq!((e.offset + w[0].end) % c, 0, "split exactly at a chunk boundary");
                }
                prop_assert_eq!(pieces.last().map(|p| p.end), Some(e.numel));
            }
            if unit.kind == UnitKind::Gather {
                let m = &model.params[plan.unit_entries(u)[0].param].module;
                prop_assert!(plan.unit_entries(u).iter().all(|e| &model.params[e.param].module == m));
            }
        }
    }
}
