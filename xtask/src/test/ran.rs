//! "Every test ran", checked two ways:
//! - each test binary's list (`--list`) against what cargo's run of it executed, so a test that
//!   is ignored, filtered out or lost with its binary shows;
//! - the `#[test]` functions of the sources against what every run executed, so a test compiled
//!   out (by a feature no step enables, or in a binary no step builds) shows too. Only the GPU
//!   tests may be, and they are listed by file in [`GPU_ONLY`].
//!
//! A test that ran but returned early (no adapter, no `mpirun`) is the skip log's business
//! (`gates.rs`).

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use anyhow::{Context, bail};

use super::gates::NotRun;

/// One test binary as `cargo test` ran it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct BinaryRun {
    /// What cargo calls it: `unittests src/lib.rs`, `tests/families.rs`.
    pub(super) source: String,
    /// The executable.
    pub(super) path: PathBuf,
    /// The tests that ran, passed or failed.
    pub(super) executed: BTreeSet<String>,
}

impl BinaryRun {
    /// `families (tests/families.rs)`: the executable's name without cargo's hash, and its source.
    pub(super) fn name(&self) -> String {
        let stem = self
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let stem = match stem.rsplit_once('-') {
            Some((name, hash)) if hash.chars().all(|c| c.is_ascii_hexdigit()) => name.to_string(),
            _ => stem,
        };
        format!("{stem} ({})", self.source)
    }
}

/// Files whose `#[test]` functions may be compiled out of every run here: they need a GPU, are
/// built with the `gpu-tests` features, and run under `cargo xtask gpu-check`.
const GPU_ONLY: &[&str] = &[
    "zero-burn/tests/cuda_path.rs",
    "zero-burn/tests/nccl_path.rs",
    "zero-comm/src/nccl/backend/finish.rs",
    "zero-comm/src/nccl/backend/kernels.rs",
    "zero-comm/tests/cuda/loopback.rs",
    "zero-comm/tests/nccl.rs",
    "zero-quant/tests/cuda_kernels.rs",
];

/// Runs `cmd` (a `cargo test`), showing its output and errors as they come and keeping both, in
/// the order they came. A process the tests leave behind with the pipe open is not waited for
/// past a few seconds after `cmd` ends.
pub(super) fn run_capturing(name: &str, mut cmd: Command) -> anyhow::Result<(ExitStatus, String)> {
    eprintln!("==> {name}: {cmd:?}");
    let (mut reader, writer) = std::io::pipe().context("cannot make a pipe")?;
    cmd.stdout(writer.try_clone()?).stderr(writer);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start {name}"))?;
    // The command holds the pipe's writing ends: without this the reader never sees its end.
    drop(cmd);
    let kept = Arc::new(Mutex::new(Vec::new()));
    let (done, finished) = mpsc::channel::<()>();
    let sink = Arc::clone(&kept);
    std::thread::spawn(move || {
        let mut buf = [0u8; 8192];
        let mut err = std::io::stderr();
        loop {
            match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let _ = err.write_all(&buf[..n]);
                    sink.lock()
                        .expect("only this thread writes")
                        .extend_from_slice(&buf[..n]);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        let _ = done.send(());
    });
    let status = child
        .wait()
        .with_context(|| format!("waiting for {name}"))?;
    let _ = finished.recv_timeout(Duration::from_secs(10));
    let text = String::from_utf8_lossy(&kept.lock().expect("the reader never panics")).into_owned();
    Ok((status, text))
}

/// `text` without terminal colour codes (`ESC [ … letter`).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The test binaries in the output of a `cargo test` run from `root`, with the tests each executed
/// (doc-tests are not binaries and are left out).
pub(super) fn parse_runs(output: &str, root: &Path) -> Vec<BinaryRun> {
    let mut runs: Vec<BinaryRun> = Vec::new();
    let mut current = None;
    for line in output.lines() {
        let line = strip_ansi(line);
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("Running ") {
            current = None;
            if let Some((source, path)) = rest.strip_suffix(')').and_then(|r| r.rsplit_once(" (")) {
                let path = PathBuf::from(path);
                runs.push(BinaryRun {
                    source: source.to_string(),
                    path: if path.is_absolute() {
                        path
                    } else {
                        root.join(path)
                    },
                    executed: BTreeSet::new(),
                });
                current = Some(runs.len() - 1);
            }
        } else if t.starts_with("Doc-tests ") {
            current = None;
        } else if let Some(c) = current
            && let Some((test, verdict)) =
                t.strip_prefix("test ").and_then(|r| r.split_once(" ... "))
            && (verdict == "ok" || verdict == "FAILED")
        {
            runs[c].executed.insert(test.to_string());
        }
    }
    runs
}

/// The tests a test binary lists (`--list --format terse`: `name: test` lines).
fn listed(path: &Path) -> anyhow::Result<BTreeSet<String>> {
    let out = Command::new(path)
        .args(["--list", "--format", "terse"])
        .output()
        .with_context(|| format!("cannot run {} --list", path.display()))?;
    if !out.status.success() {
        bail!(
            "{} --list failed ({}): {}",
            path.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(tests_of_list(&String::from_utf8_lossy(&out.stdout)))
}

fn tests_of_list(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_suffix(": test"))
        .map(str::to_string)
        .collect()
}

/// The tests each binary lists that its run did not execute.
pub(super) fn not_executed(runs: &[BinaryRun]) -> anyhow::Result<Vec<NotRun>> {
    let mut out = Vec::new();
    for run in runs {
        out.extend(missing_from(run, &listed(&run.path)?));
    }
    Ok(out)
}

fn missing_from(run: &BinaryRun, listed: &BTreeSet<String>) -> Vec<NotRun> {
    listed
        .difference(&run.executed)
        .map(|t| NotRun {
            test: format!("{}::{t}", run.name()),
            reason: "listed by its binary, not executed (ignored, filtered out, or the binary \
                     stopped)"
                .into(),
        })
        .collect()
}

/// A `#[test]` function of the sources: its file, relative to the root, and its name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct SourceTest {
    pub(super) file: String,
    pub(super) name: String,
}

/// Every `#[test]` function in the workspace's crates (`src`, `tests`, `examples`, `benches`),
/// but those a macro names (`fn $name`).
pub(super) fn source_tests(root: &Path) -> anyhow::Result<Vec<SourceTest>> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
        for e in std::fs::read_dir(dir)? {
            let p = e?.path();
            if p.is_dir() {
                walk(&p, out)?;
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
        Ok(())
    }
    // The crates: the top-level folders with a manifest, and those nested one level inside them.
    let mut crates = Vec::new();
    for top in std::fs::read_dir(root)? {
        let top = top?.path();
        if top.join("Cargo.toml").is_file() {
            for inner in std::fs::read_dir(&top)? {
                let inner = inner?.path();
                if inner.join("Cargo.toml").is_file() {
                    crates.push(inner);
                }
            }
            crates.push(top);
        }
    }
    let mut files = Vec::new();
    for krate in crates {
        for part in ["src", "tests", "examples", "benches"] {
            let dir = krate.join(part);
            if dir.is_dir() {
                walk(&dir, &mut files)?;
            }
        }
    }
    let mut out = Vec::new();
    for f in files {
        let text =
            std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?;
        let file = f.strip_prefix(root).unwrap_or(&f).display().to_string();
        out.extend(test_names(&text).into_iter().map(|name| SourceTest {
            file: file.clone(),
            name,
        }));
    }
    out.sort();
    Ok(out)
}

/// The names of the functions marked `#[test]` in `text`: the first `fn` after the attribute, past
/// other attributes and comments.
fn test_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut lines = text.lines().map(str::trim);
    while let Some(line) = lines.next() {
        if line != "#[test]" {
            continue;
        }
        for next in lines.by_ref() {
            if next.starts_with("#[") || next.starts_with("//") || next.is_empty() {
                continue;
            }
            let sig = next.strip_prefix("pub ").unwrap_or(next);
            if let Some(rest) = sig.strip_prefix("fn ") {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '$')
                    .collect();
                if !name.is_empty() && !name.starts_with('$') {
                    names.push(name);
                }
            }
            break;
        }
    }
    names
}

/// The source tests no run executed (by the last part of the executed tests' paths), but those
/// in [`GPU_ONLY`] files.
pub(super) fn compiled_out(sources: &[SourceTest], runs: &[BinaryRun]) -> Vec<SourceTest> {
    let ran: BTreeSet<&str> = runs
        .iter()
        .flat_map(|r| r.executed.iter())
        .map(|t| t.rsplit("::").next().unwrap_or(t))
        .collect();
    sources
        .iter()
        .filter(|s| !ran.contains(s.name.as_str()))
        .filter(|s| !GPU_ONLY.iter().any(|g| s.file == *g))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `cargo test` prints, cut down: two binaries, a doc-test, colour in one line.
    const OUTPUT: &str = "   Compiling zero-core v0.1.0 (/w/zero-core)
     Running unittests src/lib.rs (target/debug/deps/zero_core-0a1b2c3d4e5f6789)

running 2 tests
test gather::tests::order ... ok
test plan::tests::units ... FAILED

test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out
\u{1b}[0m\u{1b}[1m\u{1b}[32m     Running\u{1b}[0m tests/families.rs (/t/debug/deps/families-00ff)

running 3 tests
test reads::tied ... ok
test reads::frozen ... ignored
test reads::slow has been running for over 60 seconds
test reads::slow ... ok
   Doc-tests zero_core

running 1 test
test zero-core/src/lib.rs - (line 5) ... ok
";

    #[test]
    fn the_run_of_each_binary_is_read_from_cargos_output() {
        let runs = parse_runs(OUTPUT, Path::new("/w"));
        assert_eq!(runs.len(), 2);
        assert_eq!(runs[0].source, "unittests src/lib.rs");
        assert_eq!(
            runs[0].path,
            Path::new("/w/target/debug/deps/zero_core-0a1b2c3d4e5f6789")
        );
        assert_eq!(runs[0].name(), "zero_core (unittests src/lib.rs)");
        assert_eq!(
            runs[0].executed.iter().collect::<Vec<_>>(),
            ["gather::tests::order", "plan::tests::units"]
        );
        assert_eq!(runs[1].path, Path::new("/t/debug/deps/families-00ff"));
        assert_eq!(
            runs[1].executed.iter().collect::<Vec<_>>(),
            ["reads::slow", "reads::tied"],
            "an ignored test did not run; the doc-test is not the binary's"
        );
    }

    #[test]
    fn a_listed_test_that_did_not_execute_is_named() {
        let runs = parse_runs(OUTPUT, Path::new("/w"));
        let listed = tests_of_list(
            "reads::frozen: test\nreads::slow: test\nreads::tied: test\nbench_x: benchmark\n",
        );
        assert_eq!(listed.len(), 3);
        let missing = missing_from(&runs[1], &listed);
        assert_eq!(missing.len(), 1);
        assert_eq!(
            missing[0].test,
            "families (tests/families.rs)::reads::frozen"
        );
        assert!(missing_from(&runs[0], &tests_of_list("gather::tests::order: test\n")).is_empty());
    }

    #[test]
    fn source_tests_are_found_past_attributes_and_comments() {
        let text = "#[test]\nfn a() {}\n\n    #[test]\n    #[cfg(feature = \"x\")]\n    /// doc\n    \
                    pub fn b_2() {}\n#[test]\nfn $name() {}\n#[tokio::test]\nfn c() {}\n";
        assert_eq!(test_names(text), ["a", "b_2"]);
        let sources =
            [("f.rs", "order"), ("f.rs", "frozen"), ("g.rs", "units")].map(|(f, n)| SourceTest {
                file: f.into(),
                name: n.into(),
            });
        let out = compiled_out(&sources, &parse_runs(OUTPUT, Path::new("/w")));
        assert_eq!(
            out.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
            ["frozen"]
        );
    }

    #[test]
    fn this_workspace_has_source_tests_and_the_gpu_files_exist() {
        let root = super::super::workspace_root();
        let sources = source_tests(&root).unwrap();
        assert!(sources.len() > 400, "found {} tests", sources.len());
        assert!(
            sources
                .iter()
                .any(|s| s.name == "source_tests_are_found_past_attributes_and_comments")
        );
        for f in GPU_ONLY {
            assert!(root.join(f).is_file(), "{f} is not a file");
        }
    }
}
