//! The checkpoint tools (feature `engine`): they read checkpoints with `zero_burn::checkpoint`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use zero_burn::checkpoint::{DirStorage, ExportDtype, export_safetensors, read_manifest, verify};

use super::{CkptArgs, CkptCommand, Dtype};

fn open(dir: &std::path::Path) -> anyhow::Result<DirStorage> {
    anyhow::ensure!(dir.is_dir(), "{} is not a directory", dir.display());
    Ok(DirStorage::new(dir)?)
}

/// A checkpoint named on the command line: a root (the checkpoint its `LATEST` names), or one
/// tag's directory inside a root (holding `MANIFEST.json`; that tag). `(root store, tag)`.
pub(crate) fn locate(dir: &Path) -> anyhow::Result<(DirStorage, Option<String>)> {
    anyhow::ensure!(dir.is_dir(), "{} is not a directory", dir.display());
    if dir.join("MANIFEST.json").is_file() {
        let tag = dir
            .file_name()
            .and_then(|n| n.to_str())
            .with_context(|| format!("{}: a tag directory needs a UTF-8 name", dir.display()))?;
        let root = dir
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(".".as_ref());
        return Ok((DirStorage::new(root)?, Some(tag.to_owned())));
    }
    Ok((DirStorage::new(dir)?, None))
}

pub(crate) fn run(args: CkptArgs) -> anyhow::Result<()> {
    match args.command {
        CkptCommand::Inspect { dir, json } => {
            let (store, tag) = locate(&dir)?;
            let (tag, m) = read_manifest(&store, tag.as_deref())?;
            if json {
                println!("{}", String::from_utf8_lossy(&m.to_json()));
                return Ok(());
            }
            let l = &m.layout;
            println!("{}: {tag}", dir.display());
            println!(
                "  step {} (optimizer updates {}, skipped {}), save id {}",
                m.scalars.step, m.scalars.opt_steps, m.scalars.skipped, m.save_id
            );
            println!(
                "  plan {}: world size {}, {} ranks per node, stage {}, {:?}, hpZ {}, {} parameters in {} units",
                m.plan_fingerprint,
                l.world_size,
                l.ranks_per_node,
                l.stage,
                l.precision,
                l.hpz_partition_size,
                l.params.len(),
                l.units.len()
            );
            println!(
                "  optimizer {}, reduction {}",
                m.scalars.optimizer, m.scalars.reduction
            );
            if !l.loose.is_empty() {
                let elems: u64 = l.loose.iter().map(|x| x.numel).sum();
                println!(
                    "  {} parameters in no unit (frozen), {elems} elements, each saved whole by one rank",
                    l.loose.len()
                );
            }
            for f in &m.files {
                let loose = l.loose.iter().filter(|x| x.rank == f.rank).count();
                let extra = if loose > 0 {
                    format!(", {loose} whole frozen parameter(s)")
                } else {
                    String::new()
                };
                println!(
                    "  {} {} bytes, {} blocks{extra}",
                    f.path,
                    f.bytes,
                    f.block_crc32c.len()
                );
            }
            Ok(())
        }
        CkptCommand::Verify { dir } => verify_all(&dir),
        CkptCommand::Gc { dir, keep, dry_run } => gc(&dir, keep, dry_run),
        CkptCommand::Export { dir, out, dtype } => {
            let parent = out
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(".".as_ref());
            let name = out
                .file_name()
                .and_then(|n| n.to_str())
                .context("--out needs a file name")?;
            let dtype = match dtype {
                Dtype::F32 => ExportDtype::F32,
                Dtype::Bf16 => ExportDtype::Bf16,
                Dtype::F16 => ExportDtype::F16,
            };
            let (store, tag) = locate(&dir)?;
            // Written as `NAME.tmp`, then renamed over `NAME`: that must be a regular file (a
            // device or a FIFO would be replaced), and no `NAME.tmp` may be there already.
            if let Ok(meta) = std::fs::metadata(&out) {
                anyhow::ensure!(
                    meta.is_file(),
                    "--out {} exists and is not a regular file (a directory, device or FIFO); \
                     expected a file name",
                    out.display()
                );
            }
            let tmp = parent.join(format!("{name}.tmp"));
            anyhow::ensure!(
                std::fs::symlink_metadata(&tmp).is_err(),
                "{} is in the way (the export writes there first): remove it or choose another \
                 --out",
                tmp.display()
            );
            // The export never writes into a checkpoint (it could replace LATEST, a manifest or
            // a rank file, or put files into a committed tag).
            if let Some(c) = enclosing_checkpoint(parent) {
                anyhow::bail!(
                    "--out {} lies inside the checkpoint {}: write the export elsewhere",
                    out.display(),
                    c.display()
                );
            }
            let out_store = DirStorage::new(parent)?;
            // A failed export leaves no `NAME.tmp` behind (none was there before: checked above).
            let r = export_safetensors(&store, tag.as_deref(), &out_store, name, dtype)
                .inspect_err(|_| {
                    let _ = std::fs::remove_file(&tmp);
                })?;
            println!(
                "{}: {} tensors of {} into {} ({} bytes)",
                dir.display(),
                r.tensors,
                r.tag,
                out.display(),
                r.bytes
            );
            Ok(())
        }
    }
}

/// `path` made absolute with its symlinks resolved, as far as it exists (the rest appended as
/// given), so that a path that is yet to be created can be compared too.
fn resolved(path: &Path) -> PathBuf {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut base = abs.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(real) = base.canonicalize() {
            return rest.iter().rev().fold(real, |p, c| p.join(c));
        }
        match (base.parent(), base.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                base = parent;
            }
            _ => return abs,
        }
    }
}

/// The checkpoint root (a `LATEST` naming a valid manifest) or committed tag (`MANIFEST.json`
/// and `COMMIT`) that `path` is, or lies inside, if any: a place a command must not write into
/// unless it means to.
pub(crate) fn enclosing_checkpoint(path: &Path) -> Option<PathBuf> {
    let is_root = |a: &Path| {
        a.join("LATEST").is_file()
            && DirStorage::new(a).is_ok_and(|s| read_manifest(&s, None).is_ok())
    };
    let is_tag = |a: &Path| {
        a.join("MANIFEST.json").is_file() && a.join(zero_burn::checkpoint::COMMIT).is_file()
    };
    resolved(path)
        .ancestors()
        .find(|a| is_tag(a) || is_root(a))
        .map(Path::to_path_buf)
}

/// Whether `a` and `b` name the same place (after [`resolved`]).
pub(crate) fn same_place(a: &Path, b: &Path) -> bool {
    resolved(a) == resolved(b)
}

/// `ckpt gc`: see [`CkptCommand::Gc`].
/// `ckpt verify`: one tag's directory, or every committed tag of a root and its LATEST.
fn verify_all(dir: &Path) -> anyhow::Result<()> {
    let (store, tag) = locate(dir)?;
    let (tags, latest) = match tag {
        Some(t) => (vec![t], false),
        None => (scan(dir)?.tags, true),
    };
    let mut bad = Vec::new();
    if latest && let Err(e) = read_manifest(&store, None) {
        eprintln!("{}: LATEST: {e:#}", dir.display());
        bad.push("LATEST".to_string());
    }
    for t in &tags {
        match verify(&store, Some(t)) {
            Ok(r) => println!(
                "{}: {} ok ({} files, {} bytes)",
                dir.display(),
                r.tag,
                r.files,
                r.bytes
            ),
            Err(e) => {
                eprintln!("{}: {t}: {e:#}", dir.display());
                bad.push(t.clone());
            }
        }
    }
    anyhow::ensure!(
        bad.is_empty(),
        "verifying {}: {} of {} checked failed: {} (see above)",
        dir.display(),
        bad.len(),
        tags.len() + usize::from(latest),
        bad.join(", ")
    );
    Ok(())
}

/// What a checkpoint root holds besides LATEST.
struct Scan {
    /// Committed tags (`step-NNNNNNNN` directories holding a `MANIFEST.json`), oldest first.
    tags: Vec<String>,
    /// Staging directories crashed saves left (`.staging-*`).
    staging: Vec<String>,
}

/// Lists `dir`'s committed tags and staging directories; a `step-*` directory that is not a
/// committed tag is named on stderr and left out.
fn scan(dir: &Path) -> anyhow::Result<Scan> {
    let mut out = Scan {
        tags: Vec::new(),
        staging: Vec::new(),
    };
    for e in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if !e.file_type()?.is_dir() {
            continue;
        }
        let is_tag = name
            .strip_prefix("step-")
            .is_some_and(|n| n.len() >= 8 && n.bytes().all(|b| b.is_ascii_digit()));
        if is_tag && e.path().join("MANIFEST.json").is_file() {
            out.tags.push(name);
        } else if name.starts_with("step-") {
            eprintln!(
                "note: {} is not a committed checkpoint tag; left alone",
                e.path().display()
            );
        } else if name.starts_with(".staging-") {
            out.staging.push(name);
        }
    }
    // Tags are `step-NNNNNNNN`: zero-padded, so the names sort by step.
    out.tags.sort();
    Ok(out)
}

pub(crate) fn gc(dir: &std::path::Path, keep: usize, dry_run: bool) -> anyhow::Result<()> {
    // LATEST is checked (length and crc of its manifest) before anything is deleted.
    let (latest, _) = read_manifest(&open(dir)?, None)
        .with_context(|| format!("{}: no valid LATEST; nothing deleted", dir.display()))?;
    anyhow::ensure!(
        keep >= 1,
        "--keep 0 would delete {latest}, the checkpoint LATEST names; nothing deleted"
    );
    let Scan { tags, staging } = scan(dir)?;
    let mut doomed: Vec<String> = tags
        .iter()
        .rev()
        .filter(|t| **t != latest)
        .skip(keep - 1)
        .cloned()
        .collect();
    doomed.extend(staging);
    let mut freed = 0u64;
    for name in &doomed {
        let path = dir.join(name);
        let bytes = dir_bytes(&path);
        freed += bytes;
        println!(
            "{} {} ({bytes} bytes)",
            if dry_run { "would delete" } else { "deleting" },
            path.display()
        );
        if !dry_run {
            std::fs::remove_dir_all(&path)
                .with_context(|| format!("cannot delete {}", path.display()))?;
        }
    }
    println!(
        "{}: kept {latest} (LATEST) and {} more; {} {} directories, {freed} bytes",
        dir.display(),
        tags.len().saturating_sub(1).min(keep - 1),
        if dry_run { "would delete" } else { "deleted" },
        doomed.len()
    );
    Ok(())
}

fn dir_bytes(p: &std::path::Path) -> u64 {
    std::fs::read_dir(p)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            _ => e.metadata().map(|m| m.len()).unwrap_or(0),
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        ckpt: CkptArgs,
    }

    fn ckpt(argv: &[&str]) -> anyhow::Result<()> {
        run(Cli::try_parse_from([&["ckpt"], argv].concat())?.ckpt)
    }

    /// Trains the tiny model for `steps` steps under `root`, saving after every step into
    /// `root/ck`, which it returns.
    fn saved_every_step(root: &Path, steps: u32) -> PathBuf {
        let ck = root.join("ck");
        let steps = steps.to_string();
        let train = crate::train::tests::args(
            &root.join("run"),
            &[
                "--model",
                "tiny",
                "--micro-batch",
                "2",
                "--steps",
                &steps,
                "--save-every",
                "1",
                "--save-dir",
                ck.to_str().unwrap(),
            ],
        );
        crate::train::run(train).unwrap();
        ck
    }

    /// The export never writes into the checkpoint it reads (even into a directory yet to be
    /// made there), nor onto a directory or a FIFO, nor over a `NAME.tmp` already there, and a
    /// refused one leaves nothing behind; `gc --keep 0` is refused naming LATEST's tag.
    #[test]
    fn an_export_into_the_checkpoint_or_onto_a_non_file_is_refused_and_leaves_nothing() {
        let tmp = crate::temp_dir("zero-rs-ckpt-cli-");
        let root = tmp.path().to_path_buf();
        let ck = saved_every_step(&root, 1);
        let ck_s = ck.to_str().unwrap();
        let before: Vec<_> = std::fs::read_dir(&ck)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        let latest = std::fs::read(ck.join("LATEST")).unwrap();
        for out in [
            ck.join("LATEST"),
            ck.join("step-00000001").join("MANIFEST.json"),
        ] {
            let e = ckpt(&["export", ck_s, "--out", out.to_str().unwrap()]).unwrap_err();
            assert!(format!("{e:#}").contains("inside the checkpoint"), "{e:#}");
        }
        assert_eq!(std::fs::read(ck.join("LATEST")).unwrap(), latest);
        let dir = root.join("a-dir");
        std::fs::create_dir_all(&dir).unwrap();
        let e = ckpt(&["export", ck_s, "--out", dir.to_str().unwrap()]).unwrap_err();
        assert!(format!("{e:#}").contains("not a regular file"), "{e:#}");
        assert!(!root.join("a-dir.tmp").exists());
        // A FIFO would be replaced by the rename: refused too.
        let fifo = root.join("a-fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo {}", fifo.display());
        let e = ckpt(&["export", ck_s, "--out", fifo.to_str().unwrap()]).unwrap_err();
        assert!(format!("{e:#}").contains("not a regular file"), "{e:#}");
        // Inside the checkpoint even where the directory is yet to be made: nothing is made.
        let deep = ck.join("not-yet").join("model.safetensors");
        let e = ckpt(&["export", ck_s, "--out", deep.to_str().unwrap()]).unwrap_err();
        assert!(format!("{e:#}").contains("inside the checkpoint"), "{e:#}");
        assert!(!ck.join("not-yet").exists());
        // Someone's `NAME.tmp` is in the way: refused, and left as it was.
        let planted = root.join("other.safetensors.tmp");
        std::fs::write(&planted, b"someone's").unwrap();
        let other = root.join("other.safetensors");
        let e = ckpt(&["export", ck_s, "--out", other.to_str().unwrap()]).unwrap_err();
        assert!(format!("{e:#}").contains("is in the way"), "{e:#}");
        assert_eq!(std::fs::read(&planted).unwrap(), b"someone's");
        assert!(!other.exists());
        let after: Vec<_> = std::fs::read_dir(&ck)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(before, after, "the checkpoint root is unchanged");
        let e = ckpt(&["gc", ck_s, "--keep", "0"]).unwrap_err();
        assert!(
            format!("{e:#}").contains("would delete step-00000001"),
            "{e:#}"
        );
        // A good export still works.
        let good = root.join("model.safetensors");
        ckpt(&["export", ck_s, "--out", good.to_str().unwrap()]).unwrap();
        assert!(good.is_file());
    }

    /// `ckpt verify ROOT` checks every committed tag, not only LATEST's: a byte flipped in an
    /// older tag fails it, naming that tag, while the newer tag's directory still verifies.
    /// `ckpt gc` then deletes a planted staging directory and the old tags, and leaves a
    /// `step-*` directory that was never committed.
    #[test]
    fn verify_checks_every_tag_and_gc_clears_staging() {
        let tmp = crate::temp_dir("zero-rs-ckpt-verify-");
        let root = tmp.path().to_path_buf();
        let ck = saved_every_step(&root, 2);
        let ck_s = ck.to_str().unwrap();
        ckpt(&["verify", ck_s]).unwrap();
        let old = ck.join("step-00000001");
        let file = std::fs::read_dir(&old)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.file_name().is_some_and(|n| n != "MANIFEST.json"))
            .unwrap();
        let mut bytes = std::fs::read(&file).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x40;
        std::fs::write(&file, bytes).unwrap();
        let e = format!("{:#}", ckpt(&["verify", ck_s]).unwrap_err());
        assert!(e.contains("1 of 3 checked failed: step-00000001"), "{e}");
        ckpt(&["verify", ck.join("step-00000002").to_str().unwrap()]).unwrap();
        let staging = ck.join(".staging-step-00000003-1");
        let uncommitted = ck.join("step-00000009");
        std::fs::create_dir_all(&staging).unwrap();
        std::fs::write(staging.join("rank-0.bin"), b"partial").unwrap();
        std::fs::create_dir_all(&uncommitted).unwrap();
        ckpt(&["gc", ck_s]).unwrap();
        assert!(!staging.exists(), "the staging directory is gone");
        assert!(!old.exists(), "the older tag is gone");
        assert!(ck.join("step-00000002").exists(), "LATEST's tag stays");
        assert!(
            uncommitted.exists(),
            "a directory never committed is left alone"
        );
        ckpt(&["verify", ck_s]).unwrap();
    }
}
