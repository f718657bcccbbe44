//! `cargo xtask ptx`: compiles `zero-quant/src/cuda/kernels.cu` to the checked-in
//! `zero-quant/src/cuda/kernels.ptx` with NVRTC.
//!
//! Needs libnvrtc (any CUDA 12 or 13 NVRTC; no GPU): pip's `nvidia-cuda-nvrtc-cu12` works, e.g.
//! `pip download --no-deps nvidia-cuda-nvrtc-cu12`, unzip, and pass `--nvrtc-dir
//! <unzipped>/nvidia/cuda_nvrtc/lib`. The PTX's first line records the source's hash, which a
//! zero-quant test compares with the source, so a stale PTX fails CI.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Args;

#[derive(Args, Debug)]
pub(crate) struct PtxArgs {
    /// Directory holding libnvrtc.so (or libnvrtc.so.12); prepended to the loader's search path
    /// by re-running this command with `LD_LIBRARY_PATH` set.
    #[arg(long)]
    nvrtc_dir: Option<PathBuf>,
    /// Check that the checked-in PTX is what the source compiles to, instead of writing it.
    #[arg(long)]
    check: bool,
}

const ARCH: &str = "compute_80";

pub(crate) fn run(a: PtxArgs) -> anyhow::Result<()> {
    let root = crate::test::workspace_root();
    let dir = root.join("zero-quant/src/cuda");
    if let Some(d) = &a.nvrtc_dir
        && std::env::var_os("ZERO_PTX_REEXEC").is_none()
    {
        // dlopen reads LD_LIBRARY_PATH at process start: re-run with it set.
        let mut path = d.display().to_string();
        if let Ok(old) = std::env::var("LD_LIBRARY_PATH") {
            path = format!("{path}:{old}");
        }
        let status = std::process::Command::new(std::env::current_exe()?)
            .args(std::env::args_os().skip(1))
            .env("LD_LIBRARY_PATH", path)
            .env("ZERO_PTX_REEXEC", "1")
            .status()?;
        if !status.success() {
            bail!("ptx failed ({status})");
        }
        return Ok(());
    }
    let src = std::fs::read_to_string(dir.join("kernels.cu")).context("reading kernels.cu")?;
    let opts = cudarc::nvrtc::CompileOptions {
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(false),
        arch: Some(ARCH),
        name: Some("kernels.cu".into()),
        ..Default::default()
    };
    // cudarc's loader panics when libnvrtc is missing: turn that into an error.
    let ptx = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(&src, opts))
        .map_err(|_| {
            anyhow::anyhow!("libnvrtc not found: pass --nvrtc-dir (see `cargo xtask ptx --help`)")
        })?
        .map_err(|e| anyhow::anyhow!("NVRTC: {e:?}"))?;
    let body = ptx.to_src();
    let body = body.trim_end_matches('\0');
    let text = format!("{}\n{body}", zero_quant::cuda_ptx_header(&src, body));
    let out = dir.join("kernels.ptx");
    if a.check {
        let old = std::fs::read_to_string(&out).unwrap_or_default();
        if old != text {
            bail!("{} is stale: run `cargo xtask ptx`", out.display());
        }
        println!("{} is up to date", out.display());
    } else {
        std::fs::write(&out, text)?;
        println!("wrote {} ({ARCH})", out.display());
    }
    Ok(())
}
