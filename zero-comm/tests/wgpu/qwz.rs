//! qwZ on wgpu buffers (`wgpu_loopback::qwz_all_gather_device`, the WGSL codecs) against the host
//! path on the host loopback, bit for bit, errors included.

use zero_comm::Communicator;
use zero_comm::quantized::{QuantScratch, qwz_all_gather};
use zero_comm::wgpu_loopback::{WgpuBuffer, qwz_all_gather_device};
use zero_quant::{Codec, Int4Block, Int8Block, WgpuQuantizer};

use crate::common::*;
use crate::device::{or_skip, wgpu_world};

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
    let t = topo(n, n);
    let host = run_ranks(host_world(t), |mut comm| {
        let x = input(comm.rank());
        let mut out = vec![0f32; n * c];
        let r = qwz_all_gather(&mut comm, &codec, &x, &mut out, &mut QuantScratch::new());
        r.map(|()| out).map_err(|e| e.to_string())
    });
    let device = or_skip().expect("checked by the caller");
    let q = WgpuQuantizer::new(device.device().clone(), device.queue().clone()).unwrap();
    let gpu = run_ranks(wgpu_world(t), |mut comm| {
        let chunk = comm.upload(&input(comm.rank())).unwrap();
        let mut out: WgpuBuffer<f32> = comm.alloc(n * c).unwrap();
        let r = qwz_all_gather_device(&mut comm, &q, codec, &chunk, &mut out);
        r.map(|()| comm.download_vec(&out).unwrap())
            .map_err(|e| e.to_string())
    });
    for (r, (g, h)) in gpu.iter().zip(&host).enumerate() {
        match (g, h) {
            (Ok(g), Ok(h)) => assert_bits(g, h, &format!("{codec:?} n={n} c={c} rank {r}")),
            (Err(g), Err(h)) => assert_eq!(g, h, "{codec:?} n={n} c={c} rank {r}"),
            (g, h) => panic!("{codec:?} n={n} c={c} rank {r}: device {g:?}, host {h:?}"),
        }
    }
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
