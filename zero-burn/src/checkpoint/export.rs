//! Consolidated export of a checkpoint's parameters to one safetensors file, offline (no
//! communicator, no engine): every rank file is verified, and each parameter's elements are the
//! concatenation of its pieces in the saved ranks' chunks.

use std::collections::BTreeMap;

use zero_core::CheckpointError;

use super::load::{open_file, resolve};
use super::shard::{self, ShardFile};
use super::storage::{Storage, put};
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

/// Writes the parameters of the checkpoint `tag` names in `store` (`None`: `LATEST`'s) as the safetensors file
/// `name` in `out` (crash-safe: temp name, fsync, rename, fsync), named by burn's parameter
/// paths, in the model's order, with the tag and step in `__metadata__`. A frozen parameter that
/// the saved plan kept outside every unit (stages 0–2) is not in the checkpoint: an error names
/// it. The file and every rank file are held in memory (no streaming bound yet).
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
    let mut files: BTreeMap<usize, ShardFile> = BTreeMap::new();
    let mut header = serde_json::Map::new();
    let mut data: Vec<u8> = Vec::new();
    let (code, half, width) = match dtype {
        ExportDtype::F32 => ("F32", None, 4),
        ExportDtype::Bf16 => ("BF16", Some(Half::Bf16), 2),
        ExportDtype::F16 => ("F16", Some(Half::F16), 2),
    };
    let mut tensors: BTreeMap<(usize, usize), Vec<f32>> = BTreeMap::new();
    for (p, desc) in layout.params.iter().enumerate() {
        let Some((u, offset)) = loc[p] else {
            return Err(CheckpointError::NotSharded {
                param: p,
                name: desc.name.clone(),
            }
            .into());
        };
        let c = layout.chunk_len(u);
        let (lo, hi) = (offset, offset + desc.numel());
        let start = data.len();
        for k in (lo / c) as usize..hi.div_ceil(c) as usize {
            if let std::collections::btree_map::Entry::Vacant(slot) = files.entry(k) {
                slot.insert(open_file(store, &tag, &m, &mpath, k)?);
            }
            let t = match tensors.entry((k, u)) {
                std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::btree_map::Entry::Vacant(v) => {
                    let real = layout.real_in_chunk(u, k);
                    v.insert(files[&k].tensor(&shard::name("w", u), real)?)
                }
            };
            let base = k as u64 * c;
            let (a, b) = (lo.max(base) - base, hi.min(base + c) - base);
            for &x in &t[a as usize..b as usize] {
                match half {
                    None => data.extend_from_slice(&x.to_le_bytes()),
                    Some(h) => data.extend_from_slice(&h.round(x).to_le_bytes()),
                }
            }
        }
        debug_assert_eq!(data.len() - start, desc.numel() as usize * width);
        header.insert(
            desc.name.clone(),
            serde_json::json!({
                "dtype": code,
                "shape": desc.shape,
                "data_offsets": [start, data.len()],
            }),
        );
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
    let mut file = Vec::with_capacity(8 + json.len() + data.len());
    file.extend_from_slice(&(json.len() as u64).to_le_bytes());
    file.extend_from_slice(&json);
    file.extend_from_slice(&data);
    put(out, "", name, &file)?;
    Ok(ExportReport {
        tag,
        tensors: layout.params.len(),
        bytes: file.len() as u64,
    })
}
