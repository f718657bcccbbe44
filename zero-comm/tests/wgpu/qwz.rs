//! qwZ on wgpu buffers (`quantized::qwz_all_gather_device` with the WGSL codecs) against the host
//! path on the host loopback, bit for bit, errors included.

use zero_comm::Communicator;
use zero_comm::wgpu_loopback::WgpuComm;
use zero_quant::{Codec, Int4Block, Int8Block, WgpuQuantizer};

use crate::common::*;
use crate::device::{or_skip, wgpu_world};
use crate::quant_common::compare_qwz;

fn codecs() -> [Codec; 3] {
    [
        Int8Block::default().into(),
        Int8Block::new(7).unwrap().into(),
        Int4Block::new(6).unwrap().into(),
    ]
}

/// Runs qwZ on both paths for every rank's `values(rank, c, salt)` (with element `nan_at` of rank
/// 1 made NaN, if given) and compares results or error messages.
fn compare(n: usize, c: usize, codec: Codec, nan_at: Option<usize>) {
    let input = |r: usize| {
        let mut x = values::<f32>(r, c, c as u64);
        if let Some(i) = nan_at.filter(|_| r == 1) {
            x[i] = f32::NAN;
        }
        x
    };
    let device = or_skip().expect("checked by the caller");
    let q = WgpuQuantizer::new(device.device().clone(), device.queue().clone()).unwrap();
    let place = |comm: &WgpuComm, x: &[f32]| comm.upload(x).unwrap();
    compare_qwz(wgpu_world(topo(n, n)), &q, c, codec, place, input);
}

#[test]
fn qwz_on_wgpu_buffers_matches_the_host_path() {
    if or_skip().is_none() {
        return;
    }
    for codec in codecs() {
        for n in [1, 2, 3] {
            for c in [0, 1, 5, 100] {
                compare(n, c, codec, None);
            }
        }
        // Rank 1's non-finite element: every rank fails naming rank 1, as on the host.
        compare(3, 100, codec, Some(37));
    }
}
