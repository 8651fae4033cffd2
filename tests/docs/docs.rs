//! The documents hold together: every relative link in the repository's markdown reaches a
//! file that exists, and an anchor (`FILE.md#heading`, `#heading`) reaches a heading there, as
//! GitHub spells its anchors; and every file under docs/ is linked from some document, so none
//! is orphaned. No kernel, no privilege.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Component, Path, PathBuf},
};

use pulldown_cmark::{Event, HeadingLevel, Parser, Tag, TagEnd};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The repository's markdown files, relative to its root (not under target/ or dot folders).
fn markdown(root: &Path) -> Vec<PathBuf> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy();
            if name.starts_with('.') || name == "target" {
                continue;
            }
            if path.is_dir() {
                walk(root, &path, out);
            } else if name.ends_with(".md") {
                out.push(path.strip_prefix(root).unwrap().to_path_buf());
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

/// GitHub's anchor for a heading: lower case, punctuation other than `-` and `_` dropped,
/// spaces to `-`; a repeated one gets `-1`, `-2`, ...
fn anchors(headings: &[String]) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for heading in headings {
        let slug: String = heading
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let n = seen.entry(slug.clone()).or_insert(0);
        out.insert(if *n == 0 { slug.clone() } else { format!("{slug}-{n}") });
        *n += 1;
    }
    out
}

/// A document's link targets and its headings' anchors.
fn read(text: &str) -> (Vec<String>, BTreeSet<String>) {
    let (mut links, mut headings) = (Vec::new(), Vec::new());
    let mut heading: Option<String> = None;
    for event in Parser::new(text) {
        match event {
            Event::Start(Tag::Link { dest_url, .. } | Tag::Image { dest_url, .. }) => links.push(dest_url.to_string()),
            Event::Start(Tag::Heading { level, .. }) if level <= HeadingLevel::H6 => heading = Some(String::new()),
            Event::Text(t) | Event::Code(t) => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            Event::End(TagEnd::Heading(_)) => headings.extend(heading.take()),
            _ => {}
        }
    }
    (links, anchors(&headings))
}

/// `base/rel` with `.` and `..` resolved, relative to the repository root.
fn join(base: &Path, rel: &str) -> PathBuf {
    let mut out = PathBuf::new();
    for c in base.join(rel).components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

#[test]
fn every_relative_link_resolves_and_no_doc_is_orphaned() {
    let root = root();
    let docs = markdown(&root);
    assert!(docs.iter().any(|d| d == Path::new("README.md")), "no README.md under {}", root.display());
    let parsed: BTreeMap<PathBuf, (Vec<String>, BTreeSet<String>)> =
        docs.iter().map(|d| (d.clone(), read(&std::fs::read_to_string(root.join(d)).unwrap()))).collect();
    let mut broken = Vec::new();
    let mut linked = BTreeSet::new();
    for (doc, (links, _)) in &parsed {
        for link in links {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = link.split_once('#').map_or((link.as_str(), None), |(f, a)| (f, Some(a)));
            let target = if file.is_empty() { doc.clone() } else { join(doc.parent().unwrap(), file) };
            if !root.join(&target).exists() {
                broken.push(format!("{}: {link}: no {}", doc.display(), target.display()));
                continue;
            }
            linked.insert(target.clone());
            if let Some(anchor) = anchor {
                match parsed.get(&target) {
                    Some((_, anchors)) if !anchors.contains(anchor) => {
                        broken.push(format!("{}: {link}: no heading #{anchor} in {}", doc.display(), target.display()))
                    }
                    _ => {}
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));

    // Every file under docs/ is reached from some document.
    let mut orphans = Vec::new();
    let mut stack = vec![root.join("docs")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let rel = path.strip_prefix(&root).unwrap().to_path_buf();
                if !linked.contains(&rel) {
                    orphans.push(rel.display().to_string());
                }
            }
        }
    }
    orphans.sort();
    assert!(orphans.is_empty(), "files under docs/ that no document links to: {orphans:?}");
}

/// The checker itself: GitHub's anchors, and a link into a code block is no link.
#[test]
fn anchors_and_code_blocks_read_as_github_does() {
    let (links, anchors) = read(
        "# Start, stop, restart\n## Per CPU: the multiplier, and host scope\n## Notes\n## Notes\n\
         [a](x.md#y) ![p](p.svg)\n\n```\n[not](a-link.md)\n```\n",
    );
    assert_eq!(links, ["x.md#y", "p.svg"]);
    let want = ["notes", "notes-1", "per-cpu-the-multiplier-and-host-scope", "start-stop-restart"];
    assert_eq!(anchors.iter().map(String::as_str).collect::<Vec<_>>(), want);
}
