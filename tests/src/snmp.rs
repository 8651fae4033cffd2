//! A namespace's network statistics (/proc/net/snmp and snmp6), read from a thread inside it.

use anyhow::Context as _;

use crate::netns::End;

/// Both files of `end`'s namespace.
pub struct Snmp {
    snmp: String,
    snmp6: String,
}

impl Snmp {
    pub fn read(end: &End) -> anyhow::Result<Self> {
        end.run(|| -> anyhow::Result<Snmp> {
            // thread-self: /proc/net would show the main thread's namespace.
            Ok(Snmp {
                snmp: std::fs::read_to_string("/proc/thread-self/net/snmp")?,
                snmp6: std::fs::read_to_string("/proc/thread-self/net/snmp6")?,
            })
        })?
    }

    /// A field of /proc/net/snmp, where each protocol has a line of names then a line of values,
    /// e.g. `get("Udp:", "NoPorts")`.
    pub fn get(&self, proto: &str, field: &str) -> anyhow::Result<u64> {
        let mut lines = self.snmp.lines().filter(|l| l.starts_with(proto));
        let (names, values) = lines.next().zip(lines.next()).with_context(|| format!("no {proto} lines in snmp"))?;
        let index = names.split_whitespace().position(|n| n == field).with_context(|| format!("no {proto} {field}"))?;
        let value = values.split_whitespace().nth(index).with_context(|| format!("no value for {proto} {field}"))?;
        Ok(value.parse()?)
    }

    /// A field of /proc/net/snmp6, e.g. `get6("Udp6NoPorts")`.
    pub fn get6(&self, field: &str) -> anyhow::Result<u64> {
        let line = self
            .snmp6
            .lines()
            .find(|l| l.split_whitespace().next() == Some(field))
            .with_context(|| format!("no {field}"))?;
        Ok(line.split_whitespace().nth(1).with_context(|| format!("no value for {field}"))?.parse()?)
    }
}
