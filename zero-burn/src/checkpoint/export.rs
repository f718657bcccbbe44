//! Consolidated export of a checkpoint's parameters to one safetensors file, offline (no
//! communicator, no engine), streamed: each parameter's elements are the concatenation of its
//! pieces in the saved ranks' chunks, each piece verified by the checksum blocks it lies in.

use zero_core::checkpoint::{Locator, Piece};

use super::ranged::RankIndex;
use super::resolve::{in_manifest, resolve};
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
/// parameter paths, in the model's order, with the tag and step in `__metadata__` (a frozen
/// parameter kept outside every unit at stages 0–2 from the one rank file that holds it whole).
/// A parameter the manifest's layout saves nowhere is an error that names it before anything is
/// written. Streamed: the header first, then one parameter
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
    let at_saved = Locator::new(layout);
    let (code, half, width) = match dtype {
        ExportDtype::F32 => ("F32", None, 4u64),
        ExportDtype::Bf16 => ("BF16", Some(Half::Bf16), 2),
        ExportDtype::F16 => ("F16", Some(Half::F16), 2),
    };
    // The header, from the layout alone.
    let mut header = serde_json::Map::new();
    let mut at = 0u64;
    let mut pieces: Vec<Vec<Piece>> = Vec::with_capacity(layout.params.len());
    for (p, desc) in layout.params.iter().enumerate() {
        let mut mine = Vec::new();
        at_saved
            .pieces(p, 0..desc.numel(), |x| mine.push(x))
            .map_err(|e| in_manifest(e, &mpath))?;
        pieces.push(mine);
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
    for (desc, mine) in layout.params.iter().zip(&pieces) {
        let mut bytes = Vec::with_capacity((desc.numel() * width) as usize);
        for x in mine {
            piece.resize(x.len as usize, 0.0);
            let real = layout.saved_len(x.src, x.src_rank);
            let range = x.src_off as usize..(x.src_off + x.len) as usize;
            // Every piece lies in a rank of the world: `Manifest::from_json` checked the layout.
            ranks[x.src_rank].read_into(
                store,
                &shard::name("w", x.src),
                real,
                range,
                &mut piece,
            )?;
            for &v in &piece {
                match half {
                    None => bytes.extend_from_slice(&v.to_le_bytes()),
                    Some(h) => bytes.extend_from_slice(&h.round(v).to_le_bytes()),
                }
            }
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
