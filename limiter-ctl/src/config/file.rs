//! The daemon's TOML config: policies and allow/deny lists. Loaded at start and on SIGHUP;
//! edited in place on every change (`write.rs`: comments and order kept, written atomically).
//!
//! ```toml
//! version = 2             # the format: without it, a policy without `scope` is scope cpu
//! allow = ["198.18.7.0/24"]
//! deny = ["2001:db8:bad::/48"]
//!
//! [[policy]]
//! name = "dns"
//! match = "udp:53"        # any | tcp | udp | icmp, optionally :PORT or :LOW-HIGH
//! rate = "100/s"          # N/s, N/min, N/h
//! burst = 200             # default: one second's worth
//! key = "src/24,/56"      # default src/32,/64; +dport to key on the destination port too
//! unit = "packets"        # or "bytes"
//! mode = "enforce"        # or "dry-run"
//! scope = "cpu"           # default "host": one allowance for the whole host; "cpu": one per CPU
//! ```
//!
//! The format marker `version = 2` says that a policy without `scope` is scope host. A file
//! without it was written before scope host became the default: there such a policy keeps
//! scope cpu, as it always had (see [`unversioned`]), and the daemon's first write of the file
//! adds the marker and writes `scope = "cpu"` on those policies, so the file keeps its meaning.

use std::{fs, io, path::Path};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::{
    Error,
    def::PolicyDef,
    field::net_serde,
    policy::{Name, Scope},
};

pub const DEFAULT_PATH: &str = "/etc/limiter/limiter.toml";

/// The format this version reads and writes: the value of the top-level `version` key.
pub const FORMAT_VERSION: i64 = 2;
/// The key that says the format.
pub const FORMAT_KEY: &str = "version";

/// The rules a file says, every policy's scope resolved (see the module's comment): the file's
/// format marker is not among them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ConfigFile {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<IpNet>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<IpNet>,
    #[serde(rename = "policy", skip_serializing_if = "Vec::is_empty")]
    pub policies: Vec<PolicyDef>,
}

/// The file as written: the marker beside the rules.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Document {
    #[serde(default, deserialize_with = "format_version")]
    version: Option<i64>,
    // Through the config's own parser: ipnet's reads `010.1.1.1/32` as 10.1.1.1.
    #[serde(default, deserialize_with = "net_serde::deserialize_vec")]
    allow: Vec<IpNet>,
    #[serde(default, deserialize_with = "net_serde::deserialize_vec")]
    deny: Vec<IpNet>,
    #[serde(default, rename = "policy")]
    policies: Vec<PolicyDef>,
}

/// The marker: 2 alone (a later format must not be read as this one).
fn format_version<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    let v = i64::deserialize(d)?;
    if v != FORMAT_VERSION {
        return Err(serde::de::Error::custom(format!(
            "unsupported version {v}: this limiter-ctl reads version {FORMAT_VERSION} (and files without a version, \
             from before it)"
        )));
    }
    Ok(Some(v))
}

/// Parses config text; errors carry the line and column they were found at. In a file without
/// the format marker, a policy without `scope` is scope cpu (see the module's comment).
pub fn parse(path: &Path, text: &str) -> Result<ConfigFile, Error> {
    let doc: Document = toml::from_str(text).map_err(|e| {
        let (line, column) = e.span().map_or((1, 1), |span| line_column(text, span.start));
        Error::Parse { path: path.to_path_buf(), line, column, message: e.message().trim().replace('\n', " ") }
    })?;
    let mut file = ConfigFile { allow: doc.allow, deny: doc.deny, policies: doc.policies };
    if doc.version.is_none() {
        let unsaid = scope_unsaid(text);
        for (def, _) in file.policies.iter_mut().zip(&unsaid).filter(|(_, unsaid)| **unsaid) {
            def.scope = Scope::Cpu;
        }
    }
    Ok(file)
}

/// For each policy of the text, in order, whether it leaves `scope` out.
fn scope_unsaid(text: &str) -> Vec<bool> {
    let table = text.parse::<toml::Table>().unwrap_or_default();
    let policies = table.get("policy").and_then(toml::Value::as_array).map(Vec::as_slice).unwrap_or_default();
    policies.iter().map(|p| p.as_table().is_some_and(|t| !t.contains_key("scope"))).collect()
}

/// A file without the format marker (written before scope host became the default): the
/// policies that take scope cpu for leaving `scope` out, in the file's order. None for a file
/// with the marker, and for one where no policy leaves `scope` out (nothing differs there).
pub fn unversioned(text: &str) -> Option<Vec<Name>> {
    let table = text.parse::<toml::Table>().ok()?;
    if table.contains_key(FORMAT_KEY) {
        return None;
    }
    let policies = table.get("policy").and_then(toml::Value::as_array).map(Vec::as_slice).unwrap_or_default();
    let names: Vec<Name> = policies
        .iter()
        .filter_map(toml::Value::as_table)
        .filter(|t| !t.contains_key("scope"))
        .filter_map(|t| t.get("name")?.as_str()?.parse().ok())
        .collect();
    (!names.is_empty()).then_some(names)
}

/// What the daemon logs and `config check` says of an [`unversioned`] file: which policies keep
/// scope cpu, and how to opt in to the new default.
pub fn unversioned_note(path: &Path, names: &[Name]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("'{n}'")).collect();
    let which = match quoted.as_slice() {
        [one] => format!("policy {one} keeps"),
        _ => format!("policies {} keep", quoted.join(", ")),
    };
    format!(
        "{} has no `version = {FORMAT_VERSION}` (written before scope host became the default): {which} scope cpu, \
         a rate per CPU, for leaving `scope` out; add `version = {FORMAT_VERSION}` on top of the file for one \
         allowance for the whole host (the daemon adds it at its next write of the file, with `scope = \"cpu\"` \
         where scope is left out)",
        path.display()
    )
}

fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// The largest config read: 256 policies and 2 x 16384 list entries take well under 2 MiB.
pub const MAX_FILE_BYTES: u64 = 8 << 20;

/// Reads the config file's text, refusing anything that is not a config: a missing file, one
/// that is not a regular file (a FIFO, a directory, a device), one larger than
/// [`MAX_FILE_BYTES`], one that is not UTF-8, one with nothing in it but whitespace.
///
/// It never blocks: the file is opened with O_NONBLOCK (opening a FIFO would otherwise wait for
/// a writer) and its type checked on the open descriptor (fstat) before a byte is read.
pub fn read(path: &Path) -> Result<String, Error> {
    use std::{
        io::Read as _,
        os::unix::fs::{FileTypeExt as _, OpenOptionsExt as _},
    };
    let rerr = |source| Error::Read { path: path.to_path_buf(), source };
    let flags = nix::fcntl::OFlag::O_NONBLOCK | nix::fcntl::OFlag::O_NOCTTY;
    let file = match fs::OpenOptions::new().read(true).custom_flags(flags.bits()).open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(Error::Missing { path: path.to_path_buf() }),
        Err(e) => return Err(rerr(e)),
    };
    let meta = file.metadata().map_err(rerr)?;
    let kind = meta.file_type();
    if !kind.is_file() {
        let kind = match () {
            _ if kind.is_dir() => "a directory",
            _ if kind.is_fifo() => "a FIFO",
            _ if kind.is_socket() => "a socket",
            _ if kind.is_char_device() => "a character device",
            _ if kind.is_block_device() => "a block device",
            _ => "not a regular file",
        };
        return Err(Error::NotAFile { path: path.to_path_buf(), kind });
    }
    let too_large = |size| Error::TooLarge { path: path.to_path_buf(), size, max: MAX_FILE_BYTES };
    if meta.len() > MAX_FILE_BYTES {
        return Err(too_large(meta.len()));
    }
    // Capped again while reading: the file may grow between the fstat and the read.
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(rerr)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(too_large(bytes.len() as u64));
    }
    let text = String::from_utf8(bytes)
        .map_err(|e| rerr(io::Error::new(io::ErrorKind::InvalidData, format!("not UTF-8 text ({e})"))))?;
    if text.trim().is_empty() {
        return Err(Error::Empty { path: path.to_path_buf() });
    }
    Ok(text)
}

/// Loads the config at start: [`read`] and [`parse`], except that a missing file is an empty
/// config (a first start; the daemon writes the file). An empty or non-regular file is refused.
pub fn load(path: &Path) -> Result<ConfigFile, Error> {
    load_with_text(path).map(|(file, _)| file)
}

/// [`load`], with the text loaded (None: there was no file), for the daemon to tell a later
/// hand edit from what it runs.
pub fn load_with_text(path: &Path) -> Result<(ConfigFile, Option<String>), Error> {
    match read(path) {
        Ok(text) => Ok((parse(path, &text)?, Some(text))),
        Err(Error::Missing { .. }) => Ok((ConfigFile::default(), None)),
        Err(e) => Err(e),
    }
}

/// Whether the text says, explicitly, that it has no policies: `policy = []`. A reload onto a
/// file without rules is refused unless it does (see docs/OPERATIONS.md, "Reload").
pub fn says_no_rules(text: &str) -> bool {
    text.parse::<toml::Table>()
        .ok()
        .and_then(|t| t.get("policy").and_then(|p| p.as_array().map(Vec::is_empty)))
        .unwrap_or(false)
}

impl ConfigFile {
    /// No policy and no list entry.
    pub fn has_no_rules(&self) -> bool {
        self.policies.is_empty() && self.allow.is_empty() && self.deny.is_empty()
    }
}

/// Where in `text` (line, column) the thing a validation error names is: the `name` of the
/// policy it is about (for a policy defined twice, its second definition), or the list entry.
/// None for errors about the whole file, and for text that does not parse.
pub fn position(text: &str, error: &Error) -> Option<(usize, usize)> {
    use toml::de::{DeTable, DeValue};
    let root = DeTable::parse(text).ok()?;
    let get = |key: &str| root.get_ref().iter().find(|(k, _)| k.get_ref() == key).map(|(_, v)| v);
    let items = |key: &str| match get(key).map(|v| v.get_ref()) {
        Some(DeValue::Array(items)) => items.iter().collect::<Vec<_>>(),
        _ => Vec::new(),
    };
    let policy_names = |name: &Name| {
        items("policy")
            .into_iter()
            .filter_map(|item| match item.get_ref() {
                DeValue::Table(t) => t.iter().find(|(k, _)| k.get_ref() == "name").map(|(_, v)| v),
                _ => None,
            })
            .filter(|v| matches!(v.get_ref(), DeValue::String(s) if s.as_ref() == name.as_str()))
            .map(|v| v.span())
            .collect::<Vec<_>>()
    };
    let span = match error {
        Error::DefinedTwice(name) => policy_names(name).get(1)?.clone(),
        Error::BurstBelowFrame { name, .. } | Error::Policy { name, .. } | Error::SportWithoutPorts { name, .. } => {
            policy_names(name).first()?.clone()
        }
        Error::TooManyLayers { names, .. } | Error::TooManyCandidates { names, .. } => {
            policy_names(names.last()?).first()?.clone()
        }
        Error::HostBits { net } | Error::OnOtherList { net, .. } => ["allow", "deny"]
            .into_iter()
            .flat_map(items)
            .find(|v| matches!(v.get_ref(), DeValue::String(s) if s.parse::<IpNet>().is_ok_and(|n| n == *net)))?
            .span(),
        _ => return None,
    };
    Some(line_column(text, span.start))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Mode, Scope, Unit};

    const EXAMPLE: &str = r#"
allow = ["198.18.7.0/24"]
deny = ["2001:db8:bad::/48"]

[[policy]]
name = "dns"
match = "udp:53"
rate = "100/s"
burst = 200
key = "src/24,/56"

[[policy]]
name = "web"
match = "tcp:8000-8999"
rate = "50/min"
unit = "bytes"
mode = "dry-run"
scope = "host"

[[policy]]
name = "opens"
match = "tcp:443,syn"
rate = "10/s"
"#;

    #[test]
    fn round_trips_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/limiter.toml");
        let config = parse(&path, EXAMPLE).unwrap();
        assert_eq!(config.policies.len(), 3);
        assert!(config.policies[2].matches.syn && !config.policies[1].matches.syn);
        assert_eq!(config.policies[1].unit, Unit::Bytes);
        assert_eq!(config.policies[1].mode, Mode::DryRun);
        assert_eq!(config.policies[1].burst, None);
        assert_eq!((config.policies[0].scope, config.policies[1].scope), (Scope::Cpu, Scope::Host));
        super::super::save(&path, &config, None).unwrap();
        assert_eq!(load(&path).unwrap(), config);
        // Nothing but the file is left behind in the directory.
        let names: Vec<_> = fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("limiter.toml")]);
    }

    /// `version = 2` says a policy without scope is host; without it (a file from before), cpu.
    #[test]
    fn the_format_marker_says_what_a_policy_without_scope_means() {
        let p = Path::new("/etc/limiter/limiter.toml");
        let scopes = |text: &str| parse(p, text).unwrap().policies.iter().map(|d| d.scope).collect::<Vec<_>>();
        let two = "[[policy]]\nname = \"a\"\nrate = \"1/s\"\n\n[[policy]]\nname = \"b\"\nrate = \"1/s\"\nscope = \"host\"\n\n\
                   [[policy]]\nname = \"c\"\nrate = \"1/s\"\nscope = \"cpu\"\n";
        assert_eq!(scopes(two), [Scope::Cpu, Scope::Host, Scope::Cpu]);
        let versioned = format!("version = 2\n\n{two}");
        assert_eq!(scopes(&versioned), [Scope::Host, Scope::Host, Scope::Cpu]);
        // The note names the policies that keep cpu for leaving scope out, and how to opt in.
        let names = unversioned(two).unwrap();
        assert_eq!(names, vec![Name::from_static("a")]);
        let note = unversioned_note(p, &names);
        assert!(note.contains("'a'") && !note.contains("'b'") && note.contains("version = 2"), "{note}");
        assert!(note.contains(&p.display().to_string()) && !note.contains('\n'), "{note}");
        assert_eq!(unversioned(&versioned), None);
        // Nothing differs where no policy leaves scope out: no note.
        assert_eq!(unversioned("allow = [\"198.18.0.0/24\"]\n"), None);
        assert_eq!(unversioned("[[policy]]\nname = \"a\"\nrate = \"1/s\"\nscope = \"cpu\"\n"), None);
        // Inline tables too.
        assert_eq!(scopes("policy = [{ name = \"a\", rate = \"1/s\" }]\n"), [Scope::Cpu]);
        // Any other version is refused, where it is written.
        for bad in ["version = 3\n", "version = 1\n", "version = \"2\"\n", "version = 2.0\n"] {
            match parse(p, bad) {
                Err(Error::Parse { line: 1, message, .. }) => assert!(!message.contains('\n'), "{message}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        let err = parse(p, "version = 3\n").unwrap_err().to_string();
        assert!(err.contains("unsupported version 3"), "{err}");
    }

    #[test]
    fn errors_name_the_line_and_column() {
        let p = Path::new("/etc/limiter/limiter.toml");
        let cases = [
            ("[[policy]]\nname = \"dns\"\nrate = \"100/d\"\n", 3, "invalid rate"),
            ("[[policy]]\nname = \"dns\"\nrate = \"1/s\"\nmatch = \"udp:0\"\n", 4, "invalid match"),
            ("[[policy]]\nname = \"dns\"\nrate = \"1/s\"\nmatch = \"udp:53,syn\"\n", 4, "invalid match"),
            ("[[policy]]\nname = \"dns\"\nrate = \"1/s\"\nspeed = 3\n", 4, "unknown field"),
            ("allow = [\"198.18.0.0/33\"]\n", 1, "invalid"),
            ("[[policy]]\nname = \"dns\"\nrate = \"1/s\"\nburst = \"ten\"\n", 4, "invalid type"),
            ("[[policy]\n", 1, ""),
        ];
        for (text, line, what) in cases {
            match parse(p, text) {
                Err(Error::Parse { line: l, message, .. }) => {
                    assert_eq!(l, line, "{text:?}: {message}");
                    assert!(message.contains(what), "{text:?}: {message}");
                    assert!(!message.contains('\n'));
                }
                other => panic!("{text:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_missing_file_is_an_empty_config() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(load(&dir.path().join("none.toml")).unwrap(), ConfigFile::default());
    }

    #[test]
    fn only_a_regular_non_empty_file_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let at = |name: &str| dir.path().join(name);
        assert!(matches!(read(&at("none.toml")), Err(Error::Missing { .. })));
        nix::unistd::mkfifo(&at("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // Opened without a writer, and not read: no wait.
        assert!(matches!(read(&at("fifo")), Err(Error::NotAFile { kind: "a FIFO", .. })));
        assert!(matches!(load(&at("fifo")), Err(Error::NotAFile { .. })));
        assert!(matches!(read(dir.path()), Err(Error::NotAFile { kind: "a directory", .. })));
        assert!(matches!(read(Path::new("/dev/null")), Err(Error::NotAFile { kind: "a character device", .. })));
        for empty in ["", " \n\t\n"] {
            fs::write(at("empty.toml"), empty).unwrap();
            assert!(matches!(read(&at("empty.toml")), Err(Error::Empty { .. })), "{empty:?}");
            assert!(matches!(load(&at("empty.toml")), Err(Error::Empty { .. })), "{empty:?}");
        }
        fs::write(at("big.toml"), vec![b'#'; MAX_FILE_BYTES as usize + 1]).unwrap();
        assert!(matches!(read(&at("big.toml")), Err(Error::TooLarge { .. })));
        fs::write(at("latin1.toml"), b"# caf\xe9\n").unwrap();
        assert!(matches!(read(&at("latin1.toml")), Err(Error::Read { .. })));
        fs::write(at("comments.toml"), "# nothing yet\n").unwrap();
        assert_eq!(load(&at("comments.toml")).unwrap(), ConfigFile::default());
        for e in [read(&at("none.toml")).unwrap_err(), read(&at("fifo")).unwrap_err()] {
            assert!(e.to_string().contains(&dir.path().display().to_string()), "{e}");
        }
    }

    #[test]
    fn no_rules_must_be_said() {
        assert!(says_no_rules("policy = []\n"));
        assert!(says_no_rules("# off for now\nallow = []\npolicy = []\n"));
        assert!(!says_no_rules("# policy = []\n"));
        assert!(!says_no_rules("allow = []\n"));
        assert!(!says_no_rules(EXAMPLE));
        assert!(parse(Path::new("x"), "policy = []\n").unwrap().has_no_rules());
        assert!(!parse(Path::new("x"), "deny = [\"198.18.0.0/24\"]\n").unwrap().has_no_rules());
    }

    #[test]
    fn validation_errors_are_placed_on_what_they_name() {
        let text = "allow = [\"198.18.0.0/24\", \"198.18.1.1/24\"]\n\n[[policy]]\nname = \"a\"\nrate = \"1/s\"\n\n\
                    [[policy]]\nname = \"b\"\nrate = \"1/s\"\n\n[[policy]]\n  name = \"a\"\nrate = \"2/s\"\n";
        let a: Name = "a".parse().unwrap();
        assert_eq!(position(text, &Error::DefinedTwice(a.clone())), Some((12, 10)));
        let layers = Error::TooManyLayers { traffic: "udp".into(), names: vec!["b".parse().unwrap(), a], max: 4 };
        assert_eq!(position(text, &layers), Some((4, 8)));
        let net: IpNet = "198.18.1.1/24".parse().unwrap();
        assert_eq!(position(text, &Error::HostBits { net }), Some((1, 27)));
        assert_eq!(position(text, &Error::TooManyPolicies { max: 1 }), None);
        assert_eq!(position("[[policy]\n", &Error::TooManyPolicies { max: 1 }), None);
    }
}
