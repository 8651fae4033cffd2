//! Writing the config back: the operator's file is edited, not replaced.
//!
//! The daemon's rules are written into the document on disk with `toml_edit`: a changed field is
//! set in its `[[policy]]` table (its comment kept), a field that did not change keeps its
//! spelling (`src/24` stays `src/24`), a new policy is appended, a removed one deleted, list
//! entries added or removed one by one. Comments, order and blank lines survive. The file is
//! replaced atomically (temp file in the same directory, fsync, rename, fsync of the directory)
//! with its owner and mode; a symlink is followed and its target replaced, the link kept.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    io::{self, Write as _},
    os::unix::fs::{MetadataExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
};

use ipnet::IpNet;
use toml_edit::{ArrayOfTables, DocumentMut, Item, Table, Value};

use super::{
    Error,
    def::{FieldValue, PolicyDef, Visit},
    field::parse_net,
    file::ConfigFile,
};

/// The top of a file the daemon creates.
const HEADER: &str = "# limiter: policies and allow/deny lists.\n\
# limiter-ctl edits this file in place on every change (comments and order are kept);\n\
# edit by hand, then `systemctl reload limiter` (SIGHUP).\n";

/// The format marker, as the daemon writes it on top of a file that has none (see `file`).
const MARKER: &str = "version = 2 # a policy without `scope` is one allowance for the whole host\n";

/// Mode of a file the daemon creates (it holds no secret; an existing file keeps its own).
const NEW_FILE_MODE: u32 = 0o644;

/// Symlinks followed before giving up (as the kernel's MAXSYMLINKS).
const MAX_LINKS: usize = 40;

/// Writes `config` into the file at `path` (see the module's comment) and returns the text the
/// file now holds. A file that already says exactly this is left alone.
///
/// `last` is the file's text as the caller last read or wrote it (None: there was no file). A
/// file that says anything else holds a change the caller has not seen (a hand edit): it is not
/// overwritten ([`Error::Changed`]), for merging the caller's rules into it would undo that edit.
/// A missing file is written afresh. The file is read as a reload reads it ([`super::read`]:
/// opened non-blocking, its type checked first), so a FIFO or a device is refused, never waited
/// on.
pub fn save(path: &Path, config: &ConfigFile, last: Option<&str>) -> Result<String, Error> {
    let target = resolve(path).map_err(|source| Error::Write { path: path.to_path_buf(), source })?;
    let werr = |source| Error::Write { path: target.clone(), source };
    let current = match super::read(&target) {
        Ok(text) => Some(text),
        Err(Error::Missing { .. }) => None,
        Err(e) => return Err(e),
    };
    let (text, meta) = match current {
        Some(text) if last != Some(text.as_str()) => return Err(Error::Changed { path: target }),
        Some(text) => (text, Some(fs::metadata(&target).map_err(werr)?)),
        None => (String::new(), None),
    };
    // The comment block that opens the file is the file's own, not the first key's: kept apart,
    // so that it stays on top whatever happens to what follows.
    let (opening, rest) = if meta.is_some() { split_opening(&text) } else { (format!("{HEADER}\n"), String::new()) };
    let parse = |rest: &str| {
        rest.parse::<DocumentMut>().map_err(|e| {
            let (line, column) = e.span().map_or((1, 1), |span| line_column(rest, span.start));
            let line = line + opening.matches('\n').count();
            let message = format!("{} (not overwritten: fix it, then retry)", e.message().trim().replace('\n', " "));
            Error::Parse { path: target.clone(), line, column, message }
        })
    };
    let mut doc = parse(&rest)?;
    if !doc.contains_key(super::FORMAT_KEY) {
        // A file from before the marker (or a new one). The same rules: left alone, the marker
        // waits for a change. Else the marker goes on top, and with it every policy of scope cpu
        // gets `scope = "cpu"` written out below (no longer the default the marker says).
        if meta.is_some() && super::parse(&target, &text).is_ok_and(|old| old.same_rules(config)) {
            return Ok(text);
        }
        // A blank line between it and what the file said (none in a new file: its keys follow).
        let gap = if rest.trim().is_empty() { "" } else { "\n" };
        doc = parse(&format!("{MARKER}{gap}{rest}"))?;
    }
    edit(&mut doc, config);
    let body = format!("{opening}{doc}");
    if meta.is_some() && body == text {
        return Ok(text);
    }
    replace(&target, body.as_bytes(), meta.as_ref()).map_err(werr)?;
    Ok(body)
}

impl ConfigFile {
    /// Whether the two say the same rules, however written: policies in any order, list
    /// entries in any order or repeated, fields at their defaults written out or left out.
    pub fn same_rules(&self, other: &ConfigFile) -> bool {
        let policies =
            |c: &ConfigFile| c.policies.iter().map(|d| (d.name.clone(), d.clone())).collect::<BTreeMap<_, _>>();
        let nets = |l: &[IpNet]| l.iter().copied().collect::<BTreeSet<_>>();
        policies(self) == policies(other)
            && nets(&self.allow) == nets(&other.allow)
            && nets(&self.deny) == nets(&other.deny)
    }
}

/// The comment lines that open `text` with the blank line after them, and the rest. Without a
/// blank line after it, the comment is the first key's or table's, and moves with it.
fn split_opening(text: &str) -> (String, String) {
    let mut end = 0;
    for line in text.split_inclusive('\n') {
        if line.trim_start().starts_with('#') {
            end += line.len();
        } else {
            if end > 0 && line.trim().is_empty() {
                end += line.len();
                return (text[..end].to_string(), text[end..].to_string());
            }
            break;
        }
    }
    (String::new(), text.to_string())
}

/// Edits `doc` in place so that it says `config`, changing only what differs.
fn edit(doc: &mut DocumentMut, config: &ConfigFile) {
    set_list(doc, "allow", &config.allow);
    set_list(doc, "deny", &config.deny);
    set_policies(doc, &config.policies);
    if config.policies.is_empty() && config.allow.is_empty() && config.deny.is_empty() {
        // Said explicitly: a file with no rules is refused on reload unless it says `policy = []`.
        doc.insert("policy", toml_edit::value(toml_edit::Array::new()));
    }
}

/// Keeps the entries still listed (with their comments, in their order), removes the others,
/// appends the new ones.
fn set_list(doc: &mut DocumentMut, key: &str, nets: &[IpNet]) {
    if nets.is_empty() {
        doc.remove(key);
        return;
    }
    let Some(array) = doc.get_mut(key).and_then(Item::as_array_mut) else {
        doc.insert(key, toml_edit::value(nets.iter().map(|n| n.to_string()).collect::<toml_edit::Array>()));
        return;
    };
    let wanted: BTreeSet<IpNet> = nets.iter().copied().collect();
    let mut kept = BTreeSet::new();
    let keep: Vec<bool> = array
        .iter()
        .map(|v| v.as_str().and_then(|s| parse_net(s).ok()).is_some_and(|n| wanted.contains(&n) && kept.insert(n)))
        .collect();
    for i in (0..keep.len()).rev().filter(|&i| !keep[i]) {
        remove_entry(array, i);
    }
    // A new entry goes on a line of its own if the last one has one (after the last entry's
    // comment, which is in the array's trailing), else after a space.
    for net in nets.iter().filter(|n| !kept.contains(n)) {
        let indent = array.iter().last().map(|v| split_line(&raw(v.decor().prefix())).1);
        let (last_line, rest) = split_line(&raw(Some(array.trailing())));
        let mut value = Value::from(net.to_string());
        match indent {
            Some(indent)
                if !last_line.is_empty()
                    || raw(array.iter().last().and_then(|v| v.decor().prefix())).contains('\n') =>
            {
                value.decor_mut().set_prefix(last_line + &indent);
                array.set_trailing(format!("\n{rest}"));
            }
            Some(_) => value.decor_mut().set_prefix(" "),
            None => {}
        }
        array.push_formatted(value);
    }
}

fn raw(r: Option<&toml_edit::RawString>) -> String {
    r.and_then(|r| r.as_str()).unwrap_or("").to_string()
}

/// Up to and including the last newline (the end of the previous line), and after it (indentation).
fn split_line(s: &str) -> (String, String) {
    s.rfind('\n').map_or((String::new(), s.to_string()), |at| (s[..=at].to_string(), s[at + 1..].to_string()))
}

/// Removes entry `i` with its own comment, keeping the previous entry's. An entry's prefix
/// holds what follows the comma before it: the rest of the previous line (its comment), then the
/// indentation of its own; its comment is in the next entry's prefix (or the array's trailing).
fn remove_entry(array: &mut toml_edit::Array, i: usize) {
    let split = |s: &str| split_line(s);
    let (previous_line, _) = split(&raw(array.get(i).and_then(|v| v.decor().prefix())));
    if i + 1 < array.len() {
        if let Some(next) = array.get_mut(i + 1) {
            let (_, indent) = split(&raw(next.decor().prefix()));
            next.decor_mut().set_prefix(previous_line + &indent);
        }
    } else {
        let (_, indent) = split(&raw(Some(array.trailing())));
        array.set_trailing(previous_line + &indent);
    }
    array.remove(i);
}

/// Updates the `[[policy]]` tables by name, removes those no longer defined, appends new ones.
fn set_policies(doc: &mut DocumentMut, defs: &[PolicyDef]) {
    let wanted: BTreeMap<&str, &PolicyDef> = defs.iter().map(|d| (d.name.as_str(), d)).collect();
    if !matches!(doc.get("policy"), Some(Item::ArrayOfTables(_))) {
        // Absent, or written inline (`policy = [{...}]`): rewritten as tables.
        doc.remove("policy");
        if defs.is_empty() {
            return;
        }
        doc.insert("policy", Item::ArrayOfTables(ArrayOfTables::new()));
    }
    let Some(tables) = doc.get_mut("policy").and_then(Item::as_array_of_tables_mut) else {
        return;
    };
    let mut seen = BTreeSet::new();
    tables.retain(|t| {
        t.get("name").and_then(Item::as_str).is_some_and(|n| wanted.contains_key(n) && seen.insert(n.to_string()))
    });
    for table in tables.iter_mut() {
        if let Some(def) = table.get("name").and_then(Item::as_str).and_then(|n| wanted.get(n)).copied() {
            set_fields(table, def);
        }
    }
    for def in defs.iter().filter(|d| !seen.contains(d.name.as_str())) {
        let mut table = Table::new();
        table.insert("name", toml_edit::value(def.name.as_str()));
        set_fields(&mut table, def);
        table.decor_mut().set_prefix("\n");
        tables.push(table);
    }
    if tables.is_empty() {
        doc.remove("policy");
    }
}

/// Sets each field of `table` to what `def` says, where it says something else.
fn set_fields(table: &mut Table, def: &PolicyDef) {
    def.visit(&mut SetField(table));
}

/// One field: left as written if it already says the value (in any spelling), left out if
/// absent and the value is the default, else set (keeping the old value's comment) or, for a
/// value the file says by leaving the key out, removed.
struct SetField<'t>(&'t mut Table);

impl Visit for SetField<'_> {
    fn field<T: FieldValue>(&mut self, key: &'static str, want: &T) {
        let table = &mut *self.0;
        match table.get(key) {
            Some(item) if want.said_by(item) => {}
            None if T::new_default().as_ref() == Some(want) => {}
            _ => match want.to_toml() {
                Some(value) => replace_value(table, key, value),
                None => {
                    table.remove(key);
                }
            },
        }
    }
}

/// Sets `key` to `value`, keeping the decor (spacing, trailing comment) of the value it replaces.
fn replace_value(table: &mut Table, key: &str, mut value: Value) {
    if let Some(old) = table.get(key).and_then(Item::as_value) {
        *value.decor_mut() = old.decor().clone();
    }
    table.insert(key, Item::Value(value));
}

/// `path` with every symlink along its last component followed: the file to replace.
fn resolve(path: &Path) -> io::Result<PathBuf> {
    let mut p = path.to_path_buf();
    for _ in 0..MAX_LINKS {
        match fs::symlink_metadata(&p) {
            Ok(meta) if meta.file_type().is_symlink() => {
                let to = fs::read_link(&p)?;
                p = match p.parent() {
                    Some(dir) if to.is_relative() => dir.join(to),
                    _ => to,
                };
            }
            Ok(_) => return Ok(p),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(p),
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::from(nix::errno::Errno::ELOOP))
}

/// Replaces `target` with `body` so that a crash leaves the old file or the new one, never a mix;
/// the new file has the old one's owner and mode (`meta`), or 0644 if there was none.
fn replace(target: &Path, body: &[u8], meta: Option<&fs::Metadata>) -> io::Result<()> {
    let dir = target.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if meta.is_none() {
        fs::create_dir_all(dir)?;
    }
    let name = target.file_name().map_or("limiter.toml".into(), |n| n.to_string_lossy());
    let mut tmp = tempfile::Builder::new().prefix(&format!(".{name}.")).tempfile_in(dir)?;
    tmp.write_all(body)?;
    let file = tmp.as_file();
    match meta {
        Some(meta) => {
            // Owner first: chown clears set-id bits, the mode then restores them.
            std::os::unix::fs::fchown(file, Some(meta.uid()), Some(meta.gid()))?;
            file.set_permissions(fs::Permissions::from_mode(meta.mode() & 0o7777))?;
        }
        None => file.set_permissions(fs::Permissions::from_mode(NEW_FILE_MODE))?,
    }
    file.sync_all()?;
    tmp.persist(target).map_err(|e| e.error)?;
    fs::File::open(dir)?.sync_all()
}

fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{FileTypeExt as _, symlink};

    use super::*;
    use crate::config::{Mode, PolicyEdit, load};

    const OPERATOR: &str = r#"# Site limits. Ask ops before changing.
version = 2
deny = [
    "198.51.100.0/24", # scanner
    "2001:db8:bad::/48",
]

# Web first: it matters most.
[[policy]]
name = "web"   # the storefront
match = "tcp:80"
rate = "50/s"  # agreed with the web team
key = "src/24"

[[policy]]
name = "dns"
match = "udp:53"
rate = "100/s"
mode = "dry-run" # watching first
"#;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        fs::write(&path, text).unwrap();
        path
    }

    /// The config with `f` applied to policy `name`.
    fn edited(config: &ConfigFile, name: &str, edit: PolicyEdit) -> ConfigFile {
        let mut next = config.clone();
        let def = next.policies.iter_mut().find(|d| d.name.as_str() == name).unwrap();
        *def = edit.apply(&def.name.clone(), Some(def)).unwrap();
        next
    }

    #[test]
    fn a_change_edits_the_operators_file_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "limiter.toml", OPERATOR);
        let config = load(&path).unwrap();
        // The same rules: nothing is written.
        assert_eq!(save(&path, &config, Some(OPERATOR)).unwrap(), OPERATOR);
        assert_eq!(fs::read_to_string(&path).unwrap(), OPERATOR);

        let rate = PolicyEdit { rate: Some("80/s".parse().unwrap()), ..PolicyEdit::default() };
        let next = edited(&config, "web", rate);
        let written = save(&path, &next, Some(OPERATOR)).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert_eq!(written, text);
        assert_eq!(text, OPERATOR.replace(r#"rate = "50/s"  #"#, r#"rate = "80/s"  #"#), "one value changed");
        assert_eq!(load(&path).unwrap(), next);
    }

    #[test]
    fn policies_and_list_entries_are_added_and_removed_one_by_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "limiter.toml", OPERATOR);
        let mut config = load(&path).unwrap();
        config.policies.retain(|d| d.name.as_str() != "web");
        let new = PolicyEdit {
            rate: Some("5/s".parse().unwrap()),
            burst: Some(crate::config::BurstEdit::Count(9)),
            ..PolicyEdit::default()
        };
        config.policies.push(new.apply(&"icmp".parse().unwrap(), None).unwrap());
        config.deny.retain(|n| n.to_string() != "2001:db8:bad::/48");
        config.deny.push("203.0.113.0/24".parse().unwrap());
        config.allow.push("198.18.0.0/15".parse().unwrap());
        let dns = edited(&config, "dns", PolicyEdit { mode: Some(Mode::Enforce), ..PolicyEdit::default() });
        save(&path, &dns, Some(OPERATOR)).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert!(load(&path).unwrap().same_rules(&dns), "{text}");
        assert!(text.contains("    \"203.0.113.0/24\",\n]\n"), "{text}");
        for kept in ["# Site limits. Ask ops before changing.", r#""198.51.100.0/24", # scanner"#, "# watching first"] {
            assert!(text.contains(kept), "lost {kept:?}:\n{text}");
        }
        for gone in ["2001:db8:bad::/48", "storefront", "web"] {
            assert!(!text.contains(gone), "{gone:?} still there:\n{text}");
        }
        assert!(text.contains(r#"mode = "enforce" # watching first"#), "{text}");
        assert!(text.contains("    \"203.0.113.0/24\","), "a new entry laid out like the others:\n{text}");
        // dns stays where it was, icmp comes after it.
        let (dns_at, icmp_at) = (text.find("\"dns\"").unwrap(), text.find("\"icmp\"").unwrap());
        assert!(dns_at < icmp_at, "{text}");
        assert!(text.contains("\n\n[[policy]]\nname = \"icmp\"\nrate = \"5/s\"\nburst = 9\n"), "{text}");
        assert!(text.starts_with("# Site limits."), "{text}");
        assert!(text.find("allow = ").unwrap() < text.find("[[policy]]").unwrap(), "{text}");
    }

    #[test]
    fn a_burst_left_to_its_default_is_taken_out_and_spellings_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let text = "version = 2\n[[policy]]\nname = \"a\"\nrate = \"10/s\"\nburst = 5\nkey = \"src\"\nunit = \"packets\"\nmatch = \"any\"\n";
        let path = write(dir.path(), "limiter.toml", text);
        let config = load(&path).unwrap();
        let next = edited(
            &config,
            "a",
            PolicyEdit { burst: Some(crate::config::BurstEdit::Default), ..PolicyEdit::default() },
        );
        save(&path, &next, Some(text)).unwrap();
        // `src` and the defaults written out stay as the operator wrote them.
        assert_eq!(fs::read_to_string(&path).unwrap(), text.replace("burst = 5\n", ""));
    }

    #[test]
    fn a_new_file_gets_a_header_and_every_policy() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/limiter.toml");
        let edit = PolicyEdit { rate: Some("10/s".parse().unwrap()), ..PolicyEdit::default() };
        let config = ConfigFile {
            deny: vec!["198.51.100.0/24".parse().unwrap()],
            policies: vec![
                edit.apply(&"a".parse().unwrap(), None).unwrap(),
                edit.apply(&"b".parse().unwrap(), None).unwrap(),
            ],
            ..ConfigFile::default()
        };
        let written = save(&path, &config, None).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert_eq!(written, text);
        assert!(text.starts_with(HEADER), "{text}");
        assert_eq!(load(&path).unwrap(), config, "{text}");
        assert_eq!(fs::metadata(&path).unwrap().mode() & 0o7777, NEW_FILE_MODE);
        let names: Vec<_> = fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("limiter.toml")], "nothing left beside it");
        // Lists added after the policies go above them, the header stays on top, once.
        let with_deny = ConfigFile { deny: vec!["203.0.113.0/24".parse().unwrap()], ..config.clone() };
        let text = save(&path, &with_deny, Some(&text)).unwrap();
        assert!(text.starts_with(&format!("{HEADER}\n{MARKER}deny = [")), "{text}");
        assert_eq!(text.matches(HEADER).count(), 1, "{text}");
        // Emptied: the policies and lists go, the header stays, and the file says it has no rules.
        save(&path, &ConfigFile::default(), Some(&text)).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), format!("{HEADER}\n{MARKER}policy = []\n"));
        assert_eq!(load(&path).unwrap(), ConfigFile::default());
    }

    /// A file from before the format marker: written as it was until a change, then with the
    /// marker on top and `scope = "cpu"` on the policies that left scope out, nothing else moved.
    #[test]
    fn a_file_from_before_the_marker_keeps_its_meaning_when_rewritten() {
        use crate::config::{Scope, unversioned};
        let dir = tempfile::tempdir().unwrap();
        let old = OPERATOR.replace("version = 2\n", "");
        let old = old.replace(
            "mode = \"dry-run\" # watching first\n",
            "mode = \"dry-run\" # watching first\nscope = \"host\"\n",
        );
        let path = write(dir.path(), "limiter.toml", &old);
        let config = load(&path).unwrap();
        let scopes = |c: &ConfigFile| c.policies.iter().map(|d| (d.name.to_string(), d.scope)).collect::<Vec<_>>();
        // web leaves scope out: cpu, as before the marker; dns says host.
        assert_eq!(scopes(&config), [("web".into(), Scope::Cpu), ("dns".into(), Scope::Host)]);
        assert_eq!(unversioned(&old), Some(vec!["web".parse().unwrap()]));
        // The same rules: left alone, unversioned.
        assert_eq!(save(&path, &config, Some(&old)).unwrap(), old);
        // A change: the marker, and web's scope written out.
        let rate = PolicyEdit { rate: Some("80/s".parse().unwrap()), ..PolicyEdit::default() };
        let next = edited(&config, "web", rate);
        let text = save(&path, &next, Some(&old)).unwrap();
        assert_eq!(load(&path).unwrap(), next, "{text}");
        assert_eq!(unversioned(&text), None, "{text}");
        // On top, above the comment that opens the file (the first key's, without a blank line).
        let web = "rate = \"80/s\"  # agreed with the web team\nkey = \"src/24\"\nscope = \"cpu\"\n";
        let want = format!(
            "{MARKER}\n{}",
            old.replace("rate = \"50/s\"  # agreed with the web team\nkey = \"src/24\"\n", web)
        );
        assert_eq!(text, want, "the marker and web's scope added, nothing else");
        // From now on a policy without scope is host, and a new one is written without it.
        let new = PolicyEdit { rate: Some("5/s".parse().unwrap()), ..PolicyEdit::default() };
        let mut more = next.clone();
        more.policies.push(new.apply(&"icmp".parse().unwrap(), None).unwrap());
        let text = save(&path, &more, Some(&text)).unwrap();
        assert!(text.ends_with("\n[[policy]]\nname = \"icmp\"\nrate = \"5/s\"\n"), "{text}");
        assert_eq!(scopes(&load(&path).unwrap())[2], ("icmp".into(), Scope::Host));
        assert_eq!(text.matches("version = 2").count(), 1, "{text}");
    }

    #[test]
    fn a_symlink_is_followed_and_the_targets_mode_kept() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("real")).unwrap();
        let target = write(&dir.path().join("real"), "site.toml", OPERATOR);
        fs::set_permissions(&target, fs::Permissions::from_mode(0o600)).unwrap();
        let link = dir.path().join("limiter.toml");
        symlink("real/site.toml", &link).unwrap();
        let config = load(&link).unwrap();
        let next = edited(&config, "dns", PolicyEdit { rate: Some("7/s".parse().unwrap()), ..PolicyEdit::default() });
        save(&link, &next, Some(OPERATOR)).unwrap();
        assert!(fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link was replaced");
        assert_eq!(fs::read_link(&link).unwrap(), Path::new("real/site.toml"));
        assert!(fs::read_to_string(&target).unwrap().contains(r#"rate = "7/s""#));
        assert_eq!(fs::metadata(&target).unwrap().mode() & 0o7777, 0o600);
        let beside: Vec<_> = fs::read_dir(dir.path().join("real")).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(beside.len(), 1, "{beside:?}");
    }

    #[test]
    fn a_file_that_does_not_parse_is_not_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let broken = "[[policy]\nname = \"half-edited\"\n";
        let path = write(dir.path(), "limiter.toml", broken);
        let err = save(&path, &ConfigFile::default(), Some(broken)).unwrap_err().to_string();
        assert!(err.contains("limiter.toml:1:") && err.contains("not overwritten"), "{err}");
        assert!(!err.contains('\n'), "{err}");
        assert_eq!(fs::read_to_string(&path).unwrap(), broken);
    }

    #[test]
    fn a_hand_edit_the_caller_has_not_seen_is_not_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "limiter.toml", OPERATOR);
        let config = load(&path).unwrap();
        let edit = OPERATOR.replace(r#"rate = "50/s""#, r#"rate = "70/s""#);
        fs::write(&path, &edit).unwrap();
        let next = edited(&config, "dns", PolicyEdit { rate: Some("7/s".parse().unwrap()), ..PolicyEdit::default() });
        let err = save(&path, &next, Some(OPERATOR)).unwrap_err();
        assert!(matches!(err, Error::Changed { .. }), "{err}");
        assert!(err.to_string().contains("not overwritten"), "{err}");
        assert_eq!(fs::read_to_string(&path).unwrap(), edit);
        // A file the caller never saw, where it saw none, is no more its to overwrite.
        assert!(matches!(save(&path, &next, None), Err(Error::Changed { .. })));
        // Once seen (loaded, the change made on top), it is edited in place.
        let next = edited(
            &load(&path).unwrap(),
            "dns",
            PolicyEdit { rate: Some("7/s".parse().unwrap()), ..PolicyEdit::default() },
        );
        save(&path, &next, Some(&edit)).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.contains(r#"rate = "70/s""#) && text.contains(r#"rate = "7/s""#), "{text}");
        // A file removed is written afresh: nothing in it to lose.
        fs::remove_file(&path).unwrap();
        save(&path, &next, Some(&text)).unwrap();
        assert_eq!(load(&path).unwrap(), next);
    }

    #[test]
    fn a_fifo_in_its_place_is_refused_without_a_wait() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("limiter.toml");
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // Opened without a writer: a blocking read would never return.
        let err = save(&path, &ConfigFile::default(), Some("")).unwrap_err();
        assert!(matches!(err, Error::NotAFile { kind: "a FIFO", .. }), "{err}");
        assert!(fs::symlink_metadata(&path).unwrap().file_type().is_fifo(), "the FIFO was replaced");
    }

    #[test]
    fn a_leading_zero_in_the_file_is_refused_where_it_is() {
        let text = "allow = [\n  \"198.19.0.0/16\",\n  \"010.1.1.0/24\",\n]\n";
        match crate::config::parse(Path::new("c.toml"), text) {
            Err(Error::Parse { line: 3, message, .. }) => assert!(message.contains("invalid CIDR"), "{message}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn same_rules_ignores_order_spelling_and_repeats() {
        let a = crate::config::parse(Path::new("a"), OPERATOR).unwrap();
        let mut b = a.clone();
        b.policies.reverse();
        b.deny.reverse();
        b.deny.push(b.deny[0]);
        assert!(a.same_rules(&b));
        b.deny.pop();
        b.deny.pop();
        assert!(!a.same_rules(&b));
    }
}
