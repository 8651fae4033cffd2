//! A policy's fields, declared once: the list in [`policy_fields!`]'s one use below gives each
//! field its key (in the file, on the socket and in `policy show`), its `policy set` flag and
//! its entry in limiter.toml(5). From it come [`PolicyDef`] (a whole policy, as the file, the
//! socket and `policy show` carry it), [`PolicyEdit`] (what `policy set` changes) with its
//! [`apply`](PolicyEdit::apply), [`FIELDS`] (what the CLI builds its flags from, and the man page
//! its keys), and [`PolicyDef::visit`], which walks the fields for the file's write-back, the
//! change log line, `policy list` and `policy show`, and the stats and metrics labels. What a
//! field's type brings (its text, its default, its form in the file) is its [`FieldValue`].
//!
//! A new field: a line in the list, a [`FieldValue`] impl if its type is new, and what it means
//! to the kernel (`kernel::compile`). Every field but the rate has a default: a file written
//! before the field existed must still mean what it meant.

use std::{fmt, str::FromStr};

use limiter_common::{Gcra, gcra::GcraError, limits::MAX_FRAME_WEIGHT};
use serde::{Deserialize, Serialize};
use toml_edit::{Item, Value};

use super::{
    Error,
    policy::{BurstEdit, Destination, KeySpec, Match, Mode, Name, Scope, SourcePorts, Unit},
    rate::Rate,
};

/// What a field's type brings to the declaration.
pub trait FieldValue: Clone + PartialEq {
    /// What `policy set` and the socket give: the value itself, but for the burst (`default` or
    /// a count).
    type Edit: Clone + FromStr<Err: fmt::Display> + Into<Self>;
    /// The words it is one of (the CLI offers and checks them), or none: free text. A field of
    /// words is a stats and metrics label (few values, so few series).
    const WORDS: &'static [&'static str] = &[];
    /// Whether the file and the socket write it as a number.
    const NUMBER: bool = false;

    /// What a new policy takes when it is not given; None: it must be given.
    fn new_default() -> Option<Self>;
    /// Its text: in the change log line, the labels, `policy list` and `policy show`.
    fn text(&self) -> String;
    /// Its value in the file; None: the key is left out.
    fn to_toml(&self) -> Option<Value>;
    /// Whether an item of the file already says it, however spelt (`src/24` is `src/24,/64`).
    fn said_by(&self, item: &Item) -> bool;
}

/// Fields written as their text, a TOML string in the file.
macro_rules! text_value {
    ($($t:ty: new $new:expr $(, words $words:expr)?;)+) => {$(
        impl FieldValue for $t {
            type Edit = Self;
            $(const WORDS: &'static [&'static str] = $words;)?

            fn new_default() -> Option<Self> {
                $new
            }

            fn text(&self) -> String {
                self.to_string()
            }

            fn to_toml(&self) -> Option<Value> {
                Some(Value::from(self.to_string()))
            }

            fn said_by(&self, item: &Item) -> bool {
                item.as_str().and_then(|s| s.parse::<Self>().ok()).as_ref() == Some(self)
            }
        }
    )+};
}

text_value! {
    Match: new Some(Match::default());
    SourcePorts: new Some(SourcePorts::default());
    Destination: new Some(Destination::default());
    Rate: new None;
    KeySpec: new Some(KeySpec::default());
    Unit: new Some(Unit::default()), words Unit::WORDS;
    Mode: new Some(Mode::default()), words Mode::WORDS;
    Scope: new Some(Scope::default()), words Scope::WORDS;
}

/// The burst: a count, or None for the default (one second's worth of the rate), which the
/// file says by leaving the key out.
impl FieldValue for Option<u64> {
    type Edit = BurstEdit;
    const NUMBER: bool = true;

    fn new_default() -> Option<Self> {
        Some(None)
    }

    fn text(&self) -> String {
        self.map_or_else(|| "default".to_string(), |n| n.to_string())
    }

    fn to_toml(&self) -> Option<Value> {
        // Beyond i64 TOML has no integer (and no valid policy has such a burst): written as
        // text, the next load names it.
        self.map(|n| i64::try_from(n).map_or_else(|_| Value::from(n.to_string()), Value::from))
    }

    fn said_by(&self, item: &Item) -> bool {
        self.is_some_and(|n| item.as_integer().and_then(|v| u64::try_from(v).ok()) == Some(n))
    }
}

/// How `policy set` takes a field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flag {
    /// `--KEY VALUE`, its help in one line; `dash`: which values may start with `-` (taken as
    /// values, so `-1` meets the field's own error rather than "unexpected argument").
    Value { value_name: &'static str, help: &'static str, dash: Dash },
    /// A flag per word, each setting the field to it (`--dry-run`, `--enforce`): (word, help).
    Words(&'static [(&'static str, &'static str)]),
}

/// Which values given to a flag may start with `-`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dash {
    None,
    Numbers,
    Any,
}

/// A field as the CLI and limiter.toml(5) show it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    /// Its key in the file, on the socket and in `policy show`; its flag, for a [`Flag::Value`].
    pub key: &'static str,
    pub flag: Flag,
    /// Its entry in limiter.toml(5).
    pub about: &'static str,
    /// See [`FieldValue::WORDS`].
    pub words: &'static [&'static str],
    /// See [`FieldValue::NUMBER`].
    pub number: bool,
}

/// One visit per field of a policy, in their declared order (see [`PolicyDef::visit`]).
pub trait Visit {
    fn field<T: FieldValue>(&mut self, key: &'static str, value: &T);
}

/// Declares the fields (see the module's comment): `field: Type => "key" { flag, about }`, with
/// the field's doc and serde attributes on [`PolicyDef`] before it.
macro_rules! policy_fields {
    ($(
        $(#[$attr:meta])*
        $field:ident: $ty:ty => $key:literal { flag: $flag:expr, about: $about:literal $(,)? }
    )+) => {
        /// A named policy as the file, the socket and `policy show` carry it.
        #[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct PolicyDef {
            pub name: Name,
            $(
                $(#[$attr])*
                #[serde(rename = $key)]
                pub $field: $ty,
            )+
        }

        /// What `policy set` changes: the fields given, nothing else. An existing policy keeps
        /// every field not given (a rate change must not turn a dry-run policy into an
        /// enforcing one); a new policy takes the defaults for them, and needs a rate.
        #[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct PolicyEdit {
            $(
                #[serde(rename = $key, default, skip_serializing_if = "Option::is_none")]
                pub $field: Option<<$ty as FieldValue>::Edit>,
            )+
        }

        /// Every field, in its declared order.
        pub const FIELDS: &[Field] = &[$(
            Field {
                key: $key,
                flag: $flag,
                about: $about,
                words: <$ty as FieldValue>::WORDS,
                number: <$ty as FieldValue>::NUMBER,
            },
        )+];

        impl PolicyEdit {
            /// The policy `name` becomes: `existing` with the given fields changed, or (none
            /// existing) a new policy of the given fields and the defaults. A burst left at its
            /// default stays "one second's worth" of whatever the rate becomes.
            pub fn apply(&self, name: &Name, existing: Option<&PolicyDef>) -> Result<PolicyDef, Error> {
                let mut def = match existing {
                    Some(def) => def.clone(),
                    None => PolicyDef {
                        name: name.clone(),
                        $($field: match self.$field.clone().map(Into::into).or_else(<$ty as FieldValue>::new_default) {
                            Some(value) => value,
                            None => return Err(Error::NewPolicyNeeds { name: name.clone(), flag: $key }),
                        },)+
                    },
                };
                $(if let Some(given) = &self.$field {
                    def.$field = given.clone().into();
                })+
                Ok(def)
            }

            /// Gives the field of this key, from its text (a `policy set` flag's value).
            pub fn set(&mut self, key: &str, text: &str) -> Result<(), String> {
                match key {
                    $($key => self.$field = Some(text.parse().map_err(|e| format!("{e}"))?),)+
                    _ => return Err(format!("a policy has no field '{key}'")),
                }
                Ok(())
            }
        }

        impl PolicyDef {
            /// Visits each field (not the name), in the declared order.
            pub fn visit(&self, visitor: &mut impl Visit) {
                $(visitor.field($key, &self.$field);)+
            }
        }
    };
}

policy_fields! {
    #[serde(default)]
    matches: Match => "match" {
        flag: Flag::Value {
            value_name: "MATCH",
            help: "any, tcp, udp or icmp, optionally with a destination port or range: udp:53, tcp:8000-8999; \
                   tcp with ,syn judges connection openings only (SYN without ACK): tcp:443,syn \
                   [new policy: any]",
            dash: Dash::None,
        },
        about: "What traffic: any, tcp, udp or icmp, optionally with a destination port or range (udp:53, \
                tcp:8000-8999). For tcp, a trailing ,syn (tcp,syn, tcp:443,syn) judges connection openings \
                only, segments with SYN set and ACK clear: established traffic never meets the policy. \
                Policies may overlap: a packet is judged by every policy that covers it (match, sport and \
                dst), at most 4, and passes only if each admits it. Default: any.",
    }
    #[serde(default, skip_serializing_if = "SourcePorts::is_any")]
    sport: SourcePorts => "sport" {
        flag: Flag::Value {
            value_name: "PORTS",
            help: "Source ports the policy judges: any, a port (123) or a range (1024-65535); tcp and udp \
                   matches only [new policy: any]",
            dash: Dash::None,
        },
        about: "Which source ports: any, a port (123) or a range (1024-65535). For tcp and udp matches only; \
                a reflection flood comes from one (udp with sport 123: NTP). Default: any.",
    }
    #[serde(default, skip_serializing_if = "Destination::is_any")]
    dst: Destination => "dst" {
        flag: Flag::Value {
            value_name: "PREFIXES",
            help: "Destinations the policy judges: any, or a prefix per family, comma-separated: 198.18.0.2/32 or \
                   198.18.0.0/24,2001:db8::/64 [new policy: any]",
            dash: Dash::None,
        },
        about: "Which destination addresses: any, or a prefix per family, comma-separated (198.18.0.2/32, \
                198.18.0.0/24,2001:db8::/64). With a prefix in one family only, the policy judges no packet \
                of the other. Default: any.",
    }
    rate: Rate => "rate" {
        flag: Flag::Value {
            value_name: "RATE",
            help: "Rate per key: N/s, N/min or N/h; 0/s drops everything the policy judges (required for a new \
                   policy)",
            dash: Dash::Any,
        },
        about: "Required. The allowance per key: N/s, N/min or N/h, in the policy's unit. 0/s (or 0/min, \
                0/h) drops everything the policy judges, burst or not: a reflection source port denied \
                outright.",
    }
    /// None: one second's worth of the rate (see [`PolicyDef::default_burst`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    burst: Option<u64> => "burst" {
        flag: Flag::Value {
            value_name: "N",
            help: "Burst in the policy's unit, or `default`: one second's worth of the rate (in bytes at least \
                   65535), following the rate when it changes [new policy: default]",
            dash: Dash::Numbers,
        },
        about: "How much may pass at once, in the policy's unit. Default: one second's worth of the rate (in \
                bytes at least 65535), following the rate when it changes. A byte burst must hold the \
                interface's largest frame.",
    }
    #[serde(default)]
    key: KeySpec => "key" {
        flag: Flag::Value {
            value_name: "KEY",
            help: "Sources sharing an allowance: src/V4LEN,/V6LEN, optionally +dport [new policy: src/32,/64]",
            dash: Dash::None,
        },
        about: "Which sources share an allowance: src/V4LEN,/V6LEN, optionally +dport to key on the \
                destination port too. Default: src/32,/64.",
    }
    #[serde(default)]
    unit: Unit => "unit" {
        flag: Flag::Value { value_name: "UNIT", help: "What the rate counts [new policy: packets]", dash: Dash::None },
        about: "What the rate counts: packets or bytes. Default: packets.",
    }
    #[serde(default)]
    mode: Mode => "mode" {
        flag: Flag::Words(&[
            ("dry-run", "Pass everything; count what would have been refused"),
            ("enforce", "Drop what is over the rate (the default for a new policy; ends a dry run)"),
        ]),
        about: "enforce drops what is over the rate; dry-run passes everything and counts what would have \
                been dropped. Default: enforce.",
    }
    #[serde(default)]
    scope: Scope => "scope" {
        flag: Flag::Value {
            value_name: "SCOPE",
            help: "Whose allowance the rate is: the whole host's (host: one allowance per source however its \
                   packets spread over CPUs, updated by compare-and-exchange on admission) or each CPU's (cpu: a \
                   source spread over k CPUs can get k times the rate; no atomics) [new policy: host]",
            dash: Dash::None,
        },
        about: "Whose allowance: host (one for the whole host) or cpu (each CPU its own; a source spread over k \
                CPUs may get k times the rate). Default: host; in a file without version = 2 (written before \
                host was the default), cpu.",
    }
}

/// Collects each field's key and text.
struct Texts {
    words_only: bool,
    out: Vec<(&'static str, String)>,
}

impl Visit for Texts {
    fn field<T: FieldValue>(&mut self, key: &'static str, value: &T) {
        if !self.words_only || !T::WORDS.is_empty() {
            self.out.push((key, value.text()));
        }
    }
}

impl PolicyDef {
    /// Each field's key and text, in the declared order (the name not among them).
    pub fn fields(&self) -> Vec<(&'static str, String)> {
        let mut texts = Texts { words_only: false, out: Vec::new() };
        self.visit(&mut texts);
        texts.out
    }

    /// The stats and metrics labels: the fields of words (see [`FieldValue::WORDS`]).
    pub fn labels(&self) -> Vec<(&'static str, String)> {
        let mut texts = Texts { words_only: true, out: Vec::new() };
        self.visit(&mut texts);
        texts.out
    }

    /// The policy in one line, `name=dns match=udp:53 rate=100/s burst=100 ...`, its burst
    /// resolved: what the change log says.
    pub fn summary(&self) -> String {
        let resolved = PolicyDef { burst: Some(self.burst_or_default()), ..self.clone() };
        let mut line = format!("name={}", self.name);
        for (key, text) in resolved.fields() {
            line.push_str(&format!(" {key}={text}"));
        }
        line
    }

    pub fn burst_or_default(&self) -> u64 {
        self.burst.unwrap_or_else(|| Self::default_burst(self.rate, self.unit))
    }

    /// The burst used when none is given: one second's worth of the rate, and in byte mode at
    /// least one largest frame, so every frame can pass.
    pub fn default_burst(rate: Rate, unit: Unit) -> u64 {
        let second = rate.per_sec().ceil().max(1.0) as u64;
        match unit {
            Unit::Packets => second,
            Unit::Bytes => second.max(MAX_FRAME_WEIGHT),
        }
    }

    /// The GCRA of this policy's rate, burst and unit, as the kernel judges by it; an error if
    /// the clock cannot represent it.
    pub fn gcra(&self) -> Result<Gcra, GcraError> {
        let max_weight = match self.unit {
            Unit::Packets => 1,
            Unit::Bytes => MAX_FRAME_WEIGHT,
        };
        if self.rate.count == 0 {
            // Nothing passes (`Policy::DENY`): the kernel never judges by this one.
            return Gcra::new(1, self.rate.period_ns, 1, max_weight);
        }
        Gcra::new(self.rate.count, self.rate.period_ns, self.burst_or_default(), max_weight)
    }

    /// Test-only: a policy named `any` of this rate and burst, every other field at its default.
    #[cfg(any(test, feature = "testing"))]
    pub fn any(rate: Rate, burst: u64) -> Self {
        let edit = PolicyEdit { rate: Some(rate), burst: Some(BurstEdit::Count(burst)), ..PolicyEdit::default() };
        edit.apply(&Name::from_static("any"), None).expect("a new policy needs a rate and nothing else")
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::path::Path;

    use super::*;

    /// A policy whose every field is off its default: each shows in every form.
    pub(crate) fn every_field_set() -> PolicyDef {
        PolicyDef {
            name: "dns".parse().unwrap(),
            matches: "udp:53".parse().unwrap(),
            sport: "1024-65535".parse().unwrap(),
            dst: "198.18.0.0/24,2001:db8::/64".parse().unwrap(),
            rate: "100/s".parse().unwrap(),
            burst: Some(20),
            key: "src/24,/56+dport".parse().unwrap(),
            unit: Unit::Bytes,
            mode: Mode::DryRun,
            scope: Scope::Cpu,
        }
    }

    impl PolicyDef {
        fn with_name(self, name: &'static str) -> Self {
            Self { name: Name::from_static(name), ..self }
        }
    }

    /// Each declared field reaches every form: the file (read, and written back into a file
    /// that has it and one that has not), the socket (the whole policy and the edit), the edit
    /// from its text, the log line, the labels (its words), `policy show`. The CLI's flags are
    /// checked against the same list in `cli::args`, the man page in `cli::man`.
    #[test]
    fn every_field_reaches_every_form() {
        let set = every_field_set();
        let slow: Rate = "7/s".parse().unwrap();
        let defaults = PolicyEdit { rate: Some(slow), ..PolicyEdit::default() }.apply(&set.name, None).unwrap();
        let texts = set.fields();
        assert_eq!(texts.iter().map(|(k, _)| *k).collect::<Vec<_>>(), FIELDS.iter().map(|f| f.key).collect::<Vec<_>>());
        let json = serde_json::to_value(&set).unwrap();
        let toml_text = toml::to_string(&set).unwrap();
        let summary = set.summary();
        let labels = set.labels();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("limiter.toml");
        for (field, (key, text)) in FIELDS.iter().zip(&texts) {
            assert!(!field.about.is_empty(), "{key}: no entry for limiter.toml(5)");
            // Off its default, as the sample means it to be.
            assert_ne!(defaults.fields().iter().find(|(k, _)| k == key).map(|(_, t)| t), Some(text), "{key}");
            // The file and the socket carry it under its key; the log line and `policy show` say it.
            assert!(json.get(key).is_some(), "{key} not in {json}");
            assert!(toml_text.lines().any(|l| l.starts_with(&format!("{key} = "))), "{key} not in {toml_text}");
            assert!(summary.contains(&format!(" {key}={text}")), "{key}={text} not in {summary}");
            assert_eq!(labels.iter().any(|(k, _)| k == key), !field.words.is_empty(), "{key}: {labels:?}");
            if !field.words.is_empty() {
                assert!(field.words.contains(&text.as_str()), "{key}: {text} is not one of {:?}", field.words);
            }
            // Given alone (from its text, as `policy set` gives it), it changes that field only.
            let mut edit = PolicyEdit::default();
            edit.set(key, text).unwrap();
            let edited = edit.apply(&set.name, Some(&defaults)).unwrap();
            let changed: Vec<_> =
                edited.fields().into_iter().zip(defaults.fields()).filter(|(a, b)| a != b).map(|(a, _)| a).collect();
            assert_eq!(changed, vec![(*key, text.clone())], "{key}");
            // The edit crosses the socket.
            let wire = serde_json::to_string(&edit).unwrap();
            assert!(wire.contains(&format!("\"{key}\"")), "{wire}");
            assert_eq!(serde_json::from_str::<PolicyEdit>(&wire).unwrap(), edit);
            // Written back: into a new file, then back to the default in the file that has it.
            let one = super::super::ConfigFile { policies: vec![edited.clone()], ..Default::default() };
            let _ = std::fs::remove_file(&path);
            let written = super::super::save(&path, &one, None).unwrap();
            assert!(written.lines().any(|l| l.starts_with(&format!("{key} = "))), "{key} not written:\n{written}");
            assert_eq!(super::super::load(&path).unwrap(), one, "{written}");
            let back = super::super::ConfigFile { policies: vec![defaults.clone()], ..Default::default() };
            let text_back = super::super::save(&path, &back, Some(&written)).unwrap();
            assert_eq!(super::super::load(&path).unwrap(), back, "{key}:\n{text_back}");
        }
        // The whole policy round-trips through the file's and the socket's forms.
        assert_eq!(serde_json::from_value::<PolicyDef>(json).unwrap(), set);
        assert_eq!(toml::from_str::<PolicyDef>(&toml_text).unwrap(), set);
        // A file that leaves a field out means its default, as `policy set` does for a new policy;
        // but in a file from before the format marker, a policy without scope is scope cpu.
        let file = "version = 2\n\n[[policy]]\nname = \"dns\"\nrate = \"7/s\"\n";
        assert_eq!(super::super::parse(Path::new("x"), file).unwrap().policies, vec![defaults.clone()]);
        let old = file.trim_start_matches("version = 2\n\n");
        let cpu = PolicyDef { scope: Scope::Cpu, ..defaults };
        assert_eq!(super::super::parse(Path::new("x"), old).unwrap().policies, vec![cpu]);
    }

    #[test]
    fn an_edit_changes_only_the_fields_given() {
        let name: Name = "dns".parse().unwrap();
        let existing = every_field_set();
        let rate = PolicyEdit { rate: Some("500/s".parse().unwrap()), ..PolicyEdit::default() };
        let changed = rate.apply(&name, Some(&existing)).unwrap();
        assert_eq!(changed, PolicyDef { rate: "500/s".parse().unwrap(), ..existing.clone() });
        let enforce =
            PolicyEdit { mode: Some(Mode::Enforce), burst: Some(BurstEdit::Default), ..PolicyEdit::default() };
        assert_eq!(
            enforce.apply(&name, Some(&existing)).unwrap(),
            PolicyDef { mode: Mode::Enforce, burst: None, ..existing.clone() }
        );
        assert_eq!(PolicyEdit::default().apply(&name, Some(&existing)).unwrap(), existing);
        let host = PolicyEdit { scope: Some(Scope::Host), ..PolicyEdit::default() };
        assert_eq!(host.apply(&name, Some(&existing)).unwrap(), PolicyDef { scope: Scope::Host, ..existing.clone() });
        // A new policy: the defaults, and a rate is required.
        let new = rate.apply(&name, None).unwrap();
        assert_eq!((new.matches, new.key, new.unit, new.mode, new.burst, new.scope), Default::default());
        // One allowance for the whole host, unless asked otherwise.
        assert_eq!(new.scope, Scope::Host);
        let err = PolicyEdit::default().apply(&name, None).unwrap_err().to_string();
        assert!(err.contains("'dns'") && err.contains("--rate"), "{err}");
        assert_eq!(PolicyDef::any(rate.rate.unwrap(), 9), PolicyDef { burst: Some(9), ..new.with_name("any") });
        assert_eq!("default".parse(), Ok(BurstEdit::Default));
        assert_eq!("7".parse(), Ok(BurstEdit::Count(7)));
        for bad in ["0", "07", "+7", "Default", ""] {
            assert!(bad.parse::<BurstEdit>().is_err(), "{bad}");
        }
    }

    #[test]
    fn default_burst_lets_any_frame_through_in_byte_mode() {
        let rate: Rate = "1000/s".parse().unwrap();
        assert_eq!(PolicyDef::default_burst(rate, Unit::Packets), 1000);
        assert_eq!(PolicyDef::default_burst(rate, Unit::Bytes), MAX_FRAME_WEIGHT);
        assert_eq!(PolicyDef::default_burst("5/h".parse().unwrap(), Unit::Packets), 1);
    }
}
