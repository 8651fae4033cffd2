//! Go durations, as CrowdSec writes them ("4h59m58.5s", "-1.2s", "300ms").

use std::time::Duration;

/// A duration as Go's `time.Duration.String()` writes it (and `time.ParseDuration` reads it):
/// an optional sign, then one or more decimal numbers (a fraction allowed) each with a unit
/// (ns, us, µs, ms, s, m, h), or a bare `0`. Negative durations are those of decisions already
/// expired. `None` for anything else, and for a value beyond 2^64 ns in either direction.
pub(crate) fn go_duration(s: &str) -> Option<SignedDuration> {
    let (negative, mut rest) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    if rest == "0" {
        return Some(SignedDuration { negative: false, magnitude: Duration::ZERO });
    }
    if rest.is_empty() {
        return None;
    }
    let mut nanos: u128 = 0;
    while !rest.is_empty() {
        let int_len = rest.bytes().take_while(u8::is_ascii_digit).count();
        let (int, after) = rest.split_at(int_len);
        let (frac, after) = match after.strip_prefix('.') {
            Some(a) => {
                let n = a.bytes().take_while(u8::is_ascii_digit).count();
                a.split_at(n)
            }
            None => ("", after),
        };
        if int.is_empty() && frac.is_empty() {
            return None;
        }
        let unit_len = after.find(|c: char| c == '.' || c.is_ascii_digit()).unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let scale: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return None,
        };
        // Exact to the nanosecond, rounded down as Go does; beyond u128 refused, not wrapped.
        nanos = nanos.checked_add(crate::config::scaled_ns(int, frac, scale)?)?;
        rest = after;
    }
    let nanos = u64::try_from(nanos).ok()?;
    Some(SignedDuration { negative: negative && nanos > 0, magnitude: Duration::from_nanos(nanos) })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SignedDuration {
    pub negative: bool,
    pub magnitude: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> Option<(bool, u128)> {
        go_duration(s).map(|d| (d.negative, d.magnitude.as_nanos()))
    }

    #[test]
    fn go_durations_as_crowdsec_writes_them() {
        const S: u128 = 1_000_000_000;
        assert_eq!(d("4h"), Some((false, 4 * 3600 * S)));
        assert_eq!(d("4h59m58.5s"), Some((false, (4 * 3600 + 59 * 60 + 58) * S + S / 2)));
        assert_eq!(d("3.956111315s"), Some((false, 3_956_111_315)));
        assert_eq!(d("9m58.956109232s"), Some((false, 598 * S + 956_109_232)));
        assert_eq!(d("-2.06220007s"), Some((true, 2_062_200_070)));
        assert_eq!(d("-1s"), Some((true, S)));
        assert_eq!(d("+5s"), Some((false, 5 * S)));
        assert_eq!(d("0"), Some((false, 0)));
        assert_eq!(d("-0s"), Some((false, 0)), "minus zero is zero, not negative");
        assert_eq!(d("300ms"), Some((false, 300_000_000)));
        assert_eq!(d("1us"), Some((false, 1_000)));
        assert_eq!(d("1µs"), Some((false, 1_000)));
        assert_eq!(d("1μs"), Some((false, 1_000)));
        assert_eq!(d("7ns"), Some((false, 7)));
        assert_eq!(d(".5s"), Some((false, S / 2)));
        assert_eq!(d("5.s"), Some((false, 5 * S)));
        assert_eq!(d("1h1h"), Some((false, 2 * 3600 * S)), "Go sums repeated units");
        // A long fraction, exact (it once overflowed into 3 m 16 s).
        assert_eq!(d("0.99999999999999999999999999h"), Some((false, 3600 * S - 1)));
        // Go's longest duration, and just past what 64 bits of nanoseconds hold.
        assert_eq!(d("2562047h47m16.854775807s"), Some((false, i64::MAX as u128)));
        assert_eq!(d("5124095h"), Some((false, 5124095 * 3600 * S)));
        assert_eq!(d("5124096h"), None, "beyond 2^64 ns");
    }

    #[test]
    fn go_durations_refuse_garbage_and_huge_values() {
        for bad in [
            "",
            "-",
            "+",
            "s",
            ".s",
            "5",
            "12",
            "5d",
            "5 s",
            " 5s",
            "5s ",
            "5S",
            "1h-5m",
            "--5s",
            "5sx",
            "0x10s",
            "1e3s",
            "NaN",
            "∞s",
            "99999999999999999999999999999999999999999999h",
            "184467440737095516160ns",
        ] {
            assert_eq!(go_duration(bad), None, "{bad:?}");
        }
    }
}
