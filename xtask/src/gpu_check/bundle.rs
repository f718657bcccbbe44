//! A gpu-check bundle for a GPU machine without cargo: the programs stripped and xz-compressed
//! (the burn-cuda program is 160 MB stripped, about 28 MB compressed), this xtask, and Debian's
//! Vulkan loader packages; unpacked there into `<work>/bin` (with `xz`, or Python's `lzma`
//! where `xz` is missing).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

use super::programs::Program;
use super::{VULKAN_DEBS, WGPU_PROGRAMS, launch};

/// Copies `exe` into `dir` as `name`, stripped of debug info (most of a test binary; a missing
/// `strip` keeps it) and, with `compress`, xz-compressed as `name.xz`. Returns the bytes written.
pub(super) fn pack(dir: &Path, name: &str, exe: &Path, compress: bool) -> anyhow::Result<u64> {
    let plain = dir.join(name);
    let packed = dir.join(format!("{name}.xz"));
    let _ = std::fs::remove_file(&plain);
    let _ = std::fs::remove_file(&packed);
    std::fs::copy(exe, &plain).with_context(|| format!("copying {}", exe.display()))?;
    let _ = Command::new("strip")
        .arg("--strip-debug")
        .arg(&plain)
        .status();
    if !compress {
        return Ok(std::fs::metadata(&plain)?.len());
    }
    let st = Command::new("xz")
        .args(["-9", "-T0", "-f"])
        .arg(&plain)
        .status()
        .context("running xz (Debian's xz-utils)")?;
    if !st.success() {
        bail!("xz {} failed: {st}", plain.display());
    }
    Ok(std::fs::metadata(&packed)?.len())
}

/// A bundle's program `name`: `dir/name`, or `dir/name.xz` decompressed into `<work>/bin`.
pub(super) fn unpack(dir: &Path, work: &Path, name: &str) -> anyhow::Result<Option<PathBuf>> {
    let plain = dir.join(name);
    if plain.is_file() {
        return Ok(Some(plain));
    }
    let packed = dir.join(format!("{name}.xz"));
    if !packed.is_file() {
        return Ok(None);
    }
    let out = work.join("bin");
    std::fs::create_dir_all(&out)?;
    let exe = out.join(name);
    let decompress = |mut c: Command| -> anyhow::Result<bool> {
        let file = std::fs::File::create(&exe)?;
        Ok(c.stdout(file)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success()))
    };
    let mut xz = Command::new("xz");
    xz.arg("-dc").arg(&packed);
    let mut py = Command::new("python3");
    py.args([
        "-c",
        "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)",
    ])
    .arg(&packed);
    if !decompress(xz)? && !decompress(py)? {
        bail!(
            "cannot decompress {}: neither `xz -dc` nor python3's lzma worked",
            packed.display()
        );
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(Some(exe))
}

/// What a lent GPU machine takes with it: the device tool's carry limit.
const CARRY_LIMIT: u64 = 64 << 20;

/// `--bundle DIR`: the GPU programs, the wgpu programs unless `--no-wgpu` left them out
/// (`wgpu` empty), the xtask-nccl launch program and this xtask, each stripped and compressed (a
/// lent machine takes at most [`CARRY_LIMIT`]), and, with the wgpu programs, Debian's Vulkan
/// loader packages in `DIR/debs` when `apt-get` can fetch them, for a GPU machine without cargo.
/// Prints its size (a warning above the limit) and the commands to run there.
pub(super) fn bundle(
    dir: &Path,
    programs: &[(&Program, PathBuf)],
    wgpu: &[(usize, PathBuf)],
    nccl_xtask: &Path,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut total = pack(dir, "xtask", &std::env::current_exe()?, true)?;
    total += pack(dir, launch::PROGRAM, nccl_xtask, true)?;
    for (p, exe) in programs {
        total += pack(dir, p.name, exe, true)?;
    }
    for (i, exe) in wgpu {
        total += pack(dir, WGPU_PROGRAMS[*i].name, exe, true)?;
    }
    let debs = dir.join("debs");
    let _ = std::fs::remove_dir_all(&debs);
    let vulkan = if wgpu.is_empty() {
        "not needed (--no-wgpu)".to_string()
    } else {
        std::fs::create_dir_all(&debs)?;
        let fetched = Command::new("apt-get")
            .arg("download")
            .args(VULKAN_DEBS)
            .current_dir(&debs)
            .status()
            .is_ok_and(|s| s.success());
        for deb in std::fs::read_dir(&debs)? {
            total += deb?.metadata()?.len();
        }
        if fetched {
            "in debs/".to_string()
        } else {
            "not fetched (apt-get download failed); the GPU machine needs libvulkan.so.1".into()
        }
    };
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let d = dir.display();
    let no_wgpu = if wgpu.is_empty() { " --no-wgpu" } else { "" };
    println!(
        "bundle: {} programs and xtask, {:.1} MiB in {d}; Vulkan loader packages: {vulkan}\n\
         run on the GPU machine, from the repository root (python3's lzma where xz is missing):\n  \
         xz -dk {d}/xtask.xz && {d}/xtask gpu-check --prebuilt {d}{no_wgpu}",
        programs.len() + wgpu.len(),
        mib(total),
    );
    if total > CARRY_LIMIT {
        eprintln!(
            "warning: the bundle is {:.1} MiB, over the {:.0} MiB a lent GPU machine takes{}",
            mib(total),
            mib(CARRY_LIMIT),
            if wgpu.is_empty() {
                ""
            } else {
                "; --no-wgpu leaves the wgpu programs out"
            }
        );
    }
    Ok(())
}
