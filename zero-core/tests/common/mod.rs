//! Shared property-test strategies.

use proptest::prelude::*;
use zero_core::{ModelDesc, ParamDesc};

/// Models of 1..`max_params` two-dimensional parameters (each dimension below `max_dim`) in up to
/// five modules, about 15% frozen (never the first).
pub(crate) fn arb_model(max_dim: usize, max_params: usize) -> impl Strategy<Value = ModelDesc> {
    prop::collection::vec(
        (
            1usize..max_dim,
            1usize..4,
            0usize..5,
            prop::bool::weighted(0.85),
        ),
        1..max_params,
    )
    .prop_map(|ps| {
        let params = ps
            .into_iter()
            .enumerate()
            .map(|(i, (a, b, module, trainable))| {
                let p = ParamDesc::new(format!("p{i}"), &[a, b], format!("m{}", module.min(i)));
                if trainable || i == 0 { p } else { p.frozen() }
            })
            .collect();
        ModelDesc::new(params)
    })
}
