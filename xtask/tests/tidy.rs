//! Tidy checks that run under `cargo test`: the one-way dependency graph, test hygiene, and docs
//! that stay short and name nothing outside the repository.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The cargo that runs the tests.
fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

/// The allowed edges between workspace crates (normal and dev dependencies alike).
/// The test kit is a dev-dependency of the libraries (checked below), and xtask's own.
const ALLOWED: &[(&str, &[&str])] = &[
    ("zero-testkit", &[]),
    ("zero-core", &["zero-testkit"]),
    ("zero-quant", &["zero-testkit"]),
    ("zero-comm", &["zero-core", "zero-quant", "zero-testkit"]),
    (
        "zero-burn",
        &["zero-core", "zero-quant", "zero-comm", "zero-testkit"],
    ),
    (
        "xtask",
        &[
            "zero-core",
            "zero-quant",
            "zero-comm",
            "zero-burn",
            "zero-testkit",
        ],
    ),
];

#[test]
fn dependency_graph_is_one_way() {
    let out = cargo()
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
            if dep == "zero-testkit" && name != "xtask" {
                assert_eq!(
                    d["kind"], "dev",
                    "{name} may use the test kit in tests only"
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

/// `cargo xtask` (the alias) builds xtask without its `engine` feature, and that build has no burn
/// in its graph: a cold `cargo xtask train` compiles burn once, in the release build it hands the
/// job to.
#[test]
fn the_xtask_alias_compiles_no_burn() {
    let config = std::fs::read_to_string(root().join(".cargo/config.toml")).unwrap();
    let alias = config
        .lines()
        .find(|l| l.trim_start().starts_with("xtask ="))
        .expect("the `xtask` alias in .cargo/config.toml");
    assert!(
        alias.contains("--no-default-features"),
        "the alias must build xtask without the engine: {alias}"
    );
    let out = cargo()
        .args([
            "tree",
            "-p",
            "xtask",
            "--no-default-features",
            "--edges",
            "normal,build",
            "--prefix",
            "none",
            "--offline",
        ])
        .current_dir(root())
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(
        tree.lines().any(|l| l.starts_with("zero-comm ")),
        "cargo tree listed xtask's graph: {tree}"
    );
    let burn: Vec<&str> = tree
        .lines()
        .filter(|l| l.starts_with("burn") || l.starts_with("zero-burn "))
        .collect();
    assert!(burn.is_empty(), "xtask without the engine builds {burn:?}");
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
        // An ignore inside a cfg_attr ignores a test as surely, where its condition holds.
        let cfg_attr = concat!("cfg_", "attr(");
        assert!(
            !text
                .lines()
                .any(|l| l.contains(cfg_attr) && l.contains("ignore")),
            "{}: a conditionally ignored test checks nothing in CI where its condition holds",
            f.display()
        );
        assert!(
            !text.contains(sp),
            "{}: assert on the Err instead of should_panic",
            f.display()
        );
    }
}

/// The longest a Markdown table cell may be: a table is for scanning, and evidence that needs more
/// words goes in bullets (STATUS.md) or prose.
const MAX_TABLE_CELL: usize = 300;
/// The longest a bullet may be: one claim and its test; more goes to sub-bullets.
const MAX_BULLET: usize = 300;
/// README is the front door: it fits a few screens.
const README_MAX_LINES: usize = 200;
const README_MAX_CHARS: usize = 12_000;
/// Words that, followed by a number, name the project's history rather than the code.
const HISTORY_WORDS: &[&str] = &["session ", "issue ", "stop "];
/// Files that are not in the repository (a reader cannot open them), spelled so that this file
/// does not name them itself.
const OUTSIDE_FILES: &[&str] = &[
    concat!("zero", "-spec"),
    concat!("../", "shared"),
    concat!("aesthetics", "-review"),
    concat!("test", "-audit"),
];

/// README, STATUS, ARCHITECTURE, BENCHMARKS and every Markdown file under `docs/`.
fn markdown_docs() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    let root = root();
    let mut docs: Vec<PathBuf> = ["README.md", "STATUS.md", "ARCHITECTURE.md", "BENCHMARKS.md"]
        .iter()
        .map(|f| root.join(f))
        .collect();
    walk(&root.join("docs"), &mut docs);
    docs
}

/// The cells of a Markdown table row (`| a | b |`), split as GitHub does: at every `|` not
/// escaped with a backslash. Empty for a line that is not a table row.
fn table_cells(line: &str) -> Vec<&str> {
    let row = line.trim();
    if !row.starts_with('|') {
        return Vec::new();
    }
    let mut cells = Vec::new();
    let mut start = 1;
    let mut escaped = false;
    for (i, c) in row.char_indices().skip(1) {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '|' => {
                cells.push(row[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    if !row[start..].trim().is_empty() {
        cells.push(row[start..].trim());
    }
    cells
}

/// The first history word in `line` that is followed by a digit and starts a word of its own
/// (so "tissue" does not count), in any case.
fn history_word(line: &str) -> Option<&'static str> {
    let lower = line.to_lowercase();
    for word in HISTORY_WORDS {
        let mut from = 0;
        while let Some(k) = lower[from..].find(word) {
            let at = from + k;
            let before = lower[..at].chars().next_back();
            let starts_word = before.is_none_or(|c| !c.is_alphanumeric());
            let numbered = lower[at + word.len()..].starts_with(|c: char| c.is_ascii_digit());
            if starts_word && numbered {
                return Some(word.trim_end());
            }
            from = at + 1;
        }
    }
    None
}

/// Every rule of `docs_are_short_and_self_contained` that `text` (the file `name`) breaks.
fn doc_problems(name: &str, text: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let mut in_code = false;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        }
        if !in_code {
            let item = line.trim_start();
            let len = item.chars().count();
            if (item.starts_with("- ") || item.starts_with("* ")) && len > MAX_BULLET {
                problems.push(format!(
                    "{name}:{n}: a bullet of {len} characters (at most {MAX_BULLET}): split it \
                     into sub-bullets"
                ));
            }
            for cell in table_cells(line) {
                let len = cell.chars().count();
                if len > MAX_TABLE_CELL {
                    problems.push(format!(
                        "{name}:{n}: a table cell of {len} characters (at most {MAX_TABLE_CELL}): \
                         move the evidence to bullets"
                    ));
                }
            }
        }
        if let Some(word) = history_word(line) {
            problems.push(format!(
                "{name}:{n}: \"{word}\" with a number is project history: say what is, not how it \
                 came to be"
            ));
        }
        for outside in OUTSIDE_FILES {
            if line.contains(outside) {
                problems.push(format!(
                    "{name}:{n}: `{outside}` is not in the repository: state the fact itself, or \
                     point to a doc in the repository"
                ));
            }
        }
    }
    problems
}

#[test]
fn docs_are_short_and_self_contained() {
    let root = root();
    let mut problems = Vec::new();
    for f in markdown_docs() {
        let name = f.strip_prefix(&root).unwrap_or(&f).display().to_string();
        let text = std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{name}: {e}"));
        problems.extend(doc_problems(&name, &text));
        if name == "README.md" {
            let (lines, chars) = (text.lines().count(), text.chars().count());
            if lines > README_MAX_LINES || chars > README_MAX_CHARS {
                problems.push(format!(
                    "README.md: {lines} lines and {chars} characters (at most {README_MAX_LINES} \
                     and {README_MAX_CHARS}): evidence goes to STATUS.md"
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} problems in the docs:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn comments_name_no_history_and_no_outside_files() {
    let root = root();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let mut problems = Vec::new();
    for f in files {
        let name = f.strip_prefix(&root).unwrap_or(&f).display().to_string();
        let text = std::fs::read_to_string(&f).unwrap();
        for (i, line) in text.lines().enumerate() {
            let n = i + 1;
            for outside in OUTSIDE_FILES {
                if line.contains(outside) {
                    problems.push(format!("{name}:{n}: `{outside}` is not in the repository"));
                }
            }
            let comment = line.trim_start();
            if !comment.starts_with("//") {
                continue;
            }
            if let Some(word) = history_word(comment) {
                problems.push(format!(
                    "{name}:{n}: \"{word}\" with a number in a comment is project history"
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} problems in comments:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// The checkers above can fail: each finds what it looks for, and leaves alone what it must.
#[test]
fn the_doc_checks_find_what_they_look_for() {
    assert_eq!(
        table_cells("| a | `b` | c \\| d |"),
        ["a", "`b`", "c \\| d"]
    );
    assert_eq!(table_cells("|---|---:|"), ["---", "---:"]);
    assert!(table_cells("not | a row").is_empty());
    assert_eq!(
        history_word(concat!("as in Session", " 5, below")),
        Some("session")
    );
    assert_eq!(history_word(concat!("(issue", " 11)")), Some("issue"));
    assert_eq!(history_word(concat!("the tissue", " 3")), None);
    assert_eq!(history_word("the issue's bound; a stop sign"), None);
    let long = format!("| x | {} |", "y".repeat(MAX_TABLE_CELL + 1));
    let text = format!("# T\n\n{long}\n```\n{long}\n```\n");
    assert_eq!(
        doc_problems("T.md", &text).len(),
        1,
        "a cell in a code block is not a cell"
    );
    let bullet = format!(
        "- {}\n  * {}\n",
        "b".repeat(MAX_BULLET - 2),
        "c".repeat(MAX_BULLET)
    );
    assert_eq!(
        doc_problems("T.md", &bullet).len(),
        1,
        "only the second bullet is too long"
    );
    let outside = format!("see `{}.md`", OUTSIDE_FILES[0]);
    assert_eq!(doc_problems("T.md", &outside).len(), 1);
}

/// `text` without `//` comments and without everything from a `#[cfg(test)]` line on.
fn code_of(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            break;
        }
        out.push_str(line.find("//").map_or(line, |i| &line[..i]));
        out.push('\n');
    }
    out
}

/// Whether `code` names `path` as a whole path segment (`super::job` but not `super::jobs`).
fn names(code: &str, path: &str) -> bool {
    code.match_indices(path).any(|(i, _)| {
        let before = code[..i].chars().next_back();
        let after = code[i + path.len()..].chars().next();
        before.is_none_or(|c| !(c.is_alphanumeric() || c == '_'))
            && after.is_none_or(|c| !(c.is_alphanumeric() || c == '_'))
    })
}

/// Every module folder under `src`, `src` itself (the crate's top-level modules) included: its
/// module path (`demo::`, `engine::`, empty for the root) and its children's imports of each
/// other: a child imports a sibling when its code names `super::sibling` (a file directly in
/// the folder) or `crate::<folder path>sibling` (any file under it). A child folder counts as
/// one child with all its files.
fn folder_graphs(src: &Path) -> Vec<(String, BTreeMap<String, BTreeSet<String>>)> {
    fn walk(src: &Path, dir: &Path, out: &mut Vec<(String, BTreeMap<String, BTreeSet<String>>)>) {
        let mut children: Vec<(String, PathBuf)> = Vec::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let stem = p.file_stem().unwrap().to_string_lossy().to_string();
            if p.is_dir() {
                walk(src, &p, out);
                children.push((stem, p));
            } else if p.extension().is_some_and(|x| x == "rs") && stem != "mod" {
                children.push((stem, p));
            }
        }
        let module: String = dir
            .strip_prefix(src)
            .unwrap()
            .components()
            .map(|c| format!("{}::", c.as_os_str().to_string_lossy()))
            .collect();
        // The crate root's children are its top-level modules (`lib.rs`, `main.rs` is the root).
        children.retain(|(n, _)| dir != src || (n != "lib" && n != "main"));
        let names_of: BTreeSet<String> = children.iter().map(|(n, _)| n.clone()).collect();
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (name, path) in &children {
            let mut files = Vec::new();
            if path.is_dir() {
                rust_files(path, &mut files);
            } else {
                files.push(path.clone());
            }
            let deps = g.entry(name.clone()).or_default();
            for f in files {
                let code = code_of(&std::fs::read_to_string(&f).unwrap());
                let direct = f.parent() == Some(dir);
                for other in names_of.iter().filter(|o| *o != name) {
                    if names(&code, &format!("crate::{module}{other}"))
                        || (direct && dir != src && names(&code, &format!("super::{other}")))
                    {
                        deps.insert(other.clone());
                    }
                }
            }
        }
        out.push((module, g));
    }
    let mut out = Vec::new();
    walk(src, src, &mut out);
    out
}

/// The circles of `g`, each as the path of modules from its smallest member back to it.
fn circles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    fn reach(
        g: &BTreeMap<String, BTreeSet<String>>,
        at: &str,
        goal: &str,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> bool {
        for next in g.get(at).into_iter().flatten() {
            path.push(next.clone());
            if next == goal || (seen.insert(next.clone()) && reach(g, next, goal, path, seen)) {
                return true;
            }
            path.pop();
        }
        false
    }
    let mut found = Vec::new();
    for start in g.keys() {
        let mut path = vec![start.clone()];
        if reach(g, start, start, &mut path, &mut BTreeSet::new())
            && path.iter().all(|m| m >= start)
        {
            found.push(path);
        }
    }
    found
}

/// The top-level modules of every crate, and the files inside every module folder, import each
/// other one way, as the crates do: a circle (`demo/job.rs` importing `demo/report.rs` importing `demo/job.rs`) ties
/// two files into one that must be read at once.
#[test]
fn module_folders_import_one_way() {
    let mut problems = Vec::new();
    for krate in ["zero-core", "zero-comm", "zero-quant", "zero-burn", "xtask"] {
        for (module, g) in folder_graphs(&root().join(krate).join("src")) {
            for c in circles(&g) {
                let folder = module.replace("::", "/");
                problems.push(format!("{krate}/src/{folder}: {}", c.join(" -> ")));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "import circles inside module folders:\n{}",
        problems.join("\n")
    );
}

/// The circle finder finds a circle, and only a circle.
#[test]
fn the_folder_circle_finder_finds_a_circle() {
    let g = |edges: &[(&str, &str)]| {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    assert_eq!(
        circles(&g(&[("job", "report"), ("report", "job"), ("job", "run")])),
        [["job", "report", "job"]]
    );
    assert!(
        circles(&g(&[
            ("job", "report"),
            ("report", "config"),
            ("job", "config")
        ]))
        .is_empty()
    );
    assert!(names("use super::report::x;", "super::report"));
    assert!(!names("use super::reports::x;", "super::report"));
    // zero-burn's top level is not trivially empty: the checkpoint imports the engine.
    let burn = folder_graphs(&root().join("zero-burn/src"));
    let top = &burn.iter().find(|(m, _)| m.is_empty()).unwrap().1;
    assert!(top["checkpoint"].contains("engine"), "{top:?}");
    assert!(names("use crate::x::Y;", "crate::x"));
    assert!(!code_of("// crate::z\n#[cfg(test)]\nuse crate::t;").contains("crate::"));
}
