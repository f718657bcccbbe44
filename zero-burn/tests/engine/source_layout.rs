//! README's loop: its Rust snippet must appear, line for line, inside the crate docs'
//! example (`zero-burn/src/lib.rs`), which rustdoc compiles and runs as a doctest with only
//! `zero_burn::prelude::*` imported for the engine.

use std::path::Path;

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
