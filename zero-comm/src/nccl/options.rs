//! [`NcclOptions`]: timeouts, completion policy, peer checks. Shared by the real backend and the
//! stub, so callers configure it without `cfg`.

use std::time::Duration;

use crate::error::{Error, Result};

/// Timeout of every NCCL wait (init, split, each collective) when nothing else is configured.
/// Generous, because NCCL's first collective on a large job sets up its connections.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Overrides [`NcclOptions::timeout`], in seconds (fractions allowed).
pub const ENV_TIMEOUT: &str = "ZERO_NCCL_TIMEOUT_SECS";
/// Overrides [`NcclOptions::wait`]: `eager` or `lazy`.
pub const ENV_WAIT: &str = "ZERO_NCCL_WAIT";
/// Overrides [`NcclOptions::check_peers`]: `1` or `0`.
pub const ENV_CHECK_PEERS: &str = "ZERO_NCCL_CHECK_PEERS";
/// Overrides [`NcclOptions::nonblocking`]: `1` or `0`.
pub const ENV_NONBLOCKING: &str = "ZERO_NCCL_NONBLOCKING";
/// Overrides [`NcclOptions::device`]: a CUDA device ordinal.
pub const ENV_DEVICE: &str = "ZERO_NCCL_DEVICE";

/// When a collective returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitMode {
    /// Each collective (or group) returns once it completed on the device, polling its completion
    /// event and `ncclCommGetAsyncError` until [`NcclOptions::timeout`]. The host loopback's
    /// semantics; no overlap between communication and the caller's host code.
    Eager,
    /// Each collective returns once it is enqueued on the communicator's stream. Its completion is
    /// checked (with the same timeout, counted from when it was issued) at every later call, and
    /// waited for by `download`, `upload`, `barrier`, `synchronize` and drop.
    Lazy,
}

/// Options of an [`NcclComm`](super::NcclComm).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclOptions {
    /// Longest wait for any NCCL step: communicator init, split, and each collective (from when it
    /// is issued). On expiry the communicator is aborted (`ncclCommAbort`) and the call fails with
    /// [`Error::Timeout`]; later calls fail with [`Error::Aborted`].
    pub timeout: Duration,
    /// When collectives return.
    pub wait: WaitMode,
    /// Before each collective outside a group, exchange a 64-byte call descriptor with every peer
    /// (one small all-gather plus a host sync), so that mismatched calls fail on every rank with the
    /// host loopback's [`Error::LengthMismatch`]/[`Error::PeerMismatch`] instead of hanging until
    /// the timeout. Without it only this rank's own lengths are checked. Not done inside groups.
    pub check_peers: bool,
    /// Create communicators in NCCL's non-blocking mode (`ncclConfig_t.blocking = 0`), so that
    /// init, split and connection setup can time out and be aborted. Falls back to blocking mode
    /// when the library lacks `ncclCommInitRankConfig` (NCCL < 2.14).
    pub nonblocking: bool,
    /// The CUDA device ordinal; `None` uses the launch's `LOCAL_RANK` (one rank per GPU).
    pub device: Option<usize>,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            timeout: DEFAULT_TIMEOUT,
            wait: WaitMode::Eager,
            check_peers: true,
            nonblocking: true,
            device: None,
        }
    }
}

fn opt_err(name: &str, value: &str, expected: &str) -> Error {
    Error::Backend(format!(
        "nccl options: environment variable {name}={value:?} is not {expected}"
    ))
}

fn parse_bool(name: &str, v: &str) -> Result<bool> {
    match v.trim() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(opt_err(name, v, "1 or 0")),
    }
}

impl NcclOptions {
    /// The defaults, overridden by `ZERO_NCCL_TIMEOUT_SECS`, `ZERO_NCCL_WAIT`,
    /// `ZERO_NCCL_CHECK_PEERS`, `ZERO_NCCL_NONBLOCKING` and `ZERO_NCCL_DEVICE` where set.
    pub fn from_env() -> Result<NcclOptions> {
        NcclOptions::default().with_lookup(|k| std::env::var(k).ok())
    }

    /// `self`, overridden by the variables that `get` maps to a non-empty value. Errors name the
    /// variable.
    pub fn with_lookup(mut self, get: impl Fn(&str) -> Option<String>) -> Result<NcclOptions> {
        let var = |name: &str| get(name).filter(|v| !v.trim().is_empty());
        if let Some(v) = var(ENV_TIMEOUT) {
            let secs: f64 = v
                .trim()
                .parse()
                .map_err(|_| opt_err(ENV_TIMEOUT, &v, "a number of seconds"))?;
            self.timeout = Duration::try_from_secs_f64(secs)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| opt_err(ENV_TIMEOUT, &v, "a positive number of seconds"))?;
        }
        if let Some(v) = var(ENV_WAIT) {
            self.wait = match v.trim() {
                "eager" => WaitMode::Eager,
                "lazy" => WaitMode::Lazy,
                _ => return Err(opt_err(ENV_WAIT, &v, "eager or lazy")),
            };
        }
        if let Some(v) = var(ENV_CHECK_PEERS) {
            self.check_peers = parse_bool(ENV_CHECK_PEERS, &v)?;
        }
        if let Some(v) = var(ENV_NONBLOCKING) {
            self.nonblocking = parse_bool(ENV_NONBLOCKING, &v)?;
        }
        if let Some(v) = var(ENV_DEVICE) {
            self.device = Some(
                v.trim()
                    .parse()
                    .map_err(|_| opt_err(ENV_DEVICE, &v, "a device ordinal"))?,
            );
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_overrides_and_errors_name_the_variable() {
        let o = NcclOptions::default()
            .with_lookup(|k| match k {
                ENV_TIMEOUT => Some("2.5".into()),
                ENV_WAIT => Some("lazy".into()),
                ENV_CHECK_PEERS => Some("0".into()),
                ENV_DEVICE => Some("3".into()),
                _ => None,
            })
            .unwrap();
        assert_eq!(o.timeout, Duration::from_millis(2500));
        assert_eq!(o.wait, WaitMode::Lazy);
        assert!(!o.check_peers && o.nonblocking);
        assert_eq!(o.device, Some(3));
        for (k, v) in [
            (ENV_TIMEOUT, "-1"),
            (ENV_TIMEOUT, "soon"),
            (ENV_WAIT, "maybe"),
            (ENV_CHECK_PEERS, "2"),
            (ENV_DEVICE, "gpu0"),
        ] {
            let e = NcclOptions::default()
                .with_lookup(|q| (q == k).then(|| v.to_string()))
                .unwrap_err()
                .to_string();
            assert!(e.contains(k), "{e}");
        }
    }
}
