//! Rates as operators write them: `1000/s`, `100/min`, `5/h`.

use std::{fmt, str::FromStr};

const NS_PER_SEC: u64 = 1_000_000_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Rate {
    pub count: u64,
    pub period_ns: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "invalid rate '{0}': expected N/s, N/min or N/h with N a whole number from 1, without sign or leading zeros (e.g. 1000/s)"
)]
pub struct RateError(pub String);

impl FromStr for Rate {
    type Err = RateError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || RateError(s.to_string());
        let (count, unit) = s.trim().split_once('/').ok_or_else(err)?;
        // One form, as for every number: `+100/s` and `0100/s` are refused. `0/s`: nothing
        // passes (a source port of reflection, denied outright).
        let count = super::field::decimal(count.trim()).ok_or_else(err)?;
        let period_ns = match unit.trim() {
            "s" | "sec" | "second" => NS_PER_SEC,
            "m" | "min" | "minute" => 60 * NS_PER_SEC,
            "h" | "hour" => 3600 * NS_PER_SEC,
            _ => return Err(err()),
        };
        Ok(Self { count, period_ns })
    }
}

impl TryFrom<String> for Rate {
    type Error = RateError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Rate> for String {
    fn from(r: Rate) -> Self {
        r.to_string()
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = match self.period_ns {
            NS_PER_SEC => "s",
            p if p == 60 * NS_PER_SEC => "min",
            _ => "h",
        };
        write!(f, "{}/{unit}", self.count)
    }
}

impl Rate {
    /// Units per second, for display and for sizing tests.
    pub fn per_sec(&self) -> f64 {
        self.count as f64 * NS_PER_SEC as f64 / self.period_ns as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_accepted_forms() {
        assert_eq!("1000/s".parse(), Ok(Rate { count: 1000, period_ns: NS_PER_SEC }));
        assert_eq!("100/min".parse(), Ok(Rate { count: 100, period_ns: 60 * NS_PER_SEC }));
        assert_eq!("5/h".parse(), Ok(Rate { count: 5, period_ns: 3600 * NS_PER_SEC }));
        assert_eq!("100/min".parse::<Rate>().map(|r| r.to_string()), Ok("100/min".into()));
        assert_eq!("0/s".parse(), Ok(Rate { count: 0, period_ns: NS_PER_SEC }));
    }

    #[test]
    fn rejects_everything_else() {
        for bad in ["", "1000", "-1/s", "1.5/s", "10/d", "/s", "ten/s", "1000/ s x", "+100/s", "0100/s", "00/s"] {
            assert!(bad.parse::<Rate>().is_err(), "{bad}");
        }
    }
}
