//! One element of the decision stream judged: a ban on an address or a range, or the reason it
//! is skipped (counted); and what one answer holds ([`Batch`]). `stream` reads the answer.

use std::{borrow::Cow, fmt, net::IpAddr, time::Duration};

use ipnet::IpNet;

use super::duration::go_duration;

/// A ban on `net`: new, for `left` from when it was read; deleted, its time not used (it is
/// over, whatever it says).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Decision {
    /// The LAPI's id of the decision (several may ban the same address, each with its time).
    pub id: i64,
    pub net: IpNet,
    pub left: Duration,
}

/// What a poll's answer holds: its bans, new and deleted, and what was skipped, by reason.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Batch {
    pub new: Vec<Decision>,
    pub deleted: Vec<Decision>,
    pub skipped: Skipped,
    /// The first malformed element, where it was and why (for the log line).
    pub first_malformed: Option<String>,
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
    /// Malformed: not an object, a field twice, a missing or unreadable value, duration, type
    /// or id. Unlike the others, these could be bans: what they are is not known.
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

/// Which list of the answer an element is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Which {
    New,
    Deleted,
}

impl fmt::Display for Which {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Which::New => "new",
            Which::Deleted => "deleted",
        })
    }
}

/// A field of an element, as read: only text and integers are kept (nothing else is a field
/// of a decision).
#[derive(Debug, Default)]
pub(crate) enum Field {
    #[default]
    Absent,
    Null,
    Text(String),
    Int(i64),
    /// Another JSON value (a float, a boolean, an array, an object), not kept.
    Other,
}

/// The fields used of an element that is an object.
#[derive(Debug, Default)]
pub(crate) struct RawDecision {
    pub id: Field,
    pub kind: Field,
    pub scope: Field,
    pub value: Field,
    pub duration: Field,
}

impl Batch {
    /// Takes in the `index`th element of `which`: its fields, or why it is not an object of
    /// them.
    pub(crate) fn take(&mut self, which: Which, index: usize, element: Result<RawDecision, &'static str>) {
        match element.map_err(|why| Skip::Malformed(why.into())).and_then(|raw| decision(raw, which)) {
            Ok(d) if which == Which::New => self.new.push(d),
            Ok(d) => self.deleted.push(d),
            Err(Skip::NotBan) => self.skipped.not_ban += 1,
            Err(Skip::Scope) => self.skipped.scope += 1,
            Err(Skip::Expired) => self.skipped.expired += 1,
            Err(Skip::Malformed(why)) => {
                self.skipped.malformed += 1;
                self.first_malformed.get_or_insert_with(|| format!("{which}[{index}]: {why}"));
            }
        }
    }

    /// The decisions kept, new and deleted.
    pub(crate) fn kept(&self) -> usize {
        self.new.len() + self.deleted.len()
    }
}

enum Skip {
    NotBan,
    Scope,
    Expired,
    Malformed(Cow<'static, str>),
}

/// A field's text, or why it is not usable.
fn text(field: Field, name: &str) -> Result<String, Skip> {
    match field {
        Field::Text(t) => Ok(t),
        Field::Absent => Err(Skip::Malformed(format!("no {name}").into())),
        _ => Err(Skip::Malformed(format!("its {name} is not text").into())),
    }
}

/// The LAPI's text in a log line: quoted and escaped (no control character gets through), and
/// cut short.
fn shown(value: &str) -> String {
    let cut: String = value.chars().take(64).collect();
    format!("{cut:?}{}", if cut.len() < value.len() { "..." } else { "" })
}

fn decision(d: RawDecision, which: Which) -> Result<Decision, Skip> {
    let kind = text(d.kind, "type")?;
    let scope = text(d.scope, "scope")?;
    let value = text(d.value, "value")?;
    let duration = text(d.duration, "duration")?;
    // An absent id (no LAPI sends none) makes the decisions on one address one.
    let id = match d.id {
        Field::Absent | Field::Null => 0,
        Field::Int(id) => id,
        _ => return Err(Skip::Malformed("its id is not an integer".into())),
    };
    if !kind.eq_ignore_ascii_case("ban") {
        return Err(Skip::NotBan);
    }
    let net = if scope.eq_ignore_ascii_case("ip") {
        // The standard parser: no leading zeros (inet_aton would read 010.0.0.1 as 8.0.0.1).
        let addr: IpAddr = value
            .trim()
            .parse()
            .map_err(|_| Skip::Malformed(format!("value {} is not an address", shown(&value)).into()))?;
        // An IPv4 address written mapped (::ffff:198.18.0.1) arrives in IPv4 packets.
        IpNet::from(addr.to_canonical())
    } else if scope.eq_ignore_ascii_case("range") {
        // The config's parser (the same strictness); a range written with host bits set
        // (198.18.4.1/24) means its network; an IPv4-mapped one, the IPv4 network the daemon
        // holds it as (so the reconcile finds it in the daemon's list).
        crate::config::unmapped(
            crate::config::parse_net(value.trim())
                .map_err(|_| Skip::Malformed(format!("value {} is not a range", shown(&value)).into()))?
                .trunc(),
        )
    } else {
        return Err(Skip::Scope);
    };
    let left = go_duration(duration.trim())
        .ok_or_else(|| Skip::Malformed(format!("duration {} is not a Go duration", shown(&duration)).into()))?;
    if which == Which::New && (left.negative || left.magnitude.is_zero()) {
        return Err(Skip::Expired);
    }
    Ok(Decision { id, net, left: left.magnitude })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bouncer::stream::parse_stream;

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
        assert_eq!(batch.new[0].left, Duration::from_nanos(3_956_111_315));
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
            {"duration":"1h","id":15,"scope":"Ip","type":"ban","value":"::ffff:198.18.0.15"},
            {"duration":"1h","id":16,"scope":"Range","type":"ban","value":"::ffff:198.18.16.0/120"}
        ]}"#;
        let batch = parse_stream(body.as_bytes()).unwrap();
        let nets: Vec<(i64, IpNet)> = batch.new.iter().map(|d| (d.id, d.net)).collect();
        assert_eq!(
            nets,
            [
                (1, net("2001:db8::1/128")),
                (2, net("198.18.4.0/24")),
                (14, net("198.18.0.14/32")),
                (15, net("198.18.0.15/32")),
                // As the daemon holds it, so the reconcile finds it in the daemon's list.
                (16, net("198.18.16.0/24"))
            ]
        );
        assert_eq!(batch.skipped, Skipped { not_ban: 0, scope: 1, expired: 2, malformed: 12 });
    }
}
