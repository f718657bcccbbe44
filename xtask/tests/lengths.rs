//! A ratchet on file length: every `.rs` file of a crate's part (`src`, `tests`, `benches`,
//! `examples`) is at most its ceiling long, and each ceiling sits close above the longest file it
//! covers, so a file that shrinks lowers it. A file is read in one sitting or split.

use std::path::{Path, PathBuf};

/// Lines a ceiling may sit above its longest file before it must come down.
const SLACK: usize = 40;

/// `(crate/part, ceiling)`: the most lines one file there may have.
const CEILINGS: &[(&str, usize)] = &[
    ("zero-core/src", 580),
    ("zero-core/tests", 437),
    ("zero-core/benches", 95),
    ("zero-comm/src", 692),
    ("zero-comm/tests", 1005),
    ("zero-comm/benches", 223),
    ("zero-quant/src", 600),
    ("zero-quant/tests", 405),
    ("zero-quant/benches", 92),
    ("zero-quant/examples", 90),
    ("zero-burn/src", 500),
    ("zero-burn/tests", 664),
    ("zero-burn/examples", 229),
    ("xtask/src", 600),
    ("xtask/tests", 602),
    ("xtask/testkit/src", 148),
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// The `.rs` files under `dir`, with their line counts.
fn lengths(dir: &Path, out: &mut Vec<(PathBuf, usize)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries {
        let p = e.expect("a directory entry").path();
        if p.is_dir() {
            lengths(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            let n = std::fs::read_to_string(&p)
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
                .lines()
                .count();
            out.push((p, n));
        }
    }
}

/// What breaks the ratchet for one part: files over `ceiling`, or a ceiling more than [`SLACK`]
/// above the longest file.
fn ratchet(part: &str, ceiling: usize, files: &[(PathBuf, usize)]) -> Vec<String> {
    let mut problems: Vec<String> = files
        .iter()
        .filter(|(_, n)| *n > ceiling)
        .map(|(p, n)| {
            format!(
                "{}: {n} lines, over {part}'s {ceiling}: split it",
                p.display()
            )
        })
        .collect();
    let longest = files.iter().map(|(_, n)| *n).max().unwrap_or(0);
    if longest + SLACK < ceiling {
        problems.push(format!(
            "{part}: its longest file has {longest} lines: lower its ceiling from {ceiling} to \
             {longest} in xtask/tests/lengths.rs"
        ));
    }
    problems
}

#[test]
fn every_file_is_within_its_crates_ceiling() {
    let root = root();
    let mut problems = Vec::new();
    for (part, ceiling) in CEILINGS {
        let mut files = Vec::new();
        lengths(&root.join(part), &mut files);
        assert!(
            !files.is_empty(),
            "{part} has no .rs file: drop its ceiling"
        );
        problems.extend(ratchet(part, *ceiling, &files));
    }
    // Every part that has Rust files has a ceiling.
    for krate in [
        "zero-core",
        "zero-comm",
        "zero-quant",
        "zero-burn",
        "xtask",
        "xtask/testkit",
    ] {
        for part in ["src", "tests", "benches", "examples"] {
            let name = format!("{krate}/{part}");
            let mut files = Vec::new();
            lengths(&root.join(&name), &mut files);
            if !files.is_empty() && !CEILINGS.iter().any(|(p, _)| *p == name) {
                problems.push(format!("{name} has Rust files and no ceiling"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn the_ratchet_catches_a_long_file_and_a_loose_ceiling() {
    let files = [(PathBuf::from("a.rs"), 120), (PathBuf::from("b.rs"), 90)];
    assert!(ratchet("x/src", 120, &files).is_empty());
    let over = ratchet("x/src", 100, &files);
    assert_eq!(over.len(), 1);
    assert!(over[0].starts_with("a.rs: 120 lines"), "{over:?}");
    let loose = ratchet("x/src", 120 + SLACK + 1, &files);
    assert_eq!(loose.len(), 1);
    assert!(loose[0].contains("lower its ceiling"), "{loose:?}");
}
