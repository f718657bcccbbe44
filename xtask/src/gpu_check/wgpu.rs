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
    Ok(Step {
        name: "wgpu",
        verdict: if failed.is_empty() {
            Verdict::Pass
        } else {
            Verdict::Fail
        },
        secs: Some(t.elapsed().as_secs_f64()),
        detail: if failed.is_empty() {
            format!(
                "{note}{} programs passed on {icd}; {}",
                programs.len(),
                figures.join("; ")
            )
        } else {
            format!("{note}failed: {}", failed.join(", "))
        },
    })
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
