//! What `cargo xtask test` needs on the machine, set up when it is missing.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// The LLVM burn's CUDA backend links: tracel-llvm-bundler's folder under
/// `$XDG_DATA_HOME/tracel` (default `~/.local/share`), named by its version in `Cargo.lock`, with
/// its "installed" marker. Without it the bundler downloads LLVM, which an offline machine cannot,
/// so it is installed here from PyPI's pinned wheels by `.ci/llvm-sdk.sh` (`ZERO_LLVM_DOWNLOAD=1`
/// leaves the download to the bundler, with internet).
pub(super) fn llvm_sdk(root: &Path) -> anyhow::Result<()> {
    if std::env::var("ZERO_LLVM_DOWNLOAD").as_deref() == Ok("1") {
        return Ok(());
    }
    let marker = llvm_marker(root)?;
    if marker.exists() {
        return Ok(());
    }
    let script = root.join(".ci/llvm-sdk.sh");
    eprintln!(
        "==> setup: burn's CUDA backend (feature zero-burn/cuda, built by the checks) needs LLVM 23 \
         and {} is missing: installing it with {} (pinned wheels from PyPI)",
        marker.display(),
        script.display()
    );
    let status = Command::new("bash")
        .arg(&script)
        .status()
        .with_context(|| format!("cannot start bash {}", script.display()))?;
    if !status.success() || !marker.exists() {
        bail!(
            "installing LLVM failed ({status}); run `bash .ci/llvm-sdk.sh` to see why (it needs \
             pip and PyPI), or set ZERO_LLVM_DOWNLOAD=1 to let the build download LLVM"
        );
    }
    Ok(())
}

/// NVIDIA's PTX assembler, for the test that assembles every PTX module the project ships:
/// `$ZERO_PTXAS` when set, else the one `.ci/ptxas.sh` installs from PyPI's pinned wheel (once;
/// later calls find it). Without PyPI, `allow_skips` lets the run go on without it (the test then
/// records that it did not run); otherwise that fails, naming the command.
pub(super) fn ptxas(root: &Path, allow_skips: bool) -> anyhow::Result<Option<PathBuf>> {
    if let Some(p) = std::env::var_os("ZERO_PTXAS").filter(|p| !p.is_empty()) {
        return Ok(Some(std::path::absolute(&p)?));
    }
    let script = root.join(".ci/ptxas.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("cannot start bash {}", script.display()))?;
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if out.status.success() && path.is_file() {
        return Ok(Some(path));
    }
    let why = format!(
        "installing ptxas failed ({}); run `bash .ci/ptxas.sh` to see why (it needs pip and \
         PyPI), or set ZERO_PTXAS to a ptxas",
        out.status
    );
    if allow_skips {
        eprintln!("==> setup: {why}; the PTX test will not run");
        return Ok(None);
    }
    bail!("{why}")
}

/// The marker file whose presence tells tracel-llvm-bundler that its LLVM is installed.
fn llvm_marker(root: &Path) -> anyhow::Result<PathBuf> {
    let lock = std::fs::read_to_string(root.join("Cargo.lock")).context("reading Cargo.lock")?;
    let version = bundler_version(&lock)
        .context("Cargo.lock has no tracel-llvm-bundler (burn's CUDA backend needs it)")?;
    let data = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
        .context("neither XDG_DATA_HOME nor HOME is set")?;
    Ok(data
        .join("tracel")
        .join(format!("tracel-llvm-{version}"))
        .join(".tracel-llvm-installed"))
}

/// tracel-llvm-bundler's version in a `Cargo.lock`.
fn bundler_version(lock: &str) -> Option<&str> {
    let mut lines = lock.lines();
    lines.find(|l| l.trim() == "name = \"tracel-llvm-bundler\"")?;
    lines
        .next()?
        .trim()
        .strip_prefix("version = \"")?
        .strip_suffix('"')
}

/// A system package the tests need, and how to tell that what it gives is there.
struct Need {
    /// What it gives, for messages.
    what: &'static str,
    /// The Debian package that provides it.
    package: &'static str,
    /// Whether the build needs it; otherwise only the tests that run it do, and with
    /// `--allow-device-skips` they record that they did not run.
    build: bool,
    present: fn() -> bool,
}

/// What the test features need beyond Rust: OpenMPI and libclang to build rsmpi, `mpirun` and a
/// Vulkan driver (Mesa's lavapipe without a GPU) to run the MPI and wgpu tests.
const NEEDS: [Need; 4] = [
    Need {
        what: "OpenMPI's mpicc and headers (the MPI build)",
        package: "libopenmpi-dev",
        build: true,
        present: mpicc_found,
    },
    Need {
        what: "libclang (the MPI bindings' bindgen)",
        package: "libclang-dev",
        build: true,
        present: libclang_found,
    },
    Need {
        what: "mpirun (the MPI tests)",
        package: "openmpi-bin",
        build: false,
        present: mpirun_found,
    },
    Need {
        what: "a Vulkan driver (the wgpu tests)",
        package: "mesa-vulkan-drivers",
        build: false,
        present: vulkan_driver_found,
    },
];

/// Checks [`NEEDS`]; installs what is missing with apt-get when this runs as root on a machine
/// that has it, and otherwise fails naming the one command to run (unless only run-time needs are
/// missing and `allow_device_skips`: then their tests record that they did not run).
pub(super) fn system_packages(allow_device_skips: bool) -> anyhow::Result<()> {
    let missing = || -> Vec<&Need> { NEEDS.iter().filter(|n| !(n.present)()).collect() };
    let first = missing();
    if first.is_empty() {
        return Ok(());
    }
    let list = describe(&first);
    let packages: Vec<&str> = first.iter().map(|n| n.package).collect();
    if is_root() && on_path("apt-get") {
        eprintln!("==> setup: missing {list}: installing with apt-get");
        apt_get(&["update", "-qq"])?;
        let mut install = vec!["install", "-y", "-qq", "--no-install-recommends"];
        install.extend(&packages);
        apt_get(&install)?;
        let left = missing();
        if !left.is_empty() {
            bail!(
                "apt-get installed {packages:?}, and still missing: {}",
                describe(&left)
            );
        }
        return Ok(());
    }
    let command = install_command(&packages);
    if allow_device_skips && first.iter().all(|n| !n.build) {
        eprintln!("==> setup: missing {list}: their tests will not run (to run them: `{command}`)");
        return Ok(());
    }
    bail!("missing {list}: run `{command}` (or install the same from your distribution)")
}

/// The one command that installs `packages` on Debian or Ubuntu.
fn install_command(packages: &[&str]) -> String {
    format!(
        "sudo apt-get install -y --no-install-recommends {}",
        packages.join(" ")
    )
}

fn describe(needs: &[&Need]) -> String {
    needs
        .iter()
        .map(|n| format!("{} ({})", n.what, n.package))
        .collect::<Vec<_>>()
        .join(", ")
}

fn apt_get(args: &[&str]) -> anyhow::Result<()> {
    let status = Command::new("apt-get")
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .context("cannot start apt-get")?;
    if !status.success() {
        bail!("apt-get {} failed ({status})", args.join(" "));
    }
    Ok(())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Whether an executable `name` is in one of `$PATH`'s folders.
fn on_path(name: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
}

fn mpicc_found() -> bool {
    on_path("mpicc")
}

fn mpirun_found() -> bool {
    on_path("mpirun")
}

/// Whether one of `dirs` holds a file whose name `matches`.
fn any_file(dirs: impl IntoIterator<Item = PathBuf>, matches: impl Fn(&str) -> bool) -> bool {
    dirs.into_iter().any(|d| {
        std::fs::read_dir(d).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| matches(&e.file_name().to_string_lossy()))
        })
    })
}

/// libclang as clang-sys looks for it: `$LIBCLANG_PATH`, the system's library folders and LLVM's
/// versioned ones (`libclang.so`, `libclang-18.so.1`; not `libclang-cpp`).
fn libclang_found() -> bool {
    let mut dirs: Vec<PathBuf> = std::env::var_os("LIBCLANG_PATH")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    for d in [
        "/usr/lib",
        "/usr/lib64",
        "/usr/local/lib",
        "/usr/lib/x86_64-linux-gnu",
    ] {
        dirs.push(PathBuf::from(d));
    }
    if let Ok(entries) = std::fs::read_dir("/usr/lib") {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("llvm-") {
                dirs.push(e.path().join("lib"));
            }
        }
    }
    any_file(dirs, is_libclang)
}

fn is_libclang(name: &str) -> bool {
    name.starts_with("libclang.so")
        || name
            .strip_prefix("libclang-")
            .is_some_and(|v| v.starts_with(|c: char| c.is_ascii_digit()) && v.contains(".so"))
}

/// A Vulkan driver manifest (an ICD file) where the Vulkan loader looks, or the loader's
/// variables naming one.
fn vulkan_driver_found() -> bool {
    if ["VK_ICD_FILENAMES", "VK_DRIVER_FILES"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
    {
        return true;
    }
    let dirs = [
        "/usr/share/vulkan/icd.d",
        "/etc/vulkan/icd.d",
        "/usr/local/share/vulkan/icd.d",
    ];
    any_file(dirs.map(PathBuf::from), |n| n.ends_with(".json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bundler_version_is_read_from_the_lock_file() {
        let lock = "[[package]]\nname = \"tracel-llvm\"\nversion = \"1\"\n\n[[package]]\n\
                    name = \"tracel-llvm-bundler\"\nversion = \"23.1.0-4\"\n";
        assert_eq!(bundler_version(lock), Some("23.1.0-4"));
        assert_eq!(bundler_version("name = \"other\"\nversion = \"1\"\n"), None);
        // This workspace's: what .ci/llvm-sdk.sh installs LLVM for.
        let ours =
            std::fs::read_to_string(super::super::workspace_root().join("Cargo.lock")).unwrap();
        let script =
            std::fs::read_to_string(super::super::workspace_root().join(".ci/llvm-sdk.sh"))
                .unwrap();
        let v = bundler_version(&ours).expect("burn-cuda's bundler is in Cargo.lock");
        assert!(
            script.contains(&format!("expected=\"{v}\"")),
            "Cargo.lock has tracel-llvm-bundler {v}; .ci/llvm-sdk.sh installs another"
        );
    }

    #[test]
    fn libclang_is_told_from_its_neighbours() {
        assert!(is_libclang("libclang.so"));
        assert!(is_libclang("libclang-18.so.1"));
        assert!(is_libclang("libclang.so.14"));
        assert!(!is_libclang("libclang-cpp.so.18"));
        assert!(!is_libclang("libclangBasic.a"));
    }

    #[test]
    fn what_is_missing_is_named_with_the_command_that_installs_it() {
        let e = install_command(&["openmpi-bin", "mesa-vulkan-drivers"]);
        assert_eq!(
            e,
            "sudo apt-get install -y --no-install-recommends openmpi-bin mesa-vulkan-drivers"
        );
        let d = describe(&[&NEEDS[1], &NEEDS[3]]);
        assert_eq!(
            d,
            "libclang (the MPI bindings' bindgen) (libclang-dev), a Vulkan driver (the wgpu \
             tests) (mesa-vulkan-drivers)"
        );
    }
}
