//! gpu-check's steps 1 and 2: the machine's GPUs (`nvidia-smi`) and the CUDA and NCCL
//! libraries cudarc will load (found through `ldconfig` and the usual directories).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// `index, name, driver_version, memory.total` lines from `nvidia-smi --query-gpu`.
pub(super) fn parse_nvidia_smi(csv: &str) -> Vec<String> {
    csv.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split(',').map(str::trim).collect();
            match f.as_slice() {
                [i, name, driver, mem] => format!("GPU {i}: {name}, driver {driver}, {mem}"),
                _ => l.to_string(),
            }
        })
        .collect()
}

/// Step 1: the GPUs, or why there are none.
pub(super) fn gpus() -> anyhow::Result<Vec<String>> {
    let smi = Command::new("nvidia-smi")
        .args([
            "--query-gpu=index,name,driver_version,memory.total",
            "--format=csv,noheader",
        ])
        .output();
    let dev_nodes = Path::new("/dev/nvidia0").exists() || Path::new("/dev/nvidiactl").exists();
    match smi {
        Err(e) => {
            if dev_nodes {
                Ok(vec![format!(
                    "nvidia-smi unavailable ({e}), but /dev/nvidia* exists"
                )])
            } else {
                bail!(
                    "no NVIDIA GPU on this machine: nvidia-smi cannot run ({e}) and there is no \
                     /dev/nvidia0 or /dev/nvidiactl; gpu-check needs a GPU machine"
                )
            }
        }
        Ok(o) if !o.status.success() => bail!(
            "nvidia-smi failed ({}): {}{}",
            o.status,
            String::from_utf8_lossy(&o.stdout).trim(),
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Ok(o) => {
            let gpus = parse_nvidia_smi(&String::from_utf8_lossy(&o.stdout));
            if gpus.is_empty() {
                bail!("nvidia-smi lists no GPU");
            }
            Ok(gpus)
        }
    }
}

/// `(name, path)` pairs from `ldconfig -p`.
pub(super) fn parse_ldconfig(out: &str) -> Vec<(String, PathBuf)> {
    out.lines()
        .filter_map(|l| {
            let (left, path) = l.split_once("=>")?;
            let name = left.split_whitespace().next()?;
            Some((name.to_string(), PathBuf::from(path.trim())))
        })
        .collect()
}

/// Directories where libcuda/libnccl may live, most specific first.
pub(super) fn library_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .collect();
    if let Ok(o) = Command::new("ldconfig").arg("-p").output() {
        for (_, p) in parse_ldconfig(&String::from_utf8_lossy(&o.stdout)) {
            if let Some(d) = p.parent() {
                dirs.push(d.to_path_buf());
            }
        }
    }
    // pip's nvidia-nccl-cu12 (a namespace package: use __path__).
    if let Ok(o) = Command::new("python3")
        .args([
            "-c",
            "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))",
        ])
        .output()
        && o.status.success()
    {
        dirs.push(PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    }
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/local/cuda/lib64",
        "/usr/local/nvidia/lib64",
        "/usr/local/lib",
        "/opt/conda/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    let mut seen = BTreeSet::new();
    dirs.retain(|d| seen.insert(d.clone()) && d.is_dir());
    dirs
}

pub(super) fn find_lib(dirs: &[PathBuf], names: &[&str]) -> Option<PathBuf> {
    for d in dirs {
        for n in names {
            let p = d.join(n);
            if p.exists() {
                return Some(p);
            }
        }
    }
    None
}

/// Step 2: the libraries, and the `LD_LIBRARY_PATH` the cargo steps get.
pub(super) fn libraries(target: &Path) -> anyhow::Result<(String, String)> {
    let dirs = library_dirs();
    let cuda = find_lib(&dirs, &["libcuda.so", "libcuda.so.1"]);
    let nccl = find_lib(&dirs, &["libnccl.so", "libnccl.so.2"]);
    let mut path: Vec<String> = Vec::new();
    let mut detail = Vec::new();
    match &cuda {
        Some(p) => detail.push(format!("libcuda: {}", p.display())),
        None => detail.push("libcuda: not found".into()),
    }
    match &nccl {
        Some(p) if p.file_name().is_some_and(|f| f == "libnccl.so") => {
            detail.push(format!("libnccl: {}", p.display()));
            if let Some(d) = p.parent() {
                path.push(d.display().to_string());
            }
        }
        Some(p) => {
            // Only the runtime name: give cudarc the name it looks for.
            let dir = target.join("gpu-check").join("lib");
            std::fs::create_dir_all(&dir)?;
            let link = dir.join("libnccl.so");
            let _ = std::fs::remove_file(&link);
            symlink(p, &link)
                .with_context(|| format!("cannot link {} to {}", link.display(), p.display()))?;
            detail.push(format!(
                "libnccl: {} (linked as {})",
                p.display(),
                link.display()
            ));
            path.push(dir.display().to_string());
            if let Some(d) = p.parent() {
                path.push(d.display().to_string());
            }
        }
        None => detail.push("libnccl: not found".into()),
    }
    if let Ok(old) = std::env::var("LD_LIBRARY_PATH")
        && !old.is_empty()
    {
        path.push(old);
    }
    let detail = detail.join("; ");
    if cuda.is_none() || nccl.is_none() {
        bail!(
            "{detail} (install the NVIDIA driver, and libnccl2 or pip's nvidia-nccl-cu12, or put \
             their directory on LD_LIBRARY_PATH)"
        );
    }
    Ok((path.join(":"), detail))
}

#[cfg(unix)]
pub(super) fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(target, link)
}

#[cfg(not(unix))]
pub(super) fn symlink(_target: &Path, _link: &Path) -> std::io::Result<()> {
    Err(std::io::Error::other(
        "gpu-check links libnccl.so on Unix only",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldconfig_and_nvidia_smi_parse() {
        let ld = "\t3 libs found in cache `/etc/ld.so.cache'\n\tlibnccl.so.2 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnccl.so.2\n";
        assert_eq!(
            parse_ldconfig(ld),
            vec![(
                "libnccl.so.2".to_string(),
                PathBuf::from("/usr/lib/x86_64-linux-gnu/libnccl.so.2")
            )]
        );
        assert_eq!(
            parse_nvidia_smi("0, NVIDIA H200, 570.86.15, 143771 MiB\n"),
            vec!["GPU 0: NVIDIA H200, driver 570.86.15, 143771 MiB".to_string()]
        );
    }
}
