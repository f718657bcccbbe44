//! The zero-copy bridge (feature `wgpu`, `zero_burn::bridge`): burn tensors on burn's wgpu backend
//! as wgpu loopback buffers and back, on the one device `WgpuShared` shares between them.
//!
//! Runs on any wgpu adapter (Mesa lavapipe on CPU-only machines). Without one each test that needs
//! it prints why to stderr and passes, unless `ZERO_REQUIRE_WGPU=1`, which makes a missing adapter
//! a failure (the convention of `wgpu_path.rs`).
#![cfg(feature = "wgpu")]

mod common;

use common::shared;
use std::time::Duration;

use burn::tensor::{Device, Tensor, TensorData};
use zero_burn::Error;
use zero_burn::WgpuShared;
use zero_burn::bridge::{tensor_buffer, tensor_from_buffer};
use zero_comm::wgpu_loopback::{WgpuBuffer, WgpuComm, WgpuWorld};
use zero_comm::{Communicator, ReduceOp};
use zero_core::Topology;

const TIMEOUT: Duration = Duration::from_secs(60);

/// A one-rank wgpu loopback world on the shared device.
fn one_rank(shared: &WgpuShared) -> WgpuComm {
    let topology = Topology::new(1, 1).unwrap();
    WgpuWorld::with_device(shared.comm_device().clone(), topology, TIMEOUT)
        .into_comms()
        .pop()
        .unwrap()
}

/// burn's wgpu device without autodiff.
fn plain(shared: &WgpuShared) -> Device {
    shared.autodiff_device().inner()
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().as_slice::<f32>().unwrap().to_vec()
}

fn download(comm: &WgpuComm, buf: &WgpuBuffer<f32>) -> Vec<f32> {
    let mut out = vec![f32::NAN; buf.len()];
    comm.download(buf, &mut out).unwrap();
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `got == want` bit for bit, reporting the first difference rather than both vectors.
fn assert_bits_eq(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let diff: Vec<usize> = (0..got.len())
        .filter(|&i| got[i].to_bits() != want[i].to_bits())
        .collect();
    if let Some(&i) = diff.first() {
        panic!(
            "{what}: {} of {} elements differ; first at {i}: {} vs {}",
            diff.len(),
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// 12 distinct values, row-major [4, 3].
fn grid() -> Vec<f32> {
    (0..12).map(|i| i as f32 * 0.75 - 3.5).collect()
}

/// (i) A contiguous tensor's storage is the buffer: the loopback downloads the tensor's values from
/// it, and what the loopback writes into it, the tensor (and the tensor the bridge hands back)
/// reads, so nothing was copied. Both with and without autodiff.
#[test]
fn a_tensor_s_storage_is_a_loopback_buffer() {
    let Some(shared) = shared("a_tensor_s_storage_is_a_loopback_buffer") else {
        return;
    };
    let comm = one_rank(&shared);
    for device in [plain(&shared), shared.autodiff_device()] {
        let t = Tensor::<2>::from_data(TensorData::new(grid(), [4, 3]), &device);
        let mut tb = tensor_buffer(&t).unwrap();
        assert!(!tb.is_copy(), "{tb:?}");
        assert_eq!((tb.len(), tb.shape()), (12, &[4usize, 3][..]));
        assert_eq!(bits(&download(&comm, tb.buffer())), bits(&grid()), "{tb:?}");

        let new: Vec<f32> = (0..12).map(|i| 100.0 + i as f32).collect();
        comm.upload_into(&new, tb.buffer_mut()).unwrap();
        assert_eq!(values(tb.tensor::<2>().unwrap()), new);
        assert_eq!(values(t.clone()), new, "the original tensor sees the write");
        assert!(matches!(tb.tensor::<3>(), Err(Error::Backend(_))));
    }
}

/// (i) A slice of whole rows at an aligned offset is a contiguous view of its base (burn makes a
/// view when the offsets are multiples of cubecl's memory alignment, at most 256 bytes): handed out
/// in place, at that offset, so writes reach the base. A slice of columns and a transpose are views
/// that are not contiguous: the bridge hands out a contiguous copy with the right values, and says
/// so. An unaligned slice burn copies itself when slicing.
#[test]
fn slices_and_non_contiguous_tensors() {
    let Some(shared) = shared("slices_and_non_contiguous_tensors") else {
        return;
    };
    let comm = one_rank(&shared);

    // [4, 128]: a row is 512 bytes.
    let wide: Vec<f32> = (0..4 * 128).map(|i| i as f32 - 100.0).collect();
    let base = Tensor::<2>::from_data(TensorData::new(wide.clone(), [4, 128]), &plain(&shared));
    let rows = base.clone().slice([1..3, 0..128]);
    let mut rtb = tensor_buffer(&rows).unwrap();
    let btb = tensor_buffer(&base).unwrap();
    assert!(!rtb.is_copy(), "{rtb:?}");
    assert_eq!(rtb.offset(), btb.offset() + 512, "{rtb:?} vs {btb:?}");
    assert_eq!(bits(&download(&comm, rtb.buffer())), bits(&wide[128..384]));
    drop(btb);
    // Writing the rows' view changes the base tensor's rows 1..3 only.
    comm.upload_into(&[-1.0; 256], rtb.buffer_mut()).unwrap();
    let mut want = wide.clone();
    want[128..384].fill(-1.0);
    assert_eq!(values(base.clone()), want);
    drop(rtb);

    // The left half of every row: a view (its offsets are aligned), but not contiguous.
    let cols = base.slice([0..4, 0..64]);
    let ctb = tensor_buffer(&cols).unwrap();
    assert!(ctb.is_copy(), "{ctb:?}");
    let left: Vec<f32> = (0..4)
        .flat_map(|r| want[r * 128..][..64].to_vec())
        .collect();
    assert_eq!(bits(&download(&comm, ctb.buffer())), bits(&left));
    assert_eq!(values(ctb.tensor::<2>().unwrap()), left);
    drop(ctb);

    // Rows 1..3 of [4, 3] start at byte 12: burn copies them when slicing.
    let g = grid();
    let base = Tensor::<2>::from_data(TensorData::new(g.clone(), [4, 3]), &plain(&shared));
    let rtb = tensor_buffer(&base.clone().slice([1..3, 0..3])).unwrap();
    assert_eq!(bits(&download(&comm, rtb.buffer())), bits(&g[3..9]));
    drop(rtb);

    let tr = base.clone().transpose();
    let ttb = tensor_buffer(&tr).unwrap();
    assert!(ttb.is_copy(), "{ttb:?}");
    assert_eq!(ttb.shape(), &[3, 4]);
    let want: Vec<f32> = (0..3)
        .flat_map(|c| (0..4).map(move |r| (r, c)))
        .map(|(r, c)| g[r * 3 + c])
        .collect();
    assert_eq!(bits(&download(&comm, ttb.buffer())), bits(&want));
    assert_eq!(values(base), g, "copies leave the base alone");
}

/// (ii) A loopback buffer (whole, or a view at an offset) becomes a burn tensor with its values, on
/// a plain device or as an autodiff parameter that trains.
#[test]
fn a_loopback_buffer_becomes_a_tensor() {
    let Some(shared) = shared("a_loopback_buffer_becomes_a_tensor") else {
        return;
    };
    let comm = one_rank(&shared);
    let dev = shared.comm_device();
    let g = grid();
    let buf = comm.upload(&g).unwrap();

    let t = tensor_from_buffer(&buf, [3, 4], &plain(&shared), dev).unwrap();
    assert_eq!(t.dims(), [3, 4]);
    assert_eq!(bits(&values(t.clone())), bits(&g));

    // A view one element into a larger buffer.
    let mut padded = vec![99.0f32];
    padded.extend_from_slice(&g);
    padded.push(77.0);
    let big = comm.upload(&padded).unwrap();
    let view = comm
        .wrap::<f32>(big.wgpu_buffer().clone(), 4, g.len())
        .unwrap();
    let t = tensor_from_buffer(&view, [12], &plain(&shared), dev).unwrap();
    assert_eq!(bits(&values(t)), bits(&g));

    // The tensor is a copy: changing it leaves the buffer alone.
    let t = tensor_from_buffer(&buf, [12], &plain(&shared), dev).unwrap();
    let t2 = t.add_scalar(1.0);
    assert_eq!(values(t2)[0], g[0] + 1.0);
    assert_eq!(bits(&download(&comm, &buf)), bits(&g));

    // A parameter on the autodiff device: d/dp Σ p·p = 2p, exactly.
    let p = tensor_from_buffer(&buf, [12], &shared.autodiff_device(), dev)
        .unwrap()
        .require_grad();
    assert!(p.is_autodiff());
    let grads = (p.clone() * p.clone()).sum().backward();
    let grad = values(p.grad(&grads).unwrap());
    let want: Vec<f32> = g.iter().map(|x| 2.0 * x).collect();
    assert_eq!(bits(&grad), bits(&want));

    // An empty buffer, and a shape that does not fit.
    let empty = comm.alloc::<f32>(0).unwrap();
    let t = tensor_from_buffer(&empty, [0, 5], &plain(&shared), dev).unwrap();
    assert_eq!(t.dims(), [0, 5]);
    let e = tensor_from_buffer(&buf, [5, 5], &plain(&shared), dev).unwrap_err();
    assert!(
        matches!(&e, Error::Backend(m) if m.contains("25 elements")),
        "{e}"
    );
    // A device that is not burn's wgpu backend.
    let e = tensor_from_buffer(&buf, [12], &Device::flex(), dev).unwrap_err();
    assert!(matches!(&e, Error::Backend(m) if m.contains("wgpu")), "{e}");
}

/// A parameter of `n` values, different per seed.
fn param(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 37 + seed * 101) % 97) as f32 - 48.0) / 23.0)
        .collect()
}

/// What one rank saw: its gradients before the collectives, and burn's gradient tensors after.
struct RankGrads {
    w_before: Vec<f32>,
    w_after: Vec<f32>,
    b_before: Vec<f32>,
    b_shard: Vec<f32>,
    copies: bool,
}

/// (iii) Two ranks compute gradients with burn's autodiff on the wgpu backend; an all-reduce runs
/// in place on one gradient's storage and a reduce-scatter from the other gradient's storage into
/// a burn shard tensor's storage. burn's own tensors then hold the sums, bit for bit the host's
/// `g₀ + g₁` in f32: the collectives read and wrote burn's memory, with no upload of a gradient.
#[test]
fn collectives_run_in_place_on_burn_gradients() {
    let Some(shared) = shared("collectives_run_in_place_on_burn_gradients") else {
        return;
    };
    const N: usize = 1000;
    let world = WgpuWorld::with_device(
        shared.comm_device().clone(),
        Topology::new(2, 2).unwrap(),
        TIMEOUT,
    );
    let results = world.launch(|mut comm| -> zero_burn::Result<RankGrads> {
        let rank = comm.rank();
        let ad = shared.autodiff_device();
        let w = Tensor::<1>::from_data(TensorData::new(param(N, 1), [N]), &ad).require_grad();
        let b = Tensor::<1>::from_data(TensorData::new(param(N, 2), [N]), &ad).require_grad();
        let x = Tensor::<1>::from_data(TensorData::new(param(N, 10 + rank), [N]), &ad);
        let loss = (w.clone().tanh() * x.clone()).sum() + (b.clone() * b.clone() * x).sum();
        let mut grads = loss.backward();
        let gw = w.grad_remove(&mut grads).unwrap();
        let gb = b.grad_remove(&mut grads).unwrap();
        // The host oracle's inputs (downloads, not uploads).
        let w_before = values(gw.clone());
        let b_before = values(gb.clone());

        let mut tw = tensor_buffer(&gw)?;
        comm.all_reduce(tw.buffer_mut(), ReduceOp::Sum)?;

        let shard = Tensor::<1>::zeros([N / 2], &ad.inner());
        let tb = tensor_buffer(&gb)?;
        let mut ts = tensor_buffer(&shard)?;
        comm.reduce_scatter(tb.buffer(), ts.buffer_mut(), ReduceOp::Sum)?;
        let copies = tw.is_copy() || tb.is_copy() || ts.is_copy();
        drop((tw, tb, ts));

        Ok(RankGrads {
            w_before,
            w_after: values(gw),
            b_before,
            b_shard: values(shard),
            copies,
        })
    });
    let ranks: Vec<RankGrads> = results
        .into_iter()
        .map(|r| r.expect("rank panicked").expect("rank failed"))
        .collect();

    assert_ne!(
        bits(&ranks[0].w_before),
        bits(&ranks[1].w_before),
        "the ranks' gradients differ"
    );
    let w_sum: Vec<f32> = (0..N)
        .map(|i| ranks[0].w_before[i] + ranks[1].w_before[i])
        .collect();
    let b_sum: Vec<f32> = (0..N)
        .map(|i| ranks[0].b_before[i] + ranks[1].b_before[i])
        .collect();
    for (rank, r) in ranks.iter().enumerate() {
        assert!(!r.copies, "rank {rank}: a gradient or the shard was copied");
        assert_bits_eq(
            &r.w_after,
            &w_sum,
            &format!("rank {rank}: all-reduced gradient"),
        );
        assert_bits_eq(
            &r.b_shard,
            &b_sum[rank * N / 2..][..N / 2],
            &format!("rank {rank}: reduce-scattered shard"),
        );
    }
    // The analytic gradient of b, 2·b·x summed over ranks, up to rounding: the right tensors met.
    let b = param(N, 2);
    for i in [0, 1, N - 1] {
        let want = 2.0 * b[i] * (param(N, 10)[i] + param(N, 11)[i]);
        assert!((b_sum[i] - want).abs() <= 1e-5 * want.abs().max(1.0));
    }
}

/// (iv) Tensors the bridge cannot hand out give an error, not a panic: a flex (CPU) tensor, with or
/// without autodiff. Needs no wgpu adapter.
#[test]
fn a_flex_tensor_is_rejected() {
    for device in [Device::flex(), Device::flex().autodiff()] {
        let t = Tensor::<2>::from_data(TensorData::new(grid(), [4, 3]), &device);
        let e = tensor_buffer(&t).unwrap_err();
        assert!(
            matches!(&e, Error::Backend(m) if m.contains("not on burn's wgpu backend")),
            "{e}"
        );
        eprintln!("{e}");
    }
}
