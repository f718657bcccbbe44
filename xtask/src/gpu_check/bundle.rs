//! A gpu-check bundle for a GPU machine without cargo: the programs stripped and gzipped, this
//! xtask, and Debian's Vulkan loader packages; unpacked there into `<work>/bin`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use super::{PROGRAMS, VULKAN_DEBS, WGPU_PROGRAMS, launch};

/// Copies `exe` into `dir` as `name`, stripped of debug info (most of a test binary; a missing
/// `strip` keeps it) and, with `gz`, gzipped as `name.gz`. Returns the bytes written.
pub(super) fn pack(dir: &Path, name: &str, exe: &Path, gz: bool) -> anyhow::Result<u64> {
    let plain = dir.join(name);
    let zipped = dir.join(format!("{name}.gz"));
    let _ = std::fs::remove_file(&plain);
    let _ = std::fs::remove_file(&zipped);
    std::fs::copy(exe, &plain).with_context(|| format!("copying {}", exe.display()))?;
    let _ = Command::new("strip")
        .arg("--strip-debug")
        .arg(&plain)
        .status();
    if !gz {
        return Ok(std::fs::metadata(&plain)?.len());
    }
    let st = Command::new("gzip")
        .args(["-9", "-f"])
        .arg(&plain)
        .status()
        .context("running gzip")?;
    if !st.success() {
        bail!("gzip {} failed: {st}", plain.display());
    }
    Ok(std::fs::metadata(&zipped)?.len())
}

/// A bundle's program `name`: `dir/name`, or `dir/name.gz` unzipped into `<work>/bin`.
pub(super) fn unpack(dir: &Path, work: &Path, name: &str) -> anyhow::Result<Option<PathBuf>> {
    let plain = dir.join(name);
    if plain.is_file() {
        return Ok(Some(plain));
    }
    let gz = dir.join(format!("{name}.gz"));
    if !gz.is_file() {
        return Ok(None);
    }
    let out = work.join("bin");
    std::fs::create_dir_all(&out)?;
    let exe = out.join(name);
    let file = std::fs::File::create(&exe)?;
    let st = Command::new("gzip")
        .arg("-dc")
        .arg(&gz)
        .stdout(file)
        .status()
        .context("running gzip -dc")?;
    if !st.success() {
        bail!("gzip -dc {} failed: {st}", gz.display());
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(Some(exe))
}

/// `--bundle DIR`: the GPU programs and the wgpu programs (stripped, gzipped: a lent machine
/// takes a limited upload), this xtask, and Debian's Vulkan loader packages in `DIR/debs` when
/// `apt-get` can fetch them, for a GPU machine without cargo.
pub(super) fn bundle(
    dir: &Path,
    programs: &[(usize, PathBuf)],
    wgpu: &[(usize, PathBuf)],
    nccl_xtask: &Path,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut total = pack(dir, "xtask", &std::env::current_exe()?, false)?;
    total += pack(dir, launch::PROGRAM, nccl_xtask, true)?;
    for (i, exe) in programs {
        total += pack(dir, PROGRAMS[*i].name, exe, true)?;
    }
    for (i, exe) in wgpu {
        total += pack(dir, WGPU_PROGRAMS[*i].name, exe, true)?;
    }
    let debs = dir.join("debs");
    std::fs::create_dir_all(&debs)?;
    let fetched = Command::new("apt-get")
        .arg("download")
        .args(VULKAN_DEBS)
        .current_dir(&debs)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    println!(
        "bundle: {} programs and xtask, {:.1} MiB in {}; Vulkan loader packages: {}\nrun on the \
         GPU machine, from the repository root:\n  {}/xtask gpu-check --prebuilt {}",
        programs.len() + wgpu.len(),
        total as f64 / (1 << 20) as f64,
        dir.display(),
        if fetched {
            "in debs/"
        } else {
            "not fetched (apt-get download failed); the GPU machine needs libvulkan.so.1"
        },
        dir.display(),
        dir.display()
    );
    Ok(())
}
