//! An answer of `/v1/decisions/stream` read as it arrives: `{"new": [...], "deleted": [...]}`
//! (either null; one at least), each element judged as soon as it is read and only the bans
//! kept ([`Batch`]). So reading an answer costs the bans it holds, at most [`MAX_DECISIONS`],
//! and one element at a time beyond them, whatever its size (within `bounded`'s bounds) or
//! its shape. Garbage as a whole is an error: nothing of it may be applied.

use std::{
    fmt,
    io::{self, BufReader, Read},
};

use limiter_common::maps::{MAX_BAN_NETS, MAX_BANS};
use serde::{
    Deserialize, Deserializer,
    de::{self, DeserializeSeed, Error as _, IgnoredAny, MapAccess, SeqAccess, Visitor},
};

use super::{
    bounded::{Bounded, Overrun},
    decisions::{Batch, Field, RawDecision, Which},
};

/// The most bans an answer may hold, new and deleted: what the daemon can hold (its single
/// addresses and its prefixes, of both families). An answer with more is refused whole.
pub(crate) const MAX_DECISIONS: usize = 2 * (MAX_BANS as usize + MAX_BAN_NETS as usize);

/// Why an answer is not applied at all.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StreamError {
    #[error("not a decision stream: {0}")]
    Json(serde_json::Error),
    #[error("{0}")]
    Overrun(Overrun),
    #[error("more than {0} bans in one answer (the most the daemon holds)")]
    TooMany(usize),
    #[error("an answer cut short: {0}")]
    Io(io::Error),
}

/// Reads an answer of `/v1/decisions/stream` from `reader`, keeping at most `max_decisions`
/// bans; an element that is not a usable ban is skipped and counted.
pub(crate) fn read_stream(reader: impl Read, max_decisions: usize) -> Result<Batch, StreamError> {
    // Buffered outside the bounds: the parser reads a byte at a time, the bounds see chunks.
    let mut de = serde_json::Deserializer::from_reader(BufReader::with_capacity(64 * 1024, Bounded::new(reader)));
    let mut reading = Reading { batch: Batch::default(), max: max_decisions, over: false };
    let read = de.deserialize_map(Answer(&mut reading)).and_then(|()| de.end());
    match read {
        Ok(()) => Ok(reading.batch),
        Err(_) if reading.over => Err(StreamError::TooMany(max_decisions)),
        Err(e) if e.is_io() => {
            let e = io::Error::from(e);
            Err(Overrun::of(&e).map_or(StreamError::Io(e), StreamError::Overrun))
        }
        Err(e) => Err(StreamError::Json(e)),
    }
}

/// [`read_stream`] of a whole body, with the daemon's bound.
#[cfg(test)]
pub(crate) fn parse_stream(body: &[u8]) -> Result<Batch, StreamError> {
    read_stream(body, MAX_DECISIONS)
}

struct Reading {
    batch: Batch,
    max: usize,
    /// Stopped at `max`.
    over: bool,
}

/// The answer's top level.
struct Answer<'r>(&'r mut Reading);

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "lowercase")]
enum Key {
    New,
    Deleted,
    #[serde(other)]
    Other,
}

impl<'de> Visitor<'de> for Answer<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(r#"an object with "new" or "deleted""#)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let (mut new, mut deleted) = (false, false);
        while let Some(key) = map.next_key::<Key>()? {
            let (which, seen) = match key {
                Key::New => (Which::New, &mut new),
                Key::Deleted => (Which::Deleted, &mut deleted),
                Key::Other => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            if std::mem::replace(seen, true) {
                return Err(A::Error::custom(format_args!("\"{which}\" twice")));
            }
            map.next_value_seed(List { reading: self.0, which })?;
        }
        if !new && !deleted {
            return Err(A::Error::custom(r#"it has neither "new" nor "deleted""#));
        }
        Ok(())
    }
}

/// `new` or `deleted`: null, or an array of elements, each judged as it is read.
struct List<'r> {
    reading: &'r mut Reading,
    which: Which,
}

impl<'de> DeserializeSeed<'de> for List<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de> Visitor<'de> for List<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of decisions, or null")
    }

    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut index = 0;
        while let Some(Element(element)) = seq.next_element()? {
            self.reading.batch.take(self.which, index, element);
            index += 1;
            if self.reading.batch.kept() > self.reading.max {
                self.reading.over = true;
                return Err(A::Error::custom("too many decisions"));
            }
        }
        Ok(())
    }
}

/// One element: a decision's fields, or why it is not an object of them.
struct Element(Result<RawDecision, &'static str>);

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "lowercase")]
enum DecisionKey {
    Id,
    Type,
    Scope,
    Value,
    Duration,
    #[serde(other)]
    Other,
}

impl<'de> Deserialize<'de> for Element {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ElementVisitor)
    }
}

struct ElementVisitor;

impl<'de> Visitor<'de> for ElementVisitor {
    type Value = Element;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a decision")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Element, A::Error> {
        let mut raw = RawDecision::default();
        let mut twice = false;
        while let Some(key) = map.next_key::<DecisionKey>()? {
            let slot = match key {
                DecisionKey::Id => &mut raw.id,
                DecisionKey::Type => &mut raw.kind,
                DecisionKey::Scope => &mut raw.scope,
                DecisionKey::Value => &mut raw.value,
                DecisionKey::Duration => &mut raw.duration,
                DecisionKey::Other => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            // Which of two values would be meant is not known.
            twice |= !matches!(slot, Field::Absent);
            *slot = map.next_value()?;
        }
        Ok(Element(if twice { Err("a field given twice") } else { Ok(raw) }))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Element, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Element(Err("not an object")))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Element, E> {
        Ok(Element(Err("not an object")))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Element, E> {
        Ok(Element(Err("not an object")))
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Element, E> {
        Ok(Element(Err("not an object")))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Element, E> {
        Ok(Element(Err("not an object")))
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Element, E> {
        Ok(Element(Err("not an object")))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Element, E> {
        Ok(Element(Err("not an object")))
    }
}

impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(FieldVisitor)
    }
}

struct FieldVisitor;

impl<'de> Visitor<'de> for FieldVisitor {
    type Value = Field;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a decision's field")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Field, E> {
        Ok(Field::Text(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Field, E> {
        Ok(Field::Text(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Field, E> {
        Ok(Field::Int(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Field, E> {
        Ok(i64::try_from(v).map_or(Field::Other, Field::Int))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Field, E> {
        Ok(Field::Other)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Field, E> {
        Ok(Field::Other)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Field, E> {
        Ok(Field::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Field, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Field::Other)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Field, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Field::Other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_answers_are_refused_whole() {
        for bad in [
            "",
            "null",
            "[]",
            "{}",
            "\"new\"",
            "<html>502 Bad Gateway</html>",
            r#"{"message":"access forbidden"}"#,
            r#"{"new":[{"duration":"1h","id":1,"scope":"Ip","type":"ban","value":"198.18.0.1"}]"#,
            r#"{"new":{"duration":"1h"}}"#,
            r#"{"new":"198.18.0.1"}"#,
            r#"{"deleted":5}"#,
            r#"{"new":[],"new":[]}"#,
            r#"{"new":[]} trailing"#,
        ] {
            assert!(parse_stream(bad.as_bytes()).is_err(), "{bad:?}");
        }
        let mut garbage = vec![0xff, 0xfe, b'{'];
        garbage.extend(std::iter::repeat_n(b'[', 10_000));
        assert!(parse_stream(&garbage).is_err());
        // Deep nesting inside an element: serde_json's recursion limit, an error, not a crash.
        let deep = format!(r#"{{"new":[{}{}]}}"#, "[".repeat(100_000), "]".repeat(100_000));
        assert!(parse_stream(deep.as_bytes()).is_err());
    }

    #[test]
    fn an_answer_past_its_bounds_is_refused_whole() {
        let ban = r#"{"duration":"1h","id":1,"scope":"Ip","type":"ban","value":"198.18.0.1"}"#;
        let three = format!(r#"{{"new":[{ban},{ban}],"deleted":[{ban}]}}"#);
        assert_eq!(read_stream(three.as_bytes(), 3).unwrap().kept(), 3);
        assert!(matches!(read_stream(three.as_bytes(), 2), Err(StreamError::TooMany(2))));
        // Elements that are not bans cost nothing kept, however many.
        let zeros = format!(r#"{{"new":[{}0]}}"#, "0,".repeat(100_000));
        let batch = read_stream(zeros.as_bytes(), 2).unwrap();
        assert_eq!((batch.kept(), batch.skipped.malformed), (0, 100_001));
        assert_eq!(batch.first_malformed.as_deref(), Some("new[0]: not an object"));
        let long = format!(r#"{{"new":[{{"value":"{}"}}]}}"#, "1".repeat(super::super::bounded::MAX_TOKEN + 1));
        assert!(matches!(parse_stream(long.as_bytes()), Err(StreamError::Overrun(Overrun::Token))));
    }

    #[test]
    fn a_field_twice_or_of_another_kind_is_malformed() {
        let body = r#"{"new":[
            {"duration":"1h","id":1,"scope":"Ip","type":"ban","value":"198.18.0.1","value":"198.18.0.2"},
            {"duration":{"h":1},"id":2,"scope":"Ip","type":"ban","value":"198.18.0.2"},
            {"duration":"1h","id":3.5,"scope":"Ip","type":"ban","value":"198.18.0.3"},
            {"duration":"1h","id":18446744073709551615,"scope":"Ip","type":"ban","value":"198.18.0.4"},
            {"duration":"1h","id":null,"scope":"Ip","type":"ban","value":"198.18.0.5"}
        ]}"#;
        let batch = parse_stream(body.as_bytes()).unwrap();
        assert_eq!(batch.new.iter().map(|d| d.id).collect::<Vec<_>>(), [0], "null: no id");
        assert_eq!(batch.skipped.malformed, 4);
        assert_eq!(batch.first_malformed.as_deref(), Some("new[0]: a field given twice"));
    }
}
