//! gpu-check's step 6: the wgpu programs on the GPU's Vulkan driver (NVIDIA's ICD, a Vulkan
//! loader from the system or from the bundle's packages).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::bail;

use super::machine::{find_lib, library_dirs};
use super::{
    NVIDIA_ICDS, Step, Verdict, WGPU_FEATURES, WGPU_PREFIX, WGPU_PROGRAMS, build_programs,
    run_limited, unpack,
};

/// Whether a Vulkan loader is on the library path.
pub(super) fn vulkan_loader(extra: &Path) -> bool {
    let mut dirs = vec![extra.to_path_buf()];
    dirs.extend(library_dirs());
    find_lib(&dirs, &["libvulkan.so.1", "libvulkan.so"]).is_some()
}

/// Step 6: the wgpu programs on the GPU's Vulkan driver, with their figures in the detail.
pub(super) fn wgpu_step(
    root: &Path,
    work: &Path,
    prebuilt: Option<&Path>,
    programs: &[(usize, PathBuf)],
    ld_path: &str,
    limit: Duration,
) -> anyhow::Result<Step> {
    let t = Instant::now();
    // A requested step that cannot run fails the run.
    let skip = |detail: String| Step {
        name: "wgpu",
        verdict: Verdict::Fail,
        secs: None,
        detail: format!("did not run: {detail}"),
    };
    if programs.is_empty() {
        return Ok(skip(
            "no wgpu programs (bundle made before they were added?)".into(),
        ));
    }
    // The loader: the machine's, or the bundle's packages unpacked into <work>/vulkan.
    let unpacked = work.join("vulkan");
    let lib = unpacked.join("usr/lib/x86_64-linux-gnu");
    let mut note = String::new();
    if !vulkan_loader(&lib)
        && let Some(dir) = prebuilt
    {
        for deb in std::fs::read_dir(dir.join("debs"))
            .map(|r| r.flatten().map(|e| e.path()).collect::<Vec<_>>())
            .unwrap_or_default()
        {
            let _ = Command::new("dpkg-deb")
                .arg("-x")
                .arg(&deb)
                .arg(&unpacked)
                .status();
        }
        note = format!("Vulkan loader unpacked from {}/debs; ", dir.display());
    }
    if !vulkan_loader(&lib) {
        return Ok(skip(
            "no Vulkan loader (libvulkan.so.1), and no packages to unpack".into(),
        ));
    }
    let icd = std::env::var_os("VK_DRIVER_FILES")
        .or_else(|| std::env::var_os("VK_ICD_FILENAMES"))
        .map(PathBuf::from)
        .or_else(|| NVIDIA_ICDS.iter().map(PathBuf::from).find(|p| p.is_file()));
    let xdg = work.join("xdg-runtime");
    std::fs::create_dir_all(&xdg)?;
    let mut failed = Vec::new();
    let mut figures = Vec::new();
    for (i, exe) in programs {
        let p = &WGPU_PROGRAMS[*i];
        let mut c = Command::new(exe);
        c.current_dir(root)
            .args(p.args)
            .env("LD_LIBRARY_PATH", format!("{}:{ld_path}", lib.display()))
            .env("ZERO_REQUIRE_WGPU", "1")
            .env("XDG_RUNTIME_DIR", &xdg);
        if let Some(icd) = &icd {
            c.env("VK_DRIVER_FILES", icd);
        }
        let r = run_limited(p.name, c, limit, true)?;
        if !r.ok {
            failed.push(format!("{}: {}", p.name, r.status));
        }
        figures.extend(r.stdout.iter().filter_map(|l| {
            let l = l.trim();
            l.strip_prefix(WGPU_PREFIX)
                .map(str::to_string)
                .or_else(|| l.contains("s/step").then(|| l.to_string()))
        }));
    }
    let icd = icd.map_or("the loader's default ICDs".into(), |p| {
        p.display().to_string()
    });
    let (verdict, detail) = wgpu_verdict(&failed, &figures);
    Ok(Step {
        name: "wgpu",
        verdict,
        secs: Some(t.elapsed().as_secs_f64()),
        detail: match verdict {
            Verdict::Pass => format!(
                "{note}{} programs passed on {icd}; {detail}",
                programs.len()
            ),
            _ => format!("{note}{detail} (ICD: {icd})"),
        },
    })
}

/// The wgpu step's verdict from the programs that failed and the figures they printed (each
/// naming its adapter): PASS only when none failed and the figures show NVIDIA's adapter ran
/// them, not another driver the Vulkan loader found (lavapipe, say).
fn wgpu_verdict(failed: &[String], figures: &[String]) -> (Verdict, String) {
    if !failed.is_empty() {
        return (Verdict::Fail, format!("failed: {}", failed.join(", ")));
    }
    if !figures.iter().any(|f| f.contains("NVIDIA")) {
        return (
            Verdict::Fail,
            format!(
                "the programs passed, but not on an NVIDIA adapter: {}",
                figures.join("; ")
            ),
        );
    }
    (Verdict::Pass, figures.join("; "))
}

/// The wgpu programs: a bundle's, unzipped into `<work>/wgpu`, or built here.
pub(super) fn wgpu_programs(
    root: &Path,
    work: &Path,
    prebuilt: Option<&Path>,
    limit: Duration,
) -> anyhow::Result<Vec<(usize, PathBuf)>> {
    let Some(dir) = prebuilt else {
        let (b, found) = build_programs(
            root,
            work,
            limit,
            (WGPU_FEATURES, super::programs::EVERY_PACKAGE),
            WGPU_PROGRAMS,
        )?;
        if !b.ok {
            bail!("building the wgpu test programs failed: {}", b.status);
        }
        return Ok(found);
    };
    let mut found = Vec::new();
    for (i, p) in WGPU_PROGRAMS.iter().enumerate() {
        if let Some(exe) = unpack(dir, work, p.name)? {
            found.push((i, exe));
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wgpu_step_passes_only_on_nvidia_s_adapter() {
        let nvidia = ["stage=3 ... on NVIDIA H200 (570.86, Vulkan)".to_string()];
        let lavapipe =
            ["stage=3 ... on llvmpipe (LLVM 15.0.6, 256 bits) (Mesa, Vulkan)".to_string()];
        assert_eq!(wgpu_verdict(&[], &nvidia).0, Verdict::Pass);
        let (v, detail) = wgpu_verdict(&[], &lavapipe);
        assert_eq!(v, Verdict::Fail);
        assert!(detail.contains("llvmpipe"), "{detail}");
        assert_eq!(wgpu_verdict(&[], &[]).0, Verdict::Fail);
        let failed = ["zero-burn-wgpu-path: exit status: 101".to_string()];
        assert_eq!(wgpu_verdict(&failed, &nvidia).0, Verdict::Fail);
    }
}
