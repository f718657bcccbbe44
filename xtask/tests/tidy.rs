//! Tidy checks that run under `cargo test`: the one-way dependency graph and test hygiene.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The allowed edges between workspace crates (normal and dev dependencies alike).
const ALLOWED: &[(&str, &[&str])] = &[
    ("zero-core", &[]),
    ("zero-quant", &[]),
    ("zero-comm", &["zero-core", "zero-quant"]),
    ("zero-burn", &["zero-core", "zero-quant", "zero-comm"]),
    (
        "xtask",
        &["zero-core", "zero-quant", "zero-comm", "zero-burn"],
    ),
];

#[test]
fn dependency_graph_is_one_way() {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(root())
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let allowed: BTreeMap<&str, BTreeSet<&str>> = ALLOWED
        .iter()
        .map(|(k, v)| (*k, v.iter().copied().collect()))
        .collect();
    let members: BTreeSet<String> = v["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    for p in v["packages"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        let ok = allowed
            .get(name)
            .unwrap_or_else(|| panic!("crate {name} is not in the allow-list"));
        for d in p["dependencies"].as_array().unwrap() {
            let dep = d["name"].as_str().unwrap();
            if members.contains(dep) {
                assert!(
                    ok.contains(dep),
                    "{name} must not depend on {dep}: the graph is one-way (see ARCHITECTURE.md)"
                );
            }
        }
    }
    // Only zero-burn and xtask may name burn; cudarc and wgpu stay in the device crates (xtask
    // names cudarc for its NVRTC, to make zero-quant's PTX).
    for p in v["packages"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        for d in p["dependencies"].as_array().unwrap() {
            let dep = d["name"].as_str().unwrap();
            if dep == "burn" {
                assert!(
                    name == "zero-burn" || name == "xtask",
                    "{name} must not depend on burn"
                );
            }
            if dep == "cudarc" || dep == "wgpu" {
                assert!(
                    name == "zero-comm"
                        || name == "zero-burn"
                        || name == "zero-quant"
                        || (name == "xtask" && dep == "cudarc"),
                    "{name} must not depend on {dep}"
                );
            }
        }
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let n = p.file_name().unwrap().to_string_lossy().to_string();
        if p.is_dir() {
            if !n.starts_with('.') && n != "target" {
                rust_files(&p, out);
            }
        } else if n.ends_with(".rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_ignored_or_should_panic_tests() {
    let mut files = Vec::new();
    rust_files(&root(), &mut files);
    assert!(files.len() > 10);
    let (ig, sp) = (concat!("#[", "ignore"), concat!("#[", "should_panic"));
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        assert!(
            !text.contains(ig),
            "{}: an ignored test checks nothing in CI",
            f.display()
        );
        assert!(
            !text.contains(sp),
            "{}: assert on the Err instead of should_panic",
            f.display()
        );
    }
}
