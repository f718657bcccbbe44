//! The GPU tests' proof that they ran: each one that passes appends `<name> ok` to the cookie,
//! and one that the machine's library cannot run `<name> skipped: <reason>`. `cargo xtask
//! gpu-check` removes the cookie first, runs the GPU tests with `ZERO_GPU_TESTS=1`, and reads it.

use std::io::Write;
use std::path::PathBuf;

/// The cookie's path, as `cargo xtask gpu-check` sets it.
pub const VAR: &str = "ZERO_GPU_COOKIE";
/// `1`: run the GPU tests (a missing library or device then fails them).
pub const GPU_TESTS: &str = "ZERO_GPU_TESTS";
/// The cookie's file name in the target directory, when [`VAR`] is not set.
pub const FILE: &str = ".gpu_tests_ran";

/// Whether the GPU tests are asked to run ([`GPU_TESTS`] is `1`).
pub fn gpu_tests() -> bool {
    std::env::var(GPU_TESTS).as_deref() == Ok("1")
}

/// `$ZERO_GPU_COOKIE`, else [`FILE`] in the target directory: `$CARGO_TARGET_DIR`, else three
/// levels above the test binary (`target/<profile>/deps/<binary>`).
pub fn path() -> PathBuf {
    if let Some(p) = std::env::var_os(VAR) {
        return PathBuf::from(p);
    }
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(dir).join(FILE);
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.ancestors()
        .nth(3)
        .unwrap_or_else(|| exe.parent().expect("a binary sits in a folder"))
        .join(FILE)
}

/// Appends `line` to the cookie.
pub fn write(line: &str) {
    let path = path();
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| writeln!(f, "{line}"))
        .unwrap_or_else(|e| panic!("cannot append to the GPU cookie {}: {e}", path.display()));
}

/// Records that GPU test `test` ran and passed.
pub fn passed(test: &str) {
    write(&format!("{test} ok"));
}
