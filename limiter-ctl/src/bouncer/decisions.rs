//! The decision stream: an answer of `/v1/decisions/stream` read into the bans it makes, new
//! and deleted, and what it holds that is not a usable ban, counted by reason.

use std::{fmt, net::IpAddr};

use ipnet::IpNet;
use serde::{Deserialize, Deserializer, de::IgnoredAny};

use super::duration::{SignedDuration, go_duration};

/// `{"new": [...], "deleted": [...]}`, either null; an answer with neither key is not a stream.
#[derive(Deserialize)]
struct RawStream {
    #[serde(default, deserialize_with = "present")]
    new: Option<Option<Vec<RawItem>>>,
    #[serde(default, deserialize_with = "present")]
    deleted: Option<Option<Vec<RawItem>>>,
}

/// A key that is present (null or not), told from one that is absent (`None`).
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// One element of `new` or `deleted`: a decision, or something else (counted, skipped), so that
/// one odd element does not cost the others.
#[derive(Deserialize)]
#[serde(untagged)]
enum RawItem {
    Decision(RawDecision),
    Other(IgnoredAny),
}

/// The fields used; each any JSON (checked in [`decision`]), the others ignored.
#[derive(Deserialize)]
struct RawDecision {
    #[serde(default)]
    id: Option<serde_json::Value>,
    #[serde(default, rename = "type")]
    kind: Option<serde_json::Value>,
    #[serde(default)]
    scope: Option<serde_json::Value>,
    #[serde(default)]
    value: Option<serde_json::Value>,
    #[serde(default)]
    duration: Option<serde_json::Value>,
}

/// A ban on `net`, for `left` from when it was read (zero or negative: already over).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Decision {
    /// The LAPI's id of the decision (several may ban the same address, each with its time).
    pub id: i64,
    pub net: IpNet,
    pub left: SignedDuration,
}

/// What a poll's answer holds: its bans, new and deleted, and what was skipped, by reason.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Batch {
    pub new: Vec<Decision>,
    pub deleted: Vec<Decision>,
    pub skipped: Skipped,
}

/// Decisions not turned into bans, counted by reason.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Skipped {
    /// Of another type than ban (captcha, throttle...): not the limiter's to apply.
    pub not_ban: u64,
    /// Of another scope than Ip or Range (Country, AS, Username...).
    pub scope: u64,
    /// New, but already expired (a zero or negative duration).
    pub expired: u64,
    /// Malformed: not an object, a missing or unreadable value, duration or type.
    pub malformed: u64,
}

impl Skipped {
    pub fn total(&self) -> u64 {
        self.not_ban + self.scope + self.expired + self.malformed
    }
}

impl fmt::Display for Skipped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} not bans, {} of another scope than Ip or Range, {} already expired, {} malformed",
            self.not_ban, self.scope, self.expired, self.malformed
        )
    }
}

/// Why an answer is not a decision stream at all (then nothing of it is applied).
#[derive(Debug, thiserror::Error)]
pub(crate) enum StreamError {
    #[error("not a decision stream: {0}")]
    Json(#[from] serde_json::Error),
    #[error("not a decision stream: it has neither \"new\" nor \"deleted\"")]
    Empty,
}

/// Reads an answer of `/v1/decisions/stream`. Garbage as a whole is an error (nothing of it may
/// be applied); an element that is not a usable ban is skipped and counted.
pub(crate) fn parse_stream(body: &[u8]) -> Result<Batch, StreamError> {
    let raw: RawStream = serde_json::from_slice(body)?;
    if raw.new.is_none() && raw.deleted.is_none() {
        return Err(StreamError::Empty);
    }
    let mut batch = Batch::default();
    for item in raw.deleted.flatten().into_iter().flatten() {
        // A deleted decision's duration is not used (it is over, whatever it says).
        match decision(item) {
            Ok(d) => batch.deleted.push(d),
            Err(why) => why.count(&mut batch.skipped),
        }
    }
    for item in raw.new.flatten().into_iter().flatten() {
        match decision(item) {
            Ok(d) if d.left.negative || d.left.magnitude.is_zero() => batch.skipped.expired += 1,
            Ok(d) => batch.new.push(d),
            Err(why) => why.count(&mut batch.skipped),
        }
    }
    Ok(batch)
}

enum Skip {
    NotBan,
    Scope,
    Malformed,
}

impl Skip {
    fn count(self, skipped: &mut Skipped) {
        match self {
            Skip::NotBan => skipped.not_ban += 1,
            Skip::Scope => skipped.scope += 1,
            Skip::Malformed => skipped.malformed += 1,
        }
    }
}

fn decision(item: RawItem) -> Result<Decision, Skip> {
    let RawItem::Decision(d) = item else { return Err(Skip::Malformed) };
    let text = |v: &Option<serde_json::Value>| v.as_ref().and_then(|v| v.as_str().map(str::to_owned));
    let kind = text(&d.kind).ok_or(Skip::Malformed)?;
    let scope = text(&d.scope).ok_or(Skip::Malformed)?;
    let value = text(&d.value).ok_or(Skip::Malformed)?;
    let duration = text(&d.duration).ok_or(Skip::Malformed)?;
    // An absent id (no LAPI sends none) makes the decisions on one address one.
    let id = match &d.id {
        None | Some(serde_json::Value::Null) => 0,
        Some(v) => v.as_i64().ok_or(Skip::Malformed)?,
    };
    if !kind.eq_ignore_ascii_case("ban") {
        return Err(Skip::NotBan);
    }
    let net = if scope.eq_ignore_ascii_case("ip") {
        // The standard parser: no leading zeros (inet_aton would read 010.0.0.1 as 8.0.0.1).
        let addr: IpAddr = value.trim().parse().map_err(|_| Skip::Malformed)?;
        // An IPv4 address written mapped (::ffff:198.18.0.1) arrives in IPv4 packets.
        IpNet::from(addr.to_canonical())
    } else if scope.eq_ignore_ascii_case("range") {
        // The config's parser (the same strictness); a range written with host bits set
        // (198.18.4.1/24) means its network.
        crate::config::parse_net(value.trim()).map_err(|_| Skip::Malformed)?.trunc()
    } else {
        return Err(Skip::Scope);
    };
    let left = go_duration(duration.trim()).ok_or(Skip::Malformed)?;
    Ok(Decision { id, net, left })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const ANSWER: &str = r#"{"deleted":null,"new":[
        {"duration":"3.956111315s","id":1,"origin":"cscli","scenario":"manual","scope":"Ip","type":"ban","value":"198.18.0.7"},
        {"duration":"9m58.9s","id":3,"origin":"cscli","scenario":"manual","scope":"Ip","type":"captcha","value":"2001:db8::5"},
        {"duration":"59m58.9s","id":2,"origin":"cscli","scenario":"manual","scope":"Range","type":"ban","value":"198.18.4.0/24"}]}"#;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    #[test]
    fn a_stream_answer_gives_its_bans_and_counts_the_rest() {
        let batch = parse_stream(ANSWER.as_bytes()).unwrap();
        assert_eq!(batch.deleted, []);
        let nets: Vec<(i64, IpNet)> = batch.new.iter().map(|d| (d.id, d.net)).collect();
        assert_eq!(nets, [(1, net("198.18.0.7/32")), (2, net("198.18.4.0/24"))]);
        assert_eq!(batch.new[0].left.magnitude, Duration::from_nanos(3_956_111_315));
        assert_eq!(batch.skipped, Skipped { not_ban: 1, ..Skipped::default() });

        let deleted = r#"{"deleted":[{"duration":"-2.06220007s","id":1,"origin":"cscli","scope":"Ip","type":"ban",
            "value":"198.18.0.7"}],"new":null}"#;
        let batch = parse_stream(deleted.as_bytes()).unwrap();
        assert_eq!(batch.deleted.len(), 1);
        assert_eq!(batch.deleted[0].net, net("198.18.0.7/32"));
        assert_eq!(batch.skipped.total(), 0, "a deleted decision's negative duration is no reason to skip it");
        assert_eq!(parse_stream(br#"{"deleted":null,"new":null}"#).unwrap(), Batch::default());
    }

    #[test]
    fn odd_decisions_are_skipped_one_by_one() {
        let body = r#"{"new":[
            {"duration":"1h","id":1,"scope":"ip","type":"BAN","value":"2001:db8::1"},
            {"duration":"1h","id":2,"scope":"Range","type":"ban","value":"198.18.4.1/24"},
            {"duration":"-1s","id":3,"scope":"Ip","type":"ban","value":"198.18.0.3"},
            {"duration":"0s","id":4,"scope":"Ip","type":"ban","value":"198.18.0.4"},
            {"duration":"1h","id":5,"scope":"Country","type":"ban","value":"FR"},
            {"duration":"1h","id":6,"scope":"Ip","type":"ban","value":"010.0.0.1"},
            {"duration":"1h","id":7,"scope":"Ip","type":"ban","value":"198.18.0.1/32"},
            {"duration":"1 hour","id":8,"scope":"Ip","type":"ban","value":"198.18.0.8"},
            {"duration":3600,"id":9,"scope":"Ip","type":"ban","value":"198.18.0.9"},
            {"duration":"1h","id":"ten","scope":"Ip","type":"ban","value":"198.18.0.10"},
            {"duration":"1h","id":11,"scope":"Ip","type":"ban"},
            {"duration":"1h","id":12,"scope":"Range","type":"ban","value":"198.18.0.0/33"},
            {"duration":"9999999999h","id":13,"scope":"Ip","type":"ban","value":"198.18.0.13"},
            "garbage", 42, null, [],
            {"duration":"2562047h","id":14,"scope":"Ip","type":"ban","value":"198.18.0.14","extra":{"a":[1]}},
            {"duration":"1h","id":15,"scope":"Ip","type":"ban","value":"::ffff:198.18.0.15"}
        ]}"#;
        let batch = parse_stream(body.as_bytes()).unwrap();
        let nets: Vec<(i64, IpNet)> = batch.new.iter().map(|d| (d.id, d.net)).collect();
        assert_eq!(
            nets,
            [
                (1, net("2001:db8::1/128")),
                (2, net("198.18.4.0/24")),
                (14, net("198.18.0.14/32")),
                (15, net("198.18.0.15/32"))
            ]
        );
        assert_eq!(batch.skipped, Skipped { not_ban: 0, scope: 1, expired: 2, malformed: 12 });
    }

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
}
