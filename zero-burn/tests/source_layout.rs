//! The shape of zero-burn's source, as ARCHITECTURE.md states it: no file over 500 lines, and the
//! crate's top-level modules import each other one way (no circle through `crate::` paths).
//! Comments and `#[cfg(test)]` modules do not count: doc links and tests may point anywhere.
//!
//! Also README's loop: its Rust snippet must appear, line for line, inside the crate docs'
//! example (`zero-burn/src/lib.rs`), which rustdoc compiles and runs as a doctest with only
//! `zero_burn::prelude::*` imported for the engine.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The most lines a file of `zero-burn/src` may have.
const MAX_LINES: usize = 500;

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("zero-burn/src is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// `text` without `//` comments and without everything from a `#[cfg(test)]` line on (the
/// crate keeps its unit tests at the end of a file).
fn code_of(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            break;
        }
        let code = line.find("//").map_or(line, |i| &line[..i]);
        out.push_str(code);
        out.push('\n');
    }
    out
}

/// The top-level modules named by `crate::<name>` paths in `code`.
fn crate_paths(code: &str) -> BTreeSet<String> {
    code.match_indices("crate::")
        .filter(|(i, _)| {
            // Not `zero_burn_crate::` or the like: the path starts here.
            code[..*i]
                .chars()
                .next_back()
                .is_none_or(|c| !(c.is_alphanumeric() || c == '_'))
        })
        .map(|(i, m)| {
            code[i + m.len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect::<String>()
        })
        .filter(|name| !name.is_empty())
        .collect()
}

/// The module graph: top-level module → the top-level modules it imports.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = src_dir();
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(&src).expect("under src");
        if rel == Path::new("lib.rs") {
            continue;
        }
        let top = rel
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .expect("a file name")
            .trim_end_matches(".rs")
            .to_owned();
        let code = code_of(&fs::read_to_string(&f).expect("readable"));
        let deps: Vec<String> = crate_paths(&code)
            .into_iter()
            .filter(|d| *d != top)
            .collect();
        g.entry(top).or_default().extend(deps);
    }
    let tops: BTreeSet<String> = g.keys().cloned().collect();
    for deps in g.values_mut() {
        deps.retain(|d| tops.contains(d));
    }
    g
}

/// A circle through `from`, as the path of modules, if there is one.
fn circle_through(g: &BTreeMap<String, BTreeSet<String>>, from: &str) -> Option<Vec<String>> {
    fn walk(
        g: &BTreeMap<String, BTreeSet<String>>,
        at: &str,
        goal: &str,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> bool {
        for next in g.get(at).into_iter().flatten() {
            if next == goal {
                path.push(next.clone());
                return true;
            }
            if seen.insert(next.clone()) {
                path.push(next.clone());
                if walk(g, next, goal, path, seen) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    let mut path = vec![from.to_owned()];
    walk(g, from, from, &mut path, &mut BTreeSet::new()).then_some(path)
}

#[test]
fn no_source_file_is_over_500_lines() {
    let mut files = Vec::new();
    sources(&src_dir(), &mut files);
    assert!(files.len() > 10, "found only {} files", files.len());
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let n = fs::read_to_string(f).expect("readable").lines().count();
            (n > MAX_LINES).then(|| format!("{} ({n} lines)", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "over {MAX_LINES} lines: {long:?}");
}

#[test]
fn the_modules_import_each_other_one_way() {
    let g = graph();
    // The graph is not trivially empty: the engine imports the trainer.
    assert!(g["engine"].contains("trainer"), "{g:?}");
    let circles: Vec<Vec<String>> = g.keys().filter_map(|m| circle_through(&g, m)).collect();
    assert!(circles.is_empty(), "import circles: {circles:?}");
}

#[test]
fn the_circle_finder_finds_a_circle() {
    // The check above can fail: a graph with a circle is reported.
    let mut g = BTreeMap::new();
    g.insert("a".to_owned(), BTreeSet::from(["b".to_owned()]));
    g.insert("b".to_owned(), BTreeSet::from(["c".to_owned()]));
    g.insert("c".to_owned(), BTreeSet::from(["a".to_owned()]));
    assert_eq!(
        circle_through(&g, "a"),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    let code = code_of(
        "use crate::x::Y; // crate::z\nfn f() { crate::w::g() }\n#[cfg(test)]\nuse crate::t;",
    );
    assert_eq!(
        crate_paths(&code),
        BTreeSet::from(["w".to_owned(), "x".to_owned()])
    );
}

/// The lines of the first Markdown code block of `lang` in `text`.
fn first_block<'a>(text: &'a str, lang: &str) -> Vec<&'a str> {
    let fence = format!("```{lang}");
    text.lines()
        .skip_while(|l| l.trim_end() != fence)
        .skip(1)
        .take_while(|l| !l.starts_with("```"))
        .collect()
}

#[test]
fn readmes_loop_is_part_of_the_crate_docs_doctest() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let lib = std::fs::read_to_string(root.join("zero-burn/src/lib.rs")).unwrap();
    let snippet = first_block(&readme, "rust");
    assert!(
        snippet.len() >= 5,
        "README has no ```rust block with the loop: {snippet:?}"
    );
    assert!(
        snippet[0].starts_with("use zero_burn::prelude::*;"),
        "README's loop starts from the one import: {:?}",
        snippet[0]
    );
    // The crate docs' example, without the `//! ` prefix.
    let docs: Vec<&str> = lib
        .lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .map(|l| l.strip_prefix(' ').unwrap_or(l))
        .collect();
    let example = first_block(&docs.join("\n"), "")
        .iter()
        .map(|l| l.to_string())
        .collect::<Vec<_>>();
    assert!(!example.is_empty(), "lib.rs has no doc example");
    let found = example.windows(snippet.len()).any(|w| {
        w.iter()
            .zip(&snippet)
            .all(|(a, b)| a.trim_end() == b.trim_end())
    });
    assert!(
        found,
        "README's loop is not, line for line, in lib.rs's doc example:\n{}",
        snippet.join("\n")
    );
}
