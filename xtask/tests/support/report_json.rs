//! Reading a run's `report.json` in xtask's tests (its unit tests include this file too).

use std::path::Path;

/// `dir/report.json`, parsed.
pub(crate) fn read(dir: &Path) -> serde_json::Value {
    let path = dir.join("report.json");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The report's losses, as the bits of their `f32`s.
pub(crate) fn loss_bits(v: &serde_json::Value) -> Vec<u32> {
    v["loss"]
        .as_array()
        .expect("report.json has its losses")
        .iter()
        .map(|x| (x.as_f64().expect("a loss is a number") as f32).to_bits())
        .collect()
}
