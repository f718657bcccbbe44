//! The verified load, on the same plan or resharded: resolve `LATEST` (or a tag), check the
//! manifest's checksum, the model, the plan and every byte of the rank files this rank reads,
//! agree with every rank, and only then restore.

use std::collections::BTreeMap;
use std::ops::Range;

use zero_comm::Communicator;
use zero_core::CheckpointError;
use zero_core::checkpoint::{
    CkptLayout, CopyRun, Manifest, Piece, copies, fingerprint, loose_copies,
};

use super::ranged::{Ranged, RankIndex, Reread, Want};
use super::resolve::{in_manifest, open_file, resolve};
use super::shard::{self, ShardFile};
use super::storage::Storage;
use super::{LoadOptions, Loaded, Scalars, agree, engine_scalars};
use crate::engine::ZeroEngine;
use crate::error::Result;
use crate::segmented::Segmented;

/// A saved rank file as the load reads it: on the same plan the rank's own file whole (it needs
/// all of it, its shard); any other file, and every file on a reshard, by the checksum blocks
/// the rank needs ([`Ranged`]): those of its new shard held, those of the weights outside it
/// (the other chunks of the units the rank holds whole, and the frozen parameters) verified, let
/// go, and read and verified again as they are restored, so the load never holds them all.
enum Source {
    Whole(ShardFile),
    Ranged(Ranged),
}

impl Source {
    fn check(&self, name: &str, len: u64, range: Range<usize>) -> Result<()> {
        match self {
            Source::Whole(f) => f.check(name, len, range),
            Source::Ranged(p) => p.check(name, len, range),
        }
    }

    fn read_into(
        &self,
        store: &dyn Storage,
        cache: &Reread,
        name: &str,
        len: u64,
        range: Range<usize>,
        dst: &mut [f32],
    ) -> Result<()> {
        match self {
            Source::Whole(f) => f.read_into(name, len, range, dst),
            Source::Ranged(p) => p.read_into(store, cache, name, len, range, dst),
        }
    }
}

/// Everything read and verified, ready to restore.
struct Prepared {
    /// The verified source files, by saved rank.
    files: BTreeMap<usize, Source>,
    /// The blocks last read again from any of them.
    cache: Reread,
    /// Per destination unit: the copy runs into it, each with the destination rank whose chunk
    /// it lands in, in destination order (every tensor a run reads already checked to exist
    /// with its length).
    runs: Vec<Vec<(usize, CopyRun)>>,
    /// Every parameter in no destination unit (frozen, stages 0–2; each rank restores it whole)
    /// with its saved pieces (every tensor a piece reads already checked).
    loose: Vec<(usize, Vec<Piece>)>,
    /// The saved layout (real elements per chunk).
    src: CkptLayout,
    /// Optimizer state buffers saved (0, 1 or 2).
    states: usize,
    scalars: Scalars,
    loaded: Loaded,
}

impl Prepared {
    /// Decodes elements `range` (offsets in unit `v`, whose chunks are `chunk_len` long) of
    /// state `state` (0: weights, 1: `m`, 2: `v`) straight from the files into `dst`, of the
    /// range's length; padding and states the checkpoint lacks stay as `dst` holds them (zero).
    fn fill(
        &self,
        store: &dyn Storage,
        v: usize,
        chunk_len: u64,
        state: usize,
        range: Range<u64>,
        dst: &mut [f32],
    ) -> Result<()> {
        if state > 0 && self.states < state {
            return Ok(());
        }
        let name = ["w", "m", "v"][state.min(2)];
        // The unit's runs are in destination order: skip to the first that reaches the range.
        let runs = &self.runs[v];
        let at = |&(s, r): &(usize, CopyRun)| s as u64 * chunk_len + r.dst_off;
        let first = runs.partition_point(|x| at(x) + x.1.len <= range.start);
        for x in &runs[first..] {
            let (start, r) = (at(x), x.1);
            if start >= range.end {
                break;
            }
            let (a, b) = (start.max(range.start), (start + r.len).min(range.end));
            let from = r.src_off + (a - start);
            self.files[&r.src_rank].read_into(
                store,
                &self.cache,
                &shard::name(name, r.src),
                self.src.saved_len(r.src, r.src_rank),
                from as usize..(from + (b - a)) as usize,
                &mut dst[(a - range.start) as usize..(b - range.start) as usize],
            )?;
        }
        Ok(())
    }

    /// Decodes a loose parameter of `numel` elements from its saved pieces.
    fn read_loose(&self, store: &dyn Storage, pieces: &[Piece], numel: u64) -> Result<Vec<f32>> {
        let mut out = vec![0.0; numel as usize];
        for x in pieces {
            let (a, b) = (x.elem as usize, (x.elem + x.len) as usize);
            self.files[&x.src_rank].read_into(
                store,
                &self.cache,
                &shard::name("w", x.src),
                self.src.saved_len(x.src, x.src_rank),
                x.src_off as usize..(x.src_off + x.len) as usize,
                &mut out[a..b],
            )?;
        }
        Ok(out)
    }
}

pub(crate) fn load<C: Communicator, M: Segmented>(
    e: &mut ZeroEngine<C, M>,
    store: &dyn Storage,
    opts: &LoadOptions,
) -> Result<Loaded> {
    // Everything read and verified on every rank before any state changes.
    let local = prepare(e, store, opts);
    let p = agree(e.ckpt_world(), "load", local)?;
    let restored = restore(e, store, &p);
    // A rank file that changed since it was verified fails the restore part-way: then every
    // rank's state is partly the checkpoint's, and every rank refuses to go on.
    match agree(e.ckpt_world(), "load", restored) {
        Ok(()) => {
            e.core.ckpt_partly_restored(None);
            Ok(p.loaded)
        }
        Err(err) => {
            e.core.ckpt_partly_restored(Some(err.full_message()));
            Err(err)
        }
    }
}

/// Writes what `p` verified into the engine's state.
fn restore<C: Communicator, M: Segmented>(
    e: &mut ZeroEngine<C, M>,
    store: &dyn Storage,
    p: &Prepared,
) -> Result<()> {
    let plan = e.plan().clone();
    e.core.ckpt_restore(
        |v, state, range, dst| p.fill(store, v, plan.chunk_len(v), state, range, dst),
        p.scalars,
    )?;
    // The loose parameters, one at a time.
    for (param, pieces) in &p.loose {
        let values = p.read_loose(store, pieces, plan.model().params[*param].numel())?;
        e.core.ckpt_restore_loose(*param, values);
    }
    Ok(())
}

fn prepare<C: Communicator, M: Segmented>(
    e: &ZeroEngine<C, M>,
    store: &dyn Storage,
    opts: &LoadOptions,
) -> Result<Prepared> {
    let plan = e.plan().clone();
    let reshard = opts.reshard;
    let (tag, m, mpath) = resolve(store, opts.tag.as_deref())?;
    check_model(e, &m, &mpath)?;
    let current = CkptLayout::of(&plan);
    let fp = fingerprint(&plan);
    let mine = engine_scalars(e);
    let resharding = m.plan_fingerprint != fp;
    if (resharding && !reshard)
        || m.scalars.optimizer != mine.optimizer
        || m.scalars.reduction != mine.reduction
    {
        let words = |l: &CkptLayout, opt: &serde_json::Value, red: &str| {
            format!(
                "world_size {}, {} ranks per node, stage {}, {:?}, hpZ {}, {} units, optimizer {opt}, reduction {red}",
                l.world_size,
                l.ranks_per_node,
                l.stage,
                l.precision,
                l.hpz_partition_size,
                l.units.len()
            )
        };
        return Err(CheckpointError::PlanMismatch {
            file: mpath,
            saved: words(&m.layout, &m.scalars.optimizer, &m.scalars.reduction),
            saved_fingerprint: m.plan_fingerprint.clone(),
            current: words(&current, &mine.optimizer, &mine.reduction),
            current_fingerprint: fp,
        }
        .into());
    }

    // The copy runs (zero_core's reshard map; the identity on the same plan) of every
    // destination chunk this rank needs: the whole unit where the model holds it, else its own.
    let src = &m.layout;
    let needs: Vec<_> = (0..plan.units().len())
        .map(|u| e.core.ckpt_needs(u))
        .collect();
    let mut by_rank: BTreeMap<usize, Vec<CopyRun>> = BTreeMap::new();
    for (u, (w, _)) in needs.iter().enumerate() {
        let c = plan.chunk_len(u);
        for s in (w.start / c) as usize..w.end.div_ceil(c) as usize {
            if let std::collections::btree_map::Entry::Vacant(slot) = by_rank.entry(s) {
                slot.insert(copies(src, &current, s).map_err(|e| in_manifest(e, &mpath))?);
            }
        }
    }
    let runs: Vec<(usize, CopyRun)> = by_rank
        .into_iter()
        .flat_map(|(s, runs)| runs.into_iter().map(move |r| (s, r)))
        .filter(|(s, r)| {
            let c = plan.chunk_len(r.dst_unit);
            let w = &needs[r.dst_unit].0;
            w.start <= *s as u64 * c && (*s as u64 + 1) * c <= w.end
        })
        .collect();

    // The source files those runs read: the rank's own file on the same plan read and verified
    // whole; any other (every file on a reshard) only by the checksum blocks the runs lie in,
    // each verified.
    let states = m.scalars.optimizer_states;
    // Whether a run lands in the rank's optimizer range, its new shard: then it reads `m` and `v`
    // too, and its blocks are held to the restore. At stages 1–2 a rank restores whole units'
    // weights but only its chunk of their state; the weights outside it are streamed.
    let in_opt = |s: usize, r: &CopyRun| {
        let at = s as u64 * plan.chunk_len(r.dst_unit) + r.dst_off;
        needs[r.dst_unit]
            .1
            .as_ref()
            .is_some_and(|o| o.contains(&at))
    };
    let tensors = |s: usize, r: &CopyRun| -> Vec<Want> {
        let real = src.saved_len(r.src, r.src_rank);
        let range = r.src_off as usize..(r.src_off + r.len) as usize;
        let opt = in_opt(s, r);
        ["w", "m", "v"]
            .into_iter()
            .enumerate()
            .filter(|&(state, _)| state == 0 || (opt && states >= state))
            .map(|(_, name)| (shard::name(name, r.src), real, range.clone()))
            .collect()
    };
    // What a loose piece reads: its weights.
    let loose = loose_copies(src, &current).map_err(|e| in_manifest(e, &mpath))?;
    let piece = |x: &Piece| {
        let range = x.src_off as usize..(x.src_off + x.len) as usize;
        (
            shard::name("w", x.src),
            src.saved_len(x.src, x.src_rank),
            range,
        )
    };
    // Per saved rank: the ranges to hold and the ranges to stream.
    let mut wanted: BTreeMap<usize, (Vec<Want>, Vec<Want>)> = BTreeMap::new();
    for (s, r) in &runs {
        let (hold, stream) = wanted.entry(r.src_rank).or_default();
        if in_opt(*s, r) { hold } else { stream }.extend(tensors(*s, r));
    }
    for x in loose.iter().flat_map(|(_, pieces)| pieces) {
        wanted.entry(x.src_rank).or_default().1.push(piece(x));
    }
    let mut files: BTreeMap<usize, Source> = BTreeMap::new();
    for (k, (hold, stream)) in wanted {
        let source = if !resharding && k == e.rank() {
            Source::Whole(open_file(store, &tag, &m, &mpath, k)?)
        } else {
            let index = RankIndex::open(store, &tag, &m, &mpath, k)?;
            Source::Ranged(Ranged::read(store, index, &hold, &stream)?)
        };
        files.insert(k, source);
    }

    // Every tensor a run or piece reads exists with its length, so the restore cannot fail
    // half-way.
    let mut by_unit: Vec<Vec<(usize, CopyRun)>> = vec![Vec::new(); needs.len()];
    for (s, r) in runs {
        for (name, real, range) in tensors(s, &r) {
            files[&r.src_rank].check(&name, real, range)?;
        }
        by_unit[r.dst_unit].push((s, r));
    }
    // `Prepared::fill` searches each unit's runs by destination offset.
    debug_assert!(by_unit.iter().enumerate().all(|(u, runs)| {
        let at = |(s, r): &(usize, CopyRun)| *s as u64 * plan.chunk_len(u) + r.dst_off;
        runs.windows(2).all(|w| at(&w[0]) + w[0].1.len <= at(&w[1]))
    }));
    for x in loose.iter().flat_map(|(_, pieces)| pieces) {
        let (name, real, range) = piece(x);
        files[&x.src_rank].check(&name, real, range)?;
    }
    let s = &m.scalars;
    let scaler = s.loss_scaler.as_ref().map(|l| {
        (
            f64::from_bits(l.scale_bits),
            l.hysteresis,
            l.iter,
            l.last_overflow,
        )
    });
    Ok(Prepared {
        files,
        cache: Reread::default(),
        runs: by_unit,
        loose,
        src: m.layout.clone(),
        states,
        scalars: Scalars {
            step: s.step,
            opt_steps: s.opt_steps,
            skipped: s.skipped,
            scaler,
        },
        loaded: Loaded {
            tag,
            step: s.step,
            client_state: m.client_state,
        },
    })
}

/// Names, shapes, dtypes and trainable flags equal the current model's.
fn check_model<C: Communicator, M: Segmented>(
    e: &ZeroEngine<C, M>,
    m: &Manifest,
    file: &str,
) -> Result<()> {
    let now = &e.plan().model().params;
    let then = &m.layout.params;
    let mut diffs = Vec::new();
    if now.len() != then.len() {
        diffs.push(format!(
            "{} parameters saved, the model has {}",
            then.len(),
            now.len()
        ));
    }
    for (i, (a, b)) in then.iter().zip(now).enumerate() {
        if a.name != b.name {
            diffs.push(format!(
                "parameter {i} is {} in the checkpoint, {} in the model",
                a.name, b.name
            ));
        } else if a.shape != b.shape || a.dtype != b.dtype || a.trainable != b.trainable {
            diffs.push(format!(
                "{}: saved {:?} {:?} trainable={}, the model has {:?} {:?} trainable={}",
                a.name, a.shape, a.dtype, a.trainable, b.shape, b.dtype, b.trainable
            ));
        }
    }
    if diffs.is_empty() {
        Ok(())
    } else {
        Err(CheckpointError::ModelMismatch {
            file: file.into(),
            differences: diffs,
        }
        .into())
    }
}
