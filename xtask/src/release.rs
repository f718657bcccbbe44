//! The commands that run the engine (`train`, `launch -- train`, `bench`, `ckpt`, `simulate
//! --validate-host`) run a release build that has it. The `cargo xtask` alias builds this binary
//! in the dev profile without the `engine` feature (no burn: quick to build for `cargo xtask
//! test`), so those commands run themselves again from a release build (`cargo run --release`,
//! default features: the engine), which is also 2–3x faster per step: burn compiles once, in
//! release. The release build never enables the `wgpu` feature: burn-wgpu takes over 20 minutes
//! to build in release, so a wgpu build (which has the engine) runs where it is.

use std::process::Command;

use anyhow::{Context, bail};

/// Set on the release child, and by a user who wants the dev build to train.
const STAY: &str = "ZERO_XTASK_NO_RELEASE";

/// Whether this (debug, host-only) build should hand the command to a release build.
pub(crate) fn wanted() -> bool {
    cfg!(debug_assertions) && !cfg!(feature = "wgpu") && std::env::var_os(STAY).is_none()
}

/// xtask's features a command can need, and whether this binary has each.
const FEATURES: [(&str, bool); 3] = [
    ("mpi", cfg!(feature = "mpi")),
    ("nccl", cfg!(feature = "nccl")),
    ("cuda", cfg!(feature = "cuda")),
];

/// Whether this binary was built with the engine and every one of xtask's `features` (`mpi`,
/// `nccl`, `cuda`).
pub(crate) fn compiled(features: &[&str]) -> bool {
    cfg!(feature = "engine")
        && features
            .iter()
            .all(|f| FEATURES.iter().any(|(name, on)| name == f && *on))
}

/// Whether a command that runs the engine with xtask's `features` hands itself to a release
/// build: this build lacks one of them, or is a debug build that should ([`wanted`]).
pub(crate) fn needed(features: &[&str]) -> bool {
    wanted() || !compiled(features)
}

/// Runs this command line again from a release build with xtask's `features` (none: the default
/// build, which has the engine) and exits with its status. Refused where [`STAY`] is set: the
/// user asked for this build, and a release child never reruns itself.
pub(crate) fn rerun(features: &[&str]) -> anyhow::Result<()> {
    if std::env::var_os(STAY).is_some() {
        return Err(missing(features));
    }
    eprintln!(
        "running an optimised (release) xtask for this job; the first build takes a few minutes \
         (set {STAY}=1 to run the dev build instead)"
    );
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(crate::test::workspace_root())
        .args([
            "run",
            "--release",
            "--quiet",
            "--package",
            "xtask",
            "--bin",
            "xtask",
        ])
        .args(
            (!features.is_empty())
                .then(|| ["--features".to_string(), features.join(",")])
                .into_iter()
                .flatten(),
        )
        .arg("--")
        .args(std::env::args_os().skip(1))
        .env(STAY, "1")
        .status()
        .context("cannot start the release build of xtask")?;
    match status.code() {
        Some(0) => Ok(()),
        // The child printed its own error; exit as it did.
        Some(code) => std::process::exit(code),
        None => bail!("the release xtask was killed ({status})"),
    }
}

/// The error of a command this build cannot run: it lacks the engine or one of `features`.
pub(crate) fn missing(features: &[&str]) -> anyhow::Error {
    let mut all = vec!["engine"];
    all.extend(features);
    anyhow::anyhow!(
        "this xtask was built without the features this command needs ({}); run `cargo run -p \
         xtask --release --features {} -- ...`, or `cargo xtask ...` with {STAY} unset",
        all.join(", "),
        all.join(",")
    )
}
