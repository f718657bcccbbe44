//! Mismatched calls, one [`Case`] each, generic over the backend: every rank fails promptly with
//! the same error, nothing is moved or counted, and the group goes on.

use std::time::{Duration, Instant};

use half::f16;
use zero_comm::{Communicator, Error, ReduceOp};

use crate::common::run_ranks;

/// One kind of mismatched call, made on 4 ranks.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Case {
    RecvLength,
    Chunk,
    AllReduceLength,
    ReduceScatterLength,
    Dtype,
    Reduction,
    Op,
    Root,
    RootRange,
    U8Reduce,
    AllToAllLength,
    InPlaceLength,
    SplitVsBarrier,
}

impl Case {
    pub(crate) const ALL: [Case; 13] = [
        Case::RecvLength,
        Case::Chunk,
        Case::AllReduceLength,
        Case::ReduceScatterLength,
        Case::Dtype,
        Case::Reduction,
        Case::Op,
        Case::Root,
        Case::RootRange,
        Case::U8Reduce,
        Case::AllToAllLength,
        Case::InPlaceLength,
        Case::SplitVsBarrier,
    ];

    /// Makes the bad call on `c`; returns its error and whether `recv` kept its contents.
    fn call<C: Communicator>(self, c: &mut C) -> (Error, bool) {
        let r = c.rank();
        let mut untouched = true;
        let e = match self {
            // Wrong receive length on rank 2: nobody's output is touched.
            Case::RecvLength => {
                let send = c.upload(&[r as f32; 3]).unwrap();
                let len = if r == 2 { 11 } else { 12 };
                let mut recv = c.upload(&vec![-1.0f32; len]).unwrap();
                let e = c.all_gather(&send, &mut recv).map(drop);
                untouched = c.download_vec(&recv).unwrap().iter().all(|&x| x == -1.0);
                e
            }
            Case::Chunk => c
                .all_gather_host(&vec![0u8; if r == 3 { 5 } else { 4 }])
                .map(drop),
            Case::AllReduceLength => {
                let mut b = c
                    .upload(&vec![-2.0f32; if r == 1 { 7 } else { 8 }])
                    .unwrap();
                let e = c.all_reduce(&mut b, ReduceOp::Sum);
                untouched = c.download_vec(&b).unwrap().iter().all(|&x| x == -2.0);
                e
            }
            Case::ReduceScatterLength => {
                let s = c.alloc::<f32>(8).unwrap();
                let mut recv = c.alloc::<f32>(if r == 0 { 2 } else { 3 }).unwrap();
                c.reduce_scatter(&s, &mut recv, ReduceOp::Sum)
            }
            Case::Dtype => {
                if r == 2 {
                    let mut b = c.alloc::<f16>(4).unwrap();
                    c.all_reduce(&mut b, ReduceOp::Sum)
                } else {
                    let mut b = c.alloc::<f32>(4).unwrap();
                    c.all_reduce(&mut b, ReduceOp::Sum)
                }
            }
            Case::Reduction => {
                let op = if r == 3 {
                    ReduceOp::Mean
                } else {
                    ReduceOp::Sum
                };
                c.all_reduce_host(&mut [0.0f32; 4], op)
            }
            Case::Op => {
                if r == 1 {
                    c.broadcast_host(&mut [0.0f32; 4], 0)
                } else {
                    c.all_reduce_host(&mut [0.0f32; 4], ReduceOp::Sum)
                }
            }
            Case::Root => c.broadcast_host(&mut [0u8; 4], r % 2),
            Case::RootRange => c.broadcast_host(&mut [0u8; 4], 4),
            Case::U8Reduce => c.all_reduce_host(&mut [0u8; 4], ReduceOp::Sum),
            Case::AllToAllLength => c.all_to_all_host(&[0u8; 6]).map(drop),
            Case::InPlaceLength => {
                let mut b = c.alloc::<u8>(if r == 3 { 10 } else { 8 }).unwrap();
                c.all_gather_in_place(&mut b)
            }
            Case::SplitVsBarrier => {
                if r == 0 {
                    c.split(0, 0).map(drop)
                } else {
                    c.barrier()
                }
            }
        };
        (e.unwrap_err(), untouched)
    }
}

/// Runs `case` on every rank of `comms` (4 ranks): every rank must fail within `prompt` (so
/// validation, not the timeout, ended the call) with the same error text, keep its output, record
/// no traffic, and go on (validation errors are not fatal). Returns every rank's error, by rank.
pub(crate) fn mismatch<C: Communicator>(comms: Vec<C>, case: Case, prompt: Duration) -> Vec<Error> {
    let errs = run_ranks(comms, |mut c| {
        let start = Instant::now();
        let (e, untouched) = case.call(&mut c);
        assert!(start.elapsed() < prompt);
        assert!(untouched, "{case:?}: output written");
        assert_eq!(c.traffic().calls(), 0, "{case:?}: traffic recorded");
        c.barrier().unwrap();
        e
    });
    let texts: Vec<String> = errs.iter().map(Error::to_string).collect();
    assert!(
        texts.iter().all(|e| e == &texts[0]),
        "{case:?}: ranks disagree: {texts:#?}"
    );
    errs
}
