//! Shared bodies of the device qwZ and qgZ tests: any backend's [`DeviceCodec`] against the host
//! path on the host loopback, results bit for bit, errors word for word, traffic byte for byte.

use zero_comm::Communicator;
use zero_comm::quantized::{
    DeviceCodec, QuantElement, QuantGroups, QuantScratch, qgz_reduce_scatter,
    qgz_reduce_scatter_device, qwz_all_gather, qwz_all_gather_device,
};
use zero_core::TrafficTable;
use zero_quant::Codec;

use crate::common::{Val, assert_bits, host_world, run_ranks};

/// What one rank got: its output or the error (message and fields, the codec's error included),
/// and the traffic of the communicators the call used.
type Outcome<E> = (Result<Vec<E>, String>, TrafficTable);

/// Compares every rank's device outcome with its host outcome; returns the host's results.
fn agree<E: Val>(
    device: Vec<Outcome<E>>,
    host: Vec<Outcome<E>>,
    what: &str,
) -> Vec<Result<Vec<E>, String>> {
    assert_eq!(device.len(), host.len(), "{what}: ranks");
    for (r, ((g, gt), (h, ht))) in device.iter().zip(&host).enumerate() {
        match (g, h) {
            (Ok(g), Ok(h)) => assert_bits(g, h, &format!("{what} rank {r}")),
            (Err(g), Err(h)) => assert_eq!(g, h, "{what} rank {r}"),
            (g, h) => panic!("{what} rank {r}: device {g:?}, host {h:?}"),
        }
        assert_eq!(gt, ht, "{what} rank {r}: traffic");
    }
    host.into_iter().map(|(h, _)| h).collect()
}

/// qwZ of every rank's `input(rank)` (`c` elements) through `codec`: on `world` with
/// `kernels` (`place` puts a rank's values into one of its buffers) and on the host path.
pub(crate) fn compare_qwz<C, Q, E>(
    world: Vec<C>,
    kernels: &Q,
    c: usize,
    codec: Codec,
    place: impl Fn(&C, &[E]) -> C::Buffer<E> + Sync,
    input: impl Fn(usize) -> Vec<E> + Sync,
) -> Vec<Result<Vec<E>, String>>
where
    C: Communicator,
    Q: DeviceCodec<C, E> + Sync,
    E: Val + QuantElement,
{
    let n = world.len();
    let what = format!("qwZ {codec:?} N={n} c={c}");
    let host = run_ranks(host_world(*world[0].topology()), |mut comm| {
        let x = input(comm.rank());
        let mut out = vec![<E as Val>::from_f32(0.0); n * c];
        let r = qwz_all_gather(&mut comm, &codec, &x, &mut out, &mut QuantScratch::new());
        (
            r.map(|()| out).map_err(|e| format!("{e} ({e:?})")),
            comm.traffic().clone(),
        )
    });
    let device = run_ranks(world, |mut comm| {
        let chunk = place(&comm, &input(comm.rank()));
        let mut out = place(&comm, &vec![<E as Val>::from_f32(7.0); n * c]);
        let r = qwz_all_gather_device(&mut comm, kernels, codec, &chunk, &mut out);
        let r = r.map(|()| comm.download_vec(&out).unwrap());
        (
            r.map_err(|e| format!("{e} ({e:?})")),
            comm.traffic().clone(),
        )
    });
    agree(device, host, &what)
}

/// qgZ of every rank's `input(rank)` (`N·c` elements) through `codec`, on nodes of `l` ranks: on
/// `world` with `kernels` (`place` as for [`compare_qwz`]) and on the host path.
pub(crate) fn compare_qgz<C, Q, E>(
    world: Vec<C>,
    kernels: &Q,
    (l, c): (usize, usize),
    codec: Codec,
    place: impl Fn(&C, &[E]) -> C::Buffer<E> + Sync,
    input: impl Fn(usize) -> Vec<E> + Sync,
) -> Vec<Result<Vec<E>, String>>
where
    C: Communicator,
    Q: DeviceCodec<C, E> + Sync,
    E: Val + QuantElement,
{
    let t = *world[0].topology();
    let what = format!("qgZ {codec:?} N={} L={l} c={c}", t.world_size());
    assert_eq!(t.ranks_per_node(), l, "{what}: the world's topology");
    let host = run_ranks(host_world(t), |mut world| {
        let x = input(world.rank());
        let mut groups = QuantGroups::new(&mut world).unwrap();
        let mut out = vec![<E as Val>::from_f32(0.0); c];
        let r = qgz_reduce_scatter(&mut groups, &codec, &x, &mut out, &mut QuantScratch::new());
        (
            r.map(|()| out).map_err(|e| format!("{e} ({e:?})")),
            groups.traffic(),
        )
    });
    let device = run_ranks(world, |mut world| {
        let x = place(&world, &input(world.rank()));
        let mut out = place(&world, &vec![<E as Val>::from_f32(7.0); c]);
        let mut groups = QuantGroups::new(&mut world).unwrap();
        let r = qgz_reduce_scatter_device(&mut groups, kernels, codec, &x, &mut out);
        let r = r.map(|()| world.download_vec(&out).unwrap());
        (r.map_err(|e| format!("{e} ({e:?})")), groups.traffic())
    });
    agree(device, host, &what)
}
