//! The collective save protocol (see the module docs of [`super`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use zero_comm::Communicator;
use zero_core::checkpoint::{
    CkptLayout, ClientState, FORMAT, FORMAT_VERSION, FileRecord, LatestPointer, Manifest, Saved,
    ShardHeader, TensorRecord, fingerprint,
};

use super::storage::{Storage, join, put};
use super::{
    COMMIT, SaveReport, all_gather_bytes, engine_scalars, failed, shard, status_bytes, statuses,
};
use crate::engine::ZeroEngine;
use crate::error::{Error, Result};
use crate::segmented::Segmented;

/// A save id unique enough to tell two saves apart (time, process, a counter).
fn nonce() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let c = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut h = t ^ (u64::from(std::process::id()) << 32) ^ c.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    // splitmix64 finaliser: spread the bits.
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

pub(crate) fn save<C: Communicator, M: Segmented>(
    e: &mut ZeroEngine<C, M>,
    store: &dyn Storage,
    client_state: ClientState,
) -> Result<SaveReport> {
    let t0 = Instant::now();
    let micro = e.core.ckpt_micro();
    if micro != 0 {
        return Err(Error::SaveBetweenMicroSteps { micro });
    }
    let plan = e.plan().clone();
    let rank = e.rank();
    let n = plan.world_size();
    let fp = fingerprint(&plan);
    let layout = CkptLayout::of(&plan);
    let scalars = engine_scalars(e);
    let tag = Manifest::tag_of(scalars.step);

    // 1. Agree on what is saved; rank 0's nonce becomes the save id.
    let mut digest = Vec::with_capacity(40);
    for x in [
        scalars.step,
        scalars.opt_steps,
        scalars.skipped,
        u64::from_str_radix(&fp, 16).unwrap_or(0),
        if rank == 0 { nonce() } else { 0 },
    ] {
        digest.extend_from_slice(&x.to_le_bytes());
    }
    let all = e.ckpt_world().all_gather_host(&digest)?;
    let word = |r: usize, k: usize| {
        let at = r * 40 + k * 8;
        u64::from_le_bytes(all[at..at + 8].try_into().unwrap_or([0; 8]))
    };
    for (k, what) in [
        (0, "the step"),
        (1, "the optimizer step count"),
        (2, "skipped steps"),
        (3, "the plan"),
    ] {
        let ranks: Vec<usize> = (1..n).filter(|&r| word(r, k) != word(0, k)).collect();
        if !ranks.is_empty() {
            return Err(Error::CheckpointDisagree { what, ranks });
        }
    }
    let save_id = format!("{:016x}", word(0, 4));
    let staging = format!(".staging-{tag}-{save_id}");

    // 2. Each rank writes its own file into the staging directory.
    let local = write_rank_file(e, store, &layout, &tag, &staging, &save_id, &fp);
    let bytes = local.as_ref().map_or(0, |r| r.bytes);
    let msg = status_bytes(
        local
            .as_ref()
            .map(|r| serde_json::to_vec(r).unwrap_or_default()),
    );
    let all = all_gather_bytes(e.ckpt_world(), &msg)?;
    let mut files: Vec<FileRecord> = Vec::with_capacity(n);
    for (r, st) in statuses(&all).into_iter().enumerate() {
        match st {
            Ok(body) => match serde_json::from_slice(body) {
                Ok(rec) => files.push(rec),
                Err(err) => return Err(failed("save", r, err.to_string(), local)),
            },
            Err(cause) => return Err(failed("save", r, cause, local)),
        }
    }
    local?;

    // 3. Rank 0 commits: the manifest, the directory rename, then LATEST; every rank learns the
    // outcome.
    let commit = if rank == 0 {
        let manifest = Manifest {
            format: FORMAT.into(),
            format_version: FORMAT_VERSION,
            tag: tag.clone(),
            save_id: save_id.clone(),
            plan_fingerprint: fp.clone(),
            layout,
            scalars,
            client_state,
            files,
        };
        commit(store, &staging, &tag, &manifest.to_json())
    } else {
        Ok(())
    };
    let msg = status_bytes(commit.as_ref().map(|()| Vec::new()));
    let all = all_gather_bytes(e.ckpt_world(), &msg)?;
    if let Err(cause) = &statuses(&all)[0] {
        return Err(failed("save", 0, cause.clone(), commit));
    }
    Ok(SaveReport {
        tag,
        bytes,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Writes this rank's file into the staging directory: for every unit its chunk's saved state
/// (see [`ZeroEngine::ckpt_unit_state`]), then the loose parameters `layout` gives this rank.
fn write_rank_file<C: Communicator, M: Segmented>(
    e: &ZeroEngine<C, M>,
    store: &dyn Storage,
    layout: &CkptLayout,
    tag: &str,
    staging: &str,
    save_id: &str,
    fp: &str,
) -> Result<FileRecord> {
    if store.exists(tag)? {
        return Err(Error::TagExists { tag: tag.into() });
    }
    let plan = e.plan();
    let (rank, n) = (e.rank(), plan.world_size());
    store.create_dir(staging)?;
    // The tensor table from the lengths alone, so the header goes first and the tensors stream
    // after it, one at a time, with the block checksums computed on the way.
    let units = plan.units().len();
    let lens: Vec<[usize; 3]> = (0..units).map(|u| e.core.ckpt_unit_lens(u)).collect();
    let loose: Vec<_> = layout.loose.iter().filter(|l| l.rank == rank).collect();
    let mut tensors = Vec::new();
    let mut offset = 0u64;
    let mut table = |name: String, len: u64| {
        tensors.push(TensorRecord { name, offset, len });
        offset += 4 * len;
    };
    for (u, l) in lens.iter().enumerate() {
        for (s, &len) in ["w", "m", "v"].into_iter().zip(l) {
            if len > 0 {
                table(shard::name(s, Saved::Unit(u)), len as u64);
            }
        }
    }
    for l in &loose {
        table(shard::name("w", Saved::Loose(l.param)), l.numel);
    }
    let head = ShardHeader {
        format_version: FORMAT_VERSION,
        save_id: save_id.into(),
        plan_fingerprint: fp.into(),
        rank,
        world_size: n,
        tensors,
    }
    .encode();
    let name = Manifest::rank_file(rank, n);
    // The crash-safe recipe of `put`, streamed: temp name, fsync, rename, fsync of the directory.
    let tmp = join(staging, &format!("{name}.tmp"));
    let mut sums = shard::BlockSums::new(shard::BLOCK);
    store.write(&tmp, &head)?;
    sums.feed(&head);
    let mut put_tensor = |what: &dyn Fn() -> String, t: Vec<f32>, len: u64| -> Result<()> {
        if t.len() as u64 != len {
            return Err(Error::Internal(format!(
                "{} has {} elements, its record {len}",
                what(),
                t.len()
            )));
        }
        let mut bytes = Vec::with_capacity(4 * t.len());
        for x in &t {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
        sums.feed(&bytes);
        store.append(&tmp, &bytes)
    };
    for (u, l) in lens.iter().enumerate() {
        for (s, &len) in l.iter().enumerate() {
            if len > 0 {
                let what = || format!("unit {u}'s saved state {s}");
                put_tensor(&what, e.core.ckpt_unit_state(u, s)?, len as u64)?;
            }
        }
    }
    for l in &loose {
        let what = || format!("loose parameter {}", l.param);
        put_tensor(&what, e.core.ckpt_loose(l.param)?, l.numel)?;
    }
    store.sync_file(&tmp)?;
    store.rename(&tmp, &join(staging, &name))?;
    store.sync_dir(staging)?;
    Ok(FileRecord {
        path: name,
        rank,
        bytes: sums.total,
        block_size: shard::BLOCK,
        block_crc32c: sums.finish(),
    })
}

/// Rank 0's commit: `MANIFEST.json` into the staging directory (durably), the rename of the
/// staging directory to the tag, the root's fsync, then `LATEST` by the same recipe.
fn commit(store: &dyn Storage, staging: &str, tag: &str, manifest: &[u8]) -> Result<()> {
    let record = LatestPointer {
        tag: tag.into(),
        manifest_crc32c: crc32c::crc32c(manifest),
        manifest_bytes: manifest.len() as u64,
    }
    .encode();
    put(store, staging, "MANIFEST.json", manifest)?;
    // The tag's own commit record, so that it can be loaded after LATEST moves on.
    put(store, staging, COMMIT, record.as_bytes())?;
    store.rename(staging, tag)?;
    store.sync_dir("")?;
    put(store, "", "LATEST", record.as_bytes())?;
    Ok(())
}
