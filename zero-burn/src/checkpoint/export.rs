//! Consolidated export of a checkpoint's parameters to one safetensors file, offline (no
//! communicator, no engine), streamed: each parameter's elements are the concatenation of its
//! pieces in the saved ranks' chunks, each piece verified by the checksum blocks it lies in.

use zero_core::CheckpointError;

use super::load::resolve;
use super::ranged::RankIndex;
use super::shard;
use super::storage::{Storage, join};
use crate::error::Result;
use crate::precision::Half;

/// The element type of an export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportDtype {
    /// The fp32 weights (the master in bf16/fp16 runs).
    F32,
    /// Rounded to bf16 (nearest-even): a bf16 run's working weights, bit for bit.
    Bf16,
    /// Rounded to fp16 (nearest-even): an fp16 run's working weights, bit for bit.
    F16,
}

/// What an export wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct ExportReport {
    /// The checkpoint's tag.
    pub tag: String,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of the output file.
    pub bytes: u64,
}

/// Writes the parameters of the checkpoint `tag` names in `store` (`None`: `LATEST`'s) as the
/// safetensors file `name` in `out` (crash-safe: temp name, fsync, rename, fsync), named by burn's
/// parameter paths, in the model's order, with the tag and step in `__metadata__`. A frozen
/// parameter that the saved plan kept outside every unit (stages 0–2) is not in the checkpoint:
/// an error names it before anything is written. Streamed: the header first, then one parameter
/// at a time, each piece read from its rank file with the checksum blocks around it and verified,
/// so the export holds one parameter, its pieces' blocks and the rank files' headers, never a
/// whole rank file.
pub fn export_safetensors(
    store: &dyn Storage,
    tag: Option<&str>,
    out: &dyn Storage,
    name: &str,
    dtype: ExportDtype,
) -> Result<ExportReport> {
    let (tag, m, mpath) = resolve(store, tag)?;
    let layout = &m.layout;
    let loc = layout.locations();
    let (code, half, width) = match dtype {
        ExportDtype::F32 => ("F32", None, 4u64),
        ExportDtype::Bf16 => ("BF16", Some(Half::Bf16), 2),
        ExportDtype::F16 => ("F16", Some(Half::F16), 2),
    };
    // The header, from the layout alone.
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    let mut places = Vec::with_capacity(layout.params.len());
    for (p, desc) in layout.params.iter().enumerate() {
        let Some(place) = loc[p] else {
            return Err(CheckpointError::NotSharded {
                param: p,
                name: desc.name.clone(),
            }
            .into());
        };
        places.push(place);
        let end = at + desc.numel() * width;
        header.insert(
            desc.name.clone(),
            serde_json::json!({ "dtype": code, "shape": desc.shape, "data_offsets": [at, end] }),
        );
        at = end;
    }
    header.insert(
        "__metadata__".into(),
        serde_json::json!({
            "producer": "zero-rs",
            "tag": tag,
            "step": m.scalars.step.to_string(),
        }),
    );
    let mut json = serde_json::to_vec(&header).unwrap_or_default();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut head = Vec::with_capacity(8 + json.len());
    head.extend_from_slice(&(json.len() as u64).to_le_bytes());
    head.extend_from_slice(&json);
    drop(json);
    // Every rank file's header, verified before the output is touched.
    let ranks = (0..m.files.len())
        .map(|k| RankIndex::open(store, &tag, &m, &mpath, k))
        .collect::<Result<Vec<_>>>()?;
    let tmp = join("", &format!("{name}.tmp"));
    out.write(&tmp, &head)?;
    let mut piece = Vec::new();
    for (desc, &(u, offset)) in layout.params.iter().zip(&places) {
        let c = layout.chunk_len(u);
        let (lo, hi) = (offset, offset + desc.numel());
        let mut bytes = Vec::with_capacity((desc.numel() * width) as usize);
        let first = (lo / c) as usize;
        let covering = ranks
            .iter()
            .enumerate()
            .take(hi.div_ceil(c) as usize)
            .skip(first);
        for (k, rank) in covering {
            let base = k as u64 * c;
            let (a, b) = (
                (lo.max(base) - base) as usize,
                (hi.min(base + c) - base) as usize,
            );
            piece.resize(b - a, 0.0);
            let real = layout.real_in_chunk(u, k);
            rank.read_into(store, &shard::name("w", u), real, a..b, &mut piece)?;
            for &x in &piece {
                match half {
                    None => bytes.extend_from_slice(&x.to_le_bytes()),
                    Some(h) => bytes.extend_from_slice(&h.round(x).to_le_bytes()),
                }
            }
        }
        if bytes.len() as u64 != desc.numel() * width {
            return Err(CheckpointError::Layout {
                file: mpath,
                what: format!(
                    "{} spans saved ranks up to {} but the manifest lists {} rank files",
                    desc.name,
                    hi.div_ceil(c) - 1,
                    ranks.len()
                ),
            }
            .into());
        }
        out.append(&tmp, &bytes)?;
    }
    out.sync_file(&tmp)?;
    out.rename(&tmp, name)?;
    out.sync_dir("")?;
    Ok(ExportReport {
        tag,
        tensors: layout.params.len(),
        bytes: head.len() as u64 + at,
    })
}
