//! The manifest (`MANIFEST.json`), the rank-file header and the `LATEST` pointer.

use serde::{Deserialize, Serialize};

use super::layout::CkptLayout;
use crate::error::{CheckpointError, Result};

/// The manifest's `format` field.
pub const FORMAT: &str = "zero-rs-checkpoint";
/// The manifest and rank-file format version this crate reads and writes. Version 2 saves the
/// parameters in no unit (frozen, stages 0–2) in the rank files; version 1 kept only their
/// checksums and is refused.
pub const FORMAT_VERSION: u32 = 2;
/// The first 8 bytes of every rank file.
pub const SHARD_MAGIC: &[u8; 8] = b"ZRSHARD1";

/// The caller's own state (data position, epoch, ...), saved and returned as it was given.
pub type ClientState = serde_json::Value;

/// fp16's dynamic loss scaler (DeepSpeed's fields). `scale_bits` is authoritative (JSON floats
/// are not guaranteed to round-trip); `scale` is for people.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LossScalerState {
    /// `f64::to_bits` of the current scale.
    pub scale_bits: u64,
    /// The scale, for reading.
    #[serde(default)]
    pub scale: Option<String>,
    /// Overflows left before the next scale cut.
    pub hysteresis: u32,
    /// Steps seen.
    pub iter: i64,
    /// The step of the last overflow (−1: none).
    pub last_overflow: i64,
}

/// The engine's scalar state at a step boundary: everything besides the shards that a bit-exact
/// continuation needs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EngineScalars {
    /// Optimizer steps taken (skipped fp16 steps included).
    pub step: u64,
    /// Optimizer updates applied (Adam's bias-correction count; skipped steps excluded).
    pub opt_steps: u64,
    /// Steps skipped (fp16 overflow).
    pub skipped: u64,
    /// The optimizer and its hyper-parameters, as the engine describes them (compared on load).
    pub optimizer: serde_json::Value,
    /// Number of optimizer state buffers per element (Adam 2, momentum SGD 1, SGD 0).
    pub optimizer_states: usize,
    /// The reduction order, as the engine names it.
    pub reduction: String,
    /// fp16: the loss scaler.
    pub loss_scaler: Option<LossScalerState>,
}

/// One rank file: its exact size and the crc32c of each block of `block_size` bytes (the last
/// block may be shorter).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    /// File name inside the checkpoint directory.
    pub path: String,
    /// The rank that wrote it.
    pub rank: usize,
    /// Exact size in bytes.
    pub bytes: u64,
    /// Block size of the checksums.
    pub block_size: u64,
    /// crc32c of every block, in order.
    pub block_crc32c: Vec<u32>,
}

/// The commit record of one checkpoint, written by rank 0 after every rank file is durable.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`FORMAT_VERSION`] when written.
    pub format_version: u32,
    /// The directory name, e.g. `step-00000012`.
    pub tag: String,
    /// Unique per save: rank files of another save carry another id.
    pub save_id: String,
    /// [`super::fingerprint`] of the plan.
    pub plan_fingerprint: String,
    /// The layout the shards follow.
    pub layout: CkptLayout,
    /// The engine's scalars.
    pub scalars: EngineScalars,
    /// The caller's state.
    pub client_state: ClientState,
    /// One record per rank, in rank order.
    pub files: Vec<FileRecord>,
}

impl Manifest {
    /// The manifest as pretty JSON.
    pub fn to_json(&self) -> Vec<u8> {
        // Plain data with string keys: serialisation cannot fail.
        serde_json::to_vec_pretty(self).unwrap_or_default()
    }

    /// Parses and checks the format and version (first, so a manifest of another version is
    /// named as such whatever its other fields), the file list and the layout
    /// ([`CkptLayout::check`]); `file` names the source in errors.
    pub fn from_json(bytes: &[u8], file: &str) -> Result<Manifest> {
        #[derive(Deserialize)]
        struct Head {
            format: String,
            format_version: u32,
        }
        let parse = |e: serde_json::Error| CheckpointError::Parse {
            file: file.into(),
            message: e.to_string(),
        };
        let h: Head = serde_json::from_slice(bytes).map_err(parse)?;
        if h.format != FORMAT || h.format_version != FORMAT_VERSION {
            return Err(CheckpointError::Version {
                file: file.into(),
                found: format!("{} v{}", h.format, h.format_version),
                expected: format!("{FORMAT} v{FORMAT_VERSION}"),
            }
            .into());
        }
        let m: Manifest = serde_json::from_slice(bytes).map_err(parse)?;
        if m.files.len() != m.layout.world_size
            || m.files.iter().enumerate().any(|(r, f)| f.rank != r)
        {
            return Err(CheckpointError::Parse {
                file: file.into(),
                message: format!(
                    "{} file records for world size {}, expected one per rank in rank order",
                    m.files.len(),
                    m.layout.world_size
                ),
            }
            .into());
        }
        m.layout.check().map_err(|message| CheckpointError::Parse {
            file: file.into(),
            message: format!("the layout: {message}"),
        })?;
        Ok(m)
    }

    /// The tag of optimizer step `step`.
    pub fn tag_of(step: u64) -> String {
        format!("step-{step:08}")
    }

    /// The rank file name of `rank` in a world of `world`.
    pub fn rank_file(rank: usize, world: usize) -> String {
        format!("rank-{rank:05}-of-{world:05}.zrs")
    }
}

/// One tensor of a rank file: `len` f32 elements at byte `offset` of the data section.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorRecord {
    /// `<state>/u<unit>`: `w/u00003`, `m/u00003`, `v/u00003`.
    pub name: String,
    /// Byte offset from the start of the data section.
    pub offset: u64,
    /// Elements (f32).
    pub len: u64,
}

/// The header of a rank file. On disk: [`SHARD_MAGIC`], the header's JSON length (u64 LE), the
/// JSON, zero padding to a multiple of 8, then the data section.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardHeader {
    /// [`FORMAT_VERSION`].
    pub format_version: u32,
    /// The save this file belongs to.
    pub save_id: String,
    /// The plan fingerprint.
    pub plan_fingerprint: String,
    /// The rank that wrote it.
    pub rank: usize,
    /// The world size.
    pub world_size: usize,
    /// The tensors, in data order.
    pub tensors: Vec<TensorRecord>,
}

impl ShardHeader {
    /// The encoded header; the data section starts right after it.
    pub fn encode(&self) -> Vec<u8> {
        let json = serde_json::to_vec(self).unwrap_or_default();
        let mut out = Vec::with_capacity(16 + json.len() + 8);
        out.extend_from_slice(SHARD_MAGIC);
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&json);
        while out.len() % 8 != 0 {
            out.push(0);
        }
        out
    }

    /// Decodes the header at the start of `bytes`; returns it and the data section's offset.
    pub fn decode(bytes: &[u8], file: &str) -> Result<(ShardHeader, usize)> {
        let bad = |message: String| {
            CheckpointError::Parse {
                file: file.into(),
                message,
            }
            .into()
        };
        if bytes.len() < 16 || &bytes[..8] != SHARD_MAGIC {
            return Err(bad("not a zero-rs rank file (bad magic)".into()));
        }
        let len = u64::from_le_bytes(bytes[8..16].try_into().unwrap_or([0; 8]));
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| l.checked_add(16))
            .filter(|&e| e <= bytes.len())
            .ok_or_else(|| bad(format!("header length {len} exceeds the file")))?;
        let h: ShardHeader =
            serde_json::from_slice(&bytes[16..end]).map_err(|e| bad(e.to_string()))?;
        Ok((h, end.div_ceil(8) * 8))
    }
}

/// The content of `<root>/LATEST`: `"<tag> <crc32c of MANIFEST.json, 8 hex> <its length>\n"`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LatestPointer {
    /// The committed tag.
    pub tag: String,
    /// crc32c of the tag's `MANIFEST.json`.
    pub manifest_crc32c: u32,
    /// Its length in bytes.
    pub manifest_bytes: u64,
}

impl LatestPointer {
    /// The file content.
    pub fn encode(&self) -> String {
        format!(
            "{} {:08x} {}\n",
            self.tag, self.manifest_crc32c, self.manifest_bytes
        )
    }

    /// Parses `LATEST`; `file` names it in errors.
    pub fn parse(text: &[u8], file: &str) -> Result<LatestPointer> {
        let bad = || {
            CheckpointError::Parse {
                file: file.into(),
                message: "expected \"<tag> <crc32c hex> <bytes>\\n\"".into(),
            }
            .into()
        };
        let s = std::str::from_utf8(text).map_err(|_| bad())?;
        let s = s.strip_suffix('\n').ok_or_else(bad)?;
        let mut it = s.split(' ');
        let (Some(tag), Some(crc), Some(len), None) = (it.next(), it.next(), it.next(), it.next())
        else {
            return Err(bad());
        };
        let ok_tag = !tag.is_empty()
            && tag
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !ok_tag || crc.len() != 8 {
            return Err(bad());
        }
        Ok(LatestPointer {
            tag: tag.into(),
            manifest_crc32c: u32::from_str_radix(crc, 16).map_err(|_| bad())?,
            manifest_bytes: len.parse().map_err(|_| bad())?,
        })
    }
}
