//! Device gates and the not-run record.
//!
//! A test that needs a device calls [`Device::missing`] when there is none: with the device's
//! `ZERO_REQUIRE_*=1` it panics; otherwise it appends one line `<package>/<crate>::<test>\t<why>`
//! to `$ZERO_SKIP_LOG` (and says so on stderr) and the test returns. `cargo xtask test` counts
//! those lines, and fails the run unless `--allow-device-skips`. `ZERO_SIMULATE_NO_*=1` makes a
//! gate behave as on a machine without its device, to check that accounting.

use std::io::Write;

/// The file a test that did not run appends its line to.
pub const SKIP_LOG: &str = "ZERO_SKIP_LOG";

/// A device some tests need, which a machine may lack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// A wgpu adapter (a Vulkan driver: Mesa's lavapipe without a GPU).
    Wgpu,
    /// OpenMPI's `mpirun`.
    Mpi,
}

impl Device {
    /// What is missing, for messages.
    pub const fn what(self) -> &'static str {
        match self {
            Self::Wgpu => "wgpu adapter",
            Self::Mpi => "mpirun",
        }
    }

    /// The variable whose `1` makes the device's absence fail its tests.
    pub const fn require_var(self) -> &'static str {
        match self {
            Self::Wgpu => "ZERO_REQUIRE_WGPU",
            Self::Mpi => "ZERO_REQUIRE_MPI",
        }
    }

    /// The variable whose `1` makes the gate behave as on a machine without the device.
    pub const fn simulate_var(self) -> &'static str {
        match self {
            Self::Wgpu => "ZERO_SIMULATE_NO_ADAPTER",
            Self::Mpi => "ZERO_SIMULATE_NO_MPI",
        }
    }

    /// What gives the device on Debian or Ubuntu.
    const fn hint(self) -> &'static str {
        match self {
            Self::Wgpu => "install mesa-vulkan-drivers for lavapipe",
            Self::Mpi => "install openmpi-bin",
        }
    }

    /// Why the device counts as missing when its absence is simulated, else `None`.
    pub fn simulated(self) -> Option<String> {
        let var = self.simulate_var();
        is_one(var).then(|| format!("simulated by {var}=1"))
    }

    /// Whether its absence must fail the tests.
    pub fn required(self) -> bool {
        is_one(self.require_var())
    }

    /// The device is missing (`why`) for `test` of `binary` (`package/crate`): panics when it is
    /// [`required`](Self::required), else records that the test did not run.
    #[track_caller]
    pub fn missing(self, binary: &str, test: &str, why: &str) {
        let (what, var) = (self.what(), self.require_var());
        if self.required() {
            panic!(
                "{var}=1 but there is no {what}: {why}; {}, or run `cargo xtask test \
                 --allow-device-skips`",
                self.hint()
            );
        }
        record_skip_as(
            binary,
            test,
            &format!(
                "no {what} ({why}); {}, or set {var}=1 to fail instead",
                self.hint()
            ),
        );
    }
}

fn is_one(var: &str) -> bool {
    std::env::var(var).as_deref() == Ok("1")
}

/// Records that `test` of `binary` (`package/crate`, see [`crate::binary!`]) did not run and why:
/// a line on stderr, and one appended to `$ZERO_SKIP_LOG` when it is set. An empty `test` names
/// the test thread's (which is the test's unless `--test-threads=1`).
#[track_caller]
pub fn record_skip_as(binary: &str, test: &str, reason: &str) {
    let thread = std::thread::current();
    let test = match thread.name() {
        Some(n) if test.is_empty() => n,
        _ => test,
    };
    let line = skip_line(binary, test, reason);
    eprintln!(
        "did not run {} (at {}): {reason}",
        line.split('\t').next().unwrap_or_default(),
        std::panic::Location::caller()
    );
    if let Some(path) = std::env::var_os(SKIP_LOG) {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(line.as_bytes()))
            .unwrap_or_else(|e| panic!("cannot append to {SKIP_LOG}={path:?}: {e}"));
    }
}

/// The record's line: `<binary>::<test>\t<reason>\n`, the reason on one line.
fn skip_line(binary: &str, test: &str, reason: &str) -> String {
    format!("{binary}::{test}\t{}\n", reason.replace(['\t', '\n'], " "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_is_one_line_with_its_reason_on_it() {
        assert_eq!(
            skip_line(
                "zero-comm/wgpu",
                "collectives::all_reduce",
                "no\tadapter\n(x)"
            ),
            "zero-comm/wgpu::collectives::all_reduce\tno adapter (x)\n"
        );
        assert_eq!(crate::binary!(), "zero-testkit/zero_testkit");
    }

    #[test]
    fn each_device_has_its_own_variables() {
        assert_eq!(Device::Wgpu.require_var(), "ZERO_REQUIRE_WGPU");
        assert_eq!(Device::Mpi.simulate_var(), "ZERO_SIMULATE_NO_MPI");
        assert_ne!(Device::Wgpu.simulate_var(), Device::Mpi.simulate_var());
    }
}
