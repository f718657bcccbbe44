//! Reading DeepSpeed's JSON values the way DeepSpeed does: numbers may be written as floats
//! (`1e7`), so an integer is any whole, non-negative number.

use serde_json::Value;

/// A number.
pub(super) fn num(v: &Value) -> Option<f64> {
    v.as_f64()
}

/// A whole, non-negative number that fits a `u64` (`1e7` included).
pub(super) fn int(v: &Value) -> Option<u64> {
    let x = v.as_f64()?;
    (x >= 0.0 && x.fract() == 0.0 && x < 1.9e19).then_some(x as u64)
}

/// A boolean.
pub(super) fn boolean(v: &Value) -> Option<bool> {
    v.as_bool()
}
