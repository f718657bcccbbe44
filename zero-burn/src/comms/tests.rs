//! The executor's modes (overlapped submits return before their collective completes, inline ones
//! run it at once), and jobs whose codec has no device kernels.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use burn::tensor::bf16;
use zero_comm::ReduceOp;
use zero_comm::host::HostWorld;
use zero_core::Topology;

use super::*;
use crate::device::WordBuffer;
use crate::precision::Half;

/// Two ranks: rank 1 submits its half of an all-reduce only once rank 0's `submit` has
/// returned (with whatever result). Overlapped, rank 0's submit returns at once and both get
/// the sum; inline it blocks in the collective until the timeout. No clock decides the
/// outcome: rank 1 waits for rank 0's return, bounded only as a guard against a hang.
fn rank1_waits_for_rank0s_submit(overlap: bool, timeout: Duration) -> Vec<Result<Vec<f32>>> {
    let submitted = AtomicBool::new(false);
    let world = HostWorld::new(Topology::new(2, 2).expect("topology"), timeout);
    world
        .launch(|comm| {
            let rank = comm.rank();
            let mut comms = Comms {
                world: comm,
                hpz: None,
                qgroups: None,
                qwz: None,
                qgz: None,
                quant: None,
                qwz_scratch: QuantScratch::new(),
                qgz_scratch: QuantScratch::new(),
            };
            with_exec(&mut comms, overlap, rank, |exec| {
                if rank == 1 {
                    let guard = Instant::now() + Duration::from_secs(60);
                    while !submitted.load(Ordering::SeqCst) {
                        assert!(Instant::now() < guard, "rank 0's submit never returned");
                        thread::sleep(Duration::from_millis(1));
                    }
                }
                let r = exec.submit(
                    Job::AllReduce {
                        data: Wire::F32(vec![rank as f32 + 1.0; 5]),
                        op: ReduceOp::Sum,
                    },
                    "the all-reduce",
                );
                submitted.store(true, Ordering::SeqCst);
                r?;
                assert_eq!(exec.in_flight().count(), 1);
                match exec.next()? {
                    Some(("the all-reduce", Elems::F32(v))) => Ok(v),
                    _ => panic!("the all-reduce returned something else"),
                }
            })
        })
        .into_iter()
        .map(|r| r.expect("no rank panics"))
        .collect()
}

#[test]
fn an_overlapped_submit_returns_before_its_collective_completes() {
    for r in rank1_waits_for_rank0s_submit(true, Duration::from_secs(20)) {
        assert_eq!(r.expect("the all-reduce completes"), vec![3.0; 5]);
    }
}

#[test]
fn an_inline_submit_runs_its_collective_at_once() {
    let r = rank1_waits_for_rank0s_submit(false, Duration::from_millis(300));
    let err = r[0].as_ref().expect_err("rank 0 blocks until its timeout");
    assert!(err.to_string().contains("all_reduce"), "{err}");
}

/// A result's elements as bits, for a bit-for-bit comparison (host elements only).
fn bits(out: Out<zero_comm::host::HostComm>) -> Vec<u32> {
    match out {
        Elems::F32(v) => v.into_iter().map(f32::to_bits).collect(),
        Elems::U16(_, v) => v.into_iter().map(u32::from).collect(),
        Elems::Device(_) | Elems::DeviceWords(_) => panic!("a result left in host memory"),
    }
}

/// A job whose codec has no device kernels here runs it on the values in host memory: qwZ on a
/// piece in the communicator's memory, qgZ on f32 and on 16-bit words there give the bits of the
/// same job on the values in host memory, and not those of the plain collective.
#[test]
fn a_codec_without_device_kernels_runs_on_the_values_in_host_memory() {
    let world = HostWorld::new(
        Topology::new(4, 2).expect("topology"),
        Duration::from_secs(20),
    );
    let results = world.launch(|mut comm| -> Result<()> {
        let rank = comm.rank();
        let qgroups = Some(QuantGroups::new(&mut comm)?);
        let mut comms = Comms {
            world: comm,
            hpz: None,
            qgroups,
            qwz: Some(Int8Block::new(32)?),
            qgz: Some(Int4Block::new(32)?),
            quant: None,
            qwz_scratch: QuantScratch::new(),
            qgz_scratch: QuantScratch::new(),
        };
        let values: Vec<f32> = (0..256)
            .map(|i| ((i * 7 + rank * 13) % 29) as f32 / 7.0 - 2.0)
            .collect();
        let op = ReduceOp::Mean;

        let piece = values[..64].to_vec();
        let up = comms.world.upload(&piece)?;
        let gather = |piece, qwz, device| Job::Gather {
            piece,
            hpz: false,
            qwz,
            device,
        };
        let on_device = bits(comms.run(gather(Elems::Device(up), true, true))?);
        let host = bits(comms.run(gather(Elems::F32(piece.clone()), true, false))?);
        let plain = bits(comms.run(gather(Elems::F32(piece), false, false))?);
        assert_eq!(on_device, host, "qwZ");
        assert_ne!(on_device, plain, "qwZ ran");

        let up = comms.world.upload(&values)?;
        let on_device = bits(comms.run(Job::ReduceScatterDevice {
            data: up,
            op,
            qgz: true,
        })?);
        let reduce = |data: &Wire, qgz| Job::ReduceScatter {
            data: data.clone(),
            op,
            qgz,
        };
        let data = Wire::F32(values.clone());
        let host = bits(comms.run(reduce(&data, true))?);
        let plain = bits(comms.run(reduce(&data, false))?);
        assert_eq!(on_device, host, "qgZ on f32");
        assert_ne!(on_device, plain, "qgZ ran on f32");

        let h = Half::Bf16;
        let words = h.round_all(&values);
        let up = comms.world.upload(
            &words
                .iter()
                .map(|&b| bf16::from_bits(b))
                .collect::<Vec<_>>(),
        )?;
        let on_device = bits(comms.run(Job::ReduceScatterWords {
            data: WordBuffer::Bf16(up),
            op,
            qgz: true,
        })?);
        let data = Wire::U16(h, words);
        let host = bits(comms.run(reduce(&data, true))?);
        let plain = bits(comms.run(reduce(&data, false))?);
        assert_eq!(on_device, host, "qgZ on 16-bit words");
        assert_ne!(on_device, plain, "qgZ ran on 16-bit words");
        Ok(())
    });
    for r in results {
        r.expect("no rank panics").expect("every job runs");
    }
}
