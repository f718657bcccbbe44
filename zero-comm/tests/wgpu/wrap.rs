//! The zero-copy bridge: `WgpuBuffer::from_wgpu` views of buffers made elsewhere (as burn-wgpu's
//! tensors would be), including every rank's views in one shared buffer at odd offsets, which
//! forces the same-buffer and unaligned paths, and an adopted device.

use half::{bf16, f16};
use zero_comm::wgpu_loopback::{REQUIRED_USAGES, WgpuBuffer, WgpuWorld, wgpu};
use zero_comm::{Communicator, ReduceOp};

use crate::common::*;
use crate::device::{or_skip, wgpu_world};

/// Lengths of the regions each rank uses in [`script`], for world `n` and chunk `c`.
fn regions(n: usize, c: usize) -> [usize; 9] {
    [c, n * c, n * c, c, n * c + 1, c + 2, n * c, n * c, n * c]
}

/// Initial contents of region `k` of rank `r` (garbage in outputs, own chunk in place for the
/// in-place all-gather).
fn initial<E: Val>(r: usize, k: usize, n: usize, c: usize) -> Vec<E> {
    let len = regions(n, c)[k];
    let mut v = values::<E>(r, len, 100 + k as u64);
    if k == 8 {
        v[r * c..(r + 1) * c].copy_from_slice(&values::<E>(r, c, 99));
    }
    v
}

/// Every collective over the nine regions; returns the outputs' bits. `buf(k)` gives region `k`.
fn script<C: Communicator, E: Val>(
    comm: &mut C,
    buf: impl Fn(&C, usize) -> C::Buffer<E>,
) -> Vec<Vec<u32>> {
    let mut b: Vec<C::Buffer<E>> = (0..9).map(|k| buf(comm, k)).collect();
    let [s0, r1, s2, r3, b4, b5, s6, r7, b8] = &mut b[..] else {
        unreachable!()
    };
    comm.all_gather(s0, r1).unwrap();
    if E::REDUCIBLE {
        comm.reduce_scatter(s2, r3, ReduceOp::Sum).unwrap();
        comm.all_reduce(b4, ReduceOp::Mean).unwrap();
    }
    let root = comm.world_size() - 1;
    comm.broadcast(b5, root).unwrap();
    comm.all_to_all(s6, r7).unwrap();
    comm.all_gather_in_place(b8).unwrap();
    b.iter()
        .map(|x| {
            let v = comm.download_vec(x).unwrap();
            v.iter().map(|e| e.bits()).collect()
        })
        .collect()
}

const GAP_BYTE: u8 = 0xa5;

/// All ranks' regions in one buffer, each after a gap of one element (so 16-bit and byte regions
/// start at odd element offsets), every gap filled with [`GAP_BYTE`].
fn shared_pool<E: Val>(n: usize, c: usize) {
    let Some(device) = or_skip() else {
        return;
    };
    let es = size_of::<E>();
    let mut bytes = Vec::new();
    let mut at = vec![[0usize; 9]; n];
    for (r, at) in at.iter_mut().enumerate() {
        for (k, at) in at.iter_mut().enumerate() {
            bytes.extend(std::iter::repeat_n(GAP_BYTE, es));
            *at = bytes.len();
            bytes.extend_from_slice(bytemuck::cast_slice(&initial::<E>(r, k, n, c)));
        }
    }
    let gaps = bytes.clone();
    bytes.resize(bytes.len().next_multiple_of(4) + 4, GAP_BYTE);
    let pool = device.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("pool"),
        size: bytes.len() as u64,
        usage: REQUIRED_USAGES,
        mapped_at_creation: true,
    });
    pool.get_mapped_range_mut(..)
        .unwrap()
        .copy_from_slice(&bytes);
    pool.unmap();

    let t = topo(n, n);
    let host = run_ranks(host_world(t), |mut comm| {
        let r = comm.rank();
        script::<_, E>(&mut comm, |c0, k| {
            c0.upload(&initial::<E>(r, k, n, c)).unwrap()
        })
    });
    let wgpu = run_ranks(wgpu_world(t), |mut comm| {
        let r = comm.rank();
        let lens = regions(n, c);
        script::<_, E>(&mut comm, |c0, k| {
            c0.wrap(pool.clone(), at[r][k] as u64, lens[k]).unwrap()
        })
    });
    for r in 0..n {
        for k in 0..9 {
            assert_eq!(
                wgpu[r][k],
                host[r][k],
                "{} n={n} c={c} rank {r} region {k}",
                E::DTYPE
            );
        }
    }
    // Nothing outside the regions was written.
    let one = wgpu_world(topo(1, 1));
    let all: WgpuBuffer<u8> = one[0].wrap(pool.clone(), 0, bytes.len()).unwrap();
    let after = one[0].download_vec(&all).unwrap();
    let mut inside = vec![false; gaps.len()];
    for (r, at) in at.iter().enumerate() {
        for k in 0..9 {
            let len = initial::<E>(r, k, n, c).len() * es;
            inside[at[k]..at[k] + len].fill(true);
        }
    }
    for (i, &b) in after[..gaps.len()].iter().enumerate() {
        assert!(inside[i] || b == GAP_BYTE, "gap byte {i} overwritten");
    }
}

#[test]
fn every_rank_in_one_shared_buffer() {
    for (n, c) in [(1, 3), (2, 1), (3, 5), (4, 64)] {
        shared_pool::<bf16>(n, c);
        shared_pool::<u8>(n, c);
    }
    shared_pool::<f32>(3, 7);
    shared_pool::<f16>(5, 9);
}

#[test]
fn wrapping_checks_usage_alignment_and_bounds() {
    let Some(device) = or_skip() else {
        return;
    };
    let make = |size, usage| {
        device.device().create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size,
            usage,
            mapped_at_creation: false,
        })
    };
    let ok = make(64, REQUIRED_USAGES);
    assert_eq!(
        WgpuBuffer::<f32>::from_wgpu(ok.clone(), 8, 14)
            .unwrap()
            .len(),
        14
    );
    assert_eq!(
        WgpuBuffer::<u8>::from_wgpu(ok.clone(), 63, 1)
            .unwrap()
            .byte_len(),
        1
    );
    let e = |r: zero_comm::Result<WgpuBuffer<bf16>>| r.unwrap_err().to_string();
    assert!(e(WgpuBuffer::from_wgpu(ok.clone(), 3, 1)).contains("offset 3 is not a multiple"));
    assert!(e(WgpuBuffer::from_wgpu(ok.clone(), 2, 32)).contains("exceed the buffer's 64 bytes"));
    let read_only = make(
        64,
        wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
    );
    assert!(e(WgpuBuffer::from_wgpu(read_only, 0, 1)).contains("lack some of"));
    let (b, off, len) = WgpuBuffer::<f16>::from_wgpu(ok.clone(), 6, 5)
        .unwrap()
        .into_parts();
    assert_eq!((b, off, len), (ok, 6, 5));
}

/// A world on an adopted device (clones of someone else's `wgpu::Device` and `wgpu::Queue`), with
/// send and receive as views of one buffer.
#[test]
fn an_adopted_device_and_views_of_one_buffer() {
    let Some(device) = or_skip() else {
        return;
    };
    let world = WgpuWorld::from_wgpu(
        device.device().clone(),
        device.queue().clone(),
        topo(2, 2),
        SAFE_TIMEOUT,
    )
    .unwrap();
    let results = world.launch(|mut comm| {
        let me = comm.rank();
        // [send (3) | recv (6)] in one buffer per rank, recv at an odd element offset.
        let host: Vec<bf16> = (0..10)
            .map(|i| bf16::from_f32((10 * me + i) as f32))
            .collect();
        let one = comm.upload(&host).unwrap();
        let (buffer, _, _) = one.into_parts();
        let send: WgpuBuffer<bf16> = comm.wrap(buffer.clone(), 0, 3).unwrap();
        let mut recv: WgpuBuffer<bf16> = comm.wrap(buffer, 8, 6).unwrap();
        comm.all_gather(&send, &mut recv).unwrap();
        comm.synchronize().unwrap();
        comm.download_vec(&recv).unwrap()
    });
    let want: Vec<bf16> = [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
        .map(bf16::from_f32)
        .to_vec();
    for r in results {
        assert_eq!(r.unwrap(), want);
    }
}

/// NCCL's in-place reduce-scatter: the output is this rank's chunk of its own input (one buffer),
/// read through the output binding for n ≤ 4 and through scratch above.
#[test]
fn in_place_reduce_scatter_views() {
    if or_skip().is_none() {
        return;
    }
    let c = 37;
    for n in [1, 2, 3, 6] {
        run_ranks(wgpu_world(topo(n, n)), |mut comm| {
            let me = comm.rank();
            let inputs: Vec<Vec<bf16>> = (0..n).map(|k| values::<bf16>(k, n * c, 8)).collect();
            let mine: Vec<Vec<bf16>> = inputs
                .iter()
                .map(|x| x[me * c..(me + 1) * c].to_vec())
                .collect();
            let want = reference_reduce(&mine, ReduceOp::Mean);
            let (buffer, _, _) = comm.upload(&inputs[me]).unwrap().into_parts();
            let send: WgpuBuffer<bf16> = comm.wrap(buffer.clone(), 0, n * c).unwrap();
            let mut recv: WgpuBuffer<bf16> = comm.wrap(buffer, (me * c * 2) as u64, c).unwrap();
            comm.reduce_scatter(&send, &mut recv, ReduceOp::Mean)
                .unwrap();
            let what = format!("in-place reduce_scatter n={n} rank {me}");
            assert_bits(&comm.download_vec(&recv).unwrap(), &want, &what);
        });
    }
}

#[test]
fn upload_into_a_view_keeps_its_neighbours() {
    let Some(device) = or_skip() else {
        return;
    };
    let pool = device.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("pool"),
        size: 16,
        usage: REQUIRED_USAGES,
        mapped_at_creation: true,
    });
    pool.get_mapped_range_mut(..)
        .unwrap()
        .copy_from_slice(&[GAP_BYTE; 16]);
    pool.unmap();
    let one = wgpu_world(topo(1, 1));
    // Bytes 2..8 (three bf16 from element 1) and byte 9 (one u8): neither starts or ends on a
    // 4-byte word boundary.
    let mut v: WgpuBuffer<bf16> = one[0].wrap(pool.clone(), 2, 3).unwrap();
    let x = [
        bf16::from_f32(1.5),
        bf16::from_f32(-2.0),
        bf16::from_f32(3.25),
    ];
    one[0].upload_into(&x, &mut v).unwrap();
    let mut b: WgpuBuffer<u8> = one[0].wrap(pool.clone(), 9, 1).unwrap();
    one[0].upload_into(&[7u8], &mut b).unwrap();
    assert_eq!(one[0].download_vec(&v).unwrap(), x);
    let all: WgpuBuffer<u8> = one[0].wrap(pool, 0, 16).unwrap();
    let after = one[0].download_vec(&all).unwrap();
    let mut want = vec![GAP_BYTE; 16];
    want[2..8].copy_from_slice(bytemuck::cast_slice(&x));
    want[9] = 7;
    assert_eq!(after, want);
}
